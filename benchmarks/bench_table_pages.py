"""In-memory tables on huge pages or on small ones: the embedded store's pull and push, side by
side in one run.

    python benchmarks/bench_table_pages.py            # about a minute on a 2-core host
    python benchmarks/bench_table_pages.py --quick    # smoke run

A table in memory storage lives in fresh anonymous memory advised onto transparent huge pages
(``ams.alloc.zeros_on_huge_pages``): private memory, which the kernel backs with 2 MiB pages
under its ``enabled`` setting. The baseline maps the same table shared, as Python's anonymous
``mmap`` does unless told otherwise; the kernel gives shared anonymous memory huge pages only
under ``shmem_enabled``, commonly ``never``, so the baseline runs on 4 KiB pages wherever that
is so (the header prints both settings). Each repeat times both mappings in turn on the same
random unique ids (medians shown); a pull or push touches one row of the table per id, at
random, so what the pages change is the TLB misses of those touches. One thread, as a shard's
handler runs.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch
from results import record, table_row

from ams import alloc
from ams.store import ShardStore, TableSpec

THP = Path("/sys/kernel/mm/transparent_hugepage")
MAPPINGS = {"shared (baseline)": mmap.MAP_SHARED, "private (xcls)": mmap.MAP_PRIVATE}


@contextmanager
def anonymous_mappings(flags: int) -> Iterator[None]:
    """New tables' memory mapped ``flags | MAP_ANONYMOUS`` for the duration."""
    real = mmap.mmap

    def mapped(fileno: int, length: int, **kwargs: int) -> mmap.mmap:
        return real(fileno, length, flags=flags | mmap.MAP_ANONYMOUS)

    mmap.mmap = mapped  # ams.alloc maps through the module attribute
    try:
        yield
    finally:
        mmap.mmap = real


def huge_kib() -> int:
    """This process's anonymous and shared memory on huge pages, KiB."""
    total = 0
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith(("AnonHugePages:", "ShmemPmdMapped:")):
            total += int(line.split()[1])
    return total


def timed(work: Callable[[torch.Tensor], object], batches: list[torch.Tensor]) -> float:
    """Rows per second of ``work`` over ``batches``."""
    started = time.perf_counter()
    for ids in batches:
        work(ids)
    return sum(b.numel() for b in batches) / (time.perf_counter() - started)


def measure(flags: int, dtype: str, args: argparse.Namespace, batches: list[torch.Tensor],
            grads: torch.Tensor) -> tuple[float, float, int]:
    """Pull and push rows/s of a fresh table mapped ``flags``, and its MiB on huge pages."""
    before = huge_kib()
    with anonymous_mappings(flags):
        store = ShardStore(0, 1)
        store.create_table(TableSpec(name="t", num_rows=args.rows, dim=args.dim,
                                     dtype=getattr(torch, dtype),
                                     state_dtype=getattr(torch, dtype)))
    store.table("t").state.zero_()  # every page of rows and state exists
    pull = timed(partial(store.pull, "t"), batches)
    push = timed(partial(store.push, "t", grads=grads, lr=1e-3), batches)
    return pull, push, max(0, huge_kib() - before) // 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=500_000, help="table rows")
    parser.add_argument("--dim", type=int, default=128, help="row width d")
    parser.add_argument("--batch", type=int, default=10_000, help="ids per pull and push")
    parser.add_argument("--calls", type=int, default=20, help="pulls and pushes per repeat")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median shown)")
    parser.add_argument("--quick", action="store_true", help="a small table, two repeats")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.batch, args.calls, args.repeats = 50_000, 2_000, 4, 2
    torch.set_num_threads(1)
    alloc.keep_large_buffers()  # as a shard server does
    settings = {name: (THP / name).read_text().strip() if (THP / name).exists() else "-"
                for name in ("enabled", "shmem_enabled")}
    print(f"transparent huge pages: enabled {settings['enabled']}, "
          f"shmem_enabled {settings['shmem_enabled']}")
    print(f"{args.rows:,} rows, d = {args.dim}, momentum 0.9, batches of {args.batch:,} unique "
          f"random ids, {args.calls} calls per repeat, {args.repeats} repeats; M rows/s")
    print()
    header = ("| dtype | mapping | on huge pages MiB | pull | push | pull vs baseline | "
              "push vs baseline |")
    print(f"{header}\n|---|---|---:|---:|---:|---:|---:|")
    rows = []
    generator = torch.Generator().manual_seed(0)
    for dtype in ("float32", "float16"):
        batches = [torch.randperm(args.rows, generator=generator)[:args.batch].sort().values
                   for _ in range(args.calls)]
        grads = torch.randn(args.batch, args.dim, generator=generator) * 1e-3
        rates: dict[str, dict[str, list[float]]] = {m: {"pull": [], "push": []}
                                                   for m in MAPPINGS}
        huge: dict[str, int] = {}
        for _ in range(args.repeats):
            for mapping, flags in MAPPINGS.items():
                pull, push, huge[mapping] = measure(flags, dtype, args, batches, grads)
                rates[mapping]["pull"].append(pull)
                rates[mapping]["push"].append(push)
        base = {op: statistics.median(rates["shared (baseline)"][op]) for op in ("pull", "push")}
        for mapping in MAPPINGS:
            pull, push = (statistics.median(rates[mapping][op]) for op in ("pull", "push"))
            line = (f"| {dtype} | {mapping} | {huge[mapping]:,} | {pull / 1e6:.2f} | "
                    f"{push / 1e6:.2f} | {pull / base['pull']:.2f}x | "
                    f"{push / base['push']:.2f}x |")
            print(line, flush=True)
            rows.append(table_row(header, line))
    record("bench_table_pages", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The shard's row update, compiled (ams/_kernels.c) against torch and numpy: an in-process
``ShardStore.push`` side by side in one run.

    python benchmarks/bench_row_update.py            # about half a minute on a 2-core host
    python benchmarks/bench_row_update.py --quick    # smoke run

Each call pushes a batch of unique random ids (ascending, as clients send them) with the
decay clock, into a table whose every row and momentum row has been written, in memory
storage, one thread, as a shard's handler runs. The updates take turns call by call (torch,
compiled, and for float16 state the compiled update without the CPU's F16C instructions, as
other CPUs run it), so drift on a shared host hits them alike; cells are medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from results import record, table_row

import ams.optim
from ams import alloc
from ams.optim import update_path
from ams.store import ShardStore, TableSpec

# (rows dtype, state dtype)
CONFIGS = [("float32", "float32"), ("float16", "float16"), ("bfloat16", "float32")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=250_000,
                        help="table rows (half of bench_ams's table: one of its 2 shards)")
    parser.add_argument("--dim", type=int, default=128, help="row width d")
    parser.add_argument("--batch", type=int, default=5_000,
                        help="ids per push (a 2-shard 10k-row push's share of one shard)")
    parser.add_argument("--calls", type=int, default=60, help="timed pushes per update")
    parser.add_argument("--quick", action="store_true", help="a small table, few calls")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.batch, args.calls = 20_000, 1_000, 4
    if ams.optim._kernels is None:
        parser.error("ams._kernels is not built: install xcls with a C compiler "
                     "(bash scripts/setup.sh)")
    torch.set_num_threads(1)
    alloc.keep_large_buffers()  # as a shard server does
    print(f"{args.rows:,} rows, d = {args.dim}, momentum 0.9, weight decay 5e-4, batches of "
          f"{args.batch:,} unique random ids, {args.calls} pushes per update; M rows/s")
    print()
    header = "| rows | state | update | push M rows/s | vs torch |"
    print(f"{header}\n|---|---|---|---:|---:|")
    rows = []
    generator = torch.Generator().manual_seed(0)
    grads = torch.randn(args.batch, args.dim, generator=generator) * 1e-3
    for rows_dtype, state_dtype in CONFIGS:
        store = ShardStore(0, 1)
        store.create_table(TableSpec(name="t", num_rows=args.rows, dim=args.dim,
                                     dtype=getattr(torch, rows_dtype),
                                     state_dtype=getattr(torch, state_dtype)))
        store.table("t").state.fill_(1e-3)  # every page of rows and state exists
        paths = ["torch", "compiled"] + \
            (["compiled, no F16C"] if "float16" in (rows_dtype, state_dtype) else [])
        seconds: dict[str, list[float]] = {path: [] for path in paths}
        for call in range(args.calls + 2):  # the first two warm up
            for path in paths[call % len(paths):] + paths[:call % len(paths)]:
                ids = torch.randperm(args.rows, generator=generator)[:args.batch].sort().values
                with update_path(path):
                    started = time.perf_counter()
                    store.push("t", ids, grads, 0.1, decay_clock=1e-4 * call)
                    if call >= 2:
                        seconds[path].append(time.perf_counter() - started)
        base = statistics.median(seconds["torch"])
        for path in paths:
            median = statistics.median(seconds[path])
            line = (f"| {rows_dtype} | {state_dtype} | {path} | "
                    f"{args.batch / median / 1e6:.2f} | {base / median:.2f}x |")
            print(line, flush=True)
            rows.append(table_row(header, line))
    record("bench_row_update", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the checksums of an mmap table's files cost at a clean stop and at the next start.

    python benchmarks/bench_table_files.py --workdir /work/tables   # a 5 GB table (4M x 128)
    python benchmarks/bench_table_files.py --quick                  # smoke run (seconds)

A table of ``--rows`` float32 rows of ``--dim`` with momentum (a state file as large as the
rows, both with a quarter more slots than rows) is made in files (``ams.connect(local_shards=1,
storage="mmap")``) and pushed to, then the client is closed (a clean stop: the maps are
flushed, the slot map and the checksums written, ``ams.shard.table_sums``) and a client opens
the files again (the checksums are checked before anything is mapped), once right after the
close and once after the files were dropped from the page cache (posix_fadvise DONTNEED, as
after a reboot). Beside each close and reopen: the checksums alone (``file_sums`` of the same
files in the same cache state; hashing leaves the cache as it found it), and their share, which
is what the close and the reopen cost more than before the checksums.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from results import record

import ams
from ams.shard.mapped import SUMMED_FILES, table_dir_name
from ams.shard.table_sums import file_sums
from ams.sharding import piece_name

TABLE = "fc"


def drop_from_cache(home: Path) -> None:
    """Drop the table's files from the page cache (they are clean once closed)."""
    for name in SUMMED_FILES:
        fd = os.open(home / name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed_sums(home: Path) -> float:
    start = time.perf_counter()
    file_sums(home, SUMMED_FILES)
    return time.perf_counter() - start


def connect(storage_dir: Path) -> ams.ShardedClient:
    return ams.connect(local_shards=1, storage="mmap", storage_dir=storage_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4_000_000, help="table rows")
    parser.add_argument("--dim", type=int, default=128, help="row width")
    parser.add_argument("--pushes", type=int, default=20, help="pushes of 10,000 rows first")
    parser.add_argument("--workdir", type=Path,
                        help="where the table's files go (default: a temporary directory)")
    parser.add_argument("--quick", action="store_true", help="100,000 rows of 32 (seconds)")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.dim, args.pushes = 100_000, 32, 2
    work = Path(tempfile.mkdtemp(prefix="bench-table-files-", dir=args.workdir))
    try:
        rows = measure(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    header = list(rows[0])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in header) + " |")
    record("bench_table_files", rows, table="close and reopen")


def measure(work: Path, args: argparse.Namespace) -> list[dict]:
    """The rows of the table: each close and reopen, with its checksums' share."""
    client = connect(work)
    start = time.perf_counter()
    client.create_table(TABLE, num_rows=args.rows, dim=args.dim, momentum=0.9, seed=1)
    print(f"created {args.rows:,} x {args.dim} in {time.perf_counter() - start:.1f} s")
    g = torch.Generator().manual_seed(0)
    for _ in range(args.pushes):
        ids = torch.randint(0, args.rows, (10_000,), generator=g).unique()
        client.push(TABLE, ids, torch.randn(ids.numel(), args.dim, generator=g), lr=0.01)
    home = work / piece_name(0, 1) / table_dir_name(TABLE)

    def row(what: str, cache: str, seconds: float, sums: float) -> dict:
        return {"rows": args.rows, "dim": args.dim, "files GB": round(gigabytes, 2),
                "step": what, "page cache": cache, "s": round(seconds, 3),
                "checksums s": round(sums, 3), "checksums share": f"{sums / seconds:.0%}",
                "checksums GB/s": round(gigabytes / sums, 2)}

    start = time.perf_counter()
    client.close()
    closed = time.perf_counter() - start
    gigabytes = sum((home / name).stat().st_size for name in SUMMED_FILES) / 1e9
    # in the cache state the close's own checksums found: theirs leave it as it was
    out = [row("close", "as after training", closed, timed_sums(home))]
    for cache in ("as the close left it", "dropped (a reboot)"):
        if cache.startswith("dropped"):
            drop_from_cache(home)
        sums = timed_sums(home)
        start = time.perf_counter()
        client = connect(work)
        out.append(row("reopen", cache, time.perf_counter() - start, sums))
        client.close()
    return out


if __name__ == "__main__":
    main()

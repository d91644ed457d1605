"""Capacity: what a class table of 1M to 100M rows costs the shard processes, in memory and in
mapped files, against what ``xcls plan`` says.

    python benchmarks/bench_capacity.py          # 1M and 10M both ways, 100M mapped (30 GB disk)
    python benchmarks/bench_capacity.py --quick  # smoke run (seconds)

For every size N of ``--sizes`` and every storage of ``--storages`` (``xcls serve shard
--storage``: ``memory``, or ``mmap``, rows in files the OS pages), ``--shards`` shard processes
on loopback hold one table of d = ``--dim`` float16 rows, no momentum. Through public calls and
the processes' own status only:

* create: the seconds ``client.create_table`` takes;
* each shard process's resident memory (``/proc/PID/status``: anonymous, and file and shared
  pages) after the create and after a neighbor graph of k = ``--k`` is installed (a stand-in
  of the exact graph's shape, int32 fixed width like a real one: an exact build is O(N^2 d));
* the table's bytes as the shards report them (``client.stats()``: rows, optimizer state,
  graph) and the resident bytes per class, all of it and above a shard process with no
  table;
* what ``xcls plan`` (``ams.cluster.plan.shard_memory``) says shard 0 holds at rest, and the
  measured over the planned resident memory (memory storage; mapped rows resident at that
  moment are page cache, which the plan counts as files).

A storage whose table would not fit the host's available memory is skipped for that size
(mmap: its files need the disk under ``--workdir``), and the report says so.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_heads import install_standin_graph
from results import markdown_rows, record

import ams
from ams.client.sharded import ShardedClient
from ams.cluster.plan import Job, load_rates, shard_memory
from xcls.shards import shard_processes

TABLE = "capacity"
ROW_DTYPE = "float16"
ITEMSIZE = 2


def resident(pid: int) -> tuple[int, int]:
    """(anonymous, file-backed and shared) resident bytes of process ``pid``."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["RssAnon"], fields["RssFile"] + fields.get("RssShmem", 0)


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.2f}"


@dataclass
class Measured:
    n: int
    storage: str
    create_s: float
    graph_s: float
    rss_created: list[tuple[int, int]]
    rss_graph: list[tuple[int, int]]
    reported: int  # rows + state + graph bytes, all shards, as client.stats() says


def reported_bytes(client: ShardedClient) -> int:
    total = 0
    for shard in client.stats():
        t = shard["tables"][TABLE]
        total += t["row_bytes"] + t["state_bytes"] + t["graph_bytes"]
    return total


def measure(n: int, storage: str, args: argparse.Namespace, workdir: Path) -> Measured:
    print(f"N={n:,} storage={storage}: creating", file=sys.stderr, flush=True)
    with shard_processes(args.shards, data_dir=workdir / f"{storage}-{n}", xcls_flags=["-q"],
                         log_dir=workdir, extra_args=["--storage", storage]) as shards, \
            ams.connect([shard.address for shard in shards], timeout=3600) as client:
        started = time.perf_counter()
        client.create_table(TABLE, n, args.dim, dtype=ROW_DTYPE, momentum=0.0, seed=args.seed)
        create_s = time.perf_counter() - started
        rss_created = [resident(shard.proc.pid) for shard in shards]
        graph_s = install_standin_graph(client, n, args.k, args.seed, TABLE)
        rss_graph = [resident(shard.proc.pid) for shard in shards]
        return Measured(n, storage, create_s, graph_s, rss_created, rss_graph,
                        reported_bytes(client))


def baseline_rss(workdir: Path) -> int:
    """A shard process's resident bytes with no table, once it has answered a call."""
    with shard_processes(1, xcls_flags=["-q"], log_dir=workdir) as shards, \
            ams.connect([shards[0].address]) as client:
        client.stats()
        return sum(resident(shards[0].proc.pid))


def planned_at_rest(m: Measured, args: argparse.Namespace) -> tuple[int, int]:
    """What ``xcls plan`` says shard 0 holds in RAM at rest: (the table alone, with the
    graph)."""
    job = Job(num_classes=m.n, dim=args.dim, dtype=ROW_DTYPE, momentum=0.0, shards=args.shards,
              graph_k=args.k, storage=m.storage)
    memory = shard_memory(job, load_rates())
    return memory.at_rest - memory.graph, memory.at_rest


def capacity_table(results: list[Measured], baseline: int,
                   args: argparse.Namespace) -> list[str]:
    lines = ["| N | storage | create s | graph install s | per shard after create: anon + "
             "file GiB (max) | + graph GiB (max) | all shards GiB | reported by the shards "
             "GiB | B/class (all) | B/class (above baseline) | shard 0: `xcls plan` at rest "
             "GiB | measured / plan: after create, + graph |",
             "|---:|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for m in results:
        created = max(m.rss_created, key=sum)
        graphed = max(m.rss_graph, key=sum)
        total = sum(sum(x) for x in m.rss_graph)
        above = total - baseline * len(m.rss_graph)
        table_only, planned = planned_at_rest(m, args)
        ratio = "—"
        if m.storage == "memory":
            ratio = (f"{sum(m.rss_created[0]) / table_only:.2f}, "
                     f"{sum(m.rss_graph[0]) / planned:.2f}")
        lines.append(
            f"| {m.n:,} | {m.storage} | {m.create_s:,.1f} | {m.graph_s:,.1f} "
            f"| {gib(created[0])} + {gib(created[1])} | {gib(graphed[0])} + {gib(graphed[1])} "
            f"| {gib(total)} | {gib(m.reported)} | {total / m.n:,.0f} | {above / m.n:,.0f} "
            f"| {gib(planned)} | {ratio} |")
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 20,000 classes")
    parser.add_argument("--sizes", default="1000000,10000000,100000000",
                        help="comma separated class counts N")
    parser.add_argument("--storages", default="memory,mmap",
                        help="comma separated shard storages, each size in each that fits")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--k", type=int, default=12, help="neighbors per class in the graph")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--memory-reserve", type=float, default=2.0,
                        help="GiB of available memory a memory table must leave free")
    parser.add_argument("--workdir", type=Path,
                        help="where the shards' files go (default: a temporary directory; "
                             "100M classes in mmap storage need about 30 GB)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.sizes = "20000"
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.storages = [s for s in args.storages.split(",") if s]
    if any(s not in ("memory", "mmap") for s in args.storages):
        parser.error(f"--storages: memory and/or mmap, got {','.join(args.storages)}")
    if any(n < args.k for n in args.sizes):
        parser.error(f"every size must be at least --k={args.k}")
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    results, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="bench_capacity_", dir=args.workdir) as tmp:
        workdir = Path(tmp)
        baseline = baseline_rss(workdir)
        for n in args.sizes:
            for storage in args.storages:
                need = n * (args.dim * ITEMSIZE + 8 + args.k * 4)  # rows, clocks, graph
                room = available_bytes() - int(args.memory_reserve * 2**30)
                if storage == "memory" and need > room:
                    skipped.append(f"N={n:,}, memory: skipped, the table needs "
                                   f"{need / 2**30:,.1f} GiB of RAM, {room / 2**30:,.1f} GiB "
                                   "available")
                    continue
                results.append(measure(n, storage, args, workdir))
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    lines = [
        f"{datetime.date.today()} · {platform.machine()}, {os.cpu_count()} cores, "
        f"{memory / 2**30:.0f} GiB, torch {torch.__version__}, d={args.dim}, {ROW_DTYPE} rows, "
        f"no row momentum, {args.shards} shard processes, graph k={args.k} (stand-in) · "
        f"{time.perf_counter() - started:,.0f} s",
        "", f"A shard process with no table: {gib(baseline)} GiB resident.", "",
        *capacity_table(results, baseline, args), *[f"\n{line}" for line in skipped]]
    print("\n".join(lines))
    record("bench_capacity", markdown_rows(capacity_table(results, baseline, args)),
           table="capacity")


if __name__ == "__main__":
    main()

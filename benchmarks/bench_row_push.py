"""Row pushes of W data-parallel ranks: what each rank sends, receives and pushes per step, and
how long the push takes.

    python benchmarks/bench_row_push.py            # N = 1M, 2 and 4 gloo ranks (minutes)
    python benchmarks/bench_row_push.py --quick    # smoke run (seconds)

For each W of ``--ranks``, W processes on gloo are clients of ``--shards`` ``xcls serve shard``
processes holding one table of N float32 rows of d = ``--dim`` with a stand-in graph of the exact
graph's shape. Every step each rank draws ``--batch`` random labels of its own, takes their
knn active classes (budget batch x ``--k``), pulls their rows, runs the head on random
features and hands the row gradients to its ``workers.row_update.RowUpdater``, then waits
until the push is applied (``flush``). The updater's counts (``RowUpdater.traffic``) give, per
rank and step: its own rows (its share), the rows it sends the ranks that push them and
receives from them, and the distinct rows it pushes. Beside them: the rows one rank would
push if it gathered every rank's gradients (the sum of all ranks' own rows), and the push's
time from ``update`` to the end of ``flush`` on the slowest rank (median over the steps after
``--warmup``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_comm import free_port
from bench_heads import install_standin_graph
from results import markdown_rows, record

import ams
from workers.distributed import process_group
from workers.heads import build_head
from workers.losses import CombinedMarginLoss
from workers.row_update import RowUpdater
from xcls.shards import shard_processes

TABLE = "push"
LR = 0.1


def run_rank(rank: int, world: int, port: int, addresses: list[str],
             args: argparse.Namespace, out: dict) -> None:
    """One rank's steps; leaves its per-step traffic and push seconds in ``out[rank]``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    steps = args.warmup + args.steps
    with process_group(world, torch.device("cpu")), ams.connect(addresses) as client:
        head = build_head("knn", client, TABLE, args.classes,
                          CombinedMarginLoss.from_preset("arcface"), k=args.k,
                          budget=args.batch * args.k, seed=args.seed * 1000 + rank)
        rows = RowUpdater(client, TABLE, [LR] * steps, rank=rank, world=world)
        generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
        features = torch.randn(args.batch, args.dim, generator=generator)
        counts, seconds = [], []
        before = rows.traffic
        for step in range(steps):
            labels = torch.randint(args.classes, (args.batch,), generator=generator)
            out_step = head.forward_backward(features, head.prepare(labels))
            dist.barrier()  # every rank starts its push together
            started = time.perf_counter()
            rows.update(step, out_step.active_ids, out_step.row_grad)
            rows.flush()
            seconds.append(time.perf_counter() - started)
            after = rows.traffic
            counts.append({name: getattr(after, name) - getattr(before, name)
                           for name in ("own_rows", "sent_rows", "received_rows",
                                        "pushed_rows", "own_bytes", "pushed_bytes")})
            before = after
        rows.close()
        out[rank] = {"counts": counts[args.warmup:], "seconds": seconds[args.warmup:]}


def measure(world: int, addresses: list[str], args: argparse.Namespace) -> dict[str, float]:
    print(f"W={world}: {args.warmup + args.steps} steps", file=sys.stderr, flush=True)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(run_rank, args=(world, free_port(), addresses, args, out), nprocs=world,
                 join=True)
        ranks = [out[r] for r in range(world)]

    def median(name: str) -> float:
        return statistics.median(c[name] for r in ranks for c in r["counts"])

    steps = range(args.steps)
    funnel = statistics.median(sum(r["counts"][s]["own_rows"] for r in ranks) for s in steps)
    ratios = [r["counts"][s]["pushed_bytes"] / r["counts"][s]["own_bytes"]
              for r in ranks for s in steps]
    slowest = [max(r["seconds"][s] for r in ranks) for s in steps]
    return {"own": median("own_rows"), "sent": median("sent_rows"),
            "received": median("received_rows"), "pushed": median("pushed_rows"),
            "ratio": statistics.median(ratios), "worst": max(ratios), "funnel": funnel,
            "push_s": statistics.median(slowest)}


def traffic_table(results: dict[int, dict[str, float]], args: argparse.Namespace) -> list[str]:
    row_bytes = 8 + 4 * args.dim  # an int64 id and float32 gradients
    lines = ["| N | ranks | own rows/step | sent | received | pushed | pushed KiB/step "
             "| pushed ÷ own: median, worst rank and step | one rank pushing all, rows "
             "| push ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for world, r in results.items():
        lines.append(f"| {args.classes:,} | {world} | {r['own']:,.0f} | {r['sent']:,.0f} "
                     f"| {r['received']:,.0f} | {r['pushed']:,.0f} "
                     f"| {r['pushed'] * row_bytes / 1024:,.0f} "
                     f"| {r['ratio']:.2f}, {r['worst']:.2f} "
                     f"| {r['funnel']:,.0f} | {r['push_s'] * 1000:,.1f} |")
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 20,000 classes")
    parser.add_argument("--classes", type=int, default=1_000_000, help="N")
    parser.add_argument("--ranks", default="2,4", help="comma separated W")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=256, help="per rank")
    parser.add_argument("--k", type=int, default=12, help="knn budget batch x k")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.classes, args.batch, args.warmup, args.steps = 20_000, 32, 1, 3
    args.ranks = [int(w) for w in args.ranks.split(",") if w]
    return args


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_row_push_") as tmp, \
            shard_processes(args.shards, xcls_flags=["-q"], log_dir=Path(tmp)) as shards:
        addresses = [shard.address for shard in shards]
        with ams.connect(addresses, timeout=3600) as client:
            client.create_table(TABLE, args.classes, args.dim, momentum=0.0, seed=args.seed)
            install_standin_graph(client, args.classes, args.k, args.seed, TABLE)
        results = {world: measure(world, addresses, args) for world in args.ranks}
    lines = [f"{datetime.date.today()} · {platform.machine()}, {os.cpu_count()} cores, "
             f"torch {torch.__version__}, gloo, {args.shards} shard processes, float32 rows, "
             f"d={args.dim}, batch {args.batch} a rank, knn budget {args.batch * args.k:,}, "
             f"medians of {args.steps} steps · {time.perf_counter() - started:,.0f} s", "",
             *traffic_table(results, args)]
    print("\n".join(lines))
    record("bench_row_push", markdown_rows(traffic_table(results, args)), table="traffic")


if __name__ == "__main__":
    main()

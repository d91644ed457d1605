"""Collective placement against AMS placement: the time of a whole training step on W ranks.

    python benchmarks/bench_collective.py            # N = 100k and 1M, 2 gloo ranks (minutes)
    python benchmarks/bench_collective.py --quick    # smoke run, N = 2,000 (seconds)
    python benchmarks/bench_collective.py --sizes 100000 --steps 5 --warmup 2

Where the class rows live while a job trains (``head.placement``):

* collective (``workers.collective``): each of the ``--ranks`` worker ranks holds its slice of
  the table in process (rank r: the classes c % W == r). A step all-gathers the ranks' labels
  and features, computes a model-parallel softmax over all slices, and each rank pushes the
  row gradient of its own slice into its own slice.
* AMS (``workers.heads``): the rows live in a model server. Each rank selects and pulls its
  active rows, computes the softmax of its own samples, and the row gradients of all ranks
  are combined, each rank pushing its share (``workers.row_update.RowUpdater``).

Three setups are timed, on the same label and image sequence:

  collective            --ranks processes, each a CollectiveShards slice + CollectiveHead
  ams grpc              --ranks processes, each an ams.connect(addresses) client of --shards
                        ``xcls serve shard`` processes on 127.0.0.1 + ClassifierHead
  ams embedded, 1 rank  one process, ams.connect(local_shards=--shards), the global batch
                        (--ranks x --batch images) on that one rank: a reference only, since
                        the embedded AMS lives inside one process and cannot serve 2 ranks

One step, as the trainer takes it: head.prepare (the AMS heads select and pull here; the
collective head only checks the labels), backbone forward (``resnet_small`` on random uint8
32x32 grayscale images), head.forward_backward, the RowUpdater push, backbone backward (under
DDP when there are several ranks) and the SGD step. There is no prefetch thread. Every setup
processes the same global batch per step, so its step times compare directly.

Heads: ``partial`` (PartialFC, ``--sample-rate`` of the classes active) at every N, ``full``
(every class active) only for N <= ``--full-max``. A partial AMS rank draws its own
sample_rate * N classes; the collective ranks draw sample_rate of each slice, sample_rate * N
in all. One table of fp32 rows, row momentum 0.

The collective and ams grpc contenders run in the same rank processes, round-robin (one step
each in turn), so drift on a shared machine hits them alike; the 1-rank reference runs after
them. A step's time on several ranks is that of its slowest rank (each step starts at a
barrier); each figure is the median over ``--steps`` measured steps after ``--warmup``.

``--device`` is where the backbones and heads compute (``auto``: CUDA when there is one). On
CUDA every rank needs a GPU of its own (rank r uses cuda:r, the ranks talk over NCCL instead
of gloo), the backbone runs under autocast unless ``--no-amp``, and every timestamp waits for
the GPU. The rows stay in host memory either way.
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
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_comm import free_port
from bench_heads import (
    IMAGE_SIZE,
    LR,
    TABLE,
    Contender,
    TimedStore,
    clock,
    device_description,
    drop_warmup,
    ms,
    round_robin,
)
from results import describe_device, markdown_rows, record
from torch.nn.parallel import DistributedDataParallel

import ams
from ams.client.sharded import ShardedClient
from workers.backbones import build_backbone
from workers.collective import CollectiveHead, CollectiveShards
from workers.device_slice import DeviceSlice
from workers.distributed import process_group, worker_device
from workers.heads import RowHead, build_head
from workers.losses import CombinedMarginLoss
from workers.predict import images_to_input
from workers.row_update import RowUpdater
from workers.trainer import step_backbone
from xcls.cli_help import DefaultsHelpFormatter
from xcls.shards import shard_processes

COLLECTIVE, GRPC, EMBEDDED = "collective", "ams grpc", "ams embedded"
PLACEMENTS = (COLLECTIVE, GRPC, EMBEDDED)


@dataclass(frozen=True)
class Job:
    """What one group of rank processes runs: every head of ``heads`` in every placement of
    ``placements`` on a table of ``n`` classes, with ``world`` ranks; ``shards``: the AMS
    shards, at ``addresses`` for ``ams grpc``, in process for ``ams embedded``; ``workdir``: a
    scratch directory (the collective slices' snapshot directories, never written)."""

    n: int
    heads: tuple[str, ...]
    world: int
    placements: tuple[str, ...]
    shards: int
    addresses: tuple[str, ...]
    workdir: str


@dataclass
class Measured:
    """One (placement, head) over the measured steps: median seconds per step, median active
    classes per step, and the number of measured steps."""

    seconds: float
    active: float
    steps: int


# ---- one rank ----------------------------------------------------------------------------


def rank_batches(args: argparse.Namespace, n: int, rank: int, world: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(uint8 images, int64 labels) of every step for ``rank`` of ``world``: each step's global
    batch of ``--ranks`` x ``--batch`` samples is the same in every job; a rank takes its
    contiguous share of it (the whole batch when world is 1)."""
    generator = torch.Generator().manual_seed(args.seed)
    total = args.ranks * args.batch
    share = total // world
    mine = slice(rank * share, (rank + 1) * share)
    out = []
    for _ in range(args.warmup + args.steps):
        images = torch.randint(0, 256, (total, 1, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8,
                               generator=generator)
        labels = torch.randint(n, (total,), generator=generator)
        out.append((images[mine], labels[mine]))
    return out


def connect(placement: str, job: Job, rank: int, stack: ExitStack) -> ShardedClient:
    """The client of ``placement``'s rows for this rank, closed by ``stack``."""
    if placement == COLLECTIVE:
        shards = CollectiveShards(rank, job.world, data_dir=Path(job.workdir) / f"slice-{rank}",
                                  keep_snapshots=1)
        stack.callback(shards.close)
        return shards.client
    if placement == GRPC:
        client = ams.connect(list(job.addresses))
    else:
        client = ams.connect(local_shards=job.shards)
    stack.callback(client.close)
    return client


def make_head(placement: str, kind: str, store: TimedStore, job: Job, rank: int,
              device: torch.device, args: argparse.Namespace) -> RowHead:
    """The head the trainer builds for ``placement`` (seeded per rank as the trainer does; in
    collective placement on CUDA the slice in GPU memory)."""
    margin = CombinedMarginLoss.from_preset(args.margin)
    options = dict(sample_rate=args.sample_rate, seed=args.seed * 1000 + rank)
    if placement == COLLECTIVE:
        device_rows = DeviceSlice(store.client.shards[rank].store, TABLE, device) \
            if device.type != "cpu" else None
        return CollectiveHead(store, TABLE, job.n, margin, kind, rank=rank, world=job.world,
                              device_rows=device_rows, **options)
    return build_head(kind, store, TABLE, job.n, margin, **options)


def make_backbone(device: torch.device, world: int, args: argparse.Namespace
                  ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``resnet_small`` with the same initial weights every time, wrapped in DDP when there
    are several ranks, and its SGD optimizer."""
    torch.manual_seed(args.seed)
    net = build_backbone("resnet_small", args.dim, 1, IMAGE_SIZE).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    if world > 1:
        net = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda"
                                      else None)
    return net, optimizer


def run_rank(rank: int, job: Job, port: int, args: argparse.Namespace, out: dict) -> None:
    """Rank ``rank`` of ``job``: build every contender, step them round-robin and leave its
    measurements in ``out[rank]``: {(placement, head): {"total": [s...], "active": [...]}}."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(job.world), LOCAL_RANK=str(rank))
    torch.set_num_threads(args.threads * args.ranks // job.world)
    device = worker_device(args.device, rank)
    amp = args.amp and device.type == "cuda"
    with process_group(job.world, device), ExitStack() as stack:
        contenders, parts = [], {}
        for placement in job.placements:
            client = connect(placement, job, rank, stack)
            client.create_table(TABLE, job.n, args.dim, dtype="float32", momentum=0.0,
                                seed=args.seed)
            for kind in job.heads:
                store = TimedStore(client)
                head = make_head(placement, kind, store, job, rank, device, args)
                # the trainer's rule: the AMS heads' ranks push their shares of one update,
                # a collective head's rank its own slice's
                combine = head.combine_row_grads
                updater = RowUpdater(head.device_rows or client, TABLE,
                                     [LR] * (args.warmup + args.steps),
                                     rank=rank if combine else 0,
                                     world=job.world if combine else 1)
                # Contender's "settings" holds the placement here
                c = Contender(kind, placement, head, store, args.steps)
                contenders.append(c)
                parts[id(c)] = (updater, *make_backbone(device, job.world, args),
                                torch.amp.GradScaler("cuda") if amp else None)
        batches = rank_batches(args, job.n, rank, job.world)

        def step(c: Contender, i: int) -> None:
            updater, net, optimizer, scaler = parts[id(c)]
            images, labels = batches[i]
            if job.world > 1:
                dist.barrier()
            started = clock(device)
            active = c.head.prepare(labels)
            with torch.autocast(device.type, enabled=amp):
                features = net(images_to_input(images.to(device, non_blocking=True)))
            result = c.head.forward_backward(features, active)
            updater.update(i, result.active_ids, result.row_grad)
            # in the step's time: the trainer overlaps it, this table not
            updater.wait_pushed(i)
            step_backbone(features, result.feature_grad, optimizer, scaler)
            optimizer.zero_grad(set_to_none=True)
            c.record(total=clock(device) - started, active=result.num_active)

        round_robin(contenders, args.warmup, step)
        drop_warmup(contenders, args.warmup)
        for updater, *_ in parts.values():
            updater.close()
        out[rank] = {(c.settings, c.name): c.samples for c in contenders}
        if job.world > 1:
            dist.barrier()  # no slice server stops while another rank still steps


def run_job(job: Job, args: argparse.Namespace) -> dict[tuple[str, str], Measured]:
    """``job`` on ``job.world`` spawned processes; per (placement, head) the median over the
    measured steps of each step's slowest rank."""
    print(f"N={job.n:,}: {' + '.join(job.placements)} on {job.world} rank(s)", file=sys.stderr,
          flush=True)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(run_rank, args=(job, free_port(), args, out), nprocs=job.world, join=True)
        ranks = [out[r] for r in range(job.world)]
    measured = {}
    for key, samples in ranks[0].items():
        slowest = [max(times) for times in zip(*(r[key]["total"] for r in ranks), strict=True)]
        measured[key] = Measured(statistics.median(slowest),
                                 statistics.median(samples["active"]), len(slowest))
    return measured


def bench_size(n: int, args: argparse.Namespace) -> dict[tuple[str, str], Measured]:
    """Every placement and head at ``n`` classes: collective and ams grpc on ``--ranks`` ranks
    (``--shards`` shard processes serving the AMS), then ams embedded on one rank."""
    heads = ("partial", "full") if n <= args.full_max else ("partial",)
    with tempfile.TemporaryDirectory(prefix="bench_collective_") as tmp:
        with shard_processes(args.shards, xcls_flags=["-q"], log_dir=Path(tmp)) as shards:
            addresses = tuple(shard.address for shard in shards)
            measured = run_job(Job(n, heads, args.ranks, (COLLECTIVE, GRPC), args.shards,
                                   addresses, tmp), args)
        measured |= run_job(Job(n, heads, 1, (EMBEDDED,), args.shards, (), tmp), args)
    return measured


# ---- report ------------------------------------------------------------------------------


def active_cell(values: list[float]) -> str:
    """Active classes per step: one figure when all placements agree, else each."""
    if len(set(values)) == 1:
        return f"{values[0]:,.0f}"
    return " / ".join(f"{v:,.0f}" for v in values)


def result_table(results: dict[int, dict[tuple[str, str], Measured]],
                 args: argparse.Namespace) -> list[str]:
    lines = [f"| N | head | active classes | collective, {args.ranks} ranks ms "
             f"| ams grpc, {args.ranks} ranks ms | ams embedded, 1 rank ms "
             "| ams grpc ÷ collective | steps |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for n, measured in results.items():
        for head in dict.fromkeys(h for _, h in measured):
            row = [measured[(p, head)] for p in PLACEMENTS]
            collective, grpc, embedded = row
            lines.append(
                f"| {n:,} | {head} | {active_cell([m.active for m in row])} "
                f"| {ms(collective.seconds)} | {ms(grpc.seconds)} "
                f"| {ms(embedded.seconds)} | {grpc.seconds / collective.seconds:,.2f}x "
                f"| {collective.steps} |")
    return lines


# ---- main --------------------------------------------------------------------------------


class HelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultsHelpFormatter):
    """The module docstring as written, and each option's default."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: N=2,000, batch 32, one warm-up and one measured step")
    parser.add_argument("--sizes", default="100000,1000000",
                        help="comma separated numbers of classes N, one table each")
    parser.add_argument("--ranks", type=int, default=2,
                        help="worker ranks (processes on this host) of collective and ams grpc")
    parser.add_argument("--shards", type=int, default=2,
                        help="AMS shards: gRPC processes, and in-process shards of the 1-rank "
                             "embedded reference")
    parser.add_argument("--batch", type=int, default=64,
                        help="images per rank and step (the 1-rank reference takes ranks x "
                             "batch)")
    parser.add_argument("--dim", type=int, default=128, help="embedding and row dimension")
    parser.add_argument("--sample-rate", type=float, default=0.1,
                        help="share of the classes active in the partial head")
    parser.add_argument("--full-max", type=int, default=100_000,
                        help="largest N that also runs the full head (every class active)")
    parser.add_argument("--margin", default="arcface", help="margin preset (s=64)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps per contender")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per contender")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where the backbones and heads compute (auto: CUDA if present; "
                             "cuda needs a GPU per rank)")
    parser.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True,
                        help="autocast and a gradient scaler for the backbone, on CUDA")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads per rank (the 1-rank reference gets "
                             "ranks x threads, the same in all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.batch, args.warmup, args.steps = "2000", 32, 1, 1
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.ranks < 2:
        parser.error("--ranks: collective placement needs at least 2 ranks")
    if min(args.sizes, default=0) < args.ranks:
        parser.error("--sizes: every N needs at least one class per rank")
    try:  # the last rank needs a device of its own; the others then have one too
        worker_device(args.device, args.ranks - 1)
    except ValueError as err:
        parser.error(f"--device {err}")
    return args


def main() -> None:
    args = parse_args()
    device = worker_device(args.device, 0)
    amp = args.amp and device.type == "cuda"
    started = time.perf_counter()
    results = {n: bench_size(n, args) for n in args.sizes}
    lines = [
        f"{datetime.date.today()} · {platform.machine()}, {os.cpu_count()} cores, "
        f"{device_description(device, amp)}, torch {torch.__version__}, "
        f"{args.threads} thread(s)/rank ({args.threads * args.ranks} for the 1-rank "
        f"reference), {'NCCL' if device.type == 'cuda' else 'gloo'}, fp32 rows, momentum 0, "
        f"d={args.dim}, margin {args.margin} s=64, partial sample_rate={args.sample_rate}, "
        f"warmup {args.warmup} step(s), medians · run took "
        f"{time.perf_counter() - started:,.0f} s",
        "", f"Whole step, resnet_small, {IMAGE_SIZE}x{IMAGE_SIZE} grayscale, global batch "
        f"{args.ranks}x{args.batch} = {args.ranks * args.batch} images; {args.shards} AMS "
        "shards (ms per step; several ranks: the slowest rank's step):", "",
        *result_table(results, args),
    ]
    print("\n".join(lines))
    record("bench_collective", markdown_rows(result_table(results, args)),
           device=describe_device(device))


if __name__ == "__main__":
    main()

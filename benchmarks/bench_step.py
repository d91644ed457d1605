"""Whole training steps side by side: images/s of the backbone alone and with each head where
the class rows live.

    python benchmarks/bench_step.py                   # CPU: resnet_small, 1M and 10M classes
    python benchmarks/bench_step.py --quick           # smoke run (a minute)
    python benchmarks/bench_step.py --device cuda     # IResNet-50 at 112x112 under AMP, d = 512
    python benchmarks/bench_step.py --device cuda --sizes 100000000 --dtype float16 \
        --dim 128 --contenders backbone,knn-embedded   # 100M rows in host RAM

Contenders (``--contenders``, all by default), each on the same label and image sequence:

  backbone            the backbone alone, forward, backward from a fixed dL/dX and the SGD
                      step: the ceiling, no head
  knn-embedded        the knn head (``--k`` neighbors, budget batch x k), rows in the embedded
                      AMS (``ams.connect(local_shards=--shards)``)
  knn-shards          the same, rows in ``--shards`` ``xcls serve shard`` processes on loopback
  partial-embedded    the partial head (PartialFC's sampling, ``--sample-rate``), embedded AMS
  knn-collective      the knn head in collective placement, one rank: the rows in the worker's
                      own slice (``workers.collective``), on CUDA in GPU memory
                      (``workers.device_slice``), as the trainer keeps it
  partial-collective  the partial head in collective placement: PartialFC's algorithm
  full-embedded       (not by default) the exact softmax over all N classes, embedded AMS:
                      a (B, N) logit matrix does not fit at 10M, so the rows are pulled
                      ``--full-block`` at a time, the log-sum-exp taken over all blocks, then
                      each block's gradients pushed (``full_softmax_blocked``); the baseline
                      a full softmax at this size needs

A step runs as the trainer runs it (``Trainer._step``): the prefetch thread selects and pulls
``--prefetch-depth`` steps ahead and on CUDA stages the rows on the device, the backbone
computes the features (autocast on CUDA), the head computes loss, dL/dX and dL/dW, the row
update hands the push to its thread (it runs behind the backward and the next forward), and
the backbone's backward and SGD step follow (a gradient scaler under AMP). The head waits for
the previous push and the prefetch thread as the trainer's does.

Contenders take turns in blocks of ``--block`` steps, so drift on a shared machine hits them
alike; between blocks a contender's pushes and prefetches are finished, so none of its work
runs in another's block. A step's time is the time between two steps' ends within a block
(throughput, as the trainer's images/s), so a block's first step is not timed; each figure is
the median over the timed steps. The class table's graph is a stand-in of the exact graph's
shape (``bench_heads.install_standin_graph``): a step's cost depends on the lists' length,
not their content. A size whose tables would not fit the host's available memory is skipped
per placement, and the report says so.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_heads import clock, install_standin_graph
from results import describe_device, markdown_rows, record

import ams
from ams.client.sharded import ShardedClient
from workers.backbones import build_backbone
from workers.collective import CollectiveHead, CollectiveShards
from workers.device_slice import DeviceSlice
from workers.distributed import worker_device
from workers.heads import RowHead, build_head
from workers.losses import CombinedMarginLoss
from workers.predict import images_to_input
from workers.prefetch import Prefetcher
from workers.row_update import RowUpdater
from workers.trainer import step_backbone
from xcls.shards import shard_processes

TABLE = "step"
LR = 0.1
EMBEDDED, SHARDS, COLLECTIVE = "embedded", "shards", "collective"
CONTENDERS = {  # name: (head, placement)
    "backbone": (None, None),
    "knn-embedded": ("knn", EMBEDDED),
    "knn-shards": ("knn", SHARDS),
    "partial-embedded": ("partial", EMBEDDED),
    "knn-collective": ("knn", COLLECTIVE),
    "partial-collective": ("partial", COLLECTIVE),
    "full-embedded": ("full", EMBEDDED),
}
DEFAULT_CONTENDERS = [name for name in CONTENDERS if name != "full-embedded"]
# Image batches made once and cycled: labels change every step, pixels need not.
IMAGE_BATCHES = 4


@dataclass
class Contender:
    """One contender's parts and what was measured of it."""

    name: str
    where: str  # the placement in words
    net: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    head: RowHead | None = None
    rows: RowUpdater | None = None
    prefetcher: Prefetcher | None = None
    batches: Iterator | None = None  # without a prefetch thread: the backbone's, full's
    client: ShardedClient | None = None  # full's
    step: int = 0
    seconds: list[float] = field(default_factory=list)
    active: list[int] = field(default_factory=list)

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        if self.rows is not None:
            self.rows.close()


def step_batches(args: argparse.Namespace, n: int) -> Iterator[tuple]:
    """(sample ids, uint8 images, int64 labels) of every step: labels drawn per step, the
    same sequence for every contender; images cycled from a few batches (pinned on CUDA, as
    a loader with pinned memory hands them over)."""
    generator = torch.Generator().manual_seed(args.seed)
    images = [torch.randint(0, 256, (args.batch, args.channels, args.image_size,
                                     args.image_size), dtype=torch.uint8, generator=generator)
              for _ in range(IMAGE_BATCHES)]
    if args.device.type == "cuda":
        images = [i.pin_memory() for i in images]
    labels = torch.Generator().manual_seed(args.seed + n)
    ids = torch.arange(args.batch)
    for step in itertools.count():
        yield ids, images[step % IMAGE_BATCHES], torch.randint(n, (args.batch,),
                                                               generator=labels)


def backbone_parts(args: argparse.Namespace
                   ) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler | None]:
    """The backbone with the same initial weights for every contender, its SGD optimizer and
    (AMP) gradient scaler."""
    torch.manual_seed(args.seed)
    net = build_backbone(args.backbone, args.dim, args.channels, args.image_size)
    net = net.to(args.device)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    return net, optimizer, torch.amp.GradScaler("cuda") if args.amp else None


def make_head(kind: str, placement: str, client: ShardedClient, n: int,
              args: argparse.Namespace) -> RowHead:
    """The head the trainer builds for ``placement``: the knn budget batch x k, partial's
    sample rate, an ArcFace margin (s = 64)."""
    options = dict(sample_rate=args.sample_rate, k=args.k, budget=args.batch * args.k,
                   seed=args.seed)
    if placement == COLLECTIVE:
        device_rows = DeviceSlice(client.shards[0].store, TABLE, args.device) \
            if args.device.type != "cpu" else None
        return CollectiveHead(client, TABLE, n, args.margin, kind, rank=0, world=1,
                              device_rows=device_rows, **options)
    return build_head(kind, client, TABLE, n, args.margin, **options)


def make_contender(name: str, where: str, client: ShardedClient | None, n: int,
                   args: argparse.Namespace) -> Contender:
    net, optimizer, scaler = backbone_parts(args)
    c = Contender(name, where, net, optimizer, scaler)
    kind, placement = CONTENDERS[name]
    if kind in (None, "full"):
        c.batches, c.client = step_batches(args, n), client
        return c
    c.head = make_head(kind, placement, client, n, args)
    c.rows = RowUpdater(c.head.device_rows or client, TABLE, [LR] * args.total_steps)
    c.prefetcher = Prefetcher(step_batches(args, n), c.head, args.prefetch_depth, 0,
                              wait_pushed=c.rows.wait_pushed, device=args.device)
    return c


def full_softmax_blocked(client: ShardedClient, features: torch.Tensor, labels: torch.Tensor,
                         margin: CombinedMarginLoss, block: int) -> tuple[float, torch.Tensor]:
    """The exact softmax cross-entropy over every class of the table, rows pulled ``block``
    at a time; each block's row gradients are pushed. features (B, d) float on the compute
    device, labels (B,) int64. Returns (loss, dL/dfeatures (B, d) float32)."""
    device, batch = features.device, features.shape[0]
    n = client.spec(TABLE).num_rows
    labels = labels.to(device)
    x = features.detach().float().requires_grad_(True)
    blocks = []
    lse = torch.full((batch,), -torch.inf, device=device)
    target_logit = torch.zeros(batch, device=device)
    with torch.no_grad():
        x_unit = F.normalize(x, dim=1)
        for start in range(0, n, block):
            ids = torch.arange(start, min(start + block, n), dtype=torch.int64)
            rows = client.pull(TABLE, ids).to(device)
            blocks.append((ids, rows))
            local = torch.where((labels >= start) & (labels < start + ids.numel()),
                                labels - start, -1)
            logits = margin(x_unit @ F.normalize(rows.float(), dim=1).t(), local)
            lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=1))
            hit = local >= 0
            target_logit[hit] = logits[hit, local[hit]]
    feature_grad = torch.zeros_like(x)
    for ids, rows in blocks:
        start = int(ids[0])
        w = rows.float().requires_grad_(True)
        local = torch.where((labels >= start) & (labels < start + ids.numel()),
                            labels - start, -1)
        logits = margin(F.normalize(x, dim=1) @ F.normalize(w, dim=1).t(), local)
        hit = (local >= 0).nonzero().squeeze(1)
        # d/dlogits of mean(lse - target): softmax minus the one-hot target, over B
        surrogate = (torch.exp(logits - lse[:, None]).sum()
                     - logits[hit, local[hit]].sum()) / batch
        dx, dw = torch.autograd.grad(surrogate, (x, w))
        feature_grad += dx
        client.push(TABLE, ids, dw.cpu(), LR)
    return float((lse - target_logit).mean()), feature_grad


def run_block(c: Contender, steps: int, args: argparse.Namespace) -> None:
    """``steps`` steps of ``c`` as the trainer takes them; then its pushes and prefetches are
    finished, so nothing of it runs while another contender steps."""
    device, last = args.device, None
    for _ in range(steps):
        if c.prefetcher is not None:
            prepared = next(c.prefetcher)
            _, images, labels = prepared.batch
        else:
            _, images, labels = next(c.batches)
        with torch.autocast(device.type, enabled=args.amp):
            features = c.net(images_to_input(images.to(device, non_blocking=True)))
        if c.head is not None:
            c.prefetcher.wait_prepared(c.step)
            c.rows.wait_pushed(c.step - 1)
            out = c.head.forward_backward(features, prepared.on_device())
            c.rows.update(c.step, out.active_ids, out.row_grad)
            feature_grad = out.feature_grad
            c.active.append(out.num_active)
        elif c.client is not None:
            _, feature_grad = full_softmax_blocked(c.client, features, labels, args.margin,
                                                   args.full_block)
            feature_grad = feature_grad.to(features.dtype)
            c.active.append(c.client.spec(TABLE).num_rows)
        else:
            feature_grad = args.feature_grad.to(features.dtype)
        step_backbone(features, feature_grad, c.optimizer, c.scaler)
        c.optimizer.zero_grad(set_to_none=True)
        if c.prefetcher is not None:
            c.prefetcher.step_done()
        c.step += 1
        now = clock(device)
        if last is not None:
            c.seconds.append(now - last)
        last = now
    if c.head is not None:
        c.rows.flush()
        c.prefetcher.wait_prepared(c.step)


def table_bytes(n: int, args: argparse.Namespace) -> int:
    """Host memory of one placement's table: rows, each row's decay clock (float64) and the
    graph's lists (int32), no momentum."""
    itemsize = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    return n * (args.dim * itemsize + 8 + args.k * 4)


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo (the host's RAM when there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def open_placement(placement: str, n: int, args: argparse.Namespace,
                   stack: contextlib.ExitStack, workdir: Path) -> ShardedClient:
    """The client of ``placement``'s rows with the table of ``n`` classes and its stand-in
    graph, closed by ``stack``."""
    if placement == EMBEDDED:
        client = stack.enter_context(ams.connect(local_shards=args.shards))
    elif placement == SHARDS:
        shards = stack.enter_context(shard_processes(args.shards, xcls_flags=["-q"],
                                                     log_dir=workdir))
        client = stack.enter_context(ams.connect([s.address for s in shards], timeout=3600))
    else:
        slices = CollectiveShards(0, 1, data_dir=workdir / f"slice-{n}", keep_snapshots=1)
        stack.callback(slices.close)
        client = slices.client
    started = time.perf_counter()
    client.create_table(TABLE, n, args.dim, dtype=args.dtype, momentum=0.0, seed=args.seed)
    created = time.perf_counter() - started
    graph = install_standin_graph(client, n, args.k, args.seed, TABLE)
    # where a GPU host's time limit goes, when a size does not fit it
    print(f"N={n:,}: table ({placement}) created in {created:.1f} s, its stand-in graph "
          f"in {graph:.1f} s", file=sys.stderr, flush=True)
    return client


def placement_words(placement: str | None, args: argparse.Namespace) -> str:
    return {None: "—", EMBEDDED: f"AMS, embedded ({args.shards} shards)",
            SHARDS: f"AMS, {args.shards} shard processes",
            COLLECTIVE: "collective, 1 rank"}[placement]


def bench_size(n: int, args: argparse.Namespace, skipped: list[str]) -> list[Contender]:
    """Every contender at ``n`` classes that fits this host's memory, round-robin."""
    placements = list(dict.fromkeys(CONTENDERS[name][1] for name in args.contenders
                                    if CONTENDERS[name][1] is not None))
    need, room = table_bytes(n, args), available_bytes() - args.memory_reserve
    kept = []
    for placement in placements:
        if need > room:
            skipped.append(f"N={n:,}: {placement_words(placement, args)} skipped, its table "
                           f"needs {need / 2**30:,.1f} GiB, {max(room, 0) / 2**30:,.1f} GiB "
                           "left of the available memory")
            continue
        kept.append(placement)
        room -= need
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory(
            prefix="bench_step_") as tmp:
        clients = {}
        for placement in kept:
            print(f"N={n:,}: creating the table ({placement})", file=sys.stderr, flush=True)
            clients[placement] = open_placement(placement, n, args, stack, Path(tmp))
        contenders = []
        for name in args.contenders:
            placement = CONTENDERS[name][1]
            if placement is None or placement in clients:
                c = make_contender(name, placement_words(placement, args),
                                   clients.get(placement), n, args)
                stack.callback(c.close)
                contenders.append(c)
        print(f"N={n:,}: {len(contenders)} contenders, {args.rounds} rounds of "
              f"{args.block} steps", file=sys.stderr, flush=True)
        for c in contenders:  # warm-up: unmeasured
            run_block(c, args.warmup, args)
            c.seconds.clear()
            c.active.clear()
        for r in range(args.rounds):
            for c in contenders:
                run_block(c, args.block, args)
            print(f"  round {r + 1} done", file=sys.stderr, flush=True)
        for c in contenders:
            c.close()
    return contenders


# ---- report ------------------------------------------------------------------------------


def step_table(results: dict[int, list[Contender]], args: argparse.Namespace) -> list[str]:
    lines = ["| N | rows | head | where the rows live | rows pulled/step | images/s | ms/step "
             "| ÷ backbone | above backbone, % of step | steps |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for n, contenders in results.items():
        base = next((statistics.median(c.seconds) for c in contenders if c.head is None), None)
        for c in contenders:
            t = statistics.median(c.seconds)
            ratio = f"{t / base:.3f}" if base else "—"
            above = f"{(t - base) / t:.1%}" if base else "—"
            active = f"{statistics.median(c.active):,.0f}" if c.active else "—"
            lines.append(f"| {n:,} | {args.dtype} x {args.dim} | {c.name.split('-')[0]} "
                         f"| {c.where} | {active} "
                         f"| {args.batch / t:,.1f} | {t * 1000:,.1f} | {ratio} | {above} "
                         f"| {len(c.seconds)} |")
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 5,000 classes, batch 16, small images, few steps")
    parser.add_argument("--sizes", default="1000000,10000000", help="comma separated N")
    parser.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS),
                        help=f"comma separated, of {', '.join(CONTENDERS)}")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where the backbone and heads compute (auto: CUDA if present); "
                             "CUDA: IResNet-50 at 112x112 RGB, d = 512, AMP; CPU: "
                             "resnet_small at 32x32 grayscale, d = 128")
    parser.add_argument("--dim", type=int, help="embedding and row dim (default by device)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16"),
                        help="the rows' dtype")
    parser.add_argument("--k", type=int, default=12,
                        help="neighbors per class (the class itself included); knn budget "
                             "batch x k")
    parser.add_argument("--sample-rate", type=float, default=0.1, help="partial head")
    parser.add_argument("--full-block", type=int, default=1 << 18,
                        help="rows per block of the full softmax (full-embedded)")
    parser.add_argument("--shards", type=int, default=2, help="AMS shards")
    parser.add_argument("--prefetch-depth", type=int, default=1,
                        help="train.prefetch_depth")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps each")
    parser.add_argument("--block", type=int, default=4, help="steps per turn")
    parser.add_argument("--rounds", type=int, default=3, help="turns each")
    parser.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True,
                        help="autocast and a gradient scaler, on CUDA")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--memory-reserve", type=float, default=2.0,
                        help="GiB of available memory left free when tables are sized")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.batch, args.warmup, args.block, args.rounds = "5000", 16, 1, 3, 1
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.contenders = [c for c in args.contenders.split(",") if c]
    unknown = [c for c in args.contenders if c not in CONTENDERS]
    if unknown:
        parser.error(f"--contenders: unknown {', '.join(unknown)}")
    try:
        args.device = worker_device(args.device, 0)
    except ValueError as err:
        parser.error(f"--device {err}")
    cuda = args.device.type == "cuda"
    args.amp = args.amp and cuda
    args.backbone, args.channels = ("iresnet50", 3) if cuda else ("resnet_small", 1)
    args.image_size = 112 if cuda else 32
    args.dim = args.dim or (512 if cuda else 128)
    args.memory_reserve = int(args.memory_reserve * 2**30)
    if args.quick:
        args.dim = 32
    args.total_steps = args.warmup + args.block * args.rounds
    args.margin = CombinedMarginLoss.from_preset("arcface")
    feature = torch.Generator().manual_seed(args.seed)
    args.feature_grad = (torch.randn(args.batch, args.dim, generator=feature)
                         / args.batch).to(args.device)
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    skipped: list[str] = []
    results = {n: bench_size(n, args, skipped) for n in args.sizes}
    model = (f"{args.backbone} at {args.image_size}x{args.image_size}"
             f"{', AMP' if args.amp else ''}")
    lines = [
        f"{datetime.date.today()} · {platform.machine()}, {os.cpu_count()} cores, "
        f"{describe_device(args.device)}, torch {torch.__version__}, threads={args.threads} · "
        f"{model}, batch {args.batch}, d={args.dim}, {args.dtype} rows, knn k={args.k} budget "
        f"{args.batch * args.k:,}, partial sample_rate={args.sample_rate}, prefetch depth "
        f"{args.prefetch_depth}, medians of {args.rounds} x {args.block - 1} timed steps · "
        f"{time.perf_counter() - started:,.0f} s",
        "", *step_table(results, args), *[f"\n{line}" for line in skipped]]
    print("\n".join(lines))
    record("bench_step", markdown_rows(step_table(results, args)), table="whole step",
           device=describe_device(args.device))


if __name__ == "__main__":
    main()

"""The full, partial and knn heads side by side: the head alone, then a whole training step.

    python benchmarks/bench_heads.py            # the default tables (about 10 minutes on 2 cores)
    python benchmarks/bench_heads.py --quick    # smoke run (seconds)
    python benchmarks/bench_heads.py --device cuda --sizes 1000000,10000000 \
        --exact-graph-max 1000000                # on a GPU host

(a) The head alone: select + pull + forward + backward + push for one batch of fixed random
    features, at each ``--sizes`` N, on an embedded AMS (``ams.connect(local_shards=S)``, fp32
    rows). Heads: full (all N rows), partial (``--sample-rate`` * N), knn at partial's active-set
    size (labels + neighbors, random fill), and knn at the KNN softmax paper's small budget (``--k``
    neighbors per label, budget batch * k).
(b) A whole training step at ``--step-classes`` N: random uint8 images through the
    ``resnet_small`` backbone, the head, the backbone's backward and SGD step, on the embedded
    AMS and on ``--shards`` ``xcls serve shard`` processes on loopback (gRPC). The step runs
    prepare and compute one after the other (the trainer's prefetch thread overlaps them; on
    2 busy cores that overlap buys little, and this way the figures add up).

``--device`` is where the heads and the backbone compute (``auto``: CUDA when there is one). The
rows stay in the AMS, in host memory, as in training: each step moves the active rows to the
device and their gradients back, and that traffic is part of the figures. On CUDA the exact
graph is built on the GPU, (b) runs the backbone under autocast with a gradient scaler as the
trainer does (``--no-amp``: float32), and every timestamp waits for the GPU to finish.

Heads run round-robin, one step each in turn, on the same label sequence, so drift on a shared
machine hits them alike; each figure is the median over the measured steps after ``--warmup``.

The knn head needs a neighbor graph. An exact build costs O(N^2 d):
``ams.graph.build.build_graph`` runs for N <= ``--exact-graph-max`` and its time is reported;
above that the shards get a stand-in graph of the same shape (each class, then k-1 uniform
random classes), and the exact build's time is extrapolated as N^2 from the largest exact build
of the run. The stand-in does not change a step's cost: lookup, selection, pull and push see
lists of the same length, and the budget fixes the active-set size whatever the lists hold.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from results import describe_device, markdown_rows, record

import ams
from ams.client.sharded import ShardedClient
from ams.graph.build import build_graph
from workers.backbones import build_backbone
from workers.distributed import worker_device
from workers.heads import ClassifierHead, build_head
from workers.losses import CombinedMarginLoss
from workers.predict import images_to_input
from workers.trainer import step_backbone
from xcls.shards import shard_processes

TABLE = "bench"
IMAGE_SIZE = 32
LR = 0.1


def clock(device: torch.device) -> float:
    """perf_counter once the work queued on ``device`` is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class TimedStore:
    """The AMS client as a head sees it, timing and counting pulls and pushes, so the step can
    be split into select / pull / compute / push without hooks in ``workers/heads.py``."""

    def __init__(self, client: ShardedClient) -> None:
        self.client = client
        self.pull_s = self.push_s = 0.0
        self.rows_pulled = 0

    def reset(self) -> None:
        self.pull_s = self.push_s = 0.0
        self.rows_pulled = 0

    def pull(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        rows = self.client.pull(table, ids)
        self.pull_s += time.perf_counter() - started
        self.rows_pulled += ids.numel()
        return rows

    def push(self, table: str, ids: torch.Tensor, grads: torch.Tensor, lr: float,
             decay_clock: float | None = None) -> None:
        started = time.perf_counter()
        self.client.push(table, ids, grads.cpu(), lr, decay_clock)  # from the head's device
        self.push_s += time.perf_counter() - started

    def neighbors(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        return self.client.neighbors(table, ids)


@dataclass
class Contender:
    """One head configuration and the per-step measurements taken of it (seconds, rows)."""

    name: str
    settings: str
    head: ClassifierHead
    store: TimedStore
    steps: int
    samples: dict[str, list[float]] = field(default_factory=dict)

    def record(self, **values: float) -> None:
        for key, value in values.items():
            self.samples.setdefault(key, []).append(value)

    def median(self, key: str) -> float:
        return statistics.median(self.samples[key])


def make_contenders(client: ShardedClient, n: int, args: argparse.Namespace, batch: int,
                    steps: int, full_steps: int, knn_same_size: bool) -> list[Contender]:
    margin = CombinedMarginLoss.from_preset(args.margin)
    partial_budget = max(1, int(args.sample_rate * n))
    small_budget = batch * args.k
    configs = [
        ("full", f"A=N={n:,}", {}, full_steps),
        ("partial", f"sample_rate={args.sample_rate}", {"sample_rate": args.sample_rate}, steps),
    ]
    if knn_same_size:
        configs.append(("knn", f"k={args.k}, budget={partial_budget:,} (=partial)",
                        {"k": args.k, "budget": partial_budget}, steps))
    configs.append(("knn", f"k={args.k}, budget={small_budget:,} (B*k)",
                    {"k": args.k, "budget": small_budget}, steps))
    out = []
    for name, settings, options, count in configs:
        store = TimedStore(client)
        head = build_head(name, store, TABLE, n, margin, seed=args.seed, **options)
        out.append(Contender(name, settings, head, store, count))
    return out


def round_robin(contenders: list[Contender], warmup: int,
                step: Callable[[Contender, int], None]) -> None:
    """``step(contender, i)`` for each contender's warm-up and measured steps, one contender
    after the other, so all see the same machine load; step i uses label batch i."""
    for i in range(warmup + max(c.steps for c in contenders)):
        for c in contenders:
            if i < warmup + c.steps:
                step(c, i)
        print(f"  step {i + 1} done", file=sys.stderr, flush=True)


def drop_warmup(contenders: list[Contender], warmup: int) -> None:
    for c in contenders:
        c.samples = {key: values[warmup:] for key, values in c.samples.items()}


# ---- setup -------------------------------------------------------------------------------


# Classes whose stand-in lists are made and sent at a time: no (N, k) tensor is ever whole.
STANDIN_BLOCK = 1 << 22


def install_standin_graph(client: ShardedClient, n: int, k: int, seed: int,
                          table: str = TABLE) -> float:
    """Lists of the exact graph's shape: the class itself, then k-1 uniform random classes
    (a repeat within a list has probability ~k^2/N and is deduplicated by the selection),
    sent in blocks; returns the seconds it took."""
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, n, STANDIN_BLOCK):
        ids = torch.arange(start, min(start + STANDIN_BLOCK, n), dtype=torch.int64)
        lists = torch.empty((ids.numel(), k), dtype=torch.int64)
        lists[:, 0] = ids
        lists[:, 1:] = torch.randint(n, (ids.numel(), k - 1), generator=generator)
        client.set_neighbors(table, ids, lists, version=1, step=0, replace_all=True)
    return time.perf_counter() - started


@dataclass
class GraphBuild:
    n: int
    k: int
    exact: bool
    seconds: float


def prepare_table(client: ShardedClient, n: int, args: argparse.Namespace) -> GraphBuild:
    client.create_table(TABLE, n, args.dim, dtype="float32", seed=args.seed)
    exact = n <= args.exact_graph_max
    started = clock(args.device)
    if exact:
        build_graph(client, TABLE, k=args.k, device=args.device)
    else:
        install_standin_graph(client, n, args.k, args.seed)
    return GraphBuild(n, args.k, exact, clock(args.device) - started)


# ---- (a) the head alone ------------------------------------------------------------------


def bench_head_alone(client: ShardedClient, n: int, args: argparse.Namespace,
                     ) -> list[Contender]:
    generator = torch.Generator().manual_seed(args.seed)
    features = torch.randn(args.batch, args.dim, generator=generator).to(args.device)
    labels = [torch.randint(n, (args.batch,), generator=generator)
              for _ in range(args.warmup + max(args.steps, args.full_steps))]
    contenders = make_contenders(client, n, args, args.batch, args.steps, args.full_steps,
                                 knn_same_size=True)

    def step(c: Contender, i: int) -> None:
        c.store.reset()
        started = clock(args.device)
        batch = c.head.prepare(labels[i])
        prepared = clock(args.device)
        out = c.head.forward_backward(features, batch)
        c.store.push(TABLE, batch.active_ids, out.row_grad, LR)
        done = clock(args.device)
        c.record(total=done - started, select=prepared - started - c.store.pull_s,
                 pull=c.store.pull_s, compute=done - prepared - c.store.push_s,
                 push=c.store.push_s, rows=c.store.rows_pulled)

    print(f"(a) head alone, N={n:,}", file=sys.stderr, flush=True)
    round_robin(contenders, args.warmup, step)
    drop_warmup(contenders, args.warmup)
    return contenders


# ---- (b) the whole step ------------------------------------------------------------------


def bench_whole_step(client: ShardedClient, n: int, args: argparse.Namespace, mode: str,
                     ) -> list[Contender]:
    generator = torch.Generator().manual_seed(args.seed)
    batch = args.step_batch
    count = args.warmup + max(args.step_steps, args.step_full_steps)
    images = [torch.randint(0, 256, (batch, 1, IMAGE_SIZE, IMAGE_SIZE), dtype=torch.uint8,
                            generator=generator) for _ in range(count)]
    labels = [torch.randint(n, (batch,), generator=generator) for _ in range(count)]
    contenders = make_contenders(client, n, args, batch, args.step_steps,
                                 args.step_full_steps, knn_same_size=False)
    device, amp = args.device, args.amp
    # one backbone per head, so each trains as it would alone (same initial weights)
    torch.manual_seed(args.seed)
    template = build_backbone("resnet_small", args.dim, 1, IMAGE_SIZE)
    nets = {}
    for c in contenders:
        net = build_backbone("resnet_small", args.dim, 1, IMAGE_SIZE).to(device)
        net.load_state_dict(template.state_dict())
        nets[id(c)] = (net, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9),
                       torch.amp.GradScaler("cuda") if amp else None)

    def step(c: Contender, i: int) -> None:
        net, optimizer, scaler = nets[id(c)]
        c.store.reset()
        started = clock(device)
        active = c.head.prepare(labels[i])
        prepared = clock(device)
        with torch.autocast(device.type, enabled=amp):
            features = net(images_to_input(images[i].to(device, non_blocking=True)))
        embedded = clock(device)
        out = c.head.forward_backward(features, active)
        c.store.push(TABLE, active.active_ids, out.row_grad, LR)
        headed = clock(device)
        step_backbone(features, out.feature_grad, optimizer, scaler)
        optimizer.zero_grad(set_to_none=True)
        done = clock(device)
        c.record(total=done - started, head=(prepared - started) + (headed - embedded),
                 backbone=(embedded - prepared) + (done - headed), rows=c.store.rows_pulled)

    print(f"(b) whole step, N={n:,}, {mode}", file=sys.stderr, flush=True)
    round_robin(contenders, args.warmup, step)
    drop_warmup(contenders, args.warmup)
    return contenders


# ---- report ------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f}" if seconds >= 0.1 else f"{seconds * 1000:,.1f}"


def head_table(results: dict[int, list[Contender]]) -> list[str]:
    lines = ["| N | head | settings | rows pulled/step | ms/step | select | pull | fwd+bwd "
             "| push | steps | speed-up vs full |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, contenders in results.items():
        full = contenders[0].median("total")
        for c in contenders:
            total = c.median("total")
            lines.append(
                f"| {n:,} | {c.name} | {c.settings} | {c.median('rows'):,.0f} | {ms(total)} "
                f"| {ms(c.median('select'))} | {ms(c.median('pull'))} "
                f"| {ms(c.median('compute'))} | {ms(c.median('push'))} "
                f"| {len(c.samples['total'])} | {full / total:,.1f}x |")
    return lines


def step_table(results: dict[str, list[Contender]], batch: int) -> list[str]:
    lines = ["| AMS | head | settings | rows pulled/step | images/s | ms/step | head ms "
             "| backbone ms | steps | speed-up vs full |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, contenders in results.items():
        full = contenders[0].median("total")
        for c in contenders:
            total = c.median("total")
            lines.append(
                f"| {mode} | {c.name} | {c.settings} | {c.median('rows'):,.0f} "
                f"| {batch / total:,.1f} | {ms(total)} | {ms(c.median('head'))} "
                f"| {ms(c.median('backbone'))} | {len(c.samples['total'])} "
                f"| {full / total:,.1f}x |")
    return lines


def graph_table(builds: list[GraphBuild]) -> list[str]:
    exact = [b for b in builds if b.exact]
    reference = max(exact, key=lambda b: b.n) if exact else None
    lines = ["| N | k | graph | seconds |", "|---:|---:|---|---:|"]
    for b in builds:
        if b.exact:
            lines.append(f"| {b.n:,} | {b.k} | exact build (build_graph) "
                         f"| {b.seconds:,.1f} |")
            continue
        estimate = ""
        if reference is not None:
            guess = reference.seconds * (b.n / reference.n) ** 2
            estimate = f"; exact est. {guess:,.0f} s (N^2 from N={reference.n:,})"
        lines.append(f"| {b.n:,} | {b.k} | stand-in (random lists){estimate} "
                     f"| {b.seconds:,.1f} |")
    return lines


# ---- main --------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: small N, small batches, one measured step each")
    parser.add_argument("--sizes", default="100000,1000000",
                        help="comma separated N for (a), the head alone")
    parser.add_argument("--step-classes", type=int, default=1_000_000,
                        help="N for (b), the whole step; 0 skips (b)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=256, help="batch of (a)")
    parser.add_argument("--step-batch", type=int, default=256, help="batch of (b)")
    parser.add_argument("--sample-rate", type=float, default=0.1, help="partial head")
    parser.add_argument("--k", type=int, default=12,
                        help="neighbors per class in the graph (the class itself included)")
    parser.add_argument("--margin", default="arcface", help="margin preset (s=64)")
    parser.add_argument("--shards", type=int, default=2,
                        help="shards, embedded and as gRPC processes")
    parser.add_argument("--no-grpc", action="store_true", help="skip (b) over gRPC shards")
    parser.add_argument("--exact-graph-max", type=int, default=100_000,
                        help="largest N that gets the exact graph; above it a stand-in")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps per head")
    parser.add_argument("--steps", type=int, default=5,
                        help="measured steps of partial and knn in (a)")
    parser.add_argument("--full-steps", type=int, default=2,
                        help="measured steps of the full head in (a) (seconds each at 1M)")
    parser.add_argument("--step-steps", type=int, default=3,
                        help="measured steps of partial and knn in (b)")
    parser.add_argument("--step-full-steps", type=int, default=2,
                        help="measured steps of full in (b)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where the heads and the backbone compute (auto: CUDA if present)")
    parser.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True,
                        help="autocast and a gradient scaler for the backbone in (b), on CUDA")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.step_classes = "5000", 5000
        args.batch = args.step_batch = 32
        args.steps = args.full_steps = args.step_steps = args.step_full_steps = 1
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    try:
        args.device = worker_device(args.device, 0)
    except ValueError as err:
        parser.error(f"--device {err}")
    args.amp = args.amp and args.device.type == "cuda"
    return args


def device_description(device: torch.device, amp: bool) -> str:
    """The machine (``results.describe_device``) and, on a GPU, the backbone's precision."""
    precision = f", backbone {'AMP' if amp else 'float32'}" if device.type == "cuda" else ""
    return describe_device(device) + precision


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    builds: list[GraphBuild] = []
    heads: dict[int, list[Contender]] = {}
    steps: dict[str, list[Contender]] = {}

    for n in sorted(set(args.sizes) | ({args.step_classes} - {0})):
        with ams.connect(local_shards=args.shards) as client:
            print(f"table N={n:,}", file=sys.stderr, flush=True)
            builds.append(prepare_table(client, n, args))
            if n in args.sizes:
                heads[n] = bench_head_alone(client, n, args)
            if n == args.step_classes:
                steps[f"embedded ({args.shards} shards)"] = bench_whole_step(
                    client, n, args, "embedded")

    if args.step_classes and not args.no_grpc:
        with tempfile.TemporaryDirectory(prefix="bench_heads_") as tmp, \
                shard_processes(args.shards, xcls_flags=["-q"], log_dir=Path(tmp)) as shards, \
                ams.connect([shard.address for shard in shards]) as client:
            prepare_table(client, args.step_classes, args)
            steps[f"gRPC ({args.shards} processes, loopback)"] = bench_whole_step(
                client, args.step_classes, args, "gRPC")

    lines = [
        f"{datetime.date.today()} · {platform.machine()}, {os.cpu_count()} cores, "
        f"{device_description(args.device, args.amp)}, "
        f"torch {torch.__version__}, threads={args.threads}, fp32 rows, d={args.dim}, "
        f"margin {args.margin} s=64, warmup {args.warmup} step(s), medians · "
        f"run took {time.perf_counter() - started:,.0f} s",
        "", "Graph (built once per table, outside the step timings):", "",
        *graph_table(builds),
        "", f"(a) Head alone, batch {args.batch}, embedded AMS ({args.shards} shards) "
        "(ms; select includes the knn neighbor lookup):", "",
        *head_table(heads),
    ]
    if steps:
        lines += ["", f"(b) Whole step, resnet_small, {IMAGE_SIZE}x{IMAGE_SIZE} grayscale, "
                  f"batch {args.step_batch}, N={args.step_classes:,} "
                  "(prepare then compute, no prefetch overlap):", "",
                  *step_table(steps, args.step_batch)]
    print("\n".join(lines))
    device = describe_device(args.device)
    record("bench_heads", markdown_rows(graph_table(builds)), table="graph", device=device)
    record("bench_heads", markdown_rows(head_table(heads)), table="head alone", device=device)
    if steps:
        record("bench_heads", markdown_rows(step_table(steps, args.step_batch)),
               table="whole step", device=device)


if __name__ == "__main__":
    main()

"""Scale: a class table of 1M, 10M and 100M rows on one host, the knn step at each size, and
the knn / full whole-step ratio at 10M.

    python benchmarks/bench_scale.py              # 1M, 10M, 100M (about 40 minutes, 30 GB disk)
    python benchmarks/bench_scale.py --quick      # smoke run (a minute)

For every size N (``--sizes``), d = ``--dim``, float16 rows, no row momentum (the knn head's
default), ``--shards`` shard processes on loopback:

(a) Capacity. ``xcls serve shard`` processes create the table (``ams.storage = "memory"``, or
    ``"mmap"`` from ``--mmap-from`` classes on: rows in files paged by the OS). Reported: create
    time, resident memory (VmRSS, anonymous + file pages) per shard after the create and after a
    neighbor graph of k = ``--k`` is installed, and bytes per class over the shards' total. A
    shard process's resident memory before any table (``baseline``) is measured too. The
    neighbor graph is a stand-in of the exact graph's shape (the class itself, then k-1 uniform
    random classes, int32 fixed-width like a real one): an exact build is O(N^2 d), and a
    step's cost depends on the lists' length, not their content. ``--resident N`` adds one
    capacity-only row: the largest table kept in RAM (memory storage) on this host.
(b) The knn head step: select (labels + neighbors by rank, budget B*k) + pull + forward and
    backward on fixed random features + push, for ``--steps`` steps after ``--warmup`` (an
    mmap table: and after ``--mmap-warmup-s`` seconds of steps, so that the kernel is writing
    back dirty row pages as fast as the steps make them), over gRPC and on the embedded AMS
    (``ams.connect(local_shards=S)``; an mmap table is reopened from the files the processes
    left, not created again). An mmap table's slot maps are first aged to the steady state
    of random pushes (``age_slots``, ``--age-sweeps``): the processes stop, the maps are
    moved as pushes would move them, and the processes start again on the same files.
    p50 / p99 milliseconds, rows pulled per second, and the host's
    disk traffic per step: pages read, made dirty and written back. For an mmap table, the
    rate at which this host's disk reads row pages at random is measured after the steps;
    the pages a step reads, at that rate, are a floor under it. Beside it: the CPU time of
    the write faults that make the pages a step pushes to dirty, at their cost on this
    host's file system (``page_dirty_cost``, also measured after the steps), and where the
    host's CPUs were while the steps ran (busy, waiting for the disk, idle).
(c) Whole step at ``--ratio-classes`` (embedded): random uint8 images through the resnet_small
    backbone, the head, the backbone's backward and SGD step, for the knn head and for the full
    softmax over all N rows. A full head cannot hold a (B, N) logit matrix at 10M, so the full
    step here is the exact full softmax computed block by block (rows pulled in blocks once,
    log-sum-exp over all blocks, then each block's gradients pushed): the baseline a full
    softmax at this size needs. Its ratio to the knn step is the speed-up.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import mmap
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from bench_heads import install_standin_graph

import ams
from ams.alloc import libc_function
from ams.client.sharded import ShardedClient
from ams.cluster.plan import Job, load_rates, shard_memory
from ams.shard.page_advice import advise_will_need, resident_pages
from ams.shard.store import ShardStore
from workers.backbones import build_backbone
from workers.heads import build_head
from workers.losses import CombinedMarginLoss
from workers.predict import images_to_input
from workers.prefetch import Prefetcher
from workers.trainer import step_backbone
from xcls.shards import shard_processes

TABLE = "scale"
_MS_SYNC = 4  # msync(2): write the range back and wait (Linux)
IMAGE_SIZE = 32
LR = 0.1
AGE_BATCH = 1 << 17  # rows per simulated push while the slot maps are aged


def resident(pid: int | str = "self") -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes of process ``pid`` from /proc."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "RssShmem"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["RssAnon"], fields["RssFile"] + fields.get("RssShmem", 0)


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.2f}"


def create_table(client: ShardedClient, n: int, args: argparse.Namespace) -> float:
    started = time.perf_counter()
    client.create_table(TABLE, n, args.dim, dtype="float16", momentum=0.0, seed=args.seed)
    return time.perf_counter() - started


# ---- (b) the knn head step ---------------------------------------------------------------


@dataclass
class StepTimes:
    seconds: list[float] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    # the host's disk traffic while the measured steps ran, 4 KiB pages per step
    # (/proc/vmstat): read from disk, made dirty, written back
    pages_read: float = 0.0
    pages_dirtied: float = 0.0
    pages_written: float = 0.0
    # where the host's CPUs were while they ran (/proc/stat), shares of all CPU time: busy
    # (user and kernel), waiting for the disk (iowait), idle
    cpu_busy: float = 0.0
    cpu_iowait: float = 0.0
    cpu_idle: float = 0.0

    def quantile(self, q: float) -> float:
        ordered = sorted(self.seconds)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    def rows_per_second(self) -> float:
        return sum(self.rows) / sum(self.seconds)

    @staticmethod
    def joined(parts: list[StepTimes]) -> StepTimes:
        """The steps of ``parts`` as one run: disk pages per step averaged over all steps."""
        steps = sum(len(p.seconds) for p in parts)

        def per_step(name: str) -> float:
            return sum(getattr(p, name) * len(p.seconds) for p in parts) / steps

        return StepTimes(seconds=[t for p in parts for t in p.seconds],
                         rows=[r for p in parts for r in p.rows],
                         pages_read=per_step("pages_read"),
                         pages_dirtied=per_step("pages_dirtied"),
                         pages_written=per_step("pages_written"),
                         cpu_busy=per_step("cpu_busy"), cpu_iowait=per_step("cpu_iowait"),
                         cpu_idle=per_step("cpu_idle"))


def knn_head_steps(client: ShardedClient, n: int, args: argparse.Namespace,
                   seed_offset: int = 0, warmup_s: float = 0.0,
                   steps: int | None = None, prefetch_depth: int | None = None
                   ) -> StepTimes:
    """``steps`` (default ``args.steps``) timed steps after ``args.warmup`` steps and at
    least ``warmup_s`` seconds of them. ``prefetch_depth``: the steps run as the trainer runs
    them, each batch's select and pull done that many steps ahead by the trainer's prefetch
    thread (``workers.prefetch.Prefetcher``, ``train.prefetch_depth``, 1 by default) while
    the steps before compute; a step's time is then the time between two finished pushes.
    None: each step selects, pulls, computes and pushes in turn."""
    steps = args.steps if steps is None else steps
    margin = CombinedMarginLoss.from_preset("arcface")
    head = build_head("knn", client, TABLE, n, margin, k=args.k, budget=args.batch * args.k,
                      seed=args.seed)
    generator = torch.Generator().manual_seed(args.seed + seed_offset)
    features = torch.randn(args.batch, args.dim, generator=generator)

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        while True:  # with prefetch, the prefetch thread draws the labels a step ahead
            labels = torch.randint(n, (args.batch,), generator=generator)
            yield torch.empty(0), torch.empty(0), labels

    source = batches()
    prefetcher = (Prefetcher(source, head.prepare, depth=prefetch_depth, start_step=0)
                  if prefetch_depth is not None else None)
    times = StepTimes()
    warm_until = time.perf_counter() + warmup_s
    warm_steps = 0
    finished = time.perf_counter()
    try:
        while len(times.seconds) < steps:
            warm = warm_steps >= args.warmup and time.perf_counter() >= warm_until
            if warm and not times.seconds:
                disk, cpu = disk_pages(), cpu_ticks()
            if prefetcher is None:
                started = time.perf_counter()
                batch = head.prepare(next(source)[2])
                out = head.forward_backward(features, batch)
                client.push(TABLE, batch.active_ids, out.row_grad, LR)
            else:
                started = finished
                batch = next(prefetcher).active
                out = head.forward_backward(features, batch)
                step = warm_steps + len(times.seconds)
                prefetcher.wait_prepared(step)
                client.push(TABLE, batch.active_ids, out.row_grad, LR)
                prefetcher.step_done()
            finished = time.perf_counter()
            if warm:
                times.seconds.append(finished - started)
                times.rows.append(batch.active_ids.numel())
            else:
                warm_steps += 1
    finally:
        if prefetcher is not None:
            prefetcher.close()
    read, dirtied, written = (after - before for after, before
                              in zip(disk_pages(), disk, strict=True))
    times.pages_read = read / steps
    times.pages_dirtied = dirtied / steps
    times.pages_written = written / steps
    busy, iowait, idle = (after - before for after, before
                          in zip(cpu_ticks(), cpu, strict=True))
    total = max(1, busy + iowait + idle)
    times.cpu_busy, times.cpu_iowait, times.cpu_idle = busy / total, iowait / total, idle / total
    return times


def cpu_ticks() -> tuple[int, int, int]:
    """The host's CPU time so far, all CPUs, in clock ticks (/proc/stat): (busy: user,
    nice, system, irq, softirq, steal; iowait; idle); zeros where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0, 0, 0
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return user + nice + system + irq + softirq + steal, iowait, idle


def disk_pages() -> tuple[int, int, int]:
    """The host's 4 KiB pages read from disk (pgpgin counts KiB), file pages made dirty
    (nr_dirtied) and written back (nr_written) so far, from /proc/vmstat; zeros where there
    is none."""
    counts = {}
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in ("pgpgin", "nr_dirtied", "nr_written"):
                    counts[key] = int(value)
    except OSError:
        return 0, 0, 0
    return (counts.get("pgpgin", 0) // 4, counts.get("nr_dirtied", 0),
            counts.get("nr_written", 0))


def random_read_rate(rows: list[torch.Tensor], pages: int = 4000) -> float | None:
    """Pages per second this host reads from disk at random: ``pages`` 4 KiB pages of the
    mapped ``rows`` tensors (mmap storage) that are not in memory (mincore), spread over the
    tensors, asked for together (madvise WILLNEED, as the store's read-ahead does) and then
    touched. The ceiling for a step whose rows miss the page cache. None where every page
    is in memory."""
    chosen: list[tuple[torch.Tensor, torch.Tensor]] = []
    for tensor in rows:
        candidates = (~resident_pages(tensor)).nonzero().squeeze(1)
        take = candidates[torch.randperm(candidates.numel())[:pages // len(rows)]]
        chosen.append((tensor, take.sort().values))
    total = sum(p.numel() for _, p in chosen)
    if total == 0:
        return None
    started = time.perf_counter()
    for tensor, picked in chosen:
        advise_will_need(tensor, picked)
    for tensor, picked in chosen:
        flat = tensor.view(torch.uint8).view(-1)
        for p in picked.tolist():
            flat[p * mmap.PAGESIZE].item()
    return total / (time.perf_counter() - started)


def page_dirty_cost(rows: list[torch.Tensor], pages: int = 4000) -> float | None:
    """CPU seconds this host spends making one clean, resident page of the mapped ``rows``
    tensors (mmap storage) dirty: the write fault a push takes on each row page it is the
    first to change since the page was last written back (the file system's page_mkwrite).
    ``pages`` random pages, spread over the tensors, are read into memory, written back and
    made clean one by one (msync), then each is written once with the byte it holds (the
    table does not change), timed as the process's CPU time, less the same writes again on
    the now dirty pages. None where there is no msync."""
    msync = libc_function("msync")
    if msync is None:
        return None
    flats, offsets = [], []
    for tensor in rows:
        count = tensor.numel() * tensor.element_size() // mmap.PAGESIZE
        picked = torch.randperm(count)[:pages // len(rows)].sort().values
        advise_will_need(tensor, picked)
        flats.append(tensor.view(torch.uint8).view(-1))
        offsets.append(picked * mmap.PAGESIZE)
    for flat, offset in zip(flats, offsets, strict=True):
        flat[offset].sum()  # resident before timing, so no read is timed
        base = flat.data_ptr()
        for o in offset.tolist():
            if msync(ctypes.c_void_p(base + o), mmap.PAGESIZE, _MS_SYNC) != 0:
                return None

    def write_each() -> float:
        started = time.process_time()
        for flat, offset in zip(flats, offsets, strict=True):
            flat[offset] = flat[offset]
        return time.process_time() - started

    faulting = write_each()
    total = sum(o.numel() for o in offsets)
    return max(0.0, faulting - write_each()) / total


# ---- (c) whole step: knn against the blocked full softmax -------------------------------


def full_softmax_blocked(client: ShardedClient, n: int, features: torch.Tensor,
                         labels: torch.Tensor, margin: CombinedMarginLoss, block: int
                         ) -> tuple[float, torch.Tensor]:
    """The exact softmax cross-entropy over all ``n`` classes, rows pulled ``block`` at a
    time; each block's row gradients are pushed. features (B, d) float32, labels (B,) int64.
    Returns (loss, dL/dfeatures (B, d) float32)."""
    batch = features.shape[0]
    x = features.detach().float().requires_grad_(True)
    blocks = []
    lse = torch.full((batch,), -torch.inf)
    target_logit = torch.zeros(batch)
    with torch.no_grad():
        x_unit = F.normalize(x, dim=1)
        for start in range(0, n, block):
            ids = torch.arange(start, min(start + block, n), dtype=torch.int64)
            rows = client.pull(TABLE, ids)
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
        client.push(TABLE, ids, dw, LR)
    return float((lse - target_logit).mean()), feature_grad


def whole_steps(client: ShardedClient, n: int, args: argparse.Namespace
                ) -> dict[str, list[float]]:
    """Seconds of ``--ratio-steps`` whole steps of the knn head and of ``--full-steps`` of
    the blocked full softmax, alternating, after one warm-up knn step."""
    margin = CombinedMarginLoss.from_preset("arcface")
    knn = build_head("knn", client, TABLE, n, margin, k=args.k, budget=args.batch * args.k,
                     seed=args.seed)
    torch.manual_seed(args.seed)
    net = build_backbone("resnet_small", args.dim, 1, IMAGE_SIZE)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    generator = torch.Generator().manual_seed(args.seed)
    out: dict[str, list[float]] = {"knn": [], "full": []}
    plan = ["knn"] + ["knn"] * args.ratio_steps + ["full"] * args.full_steps
    for i, kind in enumerate(plan):
        images = torch.randint(0, 256, (args.batch, 1, IMAGE_SIZE, IMAGE_SIZE),
                               dtype=torch.uint8, generator=generator)
        labels = torch.randint(n, (args.batch,), generator=generator)
        started = time.perf_counter()
        features = net(images_to_input(images))
        if kind == "knn":
            batch = knn.prepare(labels)
            head = knn.forward_backward(features, batch)
            client.push(TABLE, batch.active_ids, head.row_grad, LR)
            feature_grad = head.feature_grad
        else:
            _, feature_grad = full_softmax_blocked(client, n, features, labels, margin,
                                                   args.full_block)
        step_backbone(features, feature_grad, optimizer, None)
        optimizer.zero_grad(set_to_none=True)
        if i > 0:
            out[kind].append(time.perf_counter() - started)
        print(f"  whole step {i + 1}/{len(plan)} ({kind}) done", file=sys.stderr, flush=True)
    return out


# ---- the runs ----------------------------------------------------------------------------


@dataclass
class SizeResult:
    n: int
    storage: str
    create_s: float
    graph_s: float
    rss_created: list[tuple[int, int]]
    rss_graph: list[tuple[int, int]]
    grpc: StepTimes | None = None
    # the trainer's prefetch, by train.prefetch_depth
    grpc_prefetched: dict[int, StepTimes] = field(default_factory=dict)
    embedded: StepTimes | None = None
    disk_pages_per_s: float | None = None  # mmap: random_read_rate after the steps
    page_dirty_s: float | None = None  # mmap: page_dirty_cost after the steps


def storage_of(n: int, args: argparse.Namespace) -> str:
    return "mmap" if n >= args.mmap_from else "memory"


def shard_rss(shards: list) -> list[tuple[int, int]]:
    return [resident(shard.proc.pid) for shard in shards]


def age_slots(storage_dir: Path, args: argparse.Namespace) -> None:
    """Bring the slot maps of the mmap table the shard processes closed in ``storage_dir``
    to the steady state of uniformly random pushes (``ams.shard.slots``): ``args.age_sweeps``
    sweeps of each shard's free-slot cursor over its files, taken as the pushes of
    uniformly drawn rows would take them (``RowSlots.relocate``, 2 s x owned slots a sweep
    at steady state), but moving slots only: the stand-in rows' values do not matter to a
    step's time, and hours of real pushes would take the place of the benchmark. Without
    it the timed steps would all fall in the first sweep, in the files' spare slots, which
    are free in one run, and a push would dirty fewer pages than at steady state."""
    for shard_id in range(args.shards):
        store = ShardStore(shard_id, args.shards, storage="mmap", storage_dir=storage_dir)
        table = store.table(TABLE)
        slots = table.slots
        # the spare slots, zeros so far, take copies of rows (a zero row has no direction:
        # its cosine gradient is not finite), so that every slot a row lands in holds one
        spare = slots.capacity - slots.owned
        for start in range(0, spare, AGE_BATCH):
            stop = min(start + AGE_BATCH, spare)
            table.rows[slots.owned + start:slots.owned + stop] = table.rows[start:stop]
        generator = np.random.default_rng(args.seed + shard_id)
        moves = round(args.age_sweeps * 2 * (slots.capacity - slots.owned))
        for start in range(0, moves, AGE_BATCH):
            drawn = generator.choice(slots.owned, min(AGE_BATCH, moves - start), replace=False)
            slots.relocate(torch.from_numpy(np.sort(drawn)))
        store.close()


def grpc_steps(client: ShardedClient, n: int, args: argparse.Namespace, warmup_s: float,
               result: SizeResult) -> None:
    """The knn steps over gRPC, in turn and then with the trainer's prefetch at each of
    ``args.prefetch_depths`` (after a third of the warm-up each: the table is warm from the
    first)."""
    print(f"N={n:,}: knn steps over gRPC", file=sys.stderr, flush=True)
    result.grpc = knn_head_steps(client, n, args, warmup_s=warmup_s)
    for turn, depth in enumerate(args.prefetch_depths, start=1):
        print(f"N={n:,}: knn steps over gRPC, prefetched {depth} ahead", file=sys.stderr,
              flush=True)
        result.grpc_prefetched[depth] = knn_head_steps(
            client, n, args, seed_offset=turn, warmup_s=warmup_s / 3, prefetch_depth=depth)


def run_size(n: int, args: argparse.Namespace, workdir: Path, steps: bool,
             storage: str | None = None) -> SizeResult:
    storage = storage or storage_of(n, args)
    warmup_s = args.mmap_warmup_s if storage == "mmap" else 0.0
    data_dir = workdir / f"n{n}"
    print(f"N={n:,} storage={storage}: creating", file=sys.stderr, flush=True)
    aged = steps and storage == "mmap" and args.age_sweeps > 0

    def serving() -> contextlib.AbstractContextManager:
        return shard_processes(args.shards, data_dir=data_dir, xcls_flags=["-q"],
                               log_dir=workdir, extra_args=["--storage", storage])

    with serving() as shards, \
            ams.connect([shard.address for shard in shards], timeout=3600) as client:
        create_s = create_table(client, n, args)
        rss_created = shard_rss(shards)
        graph_s = install_standin_graph(client, n, args.k, args.seed, TABLE)
        rss_graph = shard_rss(shards)
        result = SizeResult(n, storage, create_s, graph_s, rss_created, rss_graph)
        if steps and not aged:
            grpc_steps(client, n, args, warmup_s, result)
    if aged:  # the processes stopped cleanly, keeping the table; they reopen it
        print(f"N={n:,}: aging the slot maps ({args.age_sweeps:g} sweeps)", file=sys.stderr,
              flush=True)
        age_slots(data_dir / "tables", args)
        with serving() as shards, \
                ams.connect([shard.address for shard in shards], timeout=3600) as client:
            install_standin_graph(client, n, args.k, args.seed, TABLE)
            grpc_steps(client, n, args, warmup_s, result)
    if steps:
        print(f"N={n:,}: knn steps embedded", file=sys.stderr, flush=True)
        with ams.connect(local_shards=args.shards, storage=storage,
                         storage_dir=data_dir / "tables") as client:
            create_table(client, n, args)  # a no-op where the mmap table was reopened
            install_standin_graph(client, n, args.k, args.seed, TABLE)
            result.embedded = knn_head_steps(client, n, args, seed_offset=2,
                                             warmup_s=warmup_s if storage == "mmap" else 0.0)
            if storage == "mmap":
                rows = [shard.store.table(TABLE).rows for shard in client.shards]
                result.disk_pages_per_s = random_read_rate(rows)
                result.page_dirty_s = page_dirty_cost(rows)
    return result


def baseline_rss(args: argparse.Namespace, workdir: Path) -> int:
    with shard_processes(1, xcls_flags=["-q"], log_dir=workdir) as shards, \
            ams.connect([shards[0].address]) as client:
        client.stats()
        anon, file = resident(shards[0].proc.pid)
    return anon + file


# ---- report ------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f}"


def planned_at_rest(r: SizeResult, args: argparse.Namespace) -> tuple[int, int]:
    """What ``xcls plan`` says shard 0 holds in RAM at rest: (the table alone, with the
    graph)."""
    job = Job(num_classes=r.n, dim=args.dim, dtype="float16", momentum=0.0, shards=args.shards,
              head="knn", budget=args.batch * args.k, graph_k=args.k, storage=r.storage)
    memory = shard_memory(job, load_rates())
    return memory.at_rest - memory.graph, memory.at_rest


def capacity_table(results: list[SizeResult], baseline: int,
                   args: argparse.Namespace) -> list[str]:
    lines = ["| N | storage | create s | per shard after create: anon + file GiB (max) "
             "| + graph GiB (max) | all shards GiB | B/class (all) | B/class (above baseline) "
             "| graph install s | shard 0: `xcls plan` at rest GiB | measured / plan: after "
             "create, + graph |",
             "|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        created = max(r.rss_created, key=sum)
        graphed = max(r.rss_graph, key=sum)
        total = sum(sum(x) for x in r.rss_graph)
        above = total - baseline * len(r.rss_graph)
        table_only, planned = planned_at_rest(r, args)
        # mmap: the mapped rows resident at that moment are page cache, which the plan
        # counts as files, not as the shard's memory
        ratio = "—"
        if r.storage == "memory":
            ratio = (f"{sum(r.rss_created[0]) / table_only:.2f}, "
                     f"{sum(r.rss_graph[0]) / planned:.2f}")
        lines.append(
            f"| {r.n:,} | {r.storage} | {r.create_s:,.1f} | {gib(created[0])} + "
            f"{gib(created[1])} | {gib(graphed[0])} + {gib(graphed[1])} | {gib(total)} "
            f"| {total / r.n:,.0f} | {above / r.n:,.0f} | {r.graph_s:,.1f} | {gib(planned)} "
            f"| {ratio} |")
    return lines


def step_table(results: list[SizeResult], args: argparse.Namespace) -> list[str]:
    lines = ["| N | storage | AMS | p50 ms | p99 ms | rows pulled/s | p50 vs smallest N "
             "| disk pages read / dirtied / written per step "
             "| reads at the disk's random-read rate, ms per step "
             "| pages made dirty at this host's cost, CPU ms per step "
             "| host CPU busy / iowait / idle % |",
             "|---:|---|---|---:|---:|---:|---:|---|---:|---:|---|"]
    grpc = f"gRPC ({args.shards} processes)"
    # (label, the row's step times, the times its ratio is against: the mode's own at the
    # smallest N, or for no read-ahead the embedded step's, as the row above it)
    Times = Callable[[SizeResult], StepTimes | None]
    modes: list[tuple[str, Times, Times]] = [
        (grpc, lambda r: r.grpc, lambda r: r.grpc),
        *((f"{grpc}, pulls {depth} step{'s' * (depth > 1)} ahead as the trainer's prefetch "
           f"(train.prefetch_depth = {depth})",
           lambda r, depth=depth: r.grpc_prefetched.get(depth),
           lambda r, depth=depth: r.grpc_prefetched.get(depth))
          for depth in args.prefetch_depths),
        (f"embedded ({args.shards} shards)", lambda r: r.embedded, lambda r: r.embedded)]
    for label, times_of, baseline_of in modes:
        timed = [r for r in results if times_of(r) is not None]
        if not timed:
            continue
        first = next(baseline_of(r) for r in results
                     if baseline_of(r) is not None).quantile(0.5)
        for r in timed:
            t: StepTimes = times_of(r)
            floor = (f"{t.pages_read / r.disk_pages_per_s * 1000:,.1f}"
                     if r.disk_pages_per_s else "—")
            dirtying = (f"{t.pages_dirtied * r.page_dirty_s * 1000:,.1f}"
                        if r.page_dirty_s is not None else "—")
            lines.append(f"| {r.n:,} | {r.storage} | {label} | {ms(t.quantile(0.5))} "
                         f"| {ms(t.quantile(0.99))} | {t.rows_per_second():,.0f} "
                         f"| {t.quantile(0.5) / first:.2f}x "
                         f"| {t.pages_read:,.0f} / {t.pages_dirtied:,.0f} / {t.pages_written:,.0f} "
                         f"| {floor} | {dirtying} | {t.cpu_busy:.0%} / {t.cpu_iowait:.0%} / "
                         f"{t.cpu_idle:.0%} |")
    for r in results:
        if r.disk_pages_per_s:
            lines += ["", f"Random reads of 4 KiB row pages missing from memory (N = {r.n:,}, "
                      f"after the steps, madvise WILLNEED together as the read-ahead asks): "
                      f"{r.disk_pages_per_s:,.0f} pages/s."]
        if r.page_dirty_s is not None:
            lines += ["", f"Making a clean, resident row page dirty (N = {r.n:,}, after the "
                      f"steps, the write fault of a push): {r.page_dirty_s * 1e6:,.1f} µs of "
                      "CPU per page."]
    return lines


def ratio_table(n: int, times: dict[str, list[float]], args: argparse.Namespace) -> list[str]:
    knn, full = statistics.median(times["knn"]), statistics.median(times["full"])
    return ["| N | head | steps | s/step (median) | images/s | speed-up vs full |",
            "|---:|---|---:|---:|---:|---:|",
            f"| {n:,} | full softmax (blocked, exact) | {len(times['full'])} | {full:,.2f} "
            f"| {args.batch / full:,.1f} | 1.0x |",
            f"| {n:,} | knn (k={args.k}, budget {args.batch * args.k:,}) | {len(times['knn'])} "
            f"| {knn:,.3f} | {args.batch / knn:,.1f} | {full / knn:,.1f}x |"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run with small sizes")
    parser.add_argument("--sizes", default="1000000,10000000,100000000",
                        help="comma separated class counts N: capacity and knn steps")
    parser.add_argument("--resident", type=int, default=64_000_000,
                        help="one more capacity-only row: a table this large kept in RAM "
                             "(memory storage); 0 skips it")
    parser.add_argument("--mmap-from", type=int, default=50_000_000,
                        help="tables of at least this many classes use mmap storage")
    parser.add_argument("--ratio-classes", type=int, default=10_000_000,
                        help="N of (c), knn vs full whole step (embedded); 0 skips (c)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--k", type=int, default=12, help="neighbors per class in the graph")
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100, help="measured knn head steps")
    parser.add_argument("--mmap-warmup-s", type=float, default=60.0,
                        help="mmap tables: warm-up steps for at least this many seconds, so "
                             "that the kernel writes back dirty row pages as fast as the steps "
                             "make them (steady state) before steps are timed")
    parser.add_argument("--age-sweeps", type=float, default=2.0,
                        help="mmap tables: sweeps of the free-slot cursor simulated on the "
                             "slot maps before the steps, so that they are timed at the steady "
                             "state of random pushes (ams.shard.slots); 0: the layout as created")
    parser.add_argument("--prefetch-depths", default="1",
                        help="comma separated train.prefetch_depth values: one row of knn "
                             "steps over gRPC run as the trainer runs them for each")
    parser.add_argument("--ratio-steps", type=int, default=5, help="measured knn whole steps")
    parser.add_argument("--full-steps", type=int, default=1, help="measured full whole steps")
    parser.add_argument("--full-block", type=int, default=1 << 18,
                        help="rows per block of the full softmax")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--workdir", type=Path,
                        help="where the shards' files go (default: a temporary directory; "
                             "100M classes in mmap storage need about 30 GB)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.resident, args.mmap_from = "20000,200000", 0, 200000
        args.ratio_classes, args.batch, args.warmup, args.steps = 20000, 32, 1, 5
        args.ratio_steps, args.full_block, args.mmap_warmup_s = 1, 4096, 0.0
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    try:
        args.prefetch_depths = [int(d) for d in args.prefetch_depths.split(",") if d]
    except ValueError:
        parser.error(f"--prefetch-depths: need comma separated integers, got "
                     f"{args.prefetch_depths!r}")
    if any(d < 1 for d in args.prefetch_depths):
        parser.error("--prefetch-depths: each depth must be at least 1")
    if any(n < args.k for n in args.sizes):
        parser.error(f"every size must be at least --k={args.k}")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_scale_", dir=args.workdir) as tmp:
        workdir = Path(tmp)
        baseline = baseline_rss(args, workdir)
        results = [run_size(n, args, workdir, steps=True) for n in args.sizes]
        if args.resident:
            results.append(run_size(args.resident, args, workdir, steps=False,
                                    storage="memory"))
        ratio = None
        if args.ratio_classes:
            print(f"N={args.ratio_classes:,}: whole steps, knn and full", file=sys.stderr,
                  flush=True)
            with ams.connect(local_shards=args.shards) as client:
                create_table(client, args.ratio_classes, args)
                install_standin_graph(client, args.ratio_classes, args.k, args.seed, TABLE)
                ratio = whole_steps(client, args.ratio_classes, args)
    lines = [
        f"{datetime.date.today()} · {platform.machine()}, {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB, CPU "
        f"only, torch {torch.__version__}, threads={args.threads}, d={args.dim}, float16 rows, "
        f"no row momentum, {args.shards} shards, batch {args.batch}, k={args.k} "
        f"(stand-in graph), arcface s=64, mmap slot maps aged {args.age_sweeps:g} sweeps · "
        f"{time.perf_counter() - started:,.0f} s",
        "",
        f"(a) capacity (a shard process with no table: {gib(baseline)} GiB resident)",
        "",
        *capacity_table(results, baseline, args),
        "",
        f"(b) knn head step (select + pull + forward/backward + push), {args.steps} steps "
        f"after {args.warmup} warm-up (mmap: and after {args.mmap_warmup_s:,.0f} s of steps)",
        "",
        *step_table(results, args),
    ]
    if ratio is not None:
        lines += ["", f"(c) whole step (resnet_small backbone, {IMAGE_SIZE}x{IMAGE_SIZE} images, "
                  f"embedded AMS), knn against the exact full softmax", "",
                  *ratio_table(args.ratio_classes, ratio, args)]
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""The training loop: backbone data-parallel, class rows in the AMS, one step at a time.

One step (ARCHITECTURE.md, "One training step"):

1. the loader yields (sample ids, images, labels); the prefetch thread has already chosen the
   batch's active classes and pulled their rows (``workers.prefetch``);
2. the backbone computes features; the head computes the margin softmax over the active rows,
   pushes dL/dW of those rows to the shards and returns dL/dX;
3. the backbone's backward (DDP all-reduces its gradients) and optimizer step.

Around it: LR warmup and schedule, graph rebuilds, checkpoints with an AMS snapshot of the same
step, evaluation on the test split, speed/ETA logs, metrics to CSV (and TensorBoard when
installed). The components are built by the caller (``xcls train``), which keeps this loop
free of configuration parsing.
"""

from __future__ import annotations

import csv
import logging
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from ams.client import ShardedClient
from ams.graph.churn import neighbour_turnover
from ams.graph_build import current_graph_version
from workers import checkpoint
from workers.gear import Gear
from workers.heads import ClassifierHead
from workers.predict import ROW_SOURCES, class_means, images_to_input, nearest_classes
from workers.prefetch import Prefetcher
from workers.schedule import decay_clocks, lr_at

log = logging.getLogger(__name__)

# Classes whose neighbour lists are compared across a rebuild (a sample: the full lists of
# 100M classes would not fit, and the share is all that is reported).
GRAPH_PROBE_CLASSES = 4096


@dataclass
class LoopOptions:
    """How long and how to run the loop (all steps count global optimizer steps)."""

    out_dir: Path
    epochs: int = 10
    max_steps: int = 0
    batch_size: int = 256
    num_workers: int = 2
    prefetch_depth: int = 1
    lr: float = 0.1
    head_lr: float = 0.1
    warmup_steps: int = 100
    schedule: str = "cosine"
    log_every: int = 50
    eval_every: int = 0
    checkpoint_every: int = 0
    rebuild_every: int = 0
    seed: int = 0
    amp: bool = True
    resume: bool = True
    keep_checkpoints: int = 2


@dataclass
class TrainResult:
    steps: int
    last_loss: float
    history: list[dict] = field(default_factory=list)
    eval: dict = field(default_factory=dict)


class BatchPlan:
    """Which samples each rank trains on, as a function of (seed, epoch, position) only.

    Each epoch is a seeded permutation of all samples; global batch g covers permutation
    entries [g·B·W, (g+1)·B·W) and rank r takes its r-th slice of B. The position saved in a
    checkpoint is (epoch, samples consumed in the epoch), so a resumed run — with the same or
    a different worker count W — continues with exactly the samples not yet seen.
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int, world: int,
                 seed: int) -> None:
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world, self.seed = rank, world, seed
        self.global_batch = batch_size * world
        if num_samples < self.global_batch:
            raise ValueError(f"the dataset has {num_samples} samples, fewer than one global "
                             f"batch ({batch_size} x {world} workers)")

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def batches(self, epoch: int, consumed: int) -> Iterator[list[int]]:
        order = torch.randperm(self.num_samples,
                               generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))
        for start in range(consumed, self.steps_per_epoch * self.global_batch,
                           self.global_batch):
            mine = start + self.rank * self.batch_size
            yield order[mine:mine + self.batch_size].tolist()


class _BatchList(torch.utils.data.Sampler):
    def __init__(self, batches: list[list[int]]) -> None:
        self._batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches)

    def __len__(self) -> int:
        return len(self._batches)


def _collate(items: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, images, labels = zip(*items, strict=True)
    return torch.stack(ids), torch.stack(images), torch.stack(labels)


def step_backbone(features: torch.Tensor, feature_grad: torch.Tensor,
                  optimizer: torch.optim.Optimizer,
                  scaler: torch.amp.GradScaler | None) -> None:
    """Continue the backward from the head's dL/dfeatures (B, dim) into the backbone that
    produced ``features`` and step its optimizer; through ``scaler`` under AMP, so float16
    gradients neither underflow nor, on overflow, reach the weights. Gradients are left for
    the caller to zero."""
    if scaler is None:
        features.backward(feature_grad)
        optimizer.step()
        return
    features.backward(scaler.scale(feature_grad))
    scaler.step(optimizer)
    scaler.update()


class Trainer:
    """Runs ``LoopOptions`` over built components.

    client: the AMS client (embedded or remote); table: the class-row table; backbone: the
    (possibly DDP-wrapped) embedding network; optimizer: over the backbone's parameters;
    head: full / partial / knn; build_graph: ``build_graph(step)`` rebuilds the neighbour graph
    (None when the head needs none); rank/world: torch.distributed position; gear: gear mode
    (``workers.gear``), None for plain training.
    """

    def __init__(self, *, client: ShardedClient, table: str, backbone: nn.Module,
                 optimizer: torch.optim.Optimizer, head: ClassifierHead, train_set: Dataset,
                 test_set: Dataset | None, options: LoopOptions, device: torch.device,
                 build_graph: Callable[[int], None] | None = None, rank: int = 0,
                 world: int = 1, gear: Gear | None = None) -> None:
        self.client, self.table = client, table
        self.backbone, self.optimizer, self.head = backbone, optimizer, head
        self.train_set, self.test_set = train_set, test_set
        self.opt, self.device = options, device
        self.build_graph = build_graph
        self.rank, self.world = rank, world
        self.gear = gear
        self.plan = BatchPlan(len(train_set), options.batch_size, rank, world, options.seed)
        total = self.plan.steps_per_epoch * options.epochs
        self.total_steps = min(total, options.max_steps) if options.max_steps else total
        # Rows that sit out a step still owe it their weight decay; the AMS settles that debt
        # at their next push from this clock (ams.optim).
        self._decay_clock = decay_clocks(map(self._head_lr, range(self.total_steps)),
                                         client.spec(table).weight_decay)
        self.step = 0
        self.position = (0, 0)  # (epoch, samples consumed in it)
        self._restored_prepared: list = []
        self._restored_gear: dict | None = None
        self._amp = options.amp and device.type == "cuda"
        self._scaler = torch.amp.GradScaler("cuda") if self._amp else None
        self._tb = None
        # evenly spaced ids: a fixed sample without a permutation of all N (100M) per rebuild
        n = head.num_classes
        self._graph_probe = torch.unique(
            torch.linspace(0, n - 1, min(n, GRAPH_PROBE_CLASSES), dtype=torch.float64).long())

    # ---- checkpoints ------------------------------------------------------------------

    def _unwrapped(self) -> nn.Module:
        return getattr(self.backbone, "module", self.backbone)

    def save_checkpoint(self) -> None:
        """Worker state + AMS snapshot of this step (rank 0 publishes; all ranks write their
        private part first)."""
        out = Path(self.opt.out_dir)
        checkpoint.save_rank(out, self.step, self.rank, {
            "prepared": self._prefetcher.pending() if self._prefetcher else [],
            "selector_rng": _selector_generator_state(self.head),
            "world": self.world,
            "gear": self.gear.state_dict() if self.gear is not None else None,
        })
        self._barrier()
        if self.rank == 0:
            self.client.snapshot(self.step)
            checkpoint.save_shared(out, self.step, {
                "step": self.step, "position": self.position,
                "backbone": self._unwrapped().state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self._scaler.state_dict() if self._scaler else None,
                "world": self.world,
            })
            checkpoint.prune(out, self.opt.keep_checkpoints)
            log.info("checkpoint step=%d dir=%s", self.step, checkpoint.checkpoint_dir(out,
                                                                                       self.step))
        self._barrier()

    def try_resume(self) -> bool:
        """Continue from the newest checkpoint in out_dir (and the AMS snapshot of its step)."""
        step = checkpoint.latest_step(Path(self.opt.out_dir)) if self.opt.resume else None
        if step is None:
            return False
        shared, private = checkpoint.load(Path(self.opt.out_dir), step, self.rank)
        self._unwrapped().load_state_dict(shared["backbone"])
        self.optimizer.load_state_dict(shared["optimizer"])
        if self._scaler and shared.get("scaler"):
            self._scaler.load_state_dict(shared["scaler"])
        self.step = shared["step"]
        self.position = tuple(shared["position"])
        if self.rank == 0:
            self.client.restore(step)
        self._barrier()
        if private is not None and private.get("world") == self.world:
            self._restored_prepared = private["prepared"]
            _set_selector_generator_state(self.head, private["selector_rng"])
            self._restored_gear = private.get("gear")
        log.info("resumed step=%d epoch=%d consumed=%d", self.step, *self.position)
        return True

    # ---- evaluation -------------------------------------------------------------------

    @torch.no_grad()
    def _features(self, dataset: Dataset, max_samples: int | None = None
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(features float32 (b, dim) on CPU, labels int64 (b,)) batches of ``dataset`` in
        id order, embedded by the backbone in eval mode (training mode is restored after)."""
        model = self._unwrapped()
        was_training = model.training
        model.eval()
        # Loaded in this process: worker processes forked here would inherit the training
        # loader's live iterator, whose finaliser then fails noisily in the child.
        loader = DataLoader(dataset, batch_size=512, num_workers=0, collate_fn=_collate)
        seen = 0
        try:
            bar = tqdm(loader, desc="embedding", leave=False, dynamic_ncols=True,
                       disable=not (self.rank == 0 and sys.stderr.isatty()))
            for _, images, labels in bar:
                with torch.autocast(self.device.type, enabled=self._amp):
                    features = model(images_to_input(images.to(self.device))).float().cpu()
                yield features, labels
                seen += labels.numel()
                if max_samples and seen >= max_samples:
                    break
        finally:
            model.train(was_training)

    def row_blocks(self, source: str = "trained") -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """The class rows as (ids int64 (b,), rows (b, dim)) blocks covering every class.

        ``"trained"``: the AMS table as trained. ``"class-means"``: each class's mean
        direction over the training split (``workers.predict.class_means``), one pass of
        the backbone over it; a class with no training image keeps its trained row.
        """
        if source not in ROW_SOURCES:
            raise ValueError(f"row source must be one of {ROW_SOURCES}, got {source!r}")
        if source == "trained":
            return self.client.scan(self.table)
        dim = self.client.spec(self.table).dim
        means, counts = class_means(self._features(self.train_set), self.head.num_classes, dim)
        return ((ids, torch.where((counts[ids] > 0)[:, None], means[ids], rows.float()))
                for ids, rows in self.client.scan(self.table))

    def evaluate(self, max_samples: int | None = None, rows: str = "trained") -> dict:
        """Top-1 / top-5 of the test split by nearest class row (rank 0 only); ``rows``: the
        row source, as in ``row_blocks``."""
        if self.test_set is None:
            return {}
        batches = list(self._features(self.test_set, max_samples))
        feats = torch.cat([f for f, _ in batches])
        y = torch.cat([labels for _, labels in batches])
        ids, _ = nearest_classes(feats, self.row_blocks(rows), 5)
        hits = ids == y[:, None]
        return {"top1": float(hits[:, 0].float().mean()), "top5": float(hits.any(1).float().mean()),
                "samples": int(y.numel())}

    # ---- the loop ---------------------------------------------------------------------

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def _loader(self, epoch: int, consumed: int) -> Iterator:
        batches = list(self.plan.batches(epoch, consumed))
        return iter(DataLoader(self.train_set, batch_sampler=_BatchList(batches),
                               num_workers=self.opt.num_workers, collate_fn=_collate,
                               persistent_workers=False))

    def _epoch_batches(self) -> Iterator[tuple[int, tuple]]:
        """(epoch, batch) from the current position to the end of training."""
        epoch, consumed = self.position
        for e in range(epoch, self.opt.epochs):
            for batch in self._loader(e, consumed if e == epoch else 0):
                yield e, batch
            consumed = 0

    def _record(self, kind: str, row: dict) -> None:
        """Append a row to OUT/{kind}.csv (train, eval or graph) and to TensorBoard when
        installed (numbers only: a None is an empty CSV cell)."""
        if self.rank != 0:
            return
        path = Path(self.opt.out_dir) / f"{kind}.csv"
        new = not path.exists()
        with open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(row))
            if new:
                writer.writeheader()
            writer.writerow(row)
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(self.opt.out_dir) / "tensorboard"))
            except ImportError:  # TensorBoard is optional; the CSV is always written
                self._tb = False
        if self._tb:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{kind}/{key}", value, row["step"])

    def train(self) -> TrainResult:
        Path(self.opt.out_dir).mkdir(parents=True, exist_ok=True)
        self._prefetcher = None
        self.try_resume()
        if self.gear is not None:
            self.gear.begin(self._restored_gear)
        if self.build_graph is not None and current_graph_version(self.client, self.table) == 0:
            self._rebuild_graph()
        result = TrainResult(steps=self.step, last_loss=math.nan)
        if self.step >= self.total_steps:
            return result
        epoch_of: dict[int, int] = {}

        def batches() -> Iterator:
            for u, (e, batch) in enumerate(self._epoch_batches(), start=self.step):
                epoch_of[u] = e
                yield batch

        self._prefetcher = Prefetcher(batches(), self.head.prepare, self.opt.prefetch_depth,
                                      self.step, self._restored_prepared)
        self._restored_prepared = []
        show_bar = self.rank == 0 and sys.stderr.isatty()
        bar = tqdm(total=self.total_steps, initial=self.step, disable=not show_bar,
                   dynamic_ncols=True, desc="train")
        self.backbone.train()
        window_start, window_images, losses = time.perf_counter(), 0, []
        try:
            for prepared in self._prefetcher:
                if self.step >= self.total_steps:
                    break
                epoch = epoch_of.pop(self.step)
                loss, acc, active = self._step(prepared)
                losses.append(loss)
                window_images += prepared.batch[1].shape[0] * self.world
                self.step += 1
                consumed = self.position[1] + self.plan.global_batch
                self.position = (epoch, consumed)
                if consumed >= self.plan.steps_per_epoch * self.plan.global_batch:
                    self.position = (epoch + 1, 0)
                end_of_epoch = self.position[1] == 0
                bar.update(1)
                if self.step % self.opt.log_every == 0 or self.step == self.total_steps:
                    elapsed = time.perf_counter() - window_start
                    speed = window_images / max(elapsed, 1e-9)
                    eta = (self.total_steps - self.step) * elapsed / max(len(losses), 1)
                    row = {"step": self.step, "epoch": epoch, "loss": sum(losses) / len(losses),
                           "train_acc": acc, "lr": self._lr(self.step - 1), "active": active,
                           "images_per_s": round(speed, 1)}
                    if self.gear is not None:
                        row.update(self.gear.summary())
                    self._record("train", row)
                    result.history.append(row)
                    if self.rank == 0:
                        log.info("step=%d/%d epoch=%d loss=%.4f acc=%.3f active=%d lr=%.4g "
                                 "images_per_s=%.0f eta_s=%.0f", self.step, self.total_steps,
                                 epoch, row["loss"], acc, active, row["lr"], speed, eta)
                    bar.set_postfix(loss=f"{row['loss']:.3f}", ips=f"{speed:.0f}")
                    window_start, window_images, losses = time.perf_counter(), 0, []
                result.last_loss = loss
                self._boundary(end_of_epoch, result)
                self._prefetcher.step_done()
        finally:
            bar.close()
            self._prefetcher.close()
        result.steps = self.step
        if self.rank == 0 and self.test_set is not None and not result.eval:
            result.eval = self.evaluate()
        return result

    def _lr(self, step: int) -> float:
        return lr_at(step, self.opt.lr, self.opt.warmup_steps, self.total_steps,
                     self.opt.schedule)

    def _head_lr(self, step: int) -> float:
        return lr_at(step, self.opt.head_lr, self.opt.warmup_steps, self.total_steps,
                     self.opt.schedule)

    def _step(self, prepared: object) -> tuple[float, float, int]:
        ids, images, _ = prepared.batch
        lr = self._lr(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.gear is not None:
            # gear mode: features from the cache (misses computed without grad); the slow gear
            # steps the backbone (with the lr just set) from accumulated dL/dX
            features = self.gear.features(ids, images)
        else:
            images = images_to_input(images.to(self.device, non_blocking=True))
            with torch.autocast(self.device.type, enabled=self._amp):
                features = self.backbone(images)
        # the pull for step+depth must see exactly the state before this push
        self._prefetcher.wait_prepared(self.step)
        head_lr = self._head_lr(self.step)
        decay_clock = self._decay_clock[self.step]
        out = self.head.forward_backward(features, prepared.active, lr=head_lr,
                                         push=self.world == 1, decay_clock=decay_clock)
        if self.world > 1:
            self._push_combined(prepared.active.active_ids, out.row_grad, head_lr, decay_clock)
        if self.gear is not None:
            self.gear.backward(ids, out.feature_grad)
        else:
            step_backbone(features, out.feature_grad, self.optimizer, self._scaler)
        self.optimizer.zero_grad(set_to_none=True)
        return out.loss, out.accuracy, out.num_active

    def _push_combined(self, ids: torch.Tensor, row_grad: torch.Tensor, lr: float,
                       decay_clock: float) -> None:
        """One push per step for all ranks: rank 0 sends the sum of every rank's row gradients
        (each a batch mean, so divided by W: the gradient of the global batch mean). Separate
        pushes would give a row W momentum updates per step, in arrival order. The gather also
        orders every rank's prefetch pull for this step before the push."""
        parts: list = [None] * self.world
        dist.all_gather_object(parts, (ids, row_grad))
        if self.rank == 0:
            self.client.push(self.table, torch.cat([i for i, _ in parts]),
                             torch.cat([g for _, g in parts]) / self.world, lr=lr,
                             decay_clock=decay_clock)

    def _boundary(self, end_of_epoch: bool, result: TrainResult) -> None:
        """Work between steps, in a fixed order: graph rebuild, checkpoint, evaluation."""
        last = self.step >= self.total_steps
        every = self.opt.rebuild_every
        if self.build_graph is not None and not last and (
                (every and self.step % every == 0) or (not every and end_of_epoch)):
            self._rebuild_graph()
        every = self.opt.checkpoint_every
        if (every and self.step % every == 0) or (not every and end_of_epoch) or last:
            self.save_checkpoint()
        every = self.opt.eval_every
        if self.rank == 0 and self.test_set is not None and (
                (every and self.step % every == 0) or (not every and end_of_epoch) or last):
            result.eval = {"step": self.step, **self.evaluate()}
            self._record("eval", dict(result.eval))
            log.info("eval step=%d top1=%.4f top5=%.4f samples=%d", self.step,
                     result.eval["top1"], result.eval["top5"], result.eval["samples"])

    def _rebuild_graph(self) -> None:
        """Rebuild the neighbour graph and record (OUT/graph.csv) how stale the old one was:
        the share of a fixed sample of classes' neighbours the rebuild replaced."""
        self._barrier()
        if self.rank == 0:
            probe = self._graph_probe
            before = (self.client.neighbors(self.table, probe)
                      if current_graph_version(self.client, self.table) else None)
            started = time.perf_counter()
            self.build_graph(self.step)
            seconds = time.perf_counter() - started
            turnover = None if before is None else float(neighbour_turnover(
                before, self.client.neighbors(self.table, probe)).mean())
            log.info("graph_rebuilt step=%d seconds=%.1f turnover=%s", self.step, seconds,
                     "-" if turnover is None else f"{turnover:.3f}")
            self._record("graph", {"step": self.step, "seconds": round(seconds, 3),
                                   "turnover": turnover})
        self._barrier()


def _selector_generator_state(head: ClassifierHead) -> torch.Tensor | None:
    gen = getattr(head.selector, "generator", None)
    return gen.get_state() if gen is not None else None


def _set_selector_generator_state(head: ClassifierHead, state: torch.Tensor | None) -> None:
    gen = getattr(head.selector, "generator", None)
    if gen is not None and state is not None:
        gen.set_state(state)

"""The training loop: backbone data-parallel, class rows in the AMS, one step at a time.

One step (docs/architecture.md, "One training step"):

1. the loader yields (sample ids, images, labels); the prefetch thread has already chosen the
   batch's active classes and pulled their rows (``workers.prefetch``);
2. the backbone computes features (in gear mode: the feature cache, ``workers.gear``);
3. the head computes the margin softmax over the active rows: loss, dL/dX and dL/dW;
4. the row update (``workers.row_update``) pushes dL/dW of the active rows to the shards, on a
   thread of its own: the push runs behind the next two parts, and the head of the next step
   (and any pull it depends on) waits until it is applied;
5. the backbone's backward (DDP all-reduces its gradients) and optimizer step, or in gear mode
   dL/dX handed to the slow gear.

Between steps: graph rebuilds, checkpoints with an AMS snapshot of the same step, evaluation
(``workers.evaluation``); metrics go to CSV and TensorBoard (``workers.run_log``). Which samples
each rank reads is ``workers.batch_plan``'s. The caller (``xcls.run``) builds the components,
which keeps this loop free of configuration parsing.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset
from tqdm import tqdm

from ams.client.sharded import ShardedClient
from ams.graph.build import GraphBuildReport, current_graph_version, graph_on_every_shard
from ams.graph.churn import neighbor_turnover
from ams.shard.spec import TableSpec
from workers import checkpoint
from workers.augment import flip_horizontally
from workers.batch_plan import Batch, BatchPlan
from workers.comm import TopkCompressor
from workers.evaluation import Evaluator
from workers.gear import Gear
from workers.heads import ActiveBatch, HeadStep, RowHead
from workers.metrics import StepClock, record_resume, watch_gear
from workers.predict import images_to_input
from workers.prefetch import Prefetcher, PreparedBatch
from workers.row_update import RowUpdater
from workers.run_log import RunLog
from workers.schedule import lr_at, row_warmup_steps
from workers.settings import ExperimentConfig
from workers.termination import TerminationRequest

log = logging.getLogger(__name__)

# Classes whose neighbor lists are compared across a rebuild (a sample: the full lists of
# 100M classes would not fit, and the share is all that is reported).
GRAPH_PROBE_CLASSES = 4096


@dataclass
class TrainResult:
    steps: int
    last_loss: float
    history: list[dict] = field(default_factory=list)
    eval: dict = field(default_factory=dict)
    # stopped early on SIGTERM, after a checkpoint of ``steps`` (run again to resume)
    terminated: bool = False


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


class _Window:
    """The steps since the last log line: their losses, carried over a resume so that the
    line after it means what it would have without the stop, and the images and seconds of
    those this process ran (for its speed)."""

    def __init__(self, losses: list[float] | None = None) -> None:
        self.start, self.images, self.timed_steps = time.perf_counter(), 0, 0
        self.losses = list(losses or [])

    def add(self, loss: float, images: int) -> None:
        self.losses.append(loss)
        self.images += images
        self.timed_steps += 1

    def seconds(self) -> float:
        return max(time.perf_counter() - self.start, 1e-9)


class Trainer:
    """Runs the loop of ``cfg`` over built components.

    cfg: the run's settings, of which the loop reads ``train`` (length, cadences, checkpoints,
    out_dir), ``data`` (batch size, loader processes, flips), ``optim`` (learning rates and
    their schedule), ``graph.rebuild_every`` and ``ams.table``; every step counts global
    optimizer steps. client: the AMS client (embedded or remote); backbone: the (possibly
    DDP-wrapped) embedding network; optimizer: over the backbone's parameters; head: full /
    partial / knn; build_graph: ``build_graph(step)`` builds or refreshes the neighbor graph
    and reports it (``ams.graph.build.GraphUpdater.update``; None when the head needs none);
    rank/world: torch.distributed position; gear: gear mode (``workers.gear``), None for plain
    training; compressor: the top-k gradient compression hook registered on the DDP wrapper,
    whose residuals are checkpointed per rank (None: dense all-reduce).
    """

    def __init__(self, *, cfg: ExperimentConfig, client: ShardedClient, backbone: nn.Module,
                 optimizer: torch.optim.Optimizer, head: RowHead, train_set: Dataset,
                 test_set: Dataset | None, device: torch.device,
                 build_graph: Callable[[int], GraphBuildReport] | None = None, rank: int = 0,
                 world: int = 1, gear: Gear | None = None,
                 compressor: TopkCompressor | None = None,
                 pair_sets: dict[str, Dataset] | None = None, config_toml: str = "") -> None:
        self.cfg = cfg
        # OUT/config.toml once training starts or resumes (xcls.config.to_toml of cfg): eval
        # and export, which only read a run, and a refused resume leave the run's own
        self.config_toml = config_toml
        self.client, self.table = client, cfg.ams.table
        self.backbone, self.optimizer, self.head = backbone, optimizer, head
        self.train_set, self.test_set = train_set, test_set
        self.device = device
        self.out_dir = Path(cfg.train.out_dir)
        self.build_graph = build_graph
        self.rank, self.world = rank, world
        self.gear = gear
        self.compressor = compressor
        watch_gear(gear)  # its cache and accumulator counters, read at scrape time
        # per rank; a batch_schedule grows it epoch by epoch
        batch_size = cfg.train.batch_schedule or cfg.data.batch_size
        self.plan = BatchPlan(len(train_set), batch_size, rank, world, cfg.train.seed)
        self._epoch_of_step = self.plan.epoch_of_steps(cfg.train.epochs)
        self.total_steps = self.plan.run_steps(cfg.train.epochs, cfg.train.max_steps)
        self.head_warmup_steps = row_warmup_steps(
            cfg.optim.head_warmup_steps, cfg.optim.warmup_steps, head.num_classes,
            self.plan.batch_size * world)
        logq_start = cfg.head.logq_start_step if cfg.head.kind == "knn" else 0
        self.logq_start_step = self.head_warmup_steps if logq_start == -1 else logq_start
        combine = head.combine_row_grads
        self.rows = RowUpdater(head.device_rows or client, self.table,
                               [self._head_lr(t) for t in range(self.total_steps)],
                               rank=rank if combine else 0, world=world if combine else 1)
        self._amp = cfg.train.amp and device.type == "cuda"
        self._scaler = torch.amp.GradScaler("cuda") if self._amp else None
        self.evaluator = Evaluator(client, self.table, self._unwrapped(), device,
                                   num_classes=head.num_classes, dim=client.spec(self.table).dim,
                                   train_set=train_set, test_set=test_set,
                                   pair_sets=pair_sets, verify_flipped=cfg.data.flip,
                                   amp=self._amp, show_progress=rank == 0)
        self.run_log = RunLog(self.out_dir, enabled=rank == 0)
        self.step = 0
        self.position = (0, 0)  # (epoch, samples consumed in it)
        self._resumed: dict | None = None  # this rank's private checkpoint part
        self._prefetcher: Prefetcher | None = None
        self._checkpointed_step = -1  # the step of this process's newest checkpoint
        self._evaluated_step = -1  # the step of its newest evaluation
        self._window = _Window()
        # evenly spaced ids: a fixed sample without a permutation of all N (100M) per rebuild
        n = head.num_classes
        self._graph_probe = torch.unique(
            torch.linspace(0, n - 1, min(n, GRAPH_PROBE_CLASSES), dtype=torch.float64).long())

    # ---- the loop ---------------------------------------------------------------------

    def train(self) -> TrainResult:
        # resume from the newest checkpoint; a graph before the first knn step
        self.out_dir.mkdir(parents=True, exist_ok=True)
        fresh = not self.try_resume()
        if self.rank == 0 and self.config_toml:
            (self.out_dir / "config.toml").write_text(self.config_toml)
        if not fresh:
            log.info("resumed step=%d epoch=%d consumed=%d", self.step, *self.position)
            record_resume()
        resumed = self._resumed or {}
        if self.gear is not None:
            self.gear.begin(resumed.get("gear"))
            if self.gear.weights is not None:
                # the leader has reset the job's weights to ours: take its version
                self._barrier()
                self.gear.sync()
        if self.build_graph is not None and not graph_on_every_shard(self.client, self.table):
            self._rebuild_graph()
        result = TrainResult(steps=self.step, last_loss=math.nan)
        if self.step >= self.total_steps:
            # finished already, or rolled back to the last checkpoint before its evaluation
            self._evaluate(result)
            return self._finish(result)
        if fresh:
            # a step every rank and shard can roll back to before the first periodic
            # checkpoint: the snapshot of step 0 holds the initial rows (and first graph)
            self.save_checkpoint()

        # batches from the saved position, prepared one step ahead by the prefetch thread
        epoch_of: dict[int, int] = {}

        def batches() -> Iterator[Batch]:
            for u, (e, batch) in enumerate(self._epoch_batches(), start=self.step):
                epoch_of[u] = e
                if self.cfg.data.flip:
                    ids, images, labels = batch
                    images = flip_horizontally(images, seed=self.cfg.train.seed, rank=self.rank,
                                               step=u)
                    batch = (ids, images, labels)
                yield batch

        self._prefetcher = Prefetcher(batches(), self.head, self.cfg.train.prefetch_depth,
                                      self.step, resumed.get("prepared"),
                                      wait_pushed=self.rows.wait_pushed, device=self.device)
        bar = tqdm(total=self.total_steps, initial=self.step, dynamic_ncols=True, desc="train",
                   disable=not (self.rank == 0 and sys.stderr.isatty()))
        self.backbone.train()
        self._window = _Window(resumed.get("loss_window"))
        with TerminationRequest() as termination:
            try:
                for prepared in self._prefetcher:
                    if self.step >= self.total_steps:
                        break
                    epoch = epoch_of.pop(self.step)

                    # one step: features -> head -> rows update -> backbone
                    out = self._step(prepared)
                    self.step += 1
                    self.position = self.plan.advance(self.position)
                    result.last_loss = out.loss
                    self._window.add(out.loss, prepared.batch[1].shape[0] * self.world)
                    bar.update(1)

                    # timing and logging
                    if self.step % self.cfg.train.log_every == 0 or self.step == self.total_steps:
                        row = self._log_window(epoch, out, self._window)
                        result.history.append(row)
                        bar.set_postfix(loss=f"{row['loss']:.3f}", ips=f"{row['images_per_s']:.0f}")
                        self._window = _Window()

                    # between steps: graph rebuild, checkpoint, evaluation
                    self._boundary(end_of_epoch=self.position[1] == 0, result=result)
                    if termination.agreed(self.world, self.device):
                        if self._checkpointed_step != self.step:
                            self.save_checkpoint()
                        log.warning("terminated step=%d reason=SIGTERM checkpoint=saved", self.step)
                        result.terminated = True
                        break
                    self._prefetcher.step_done()
            finally:
                bar.close()
                self._prefetcher.close()
                self.rows.close()
        if result.terminated:
            result.steps = self.step
            return self._finish(result)

        # the end: a final evaluation unless the last boundary made one
        result.steps = self.step
        if self._evaluated_step != self.step:
            self._evaluate(result)
        return self._finish(result)

    def _finish(self, result: TrainResult) -> TrainResult:
        """Every rank returns together: rank 0's last evaluation may still be reading the other
        ranks' rows (in collective mode their slices live in those ranks' processes)."""
        self._barrier()
        return result

    def _step(self, prepared: PreparedBatch) -> HeadStep:
        clock = StepClock(prepared.seconds)  # data and prepare: timed by the prefetch thread
        ids, images, _ = prepared.batch
        lr = self._lr(self.step)
        if self.gear is not None:
            # from the cache; misses computed without grad
            features = self.gear.features(ids, images)
        else:
            images = images_to_input(images.to(self.device, non_blocking=True))
            with torch.autocast(self.device.type, enabled=self._amp):
                features = self.backbone(images)
        clock.lap("backbone")
        # the pull for step+depth must see exactly the state before this push, and this
        # head (a collective head pulls in it) the state after the previous one
        self._prefetcher.wait_prepared(self.step)
        self.rows.wait_pushed(self.step - 1)
        clock.lap("wait")
        out = self.head.forward_backward(features, prepared.on_device(),
                                         logq=self.step >= self.logq_start_step)
        clock.lap("head")
        # pushed behind the backbone's backward and the next forward
        self.rows.update(self.step, out.active_ids, out.row_grad)
        clock.lap("push")
        if self.gear is not None:
            # the slow gear steps the backbone from accumulated dL/dX
            self.gear.backward(ids, out.feature_grad, lr)
        else:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            step_backbone(features, out.feature_grad, self.optimizer, self._scaler)
            self.optimizer.zero_grad(set_to_none=True)
        clock.lap("backbone")
        clock.record(self.step + 1, out.loss)
        return out

    def _lr(self, step: int) -> float:
        o = self.cfg.optim
        return lr_at(step, o.lr, o.warmup_steps, self.total_steps, o.schedule) \
            * self._batch_scale(step)

    def _head_lr(self, step: int) -> float:
        o = self.cfg.optim
        return lr_at(step, o.effective_head_lr(), self.head_warmup_steps, self.total_steps,
                     o.schedule) * self._batch_scale(step)

    def _batch_scale(self, step: int) -> float:
        """The step's batch over the first epoch's, when the learning rates follow a growing
        batch (1 otherwise)."""
        if not self.cfg.train.batch_lr_scaling or step >= len(self._epoch_of_step):
            return 1.0
        return self.plan.batch_size_at(self._epoch_of_step[step]) / self.plan.batch_size

    def _epoch_batches(self) -> Iterator[tuple[int, Batch]]:
        """(epoch, batch) from the current position to the end of training."""
        epoch, consumed = self.position
        for e in range(epoch, self.cfg.train.epochs):
            for batch in self.plan.loader(self.train_set, e, consumed if e == epoch else 0,
                                          self.cfg.data.num_workers):
                yield e, batch
            consumed = 0

    def _log_window(self, epoch: int, last: HeadStep, window: _Window) -> dict:
        """Record the steps since the last log line (train.csv, the log) and return the row."""
        seconds = window.seconds()
        speed = window.images / seconds
        eta = (self.total_steps - self.step) * seconds / max(window.timed_steps, 1)
        row = {"step": self.step, "epoch": epoch,
               "loss": sum(window.losses) / len(window.losses), "train_acc": last.accuracy,
               "lr": self._lr(self.step - 1), "active": last.num_active,
               "images_per_s": round(speed, 1)}
        if self.gear is not None:
            row.update(self.gear.summary())
        self.run_log.record("train", row)
        if self.rank == 0:
            log.info("step=%d/%d epoch=%d loss=%.4f acc=%.3f active=%d lr=%.4g "
                     "images_per_s=%.0f eta_s=%.0f", self.step, self.total_steps, epoch,
                     row["loss"], last.accuracy, last.num_active, row["lr"], speed, eta)
        return row

    # ---- between steps ----------------------------------------------------------------

    def _boundary(self, end_of_epoch: bool, result: TrainResult) -> None:
        """Work between steps, in a fixed order: graph rebuild, checkpoint, evaluation."""
        last = self.step >= self.total_steps

        def due(every: int) -> bool:
            return (every and self.step % every == 0) or (not every and end_of_epoch)

        if self.build_graph is not None and not last and due(self.cfg.graph.rebuild_every):
            self._rebuild_graph()
        if due(self.cfg.train.checkpoint_every) or last:
            self.save_checkpoint()
        if due(self.cfg.train.eval_every) or last:
            self._evaluate(result)

    def _evaluate(self, result: TrainResult) -> None:
        """Rank 0 evaluates on the test split and the pair sets (if any) and records it in
        eval.csv."""
        self._evaluated_step = self.step  # on every rank: the barrier below is everyone's
        self.rows.flush()
        # in collective placement rank 0 reads every rank's slice: each must have applied
        # (and, from GPU memory, written back) its last update first
        self._barrier()
        if self.rank != 0 or (self.test_set is None and not self.evaluator.pair_sets):
            return
        result.eval = {"step": self.step, **self.evaluator.evaluate(),
                       **self.evaluator.verify()}
        self.run_log.record("eval", dict(result.eval))
        log.info("eval step=%d %s", self.step, " ".join(
            f"{key}={value:.4f}" if isinstance(value, float) else f"{key}={value}"
            for key, value in result.eval.items() if key != "step"))

    def _rebuild_graph(self) -> None:
        """Rebuild the neighbor graph and record (OUT/graph.csv) how stale the old one was
        (the share of a fixed sample of classes' neighbors the rebuild replaced), whether it
        was full or refreshed the touched classes, how many lists it wrote, and the recall
        measured by an IVF build (empty otherwise)."""
        self.rows.flush()
        self._barrier()
        if self.rank == 0:
            probe = self._graph_probe
            before = (self.client.neighbors(self.table, probe)
                      if current_graph_version(self.client, self.table) else None)
            started = time.perf_counter()
            report = self.build_graph(self.step)
            seconds = time.perf_counter() - started
            turnover = None if before is None else float(neighbor_turnover(
                before, self.client.neighbors(self.table, probe)).mean())
            refresh = "full" if report.full else "touched"
            log.info("graph_rebuilt step=%d seconds=%.1f turnover=%s method=%s refresh=%s "
                     "classes=%d recall_at_k=%s", self.step, seconds,
                     "-" if turnover is None else f"{turnover:.3f}", report.method, refresh,
                     report.classes, "-" if report.recall is None else f"{report.recall:.4f}")
            self.run_log.record("graph", {"step": self.step, "seconds": round(seconds, 3),
                                          "turnover": turnover, "method": str(report.method),
                                          "refresh": refresh, "classes": report.classes,
                                          "recall": report.recall})
        self._barrier()

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    # ---- checkpoints ------------------------------------------------------------------

    def _unwrapped(self) -> nn.Module:
        return getattr(self.backbone, "module", self.backbone)

    def save_checkpoint(self) -> None:
        """Worker state + AMS snapshot of this step (rank 0 publishes; all ranks write their
        private part first)."""
        self.rows.flush()
        out = self.out_dir
        if self.rank == 0:
            checkpoint.clear_staging(out, self.step)
        self._barrier()
        checkpoint.save_rank(out, self.step, self.rank, {
            # plain tensors only: checkpoints are read with torch.load(weights_only=True)
            "prepared": [a.to_dict() for a in self._prefetcher.pending()]
            if self._prefetcher else [],
            "selector_rng": self.head.sampler_state(),
            "world": self.world,
            "selected_by": self._selected_by(),
            "gear": self.gear.state_dict() if self.gear is not None else None,
            "comm": self.compressor.state_dict() if self.compressor is not None else None,
            "loss_window": self._window.losses,
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
            checkpoint.prune(out, self.cfg.train.keep_checkpoints)
            log.info("checkpoint step=%d dir=%s", self.step,
                     checkpoint.checkpoint_dir(out, self.step))
        self._barrier()
        self._checkpointed_step = self.step

    def _check_restored_table(self, made: TableSpec, step: int) -> None:
        """CheckpointError unless the restored table's rows and optimizer are the ones this run
        was built for: a snapshot brings its own spec, and the row update (its decay clocks, a
        slice's working copy) was set up from the config's."""
        restored = self.client.spec(self.table)
        fields = ("num_rows", "dim", "dtype", "state_dtype", "momentum", "weight_decay")
        differ = [f for f in fields if getattr(restored, f) != getattr(made, f)]
        if differ:
            said = ", ".join(f"{f} {getattr(restored, f)} (this run: {getattr(made, f)})"
                             for f in differ)
            raise checkpoint.CheckpointError(
                f"{checkpoint.checkpoint_dir(self.out_dir, step)}: its class rows were made with "
                f"{said}: resume with the settings it trained with (data.train's classes, "
                "model.dim, ams.dtype, ams.state_dtype, optim.head_momentum, "
                "optim.head_weight_decay), or train afresh in another train.out_dir")

    def _selected_by(self) -> dict:
        """The settings that decide a prepared batch's samples and active classes besides the
        worker count: a checkpoint's prefetched batches are replayed only under the same."""
        return {"batch_sizes": list(self.plan.batch_sizes), "seed": self.cfg.train.seed,
                "head": {key: str(value) for key, value in vars(self.cfg.head).items()}}

    def try_resume(self) -> bool:
        """Load the newest checkpoint in out_dir (and the AMS snapshot of its step); False
        when there is none (or train.resume is off). This rank's private part (prepared
        batches, sampler and gear state) is used only when the worker count is the one it was
        saved with. Says nothing: training logs that it resumed, evaluation what it evaluates."""
        out = self.out_dir
        step = checkpoint.latest_step(out) if self.cfg.train.resume else None
        if step is None:
            return False
        shared, private = checkpoint.load(out, step, self.rank)
        try:
            self._unwrapped().load_state_dict(shared["backbone"])
        except RuntimeError as e:  # torch lists each mismatch on a line of its own
            first = next((line.strip() for line in str(e).splitlines()[1:] if line.strip()),
                         str(e))
            raise checkpoint.CheckpointError(
                f"{checkpoint.checkpoint_dir(out, step)}: its backbone does not fit this run's "
                f"(model.backbone, model.dim or the data's image size changed?): {first}"
            ) from None
        # The momentum and weight decay are this run's own: top-k compression moves them out of
        # the optimizer, so a checkpoint saved with or without it must not bring its setting.
        own = [{key: group[key] for key in ("momentum", "weight_decay") if key in group}
               for group in self.optimizer.param_groups]
        try:
            self.optimizer.load_state_dict(shared["optimizer"])
        except ValueError as e:
            raise checkpoint.CheckpointError(
                f"{checkpoint.checkpoint_dir(out, step)}: its optimizer state does not fit this "
                f"run's optimizer (optim.name changed?): {e}") from None
        for group, settings in zip(self.optimizer.param_groups, own, strict=True):
            group.update(settings)
        if self._scaler and shared.get("scaler"):
            self._scaler.load_state_dict(shared["scaler"])
        self.step = shared["step"]
        self.position = tuple(shared["position"])
        made = self.client.spec(self.table)
        if self.rank == 0:
            self.client.restore(step)
        self._barrier()
        self._check_restored_table(made, step)
        self.rows.reload()
        if private is not None and private.get("world") == self.world:
            prepared = [ActiveBatch.from_dict(a) for a in private["prepared"]]
            if prepared and private.get("selected_by") != self._selected_by():
                # Batches of another size or classes of another head: this run loads and
                # selects them afresh from the saved data position, as after a new world size.
                log.warning("prefetched_batches_dropped count=%d saved=%s now=%s",
                            len(prepared), private.get("selected_by"), self._selected_by())
                prepared = []
            self._resumed = {**private, "prepared": prepared}
            self.head.load_sampler_state(private["selector_rng"])
            if self.compressor is not None and private.get("comm") is not None:
                self.compressor.load_state_dict(private["comm"])
        elif self.compressor is not None:
            # Another worker count: the residuals were other ranks' unsent gradients.
            log.warning("compression_residuals_dropped saved_world=%s world=%d",
                        private.get("world") if private else None, self.world)
        if self.compressor is not None:
            self.compressor.step = self.step
        return True

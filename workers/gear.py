"""Gear mode in the trainer: a fast gear that trains the head from cached features and a slow
gear that trains the backbone from averaged feature gradients (the "Gear training" paper;
docs/architecture.md, "One gear step").

Per step the trainer calls :meth:`Gear.features` before the head and :meth:`Gear.backward` after
it:

* fast gear: look the batch up in the :class:`bridge.protocols.FeatureCache` (entries younger
  than the cache's ttl), run the backbone without grad on the misses only and cache what it
  computed; after the head, hand dL/dX of every sample to the
  :class:`bridge.protocols.GradientSink` (``sink.add(ids, grad, version)``);
* slow gear (:class:`SlowGear`), in this process after every fast step or in separate
  ``xcls gear slow`` processes: read ready mean gradients from a
  :class:`bridge.protocols.GradientSource`, reload those samples' images by id, forward with
  grad, ``features.backward(mean_grad)``, step the backbone at the learning rate it is given,
  bump its version.

With separate slow processes the weights travel through a :class:`bridge.protocols.WeightChannel`:
the slow worker publishes every few backbone steps and fast workers reload the newest every few
steps. The trainers own the job's timeline: when they start or roll back to a checkpoint,
rank 0 resets the channel to that backbone and the slow workers follow (:func:`follow_reset`),
so rows, backbone and queued gradients always restart from one step. This module knows only
those protocols; which backend stands behind them is the run assembly's choice. A backend
outage never stops training: the cache answers misses; the accumulator hands the gradients to
a bounded in-process fallback, which the slow gear drains when it runs in this process
(``fallback``), so the backbone keeps training; an external slow gear gets the fallback's
means once Redis is back, and meanwhile the fast gear keeps the weights it has.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import StrEnum

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from bridge.accumulator import GradientBatch, empty_batch
from bridge.protocols import FeatureCache, GradientSink, GradientSource, WeightChannel
from bridge.ratelimit import RateLimitedLog
from workers.predict import images_to_input

log = logging.getLogger(__name__)


class SlowGearMode(StrEnum):
    """Where the slow gear steps the backbone."""

    LOCAL = "local"  # in the trainer, after each fast step
    EXTERNAL = "external"  # separate 'xcls gear slow' processes fed through Redis


@dataclass
class GearCounts:
    """Work done since the gear was built. ``fast_forwards``: samples the fast gear ran through
    the backbone (cache misses); ``slow_forwards``: samples the slow gear ran forward+backward;
    ``rejected``: ready means dropped because their sample id is not in the dataset;
    ``resets``: times an external slow gear went over to the weights the trainers reset the
    job to (when they started or rolled back); ``stale``: means from steps a reset discarded,
    dropped."""

    samples: int = 0
    fast_forwards: int = 0
    slow_forwards: int = 0
    slow_steps: int = 0
    rejected: int = 0
    resets: int = 0
    stale: int = 0


class SlowGearGroup:
    """The ``xcls gear slow`` processes of one job (torchrun ranks) stepping one backbone
    together, data-parallel: each rank reads its own means from the consumer group, and every
    step sums the parameter gradients of all ranks, so the step equals one process applying
    every rank's means in one backward (up to BatchNorm batch statistics, which stay per rank as
    under DDP). Ranks read uneven and often empty batches, which torch's DDP wrapper cannot
    step on; the sum is therefore one explicit all-reduce. With ``world == 1`` nothing is sent.
    """

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.rank, self.world = rank, world

    def agree(self, items: int, stop: bool, busy: bool, reset: bool = False,
              ) -> tuple[int, bool, bool, bool]:
        """Sum of ``items`` read this round over all ranks, whether any rank was asked to stop,
        whether any rank has had work lately, and whether any rank saw the trainers reset the
        weights: every rank takes the same decisions."""
        if self.world == 1:
            return items, stop, busy, reset
        votes = torch.tensor([items, int(stop), int(busy), int(reset)], dtype=torch.int64)
        dist.all_reduce(votes)
        return int(votes[0]), bool(votes[1]), bool(votes[2]), bool(votes[3])

    def from_rank0(self, value: int) -> int:
        """Rank 0's ``value`` on every rank."""
        if self.world == 1:
            return value
        box = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(box, src=0)
        return int(box[0])

    def sum_gradients(self, module: nn.Module, device: torch.device) -> None:
        """Replace each parameter's .grad by its sum over the ranks (None counts as zeros)."""
        if self.world == 1:
            return
        params = [p for p in module.parameters() if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params]).to(device)
        dist.all_reduce(flat)
        start = 0
        for p in params:
            n = p.numel()
            p.grad = flat[start:start + n].view_as(p).to(p.dtype)
            start += n

    def broadcast_state(self, module: nn.Module, parameters: bool = True) -> None:
        """Make every rank's buffers (and parameters, if ``parameters``) rank 0's: all of it at
        start; the buffers after each step, for the BatchNorm running statistics, as DDP's
        broadcast_buffers does (the parameters stay equal by themselves)."""
        if self.world == 1:
            return
        tensors = [*module.buffers(), *(module.parameters() if parameters else ())]
        with torch.no_grad():
            for tensor in tensors:
                dist.broadcast(tensor, src=0)


class SlowGear:
    """Applies ready mean gradients to the backbone.

    backbone: the network (not DDP-wrapped: the slow gear steps it itself); optimizer: over its
    parameters, stepped at the learning rate each call is given (it overwrites the lr of the
    param groups); dataset: ``dataset[id]`` -> (id, uint8 image (C, H, W), label), the LMDB
    training set; ``max_items``: most means in one backward. ``version`` counts backbone steps
    (start it at a published version to continue that count). ``group``: the ranks this one
    steps with (None: alone).
    """

    def __init__(self, backbone: nn.Module, optimizer: torch.optim.Optimizer, dataset: Dataset,
                 device: torch.device, max_items: int = 256, version: int = 0,
                 group: SlowGearGroup | None = None) -> None:
        self.backbone, self.optimizer, self.dataset = backbone, optimizer, dataset
        self.device = device
        self.max_items = max_items
        self.version = version
        self.group = group
        self.counts = GearCounts()
        # means of an older backbone version are from steps the trainers discarded
        self.floor = -1
        self._warn = RateLimitedLog(log)

    def drop_stale(self, batch: GradientBatch) -> GradientBatch:
        """``batch`` without the means computed on a backbone older than the one the trainers
        last reset the job to (:func:`follow_reset`), counted in ``counts.stale``."""
        keep = batch.versions >= self.floor
        if bool(keep.all()):
            return batch
        self.counts.stale += int((~keep).sum())
        self._warn.warn("gear_grad_stale", count=int((~keep).sum()), floor=self.floor)
        return GradientBatch(batch.ids[keep], batch.grads[keep], batch.versions[keep],
                             [h for h, k in zip(batch.handles, keep.tolist(), strict=True) if k])

    def apply(self, batch: GradientBatch, lr: float) -> int:
        """One backbone step at learning rate ``lr`` from ``batch`` (ids (k,) int64, grads
        (k, dim) float32 mean dL/dX). Returns how many means were applied (ids outside the
        dataset are dropped). In a group every rank calls it in the same round, even with an
        empty batch, and all step."""
        ids, grads = batch.ids, batch.grads
        # A well-formed entry can still name a sample this dataset does not have (another
        # job's stream, a bad writer): it must neither crash the worker nor train anything.
        valid = (ids >= 0) & (ids < len(self.dataset))
        if not bool(valid.all()):
            bad = int((~valid).sum())
            self.counts.rejected += bad
            self._warn.warn("gear_grad_unknown_sample", count=bad, dataset_size=len(self.dataset))
            ids, grads = ids[valid], grads[valid]
        k = int(ids.numel())
        if k == 0 and self.group is None:
            return 0
        if k:
            images = torch.stack([self.dataset[int(i)][1] for i in ids])
            was_training = self.backbone.training
            # BatchNorm cannot take batch statistics of one sample; running statistics stand in.
            self.backbone.train(k > 1)
            features = self.backbone(images_to_input(images.to(self.device)))
            features.backward(grads.to(self.device, features.dtype))
            self.backbone.train(was_training)
        if self.group is not None:
            self.group.sum_gradients(self.backbone, self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.group is not None:
            self.group.broadcast_state(self.backbone, parameters=False)
        self.version += 1
        self.counts.slow_forwards += k
        self.counts.slow_steps += 1
        return k

    def run_once(self, source: GradientSource, lr: float) -> int:
        """Read up to ``max_items`` means ready now, apply them at learning rate ``lr``, ack
        them. Returns how many were read (applied or rejected); 0 when none was ready."""
        batch = source.read(self.max_items)
        if not len(batch):
            return 0
        self.apply(batch, lr)
        # Rejected ids are acked too: re-delivering them would only reject them again.
        source.ack(batch)
        return len(batch)

    def drain(self, source: GradientSource, lr: float) -> None:
        """Apply everything ready now at learning rate ``lr`` (in-process slow gear, after each
        fast step)."""
        while self.run_once(source, lr):
            pass


class Gear:
    """The trainer's gear: fast gear here, slow gear in-process (``slow``) or elsewhere
    (``weights``: reload what the slow workers publish every ``sync_every`` steps).

    backbone: the network (possibly DDP-wrapped; the fast gear only runs it without grad);
    cache: None means ttl 0, never reuse a feature; accumulator: where dL/dX goes.
    Exactly one of ``slow`` (the slow gear and the source it reads the accumulator's means from)
    and ``weights`` is given. ``fallback``: with ``slow``, a second source the slow gear drains
    after the first, where the accumulator queues means while its backend is down. ``leader``:
    with ``weights``, this trainer (rank 0) starts the job's timeline in :meth:`begin`; the
    others :meth:`sync` to it afterwards.
    """

    def __init__(self, backbone: nn.Module, cache: FeatureCache | None,
                 accumulator: GradientSink, device: torch.device, *,
                 slow: tuple[SlowGear, GradientSource] | None = None,
                 weights: WeightChannel | None = None, sync_every: int = 10,
                 fallback: GradientSource | None = None, leader: bool = True) -> None:
        if (slow is None) == (weights is None):
            raise ValueError("give exactly one of slow (in-process) and weights (external)")
        if fallback is not None and slow is None:
            raise ValueError("a fallback source needs the slow gear in this process")
        self.backbone, self.cache, self.accumulator = backbone, cache, accumulator
        self.device = device
        self.slow, self.weights, self.sync_every = slow, weights, sync_every
        self.fallback = fallback
        self.leader = leader
        # In one process the fast and slow gear share one tally, so it tells all the work.
        self.counts = slow[0].counts if slow else GearCounts()
        self._version = 0
        self._steps = 0

    @property
    def version(self) -> int:
        """Backbone version the fast gear computes with."""
        return self.slow[0].version if self.slow else self._version

    def state_dict(self) -> dict:
        """What a checkpoint keeps of the gear: the backbone version, step and work counters,
        and the cache's and (with the slow gear in this process) the accumulator's
        :meth:`~bridge.protocols.CheckpointState.checkpoint_state`."""
        owned = self.slow is not None
        return {"version": self.version, "steps": self._steps, "counts": asdict(self.counts),
                "cache": self.cache.checkpoint_state() if self.cache is not None else None,
                "accumulator": self.accumulator.checkpoint_state() if owned else None}

    def begin(self, state: dict | None) -> None:
        """Start from a checkpoint's :meth:`state_dict`, or fresh when ``state`` is None.

        The cache and, when this process owns the slow gear, the accumulator restore their own
        state (:meth:`~bridge.protocols.CheckpointState.restore_checkpoint_state`): in-process
        ones exactly, so a resumed run repeats the uninterrupted one; shared ones roll back
        what outlasted the checkpoint. With an external slow gear the leader discards the
        job's gradient state and resets the weight channel to this backbone (the checkpoint's,
        or the initial one), which the slow gear then goes back to: rows, backbone and queued
        gradients all restart from the same step. The other trainers call :meth:`sync` once
        the leader is done.
        """
        version = -1
        if state is not None:
            version = int(state["version"])
            self._steps = int(state["steps"])
            self.counts = GearCounts(**state["counts"])
            if self.slow:
                self.slow[0].version = version
                self.slow[0].counts = self.counts
            else:
                self._version = version
        if self.cache is not None:
            self.cache.restore_checkpoint_state(state["cache"] if state else None, version)
        if self.slow is not None:
            self.accumulator.restore_checkpoint_state(
                state["accumulator"] if state else None, version)
        elif self.leader:
            self.accumulator.restore_checkpoint_state(None, version)
            model = getattr(self.backbone, "module", self.backbone)
            self._version = self.weights.reset(model, max(version, 0))

    def features(self, ids: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        """ids int64 (B,), images uint8 (B, C, H, W) -> features float32 (B, dim), no grad.

        Misses run in the backbone's training mode, as the slow gear's forward does: with
        BatchNorm's running statistics instead, the head would learn on features of another
        distribution than the one the slow gear backpropagates through (on the glyph study
        that cost most of the accuracy early in training)."""
        n = int(ids.numel())
        if self.cache is not None:
            feats, hit = self.cache.get(ids)
            feats = feats.to(self.device)
        else:
            feats, hit = None, torch.zeros(n, dtype=torch.bool)
        miss = ~hit
        if bool(miss.any()):
            was_training = self.backbone.training
            # BatchNorm cannot take batch statistics of one sample; running statistics stand in.
            self.backbone.train(was_training and int(miss.sum()) > 1)
            with torch.no_grad():
                computed = self.backbone(images_to_input(images[miss].to(self.device))).float()
            self.backbone.train(was_training)
            if feats is None:
                feats = computed
            else:
                feats[miss.to(self.device)] = computed
            if self.cache is not None:
                self.cache.put(ids[miss], computed, self.version)
        self.counts.samples += n
        self.counts.fast_forwards += int(miss.sum())
        return feats

    def backward(self, ids: torch.Tensor, feature_grad: torch.Tensor, lr: float) -> None:
        """Hand dL/dX ``feature_grad`` (B, dim) float of ``ids`` (B,) int64 to the accumulator,
        then run the slow gear (in process), stepping the backbone at learning rate ``lr``, or
        pick up newer published weights (external slow gear, which runs its own schedule and
        ignores ``lr``)."""
        self.accumulator.add(ids, feature_grad.detach().float().cpu(), self.version)
        self._steps += 1
        if self.slow is not None:
            gear, source = self.slow
            gear.drain(source, lr)
            if self.fallback is not None:
                gear.drain(self.fallback, lr)
        elif self._steps % self.sync_every == 0:
            self.sync()

    def sync(self) -> None:
        """Load the newest published weights if they are newer than ours."""
        model = getattr(self.backbone, "module", self.backbone)
        loaded = self.weights.load_into(model, self._version)
        if loaded is not None:
            self._version = loaded

    def summary(self) -> dict[str, float]:
        """Per-sample work so far, for the train log."""
        c = self.counts
        per = max(c.samples, 1)
        return {"fast_fwd_per_sample": round(c.fast_forwards / per, 4),
                "slow_fwd_per_sample": round(c.slow_forwards / per, 4),
                "backbone_version": self.version}


def run_slow_worker(slow: SlowGear, source: GradientSource, weights: WeightChannel,
                    group: SlowGearGroup, *, start: int, lr_at_step: Callable[[int], float],
                    publish_every: int, should_stop: Callable[[], bool], max_steps: int = 0,
                    idle_exit_s: float = 0.0, block_ms: int = 500) -> int:
    """The loop of an ``xcls gear slow`` process: read ready means from ``source``, step the
    backbone at ``lr_at_step(steps)``, publish its weights every ``publish_every`` steps
    (rank 0) and once more at the end. Stops after ``max_steps`` backbone steps (0: never),
    after ``idle_exit_s`` seconds without a gradient (0: never), or once ``should_stop()``.
    Every rank of ``group`` runs it; returns the backbone steps taken.

    ``start``: the published version the backbone was loaded from (-1: none was published).
    When the trainers reset the channel (they started or rolled back, :meth:`Gear.begin`), the
    published version is no longer the one this worker last loaded or published: all ranks
    load the reset weights, drop their optimizer state and go on from there
    (:func:`follow_reset`); from then on means of an older version are from the discarded
    steps and are acked without being applied (:meth:`SlowGear.drop_stale`). Publications
    never overwrite a reset (``replaces``)."""
    steps, last_work = 0, time.monotonic()
    base = published = start
    while not (max_steps and steps >= max_steps):
        read = source.read(slow.max_items, block_ms)
        if len(read):
            last_work = time.monotonic()
        busy = not idle_exit_s or time.monotonic() - last_work <= idle_exit_s
        newest = weights.published_version() if group.rank == 0 else None
        reset = newest is not None and newest != base
        batch = slow.drop_stale(read)
        # One vote per round keeps the ranks in step: all apply, all stop, all follow a
        # reset, or none.
        total, stopping, anyone_busy, resetting = group.agree(len(batch), should_stop(), busy,
                                                              reset)
        if resetting:
            loaded = follow_reset(slow, weights, group)
            if loaded < 0:  # not loaded: keep what was read for later (it is re-delivered)
                read = batch = empty_batch(read.grads.shape[1])
            else:
                base = published = loaded
            batch = slow.drop_stale(batch)
            total = group.agree(len(batch), False, True)[0]
        if total:
            before = slow.version
            slow.apply(batch, lr_at_step(steps))  # alone, only rejected ids take no step
            if slow.version != before:
                steps += 1
                if group.rank == 0 and steps % publish_every == 0 and \
                        weights.publish(slow.backbone, slow.version, replaces=base):
                    base = published = slow.version
        if len(read):
            # Rejected and stale means are acked too: re-delivered, they would be dropped again.
            source.ack(read)
        if stopping or not anyone_busy:
            break
    if group.rank == 0 and slow.version != published:
        weights.publish(slow.backbone, slow.version, replaces=base)
    return steps


def follow_reset(slow: SlowGear, weights: WeightChannel, group: SlowGearGroup) -> int:
    """Every rank of ``group``: take the weights the trainers reset the channel to (rank 0
    loads them, the others get rank 0's), start the optimizer over, continue the version
    count from there. Returns the version, or -1 when rank 0 could not load them (the caller
    tries again next round)."""
    loaded = weights.load_into(slow.backbone, -1) if group.rank == 0 else None
    version = group.from_rank0(-1 if loaded is None else loaded)
    if version < 0:
        return -1
    group.broadcast_state(slow.backbone)
    # The momentum belongs to the discarded steps.
    slow.optimizer.state.clear()
    slow.version = slow.floor = version
    slow.counts.resets += 1
    log.info("slow_gear_reset version=%d rank=%d", version, group.rank)
    return version

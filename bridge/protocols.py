"""The contracts gear mode trains through.

:mod:`workers.gear` knows these protocols and nothing else of the bridge's backends:

* :class:`FeatureCache`: sample id -> cached feature (memory, LMDB, Redis; the shared encoding,
  freshness checks and counters live in :class:`bridge.cache.FeatureCacheBase`);
* :class:`GradientSink`: where the fast gear hands dL/dX (the memory or Redis accumulator);
* :class:`GradientSource`: where the slow gear reads ready means (the memory accumulator or a
  Redis consumer);
* :class:`WeightChannel`: what carries backbone weights, versioned, from an external slow gear
  to the fast gears (:class:`bridge.weight_store.WeightStore`).

Caches and sinks save and restore their own part of a training checkpoint
(:class:`CheckpointState`): an in-process backend returns its contents and restores them exactly;
a shared one (LMDB, Redis) keeps its data where it lives and on restore rolls it back to the
checkpoint instead.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol

import torch
from torch import nn

from bridge.accumulator import GradientBatch


class GearBackend(StrEnum):
    """Where gear mode keeps its feature cache and gradient sums."""

    MEMORY = "memory"  # in this process: one trainer, saved whole in its checkpoints
    LMDB = "lmdb"  # a file under the run's directory: one host, outlives the process
    REDIS = "redis"  # shared by every trainer and slow-gear process of the job


class CheckpointState(Protocol):
    """A bridge object's part of a training checkpoint."""

    def checkpoint_state(self) -> dict | None:
        """What a checkpoint must keep to restore this object exactly; None when its data
        lives outside the process and outlasts the checkpoint."""
        ...

    def restore_checkpoint_state(self, state: dict | None, version: int) -> None:
        """Start from a checkpoint: ``state`` is what :meth:`checkpoint_state` returned then,
        ``version`` the backbone version the checkpoint holds; a fresh run passes
        ``(None, -1)``. Afterwards nothing computed after the checkpoint (or, fresh, before
        this run) is served again."""
        ...


class FeatureCache(CheckpointState, Protocol):
    """Dense features of one job, keyed by sample id, with freshness checked on every read."""

    def get(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (n,) int64 -> (features (n, dim) float32 with zero rows for misses, hit mask
        (n,) bool)."""
        ...

    def put(self, ids: torch.Tensor, features: torch.Tensor, version: int) -> None:
        """Store ``features`` (n, dim) float for ``ids`` (n,) int64, computed by backbone
        ``version``."""
        ...


class GradientSink(CheckpointState, Protocol):
    """The fast gear's side of a gradient accumulator."""

    def add(self, ids: torch.Tensor, grads: torch.Tensor, version: int) -> int:
        """Add dL/dX ``grads`` (n, dim) float32 of samples ``ids`` (n,) int64, computed on
        features of backbone ``version``. Returns how many means became ready."""
        ...


class GradientSource(Protocol):
    """The slow gear's side: ready mean gradients, acknowledged once applied."""

    def read(self, max_items: int = 256, block_ms: int = 0) -> GradientBatch:
        """Up to ``max_items`` ready means, waiting up to ``block_ms`` when none is ready."""
        ...

    def ack(self, batch: GradientBatch) -> int:
        """Mark ``batch`` applied; returns how many means that newly marked."""
        ...


class WeightChannel(Protocol):
    """Backbone weights published by the slow gear at a version, loaded by the fast gears."""

    def publish(self, model: nn.Module, version: int, replaces: int | None = None) -> bool:
        """Make ``model``'s weights the newest, as backbone ``version`` (with ``replaces``:
        only if the newest is still that version, -1 for none); False if they could not be
        published (the caller tries again later, or follows a reset)."""
        ...

    def reset(self, model: nn.Module, version: int) -> int:
        """Start a new timeline from ``model`` (the trainers' start or rollback) at a version
        >= ``version`` above every one published before; returns that version."""
        ...

    def published_version(self) -> int | None:
        """The newest published version; None when there is none or it cannot be read."""
        ...

    def load_into(self, model: nn.Module, newer_than: int) -> int | None:
        """Load the published weights into ``model`` if their version > ``newer_than``.
        Returns the loaded version, or None (nothing newer, unreachable or rejected)."""
        ...

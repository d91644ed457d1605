"""Per-sample gradient accumulation for gear mode, in one process.

The fast gear hands dL/dX of every sample it trained on to ``add``; once a sample has collected
``m`` gradients (from ``m`` visits, across backbone versions), their mean is queued for the slow
gear, which ``read``s it, runs the backbone on that sample's input with grad, backpropagates the
mean and then ``ack``s. Two lines in a trainer::

    acc.add(ids, grads, version)                      # fast gear, every step
    batch = acc.read(max_items=256, block_ms=100)     # slow gear ... backward ...; acc.ack(batch)

:mod:`bridge.redis_accumulator` is the same API across processes and hosts.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import NamedTuple

import numpy as np
import torch

from bridge.cache import ArrayLike, IdsLike, as_ids, as_rows
from bridge.metrics import AccumulatorMetrics


class EntryHandle(NamedTuple):
    """What ``ack`` needs about one delivered mean: its stream ``entry_id`` (Redis) or a local
    sequence number, and its apply-once ``key`` (sample id, version, seq)."""

    entry_id: bytes
    key: bytes


class GradientBatch(NamedTuple):
    """Ready mean gradients for the slow gear.

    ids: (k,) int64 sample ids; grads: (k, dim) float32 mean dL/dX; versions: (k,) int64 backbone
    version of each mean's newest contribution; handles: k :class:`EntryHandle` for ``ack``.
    """

    ids: torch.Tensor
    grads: torch.Tensor
    versions: torch.Tensor
    handles: list[EntryHandle]

    def __len__(self) -> int:
        return len(self.handles)


def empty_batch(dim: int) -> GradientBatch:
    """A batch of zero means (nothing ready, or the backend is down)."""
    return GradientBatch(torch.zeros(0, dtype=torch.int64), torch.zeros((0, dim)),
                         torch.zeros(0, dtype=torch.int64), [])


def apply_key(sample_id: int, version: int, seq: int) -> bytes:
    """Identity of one mean: the ``seq``-th mean of ``sample_id`` whose newest gradient came
    from backbone ``version``. ``seq`` keeps two genuine means of one sample within one version
    apart; a re-delivered or re-sent entry repeats all three."""
    return f"{sample_id}:{version}:{seq}".encode()


def combine_by_id(ids: IdsLike, grads: ArrayLike, dim: int,
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate one ``add`` and fold repeated ids together.

    ids: (n,) int; grads: (n, dim) float. Returns (unique ids (u,) int64, per-id sums (u, dim)
    float64, per-id counts (u,) int64). Raises ValueError on shape or non-finite values, which
    mean a diverged step that must not reach the backbone.
    """
    ids = as_ids(ids)
    rows = as_rows(grads, ids.shape[0], dim, "grads")
    if not np.isfinite(rows).all():
        raise ValueError("grads hold non-finite values; refusing to accumulate them")
    uniq, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    sums = np.zeros((uniq.shape[0], dim), dtype=np.float64)
    np.add.at(sums, inverse, rows.astype(np.float64))
    return uniq, sums, counts.astype(np.int64)


class MemoryGradientAccumulator:
    """Accumulator and slow-gear queue in one process (tests, the embedded run).

    Per sample it keeps the float32 sum and count of its gradients, the newest version and how
    many means it has emitted. Thread-safe: the fast gear may ``add`` from one thread while the
    slow gear blocks in ``read`` on another. ``ack`` only counts: a process that dies loses its
    queue with everything else, so there is nothing to re-deliver.

    ``max_samples`` bounds what it holds, open windows and queued means together (about
    ``dim * 4`` bytes each; None: no bound): gradients of a sample without an open window are
    dropped while it is full, and counted in ``metrics.dropped``; a window that closes becomes
    a queued mean, so the total never passes the bound. A bounded accumulator forgets a sample
    once its window closes, so its next mean counts ``seq`` from 0 again (harmless here:
    ``ack`` does not de-duplicate).
    """

    def __init__(self, dim: int, m: int, max_samples: int | None = None) -> None:
        if dim <= 0 or m <= 0:
            raise ValueError(f"dim and m must be positive, got dim={dim} m={m}")
        if max_samples is not None and max_samples <= 0:
            raise ValueError(f"max_samples must be positive or None, got {max_samples}")
        self.dim = dim
        self.m = m
        self.max_samples = max_samples
        self.metrics = AccumulatorMetrics()
        # sample id -> [sum (dim,) float32, count, newest version, means emitted]
        self._state: dict[int, list] = {}
        self._ready: deque[tuple[int, np.ndarray, int, int]] = deque()
        self._cond = threading.Condition()
        self._delivered = 0

    def pending(self) -> int:
        """Samples holding a partial sum."""
        with self._cond:
            return sum(1 for s in self._state.values() if s[1] > 0)

    def add(self, ids: IdsLike, grads: ArrayLike, version: int) -> int:
        """Add dL/dX ``grads`` (n, dim) of samples ``ids`` (n,) computed on features of backbone
        ``version``. Returns how many means became ready."""
        uniq, sums, counts = combine_by_id(ids, grads, self.dim)
        emitted = refused = 0
        with self._cond:
            for i, total, count in zip(uniq.tolist(), sums, counts.tolist(), strict=True):
                state = self._state.get(i)
                if state is None:
                    if self.max_samples is not None and \
                            len(self._state) + len(self._ready) >= self.max_samples:
                        refused += count
                        continue
                    state = self._state[i] = [np.zeros(self.dim, np.float32), 0, version, 0]
                state[0] = (state[0] + total).astype(np.float32)
                state[1] += count
                state[2] = max(state[2], version)
                if state[1] >= self.m:
                    self._ready.append((i, state[0] / np.float32(state[1]), state[2], state[3]))
                    state[0], state[1], state[3] = np.zeros(self.dim, np.float32), 0, state[3] + 1
                    emitted += 1
                    if self.max_samples is not None:
                        del self._state[i]
            if emitted:
                self._cond.notify_all()
        self.metrics.added += int(counts.sum()) - refused
        self.metrics.dropped += refused
        self.metrics.emitted += emitted
        return emitted

    def take_partial_sums(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Remove every sample's state and return its open window: (ids (s,) int64, sums
        (s, dim) float64, counts (s,) int64 >= 1, newest versions (s,) int64), only samples
        whose count is above 0. Queued means stay queued."""
        with self._cond:
            items = sorted((i, s) for i, s in self._state.items() if s[1] > 0)
            self._state = {}
        sums = np.stack([s[0] for _, s in items]) if items else np.zeros((0, self.dim))
        return (np.array([i for i, _ in items], dtype=np.int64), sums.astype(np.float64),
                np.array([s[1] for _, s in items], dtype=np.int64),
                np.array([s[2] for _, s in items], dtype=np.int64))

    def take_ready(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Remove every queued mean and return them in order: (ids (r,) int64, means (r, dim)
        float32, newest versions (r,) int64); for a backend that hands them to another
        reader."""
        with self._cond:
            ready, self._ready = list(self._ready), deque()
        means = np.stack([r[1] for r in ready]) if ready else np.zeros((0, self.dim), np.float32)
        return (np.array([r[0] for r in ready], dtype=np.int64), means.astype(np.float32),
                np.array([r[2] for r in ready], dtype=np.int64))

    def read(self, max_items: int = 256, block_ms: int = 0) -> GradientBatch:
        """Up to ``max_items`` ready means, waiting up to ``block_ms`` if none is ready."""
        with self._cond:
            if not self._ready and block_ms > 0:
                self._cond.wait_for(lambda: bool(self._ready), timeout=block_ms / 1000)
            taken = [self._ready.popleft() for _ in range(min(max_items, len(self._ready)))]
        if not taken:
            return empty_batch(self.dim)
        handles = []
        for i, _, version, seq in taken:
            self._delivered += 1
            handles.append(EntryHandle(str(self._delivered).encode(), apply_key(i, version, seq)))
        self.metrics.delivered += len(taken)
        self.metrics.bytes += len(taken) * self.dim * 4
        return GradientBatch(torch.tensor([t[0] for t in taken], dtype=torch.int64),
                             torch.from_numpy(np.stack([t[1] for t in taken])),
                             torch.tensor([t[2] for t in taken], dtype=torch.int64), handles)

    def ack(self, batch: GradientBatch) -> int:
        """Mark ``batch`` applied; returns its size."""
        self.metrics.applied += len(batch)
        return len(batch)

    def checkpoint_state(self) -> dict:
        """Partial sums and queued means, for a checkpoint that must resume exactly, as tensors
        (a checkpoint loads with ``torch.load(weights_only=True)``, which refuses numpy arrays):
        ``ids`` (s,) int64, ``sums`` (s, dim) float32, ``counts``/``versions``/``seqs`` (s,)
        int64, and ``ready``: the queued means in order as (ids, means, versions, seqs)."""
        with self._cond:
            items = sorted(self._state.items())
            ready = list(self._ready)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64)

        def rows(values: list[np.ndarray]) -> torch.Tensor:
            stacked = np.stack(values) if values else np.zeros((0, self.dim), np.float32)
            return torch.from_numpy(stacked)

        return {
            "ids": ints([i for i, _ in items]),
            "sums": rows([s[0] for _, s in items]),
            "counts": ints([s[1] for _, s in items]),
            "versions": ints([s[2] for _, s in items]),
            "seqs": ints([s[3] for _, s in items]),
            "ready": (ints([r[0] for r in ready]), rows([r[1] for r in ready]),
                      ints([r[2] for r in ready]), ints([r[3] for r in ready])),
        }

    def restore_checkpoint_state(self, state: dict | None, version: int) -> None:
        """Replace the partial sums and queue with :meth:`checkpoint_state`'s (same dim;
        ValueError otherwise), or empty them when ``state`` is None (a fresh run). The queued
        means carry their own versions, so ``version`` is not needed."""
        if state is None:
            with self._cond:
                self._state, self._ready = {}, deque()
            return
        sums = np.asarray(state["sums"], dtype=np.float32)
        ready_means = np.asarray(state["ready"][1], dtype=np.float32)
        if sums.shape[1:] != (self.dim,) or ready_means.shape[1:] != (self.dim,):
            raise ValueError(f"accumulator state has width {sums.shape[1:]}, expected "
                             f"({self.dim},)")
        rows = zip(state["ids"].tolist(), sums, state["counts"].tolist(),
                   state["versions"].tolist(), state["seqs"].tolist(), strict=True)
        ready = zip(state["ready"][0].tolist(), ready_means, state["ready"][2].tolist(),
                    state["ready"][3].tolist(), strict=True)
        with self._cond:
            self._state = {i: [total.copy(), count, newest, seq]
                           for i, total, count, newest, seq in rows}
            self._ready = deque((i, mean.copy(), newest, seq)
                                for i, mean, newest, seq in ready)

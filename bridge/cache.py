"""What every feature cache backend shares: sample id -> (feature vector, backbone version,
write time).

The fast gear calls ``get`` before running the backbone and ``put`` with what it computed for the
misses (the contract is :class:`bridge.protocols.FeatureCache`). Backends
(:mod:`bridge.memory_cache`, :mod:`bridge.lmdb_cache`, :mod:`bridge.redis_cache`) only move
bytes; this base class owns encoding, validation, freshness and the counters, so every backend
answers the same way.

Freshness is checked on every read, not left to backend expiry: an entry older than ``ttl_s``
seconds by its own write timestamp (or stamped more than ``ttl_s`` ahead of the reader's clock)
is a miss even if the backend still holds it. Entries are stored as float16 (``FEATURE_DTYPE``).

Corrupt entries (see :class:`bridge.errors.CorruptEntryError`) are counted in
``metrics.corrupt``, logged (rate-limited) and answered as misses, so the sample is recomputed
and its entry overwritten; they are never returned as features.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np
import torch

from bridge.codec import decode_feature_header, decode_features, encode_features
from bridge.errors import CorruptEntryError
from bridge.metrics import CacheMetrics
from bridge.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)

# Features are stored at half the bytes of float32: they feed a cosine head, which a float16
# rounding of its input does not move measurably, and a cache holds twice the samples.
FEATURE_DTYPE = "float16"

IdsLike = np.ndarray | torch.Tensor | Sequence[int]
ArrayLike = np.ndarray | torch.Tensor


def as_ids(ids: IdsLike) -> np.ndarray:
    """Sample ids as a 1-D int64 numpy array (no copy when already one)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"ids must be a 1-D integer array, got shape {arr.shape} "
                         f"dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def as_rows(values: ArrayLike, n: int, dim: int, what: str) -> np.ndarray:
    """``values`` as an (n, dim) float numpy array (torch tensors are detached to CPU)."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().float().numpy()
    arr = np.asarray(values)
    if arr.shape != (n, dim) or not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{what} must be float ({n}, {dim}), got {arr.dtype} {arr.shape}")
    return arr


class FeatureCacheBase(ABC):
    """Dense-feature cache of one job (a :class:`bridge.protocols.FeatureCache`).

    Args:
        dim: feature width.
        ttl_s: an entry older than this many seconds (or stamped this far in the future) is
            never returned; None = no time limit.
        clock: wall clock in seconds since the epoch (entries are compared across hosts, so
            this is ``time.time``, not a monotonic clock); injectable for tests.
    """

    def __init__(self, dim: int, ttl_s: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        self.dim = dim
        self.dtype = FEATURE_DTYPE
        self.ttl_s = ttl_s
        self.clock = clock
        self.metrics = CacheMetrics()
        self._warn = RateLimitedLog(log)

    def get(self, ids: IdsLike) -> tuple[torch.Tensor, torch.Tensor]:
        """Look up ``ids`` (n,) int64.

        Returns (features (n, dim) float32 with zero rows for misses, hit_mask (n,) bool).
        """
        ids = as_ids(ids)
        n = ids.shape[0]
        blobs = self._fetch(ids) if n else []
        if blobs is None:
            self.metrics.unavailable += n
            self.metrics.misses += n
            return torch.zeros((n, self.dim)), torch.zeros(n, dtype=torch.bool)
        self.metrics.bytes_read += sum(len(b) for b in blobs if b is not None)
        dec = decode_features(blobs, self.dim, self.dtype)
        hit = dec.found.copy()
        if dec.corrupt.any():
            self.metrics.corrupt += int(dec.corrupt.sum())
            self._warn.warn("cache_corrupt_entry", backend=type(self).__name__,
                            count=int(dec.corrupt.sum()), error=repr(dec.first_error))
        if self.ttl_s is not None:
            # stamped more than a ttl ahead of this clock (a damaged stamp, a writer's clock
            # far off) would never expire: it is not fresh either
            expired = hit & ~(np.abs(self.clock() - dec.timestamps) <= self.ttl_s)
            self.metrics.expired += int(expired.sum())
            hit &= ~expired
        features = dec.features
        features[~hit] = 0.0
        self.metrics.hits += int(hit.sum())
        self.metrics.misses += n - int(hit.sum())
        return torch.from_numpy(features), torch.from_numpy(hit)

    def put(self, ids: IdsLike, features: ArrayLike, version: int) -> None:
        """Store ``features`` (n, dim), any float dtype, for ``ids`` (n,) int64, computed by
        backbone ``version``. Overwrites: a re-put entry gets a fresh timestamp (and TTL).
        A later row wins over an earlier one with the same id."""
        ids = as_ids(ids)
        rows = as_rows(features, ids.shape[0], self.dim, "features")
        if ids.shape[0] == 0:
            return
        blobs = encode_features(rows, version, self.clock(), self.dtype)
        stored = self._store(ids, blobs)
        self.metrics.puts += stored
        self.metrics.dropped_puts += len(blobs) - stored
        self.metrics.bytes_written += stored * len(blobs[0])

    def drop_newer_than(self, version: int) -> int:
        """Delete every entry written by a backbone newer than ``version`` (-1: every entry),
        and every entry that does not decode. Returns how many were deleted.

        A run that resumes from a checkpoint of backbone ``version`` calls this: newer entries
        were computed by weights the checkpoint discarded, and the resumed run will reach those
        version numbers again with other weights, so they would pass every freshness check.
        A fresh run calls it with -1 (a job reusing its prefix must not see old features).
        """
        def doomed(blob: bytes) -> bool:
            try:
                return decode_feature_header(blob, self.dim, self.dtype)[0] > version
            except CorruptEntryError:
                return True

        return self._delete_where(doomed)

    def checkpoint_state(self) -> dict | None:
        """None: the entries live outside the process (LMDB, Redis) and outlast a checkpoint;
        :meth:`restore_checkpoint_state` rolls them back instead."""
        return None

    def restore_checkpoint_state(self, state: dict | None, version: int) -> None:
        """Resume at backbone ``version`` (-1: a fresh run): drop the entries of newer backbones
        and those that do not decode (see :meth:`drop_newer_than`). ``state`` is None here."""
        dropped = self.drop_newer_than(version)
        log.info("gear_cache_rolled_back backend=%s version=%d dropped=%d",
                 type(self).__name__, version, dropped)

    @abstractmethod
    def _fetch(self, ids: np.ndarray) -> list[bytes | None] | None:
        """Raw entries for ``ids`` (n,) int64 in order, None per absent id; None altogether if
        the backend cannot be reached."""

    @abstractmethod
    def _store(self, ids: np.ndarray, blobs: list[bytes]) -> int:
        """Write encoded entries (all the same length); returns how many were stored, the rest
        were dropped (backend unreachable or full)."""

    @abstractmethod
    def _delete_where(self, doomed: Callable[[bytes], bool]) -> int:
        """Delete the entries whose raw bytes satisfy ``doomed``; returns how many (0 if the
        backend cannot be reached)."""

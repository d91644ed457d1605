"""In-process feature cache: a byte-bounded LRU dict (tests, the embedded single-process run)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from bridge.cache import FeatureCacheBase
from bridge.codec import entry_nbytes


class MemoryFeatureCache(FeatureCacheBase):
    """LRU over encoded entries, holding at most ``max_bytes`` of entry bytes.

    The bound counts encoded entries (header + payload); Python's per-object overhead (about
    100 bytes an entry) comes on top. A lookup that finds an entry, fresh or not, makes it most
    recently used; expired entries age out through the LRU order. Thread-safe (a loader thread
    and the training thread may share it).
    """

    def __init__(self, dim: int, max_bytes: int, ttl_s: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(dim, ttl_s, clock)
        if max_bytes < entry_nbytes(dim, self.dtype):
            raise ValueError(f"max_bytes={max_bytes} cannot hold one entry of "
                             f"{entry_nbytes(dim, self.dtype)} bytes")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Entry bytes held now (<= max_bytes)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def _fetch(self, ids: np.ndarray) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for i in ids.tolist():
                blob = self._entries.get(i)
                if blob is not None:
                    self._entries.move_to_end(i)
                out.append(blob)
        return out

    def _store(self, ids: np.ndarray, blobs: list[bytes]) -> int:
        with self._lock:
            for i, blob in zip(ids.tolist(), blobs, strict=True):
                old = self._entries.pop(i, None)
                if old is not None:
                    self._bytes -= len(old)
                self._entries[i] = blob
                self._bytes += len(blob)
            while self._bytes > self.max_bytes:
                _, old = self._entries.popitem(last=False)
                self._bytes -= len(old)
                self.metrics.evictions += 1
        return len(blobs)

    def _delete_where(self, doomed: Callable[[bytes], bool]) -> int:
        with self._lock:
            gone = [i for i, blob in self._entries.items() if doomed(blob)]
            for i in gone:
                self._bytes -= len(self._entries.pop(i))
        return len(gone)

    def checkpoint_state(self) -> dict:
        """Every entry in LRU order (least recent first): ``ids`` (n,) int64 and ``entries``
        (n, entry bytes) uint8 tensors, the raw encoded entries, so a restore is exact (tensors,
        not numpy arrays: a checkpoint loads with ``torch.load(weights_only=True)``)."""
        with self._lock:
            ids = np.fromiter(self._entries.keys(), dtype=np.int64, count=len(self._entries))
            raw = b"".join(self._entries.values())
        width = entry_nbytes(self.dim, self.dtype)
        entries = np.frombuffer(raw, dtype=np.uint8).reshape(len(ids), width).copy()
        return {"ids": torch.from_numpy(ids), "entries": torch.from_numpy(entries)}

    def restore_checkpoint_state(self, state: dict | None, version: int) -> None:
        """Replace the contents with what :meth:`checkpoint_state` returned (same dim and
        dtype; ValueError otherwise). Entries keep their own write times, so expiry goes on as
        before. Without a ``state`` (a fresh run), entries newer than ``version`` are dropped."""
        if state is None:
            super().restore_checkpoint_state(state, version)
            return
        ids, raw = np.asarray(state["ids"], dtype=np.int64), np.asarray(state["entries"])
        width = entry_nbytes(self.dim, self.dtype)
        if raw.ndim != 2 or raw.shape != (len(ids), width) or raw.dtype != np.uint8:
            raise ValueError(f"cache entries must be uint8 ({len(ids)}, {width}) for dim "
                             f"{self.dim} {self.dtype}, got {raw.dtype} {tuple(raw.shape)}")
        with self._lock:
            self._entries.clear()
            self._bytes = 0
        self._store(ids, [row.tobytes() for row in raw])

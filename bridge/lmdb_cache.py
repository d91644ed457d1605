"""One-host persistent feature cache in LMDB, bounded in size and swept of expired entries.

Layout (three named databases in one environment):

* ``feat``:   id (8 bytes big-endian) -> encoded feature entry
* ``bytime``: write time in us (8 bytes BE) + id -> b"", oldest first; what the sweep walks
* ``meta``:   b"bytes" -> accounted footprint of ``feat`` (u64)

Every put is one write transaction that stores the entries, updates the index and the byte count,
and sweeps from the oldest end: expired entries, then the oldest ones until the footprint is under
``max_bytes``. So the bound and the index can never disagree, and a writer killed with SIGKILL
mid-put leaves the last committed state (LMDB's copy-on-write transactions), readable as is.

Several processes on the host may open the same path; LMDB serialises writers. An environment
must not cross ``fork``, so each process opens its own on first use.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np

from bridge.cache import FeatureCacheBase
from bridge.codec import FEATURE_HEADER, FEATURE_MAGIC, entry_nbytes
from bridge.errors import BridgeError
from bridge.lmdb_file import DamagedDataFile, check_data_file

log = logging.getLogger(__name__)

_ID = struct.Struct(">q")
_STAMP = struct.Struct(">Qq")
_U64 = struct.Struct("<Q")
_PAGE = 4096
# Values bigger than about half a page leave the B-tree for their own overflow pages: a 2 KiB + 1
# entry costs two pages. Accounting by this footprint keeps max_bytes honest on disk.
_INLINE_MAX = _PAGE // 2 - 64
# Slack on top of the byte bound for B-tree branches, half-full leaves after splits, the time
# index and pages freed by copy-on-write that a still-open reader pins.
_MAP_FACTOR = 3
_MAP_SLACK = 8 << 20


def footprint(nbytes: int) -> int:
    """Bytes one entry of ``nbytes`` occupies in the data file (key and node header included)."""
    if nbytes <= _INLINE_MAX:
        return nbytes + _ID.size + 8
    return -(-(nbytes + 16) // _PAGE) * _PAGE


def map_size_for(max_bytes: int) -> int:
    """The LMDB map size (the hard ceiling of the data file) for a byte bound, MiB-aligned."""
    size = _MAP_FACTOR * max_bytes + _MAP_SLACK
    return -(-size // (1 << 20)) * (1 << 20)


def _stamp_us(blob: bytes) -> int | None:
    """Write time of a feature entry in us, None if it is not one of ours (then it has no index
    key and was never counted)."""
    if len(blob) < FEATURE_HEADER.size:
        return None
    magic, _, _, _, ts = FEATURE_HEADER.unpack_from(blob)
    if magic != FEATURE_MAGIC or not 0 <= ts < 2**63 / 1e6:  # also rejects a NaN timestamp
        return None
    return int(ts * 1e6)


class LmdbFeatureCache(FeatureCacheBase):
    """Feature cache in the LMDB environment at ``path`` (a directory, created if missing).

    ``max_bytes`` bounds the accounted footprint of the entries; the data file never grows past
    :func:`map_size_for` (``max_bytes``), about 3x the bound plus 8 MiB. Other arguments as in
    :class:`bridge.cache.FeatureCacheBase`.
    """

    def __init__(self, path: str | os.PathLike, dim: int, max_bytes: int,
                 ttl_s: float | None = None, clock: Callable[[], float] = time.time) -> None:
        super().__init__(dim, ttl_s, clock)
        if max_bytes < footprint(entry_nbytes(dim, self.dtype)):
            raise ValueError(f"max_bytes={max_bytes} cannot hold one entry of "
                             f"{footprint(entry_nbytes(dim, self.dtype))} bytes")
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.map_size = map_size_for(max_bytes)
        self._pid: int | None = None
        self._env: lmdb.Environment | None = None

    def _open(self) -> lmdb.Environment:
        if self._env is None or self._pid != os.getpid():
            self.path.mkdir(parents=True, exist_ok=True)
            data = self.path / "data.mdb"
            if data.exists():  # a page mapped past the end of a file cut short is a SIGBUS
                try:
                    check_data_file(data)
                except DamagedDataFile as e:
                    raise BridgeError(f"gear feature cache: {e}; delete {self.path} and the "
                                      "cache starts empty") from None
            env = lmdb.open(str(self.path), map_size=self.map_size, max_dbs=3, subdir=True,
                            # Integrity survives SIGKILL and power loss; only the very last
                            # transaction may be lost to a power cut, which a cache can afford.
                            metasync=False, readahead=False)
            # Reader slots of killed processes would pin old pages and let the file grow.
            stale = env.reader_check()
            if stale:
                log.info("lmdb_stale_readers_cleared path=%s count=%d", self.path, stale)
            self._feat = env.open_db(b"feat")
            self._bytime = env.open_db(b"bytime")
            self._meta = env.open_db(b"meta")
            self._env, self._pid = env, os.getpid()
        return self._env

    def close(self) -> None:
        if self._env is not None and self._pid == os.getpid():
            self._env.close()
        self._env = None

    def __len__(self) -> int:
        with self._open().begin(db=self._feat) as txn:
            return txn.stat(self._feat)["entries"]

    @property
    def nbytes(self) -> int:
        """Accounted footprint of the entries now (<= max_bytes after every put)."""
        with self._open().begin() as txn:
            raw = txn.get(b"bytes", db=self._meta)
        return _U64.unpack(raw)[0] if raw else 0

    def _fetch(self, ids: np.ndarray) -> list[bytes | None]:
        with self._open().begin(db=self._feat) as txn:
            return [txn.get(_ID.pack(i)) for i in ids.tolist()]

    def _store(self, ids: np.ndarray, blobs: list[bytes]) -> int:
        env = self._open()
        try:
            self._write(env, ids, blobs, self.max_bytes)
        except lmdb.MapFullError:
            # Fragmentation beat the slack: make room by evicting down to half and retry once.
            log.warning("lmdb_map_full path=%s map_size=%d action=evict_to_half",
                        self.path, self.map_size)
            try:
                self._write(env, ids[:0], [], self.max_bytes // 2)
                self._write(env, ids, blobs, self.max_bytes)
            except lmdb.MapFullError:
                log.warning("lmdb_put_dropped path=%s reason=map_full n=%d", self.path, len(blobs))
                return 0
        return len(blobs)

    def _write(self, env: lmdb.Environment, ids: np.ndarray, blobs: list[bytes],
               bound: int) -> None:
        with env.begin(write=True) as txn:
            raw = txn.get(b"bytes", db=self._meta)
            total = _U64.unpack(raw)[0] if raw else 0
            for i, blob in zip(ids.tolist(), blobs, strict=True):
                key = _ID.pack(i)
                old = txn.get(key, db=self._feat)
                if old is not None:
                    old_us = _stamp_us(old)
                    if old_us is not None and txn.delete(_STAMP.pack(old_us, i), db=self._bytime):
                        total -= footprint(len(old))
                txn.put(key, blob, db=self._feat)
                txn.put(_STAMP.pack(_stamp_us(blob), i), b"", db=self._bytime)
                total += footprint(len(blob))
            total = self._sweep(txn, total, bound)
            txn.put(b"bytes", _U64.pack(max(total, 0)), db=self._meta)

    def _delete_where(self, doomed: Callable[[bytes], bool]) -> int:
        with self._open().begin(write=True) as txn:
            raw = txn.get(b"bytes", db=self._meta)
            total = _U64.unpack(raw)[0] if raw else 0
            gone = [(key, blob) for key, blob in txn.cursor(db=self._feat) if doomed(blob)]
            for key, blob in gone:
                txn.delete(key, db=self._feat)
                stamp_us = _stamp_us(blob)
                # Entries without an index key were never counted (see _stamp_us).
                if stamp_us is not None and txn.delete(
                        _STAMP.pack(stamp_us, _ID.unpack(key)[0]), db=self._bytime):
                    total -= footprint(len(blob))
            txn.put(b"bytes", _U64.pack(max(total, 0)), db=self._meta)
        return len(gone)

    def _sweep(self, txn: lmdb.Transaction, total: int, bound: int) -> int:
        """Delete from the oldest end while entries are expired or the footprint is over
        ``bound``; returns the new footprint."""
        cutoff_us = int((self.clock() - self.ttl_s) * 1e6) if self.ttl_s is not None else -1
        cursor = txn.cursor(db=self._bytime)
        if not cursor.first():
            return total
        while True:
            stamp_us, i = _STAMP.unpack(cursor.key())
            if total <= bound and stamp_us >= cutoff_us:
                return total
            key = _ID.pack(i)
            blob = txn.get(key, db=self._feat)
            # Only delete the entry this index key describes (a rewrite has a newer key).
            if blob is not None and _stamp_us(blob) == stamp_us:
                txn.delete(key, db=self._feat)
                total -= footprint(len(blob))
                self.metrics.evictions += 1
            if not cursor.delete():
                return total
            if cursor.key() == b"":
                return total

"""Checksums of a closed mmap table's files: written into its ``table.json`` when a store
closes it, checked when a store reopens it, so that files changed in between (a flipped bit on
the disk, a tool writing into ``rows.bin``, a NaN) are refused rather than served; a NaN row
would also refuse every later push to it.

A file's checksum is the SHA-256 of the SHA-256s of its 32 MiB blocks, in order, so that the
blocks of all the files are hashed on every core at once (``hashlib`` lets go of the GIL): the
cost is one read of the table's files at close and one at reopen, which
benchmarks/RESULTS.md ("Table files") states for a large table. The reads leave the page cache
as they found it: a table may be larger than memory, and pushing its rows in use out of the
cache for the files' tails would make the first steps after a restart read them from the disk
again. So the pages that were not in the cache before a file was hashed are dropped from it
after their block is, and once more when the file is done (mincore, then posix_fadvise
DONTNEED). Pure: no gRPC.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ams.alloc import libc_function
from ams.errors import StorageError, shorten

# table.json's key for the checksums; it names how they are made, so that a store that makes
# them otherwise one day finds none here rather than wrong ones
SUMS_KEY = "sha256_of_32mib_blocks"
BLOCK_BYTES = 32 << 20
_HEX = re.compile(r"^[0-9a-f]{64}$")


def file_sums(home: Path, names: Sequence[str]) -> dict[str, str]:
    """The checksum (hex) of each file ``names`` in ``home``; OSError where one cannot be
    read."""
    with ExitStack() as stack:
        files, blocks = {}, []
        for name in names:
            f = stack.enter_context(open(home / name, "rb"))
            size = os.fstat(f.fileno()).st_size
            if size:  # an empty file has no block (and cannot be mapped)
                files[name] = _Mapped.of(f, size, stack)
                blocks += [(name, start) for start in range(0, size, BLOCK_BYTES)]
        workers = max(1, min(os.cpu_count() or 1, len(blocks)))
        with ThreadPoolExecutor(workers, thread_name_prefix="table-sums") as pool:
            digests = list(pool.map(lambda block: files[block[0]].digest(block[1]), blocks))
    for mapped in files.values():
        # again with the maps gone: reading a block reads around its edges, into blocks
        # hashed and dropped before
        with open(mapped.path, "rb") as f:
            _drop(f.fileno(), 0, mapped.cold)
    joined: dict[str, list[bytes]] = {name: [] for name in names}
    for (name, _), digest in zip(blocks, digests, strict=True):
        joined[name].append(digest)
    return {name: hashlib.sha256(b"".join(parts)).hexdigest() for name, parts in joined.items()}


def check_sums(home: Path, recorded: object, names: Sequence[str], fix: str) -> None:
    """``StorageError`` naming the file when a file ``names`` in ``home`` does not have the
    checksum ``recorded`` (``table.json``'s ``SUMS_KEY``: file name -> hex) says, or
    ``recorded`` is not such a record of exactly those files; ``fix`` says what to do.
    OSError where a file cannot be read."""
    if not isinstance(recorded, dict) or sorted(recorded) != sorted(names) \
            or not all(isinstance(v, str) and _HEX.match(v) for v in recorded.values()):
        raise StorageError(f"{home / 'table.json'}: malformed ({SUMS_KEY} "
                           f"{shorten(recorded)}: need one of {', '.join(names)} each); {fix}")
    for name, digest in file_sums(home, names).items():
        if digest != recorded[name]:
            raise StorageError(f"{home / name}: its checksum is not the one its table recorded "
                               f"when it was closed (changed or damaged since); {fix}")


@dataclass
class _Mapped:
    """A file mapped for hashing, and which of its pages were not in the page cache (bool
    (pages,)) before it was mapped."""

    path: Path
    fd: int
    map: mmap.mmap
    cold: np.ndarray

    @classmethod
    def of(cls, f: object, size: int, stack: ExitStack) -> _Mapped:
        m = stack.enter_context(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ))
        return cls(Path(f.name), f.fileno(), m, ~_resident(m, size))

    def digest(self, start: int) -> bytes:
        """SHA-256 of the block at byte ``start``; its cold pages leave the cache after, so
        that the cache holds a few blocks of the file at a time."""
        stop = min(start + BLOCK_BYTES, len(self.map))
        with memoryview(self.map) as view:
            digest = hashlib.sha256(view[start:stop]).digest()
        cold = self.cold[start // mmap.PAGESIZE:-(-stop // mmap.PAGESIZE)]
        if cold.any():
            # unmapped here first: the page cache keeps a page while a map holds it
            self.map.madvise(mmap.MADV_DONTNEED, start, stop - start)
            _drop(self.fd, start, cold)
        return digest


def _drop(fd: int, start: int, cold: np.ndarray) -> None:
    """Drop from the page cache the pages ``cold`` (bool (pages,)) of file ``fd`` from byte
    ``start`` on, one call per run of them."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], cold.view(np.int8), [0]])))
    for first, end in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
        os.posix_fadvise(fd, start + first * mmap.PAGESIZE, (end - first) * mmap.PAGESIZE,
                         os.POSIX_FADV_DONTNEED)


def _resident(m: mmap.mmap, size: int) -> np.ndarray:
    """bool (pages,): which pages of the map are in the page cache (mincore); all of them
    where mincore is missing or fails, so that nothing is dropped."""
    pages = -(-size // mmap.PAGESIZE)
    mincore = libc_function("mincore")
    status = np.zeros(pages, dtype=np.uint8)
    address = np.frombuffer(m, dtype=np.uint8).ctypes.data  # the view goes at once
    if mincore is None or mincore(ctypes.c_void_p(address), ctypes.c_size_t(size),
                                  ctypes.c_void_p(status.ctypes.data)) != 0:
        return np.ones(pages, dtype=bool)
    return (status & 1).astype(bool)

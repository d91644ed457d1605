"""A client's shared buffer: rows between a client and the shards on its host without the
socket.

Over loopback a frame's rows are copied by the kernel twice (into the socket, out of it) on
top of the gather and the scatter at either end, and on a host whose cores the client and its
shards share, those copies are CPU the update needs. With a shared buffer the client writes a
push's gradients where the shard applies them from, and each shard writes a pull's rows
straight to their places in the pull's result, which the client hands out without copying it;
the socket carries the frame's header, meta and ids only (``frames.SHARED_FLAG``,
proto/ams/api/frames.md).

The client makes the buffer: an anonymous memory file (memfd) sealed against shrinking and
growing, so that nothing the client does later can make the shard's accesses fault. It offers
the file in the HELLO of each of its data connections by process id, descriptor number, size
and a random nonce written at the file's start; the shard opens ``/proc/<pid>/fd/<fd>``, which
reaches the file only from the same host and pid namespace, and maps it only when it is such
a sealed memfd of that size holding that nonce. Anything else leaves the connection on plain
frames.

The client cuts the buffer into regions (``SharedArena``): a pull's result, a push piece's
gradients, a pull piece's rows where the result does not fit. A region goes back for reuse
only when nothing can still write it: a result once its last tensor is gone, a piece's once
its answer came; a region a lost connection may still be writing is never reused.
"""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import logging
import mmap
import os
import stat
import threading
import weakref

import torch

from ams.errors import InvalidArgument, shorten

log = logging.getLogger(__name__)

# The file's first page holds the nonce; the rows' region starts page-aligned after it.
RESERVED_BYTES = 4096
NONCE_BYTES = 16
# Regions of a client's buffer start at multiples of this (a cache line).
ALIGN = 64
# The most a shard maps for one connection.
MAX_SHARED_BYTES = 1 << 30
# What a client offers: room for the results its caller holds (a trainer keeps a step's
# pulls and the next step's prefetched ones) and the pushes on the wire. Memory is taken as
# regions are first written, up to the most in use at once.
ARENA_BYTES = 256 << 20
# Rows of fewer bytes go in the frame: over loopback the sender's and the receiver's copies of
# a small frame overlap, and the buffer's bookkeeping costs more than the copies it saves.
MIN_SHARED_BYTES = 1 << 20
MEMFD_NAME = "xcls-data"
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)


class SharedBuffer:
    """``capacity`` bytes that both ends of one data connection map. Not thread-safe: a
    connection uses it for one request at a time per region."""

    def __init__(self, fd: int, capacity: int, *, nonce: bytes | None = None) -> None:
        self.capacity = capacity
        self._map = mmap.mmap(fd, RESERVED_BYTES + capacity)
        self._bytes: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)
        if nonce is not None:
            self._map[:NONCE_BYTES] = nonce

    @staticmethod
    def create(capacity: int) -> tuple[SharedBuffer, dict] | None:
        """A new buffer and the offer that goes into the HELLO, or None where this system has
        no sealable memory files (the connection then moves rows in frames). The offer's
        descriptor stays open until ``withdraw(offer)``."""
        if not hasattr(os, "memfd_create") or not _SEALS or not os.path.isdir("/proc/self/fd"):
            return None
        try:
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as e:
            log.debug("shared_buffer_unavailable error=%s", e)
            return None
        try:
            os.ftruncate(fd, RESERVED_BYTES + capacity)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
            nonce = os.urandom(NONCE_BYTES)
            buffer = SharedBuffer(fd, capacity, nonce=nonce)
        except OSError as e:
            os.close(fd)
            log.debug("shared_buffer_unavailable error=%s", e)
            return None
        return buffer, {"pid": os.getpid(), "fd": fd, "bytes": capacity, "nonce": nonce.hex()}

    @staticmethod
    def withdraw(offer: dict) -> None:
        """Close the offer's descriptor once the shard answered: the mappings keep the file."""
        os.close(offer["fd"])

    @staticmethod
    def attach(offer: object) -> SharedBuffer | None:
        """The shard's side: map the buffer a HELLO offers. ``InvalidArgument`` for an offer
        that is not one; None when it names no sealed memory file of that size holding that
        nonce (another host or pid namespace, another file, a stale descriptor)."""
        if not isinstance(offer, dict) or set(offer) != {"pid", "fd", "bytes", "nonce"}:
            raise InvalidArgument(f"frame meta: 'shared' must be an object of pid, fd, bytes "
                                  f"and nonce, got {shorten(offer)}")
        pid, fd, size, nonce = (offer[k] for k in ("pid", "fd", "bytes", "nonce"))
        for name, value, low, high in (("pid", pid, 1, 1 << 32), ("fd", fd, 0, 1 << 31),
                                       ("bytes", size, ALIGN, MAX_SHARED_BYTES)):
            if isinstance(value, bool) or not isinstance(value, int) \
                    or not low <= value <= high:
                raise InvalidArgument(f"frame meta: shared {name}={shorten(value)} must be an "
                                      f"integer in [{low}, {high}]")
        if size % ALIGN:
            raise InvalidArgument(f"frame meta: shared bytes={size} must be a multiple of "
                                  f"{ALIGN}")
        try:
            expected = bytes.fromhex(nonce) if isinstance(nonce, str) else b""
        except ValueError:
            expected = b""
        if len(expected) != NONCE_BYTES:
            raise InvalidArgument(f"frame meta: shared nonce must be {2 * NONCE_BYTES} hex "
                                  f"digits, got {shorten(nonce)}")
        path = f"/proc/{pid}/fd/{fd}"
        try:
            # The name first: opening a descriptor's target may have effects (a device, a
            # pipe), so only what is named as a memory file of ours is opened at all.
            if not _is_ours(path):
                return None
            # The client may swap its descriptor for another file between any two of these
            # steps: the file is opened without write access, what was opened is checked,
            # and only that file, by our own descriptor, is opened for writing.
            looked = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError as e:
            log.debug("shared_buffer_refused path=%s error=%s", path, e)
            return None
        try:
            mine, info = f"/proc/self/fd/{looked}", os.fstat(looked)
            if not _is_ours(mine) or not stat.S_ISREG(info.st_mode) \
                    or info.st_size != RESERVED_BYTES + size \
                    or fcntl.fcntl(looked, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
                return None
            handle = os.open(mine, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            log.debug("shared_buffer_refused path=%s error=%s", path, e)
            return None
        finally:
            os.close(looked)
        try:
            buffer = SharedBuffer(handle, size)
        except OSError as e:
            log.debug("shared_buffer_refused path=%s error=%s", path, e)
            return None
        finally:
            os.close(handle)
        if not hmac.compare_digest(buffer._map[:NONCE_BYTES], expected):
            buffer.close()
            return None
        return buffer

    def fits(self, offset: int, nbytes: int) -> bool:
        """Whether ``nbytes`` from ``offset`` (checked by ``check_offset``) lie in the region."""
        return offset + nbytes <= self.capacity

    @staticmethod
    def check_offset(offset: int, dtype: torch.dtype) -> None:
        """``InvalidArgument`` unless ``offset`` is a non-negative multiple of ``dtype``'s
        size (where values of it can be viewed)."""
        if offset < 0 or offset % dtype.itemsize:
            raise InvalidArgument(f"frame meta: 'offset' must be a non-negative multiple of "
                                  f"{dtype.itemsize} for {dtype} rows, got {offset}")

    def rows(self, offset: int, dtype: torch.dtype, num_rows: int, dim: int) -> torch.Tensor:
        """The (num_rows, dim) tensor of ``dtype`` at byte ``offset`` of the region, sharing
        its memory. ``InvalidArgument`` for an offset that is not aligned or rows that do not
        fit."""
        self.check_offset(offset, dtype)
        nbytes = num_rows * dim * dtype.itemsize
        if not self.fits(offset, nbytes):
            raise InvalidArgument(f"frame: {num_rows} rows of {dim} x {dtype} at offset "
                                  f"{offset} pass the end of the {self.capacity}-byte shared "
                                  "buffer")
        assert self._bytes is not None, "the shared buffer is closed"
        start = RESERVED_BYTES + offset
        return self._bytes[start:start + nbytes].view(dtype).view(num_rows, dim)

    def close(self) -> None:
        """Unmap, once no tensor from ``rows`` is left; else the last of them unmaps it."""
        self._bytes = None
        with contextlib.suppress(BufferError):
            self._map.close()


def _is_ours(path: str) -> bool:
    """Whether descriptor link ``path`` names a memory file made by ``SharedBuffer.create``."""
    return os.readlink(path).startswith(f"/memfd:{MEMFD_NAME} ")


class SharedArena:
    """The client's side of its shared buffer, cut into regions: the buffer every data
    connection of one client offers its shard. Thread-safe.

    A region is taken by ``allocate`` and given back by ``release``, or by the death of the
    last tensor over it (``result``). ``abandon`` keeps a region from ever being given back:
    for one that a shard may still write after its connection was lost.
    """

    def __init__(self, buffer: SharedBuffer, offer: dict) -> None:
        self.buffer, self.offer = buffer, offer
        self.capacity = buffer.capacity
        assert buffer._bytes is not None
        self._base = buffer._bytes.data_ptr() + RESERVED_BYTES
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # (offset, bytes), sorted
        self._taken: dict[int, int] = {}  # offset -> bytes of each region in use
        self._abandoned: set[int] = set()
        # Regions whose last tensor died. A tensor may die in any thread, inside a call
        # that holds the lock (a garbage collection), so the finalizer only appends here
        # (atomic) and the next call under the lock gives them back.
        self._dead: list[int] = []

    @staticmethod
    def create() -> SharedArena | None:
        """A new arena of ``ARENA_BYTES``, or None where this system has no sealable memory
        files."""
        made = SharedBuffer.create(ARENA_BYTES)
        return None if made is None else SharedArena(*made)

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a region of ``nbytes`` (> 0) now the caller's, or None when no free
        region is that large."""
        size = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            self._give_back_dead()
            for i, (offset, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + size, free - size)
                    self._taken[offset] = size
                    return offset
        return None

    def release(self, offset: int) -> None:
        """Give back the region at ``offset`` (unless it was abandoned)."""
        with self._lock:
            self._give_back_dead()
            self._give_back(offset)

    def abandon(self, where: int) -> None:
        """Never give back the region that holds byte ``where``."""
        with self._lock:
            for offset, size in self._taken.items():
                if offset <= where < offset + size:
                    if offset not in self._abandoned:
                        log.warning("shared_region_abandoned offset=%d bytes=%d", offset, size)
                    self._abandoned.add(offset)
                    return

    def abandoned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` starts a region that was abandoned (``result``'s tensors do)."""
        offset = self.offset_of(tensor)
        if offset is None:
            return False
        with self._lock:
            return offset in self._abandoned

    def rows(self, offset: int, dtype: torch.dtype, num_rows: int, dim: int) -> torch.Tensor:
        """``SharedBuffer.rows``: a view of the caller's region, alive only while it is."""
        return self.buffer.rows(offset, dtype, num_rows, dim)

    def result(self, num_rows: int, dim: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A new (num_rows, dim) tensor of ``dtype`` in a region of its own, given back once
        the tensor and every view of it are gone; None when no region is free."""
        nbytes = num_rows * dim * dtype.itemsize
        offset = self.allocate(nbytes) if nbytes else None
        if offset is None:
            return None
        start = RESERVED_BYTES + offset
        view = memoryview(self.buffer._map)[start:start + nbytes]
        # the tensor holds ``view`` (torch.frombuffer keeps the exporter), so ``view`` dies
        # with the last tensor that shares its memory
        weakref.finalize(view, self._dead.append, offset)
        return torch.frombuffer(view, dtype=torch.uint8).view(dtype).view(num_rows, dim)

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """The byte offset of ``tensor``'s first element in the buffer, or None when its
        memory is not the buffer's."""
        offset = tensor.data_ptr() - self._base
        # the range first: asking a tensor for its device costs more, and most are outside
        if not 0 <= offset < self.capacity or tensor.device.type != "cpu":
            return None
        return offset

    def in_use(self) -> int:
        """Bytes of the regions taken now (abandoned ones included)."""
        with self._lock:
            self._give_back_dead()
            return sum(self._taken.values())

    def close(self) -> None:
        """Close the offer's descriptor and unmap, once no tensor of a result is left."""
        SharedBuffer.withdraw(self.offer)
        self.buffer.close()

    def _give_back_dead(self) -> None:
        while self._dead:
            self._give_back(self._dead.pop())

    def _give_back(self, offset: int) -> None:
        if offset in self._abandoned:
            return
        size = self._taken.pop(offset)
        free = self._free
        i = 0
        while i < len(free) and free[i][0] < offset:
            i += 1
        free.insert(i, (offset, size))
        # merge with the neighbours, so that large regions stay allocatable
        if i + 1 < len(free) and offset + size == free[i + 1][0]:
            free[i] = (offset, size + free[i + 1][1])
            del free[i + 1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:
            free[i - 1] = (free[i - 1][0], free[i - 1][1] + free[i][1])
            del free[i]

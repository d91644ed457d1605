"""A data connection's shared buffer: rows between a client and a shard on the same host
without the socket.

Over loopback a frame's rows are copied by the kernel twice (into the socket, out of it) on
top of the gather and the scatter at either end, and on a host whose cores the client and its
shards share, those copies are CPU the update needs. With a shared buffer the client writes a
push's gradients where the shard applies them from, and the shard gathers a pull's rows where
the client reads them; the socket carries the frame's header, meta and ids only
(``frames.SHARED_FLAG``, proto/ams/api/frames.md).

The client makes the buffer: an anonymous memory file (memfd) sealed against shrinking and
growing, so that nothing the client does later can make the shard's accesses fault. It offers
the file in its HELLO by process id, descriptor number, size and a random nonce written at the
file's start; the shard opens ``/proc/<pid>/fd/<fd>``, which reaches the file only from the
same host and pid namespace, and maps it only when it is such a sealed memfd of that size
holding that nonce. Anything else leaves the connection on plain frames.
"""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import logging
import mmap
import os
import stat

import torch

from ams.errors import InvalidArgument, shorten

log = logging.getLogger(__name__)

# The file's first page holds the nonce; the rows' region starts page-aligned after it.
RESERVED_BYTES = 4096
NONCE_BYTES = 16
# Offsets into the region are multiples of this: every row dtype views them aligned.
ALIGN = 64
# The most a shard maps for one connection.
MAX_SHARED_BYTES = 64 << 20
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
            # Stat and name first: opening a descriptor's target may have effects (a device,
            # a pipe); only a memory file of ours is opened.
            if not os.readlink(path).startswith(f"/memfd:{MEMFD_NAME} ") \
                    or not stat.S_ISREG(os.stat(path).st_mode):
                return None
            handle = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            log.debug("shared_buffer_refused path=%s error=%s", path, e)
            return None
        try:
            if os.fstat(handle).st_size != RESERVED_BYTES + size \
                    or fcntl.fcntl(handle, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
                return None
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

    def slot(self, request: int, count: int) -> int:
        """The offset of request ``request``'s slot when the region is cut into ``count``
        equal slots (multiples of ALIGN), one for each request a connection keeps on the wire:
        request i takes slot i % count."""
        return request % count * self.slot_bytes(count)

    def slot_bytes(self, count: int) -> int:
        return self.capacity // count // ALIGN * ALIGN

    def fits(self, offset: int, nbytes: int) -> bool:
        """Whether ``nbytes`` from ``offset`` (checked by ``check_offset``) lie in the region."""
        return offset + nbytes <= self.capacity

    @staticmethod
    def check_offset(offset: int) -> None:
        """``InvalidArgument`` unless ``offset`` is a non-negative multiple of ALIGN."""
        if offset < 0 or offset % ALIGN:
            raise InvalidArgument(f"frame meta: 'offset' must be a non-negative multiple of "
                                  f"{ALIGN}, got {offset}")

    def rows(self, offset: int, dtype: torch.dtype, num_rows: int, dim: int) -> torch.Tensor:
        """The (num_rows, dim) tensor of ``dtype`` at byte ``offset`` of the region, sharing
        its memory. ``InvalidArgument`` for an offset that is not aligned or rows that do not
        fit."""
        self.check_offset(offset)
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

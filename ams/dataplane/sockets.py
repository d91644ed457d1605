"""Frames on a socket: reading through a buffer, gather-writes, kernel timeouts.

Both ends of the data plane use these: ``send_frame`` writes header, meta, ids and rows with one
system call where the socket allows, ``recv_header`` and ``recv_body`` read a frame with a
large body going straight from the socket into its destination tensor.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ams.wire import frames
from ams.wire.frames import Header, Kind

# A peer that sent a header has this long between bytes of the body (a stalled peer frees the
# thread serving it).
BODY_TIMEOUT_S = 60.0


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (every dtype, bfloat16 included)."""
    if not tensor.numel():
        return memoryview(b"")
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16; the bytes are the same
        tensor = tensor.view(torch.int16)
    return memoryview(tensor.contiguous().numpy()).cast("B")


def set_kernel_timeout(sock: socket.socket, seconds: float) -> None:
    """Make ``sock`` blocking, each receive and send given up after ``seconds`` without
    progress (``BlockingIOError``). A timed socket (``settimeout``) polls before every
    receive and send: two system calls more a round trip on each end, and a 1-row pull is
    little else. Not for TLS sockets, which need ``settimeout``."""
    micros = max(1, round(seconds * 1e6))  # a zero timeval would mean never
    timeval = struct.pack("ll", micros // 1_000_000, micros % 1_000_000)
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def _body_stalled() -> None:
    raise TimeoutError("no byte within the socket's timeout")


# A TLS socket sends this much at a time between its deadline checks (``send_buffers``).
_TLS_SEND_BYTES = 1 << 20


def _check_deadline(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError("the peer did not take the frame within its deadline")


class SocketReader:
    """Reads a socket through a 64 KiB buffer: a small frame, header and body, arrives with
    one system call; a large body goes from the socket straight into its destination.

    ``stalled``: called when a receive of a socket with a kernel timeout
    (``set_kernel_timeout``) gives up; it raises ``TimeoutError``, or returns to have the
    receive tried again. ``deadline`` (``time.monotonic``; None: none): no receive starts
    after it (``TimeoutError``), so a peer that sends a byte now and then cannot stretch a
    frame past it; a receive under way ends by the kernel timeout at the latest."""

    SIZE = 64 << 10

    def __init__(self, sock: socket.socket, stalled: Callable[[], None] = _body_stalled
                 ) -> None:
        self.sock = sock
        self.stalled = stalled
        self.deadline: float | None = None
        self._buffer = memoryview(bytearray(self.SIZE))
        self._start = self._end = 0
        self._poller: select.poll | None = None

    def _recv_into(self, out: memoryview) -> int:
        while True:
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise TimeoutError("the frame did not arrive before its deadline")
            try:
                return self.sock.recv_into(out)
            except BlockingIOError:
                self.stalled()

    def wait_for_bytes(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until a byte (or the peer's end) can be read, reading
        nothing from the socket: bytes that arrived stay visible to ``with_bytes_waiting``
        until the caller reads them. False when the time ran out."""
        if self._start < self._end:
            return True
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return True
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.sock.fileno(), select.POLLIN)
        return bool(self._poller.poll(timeout_s * 1000))

    def at_frame_boundary(self) -> bool:
        """Wait for the next byte; False when the peer closed the connection first."""
        if self._start < self._end:
            return True
        self._start, self._end = 0, self._recv_into(self._buffer)
        return self._end > 0

    def read_into(self, out: memoryview) -> None:
        """Fill ``out``; ConnectionError when the peer closes first."""
        if not out.nbytes:
            return
        taken = min(self._end - self._start, out.nbytes)
        out[:taken] = self._buffer[self._start:self._start + taken]
        self._start += taken
        out = out[taken:]
        if out.nbytes >= self.SIZE:
            while out.nbytes:
                got = self._recv_into(out)
                if got == 0:
                    raise ConnectionError("the peer closed the connection")
                out = out[got:]
            return
        while out.nbytes:
            self._start, self._end = 0, self._recv_into(self._buffer)
            if self._end == 0:
                raise ConnectionError("the peer closed the connection")
            taken = min(self._end, out.nbytes)
            out[:taken] = self._buffer[:taken]
            self._start = taken
            out = out[taken:]

    def discard(self, nbytes: int) -> None:
        """Read ``nbytes`` and drop them, holding no more memory than the buffer's;
        ConnectionError when the peer closes first."""
        while nbytes:
            view = self._buffer[:min(nbytes, self.SIZE)]
            taken = min(self._end - self._start, view.nbytes)
            if taken:
                self._start += taken
            else:
                self._start = self._end = 0
                taken = self._recv_into(view)
                if taken == 0:
                    raise ConnectionError("the peer closed the connection")
            nbytes -= taken


def send_buffers(sock: socket.socket, buffers: Sequence[bytes | memoryview],
                 stalled: Callable[[], None] = _body_stalled,
                 deadline: float | None = None) -> None:
    """Send ``buffers`` back to back: one gather-write system call where the socket allows.
    ``stalled``: as ``SocketReader``'s, for a send that gives up. ``deadline``
    (``time.monotonic``; None: none): ``TimeoutError`` once it passed with bytes unsent, so
    a peer that takes a byte now and then cannot hold the frame (and its memory) for long;
    checked between sends, each bounded by the socket's own timeout."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    if isinstance(sock, ssl.SSLSocket):  # TLS has no sendmsg
        for view in views:
            for start in range(0, view.nbytes, _TLS_SEND_BYTES):
                _check_deadline(deadline)
                sock.sendall(view[start:start + _TLS_SEND_BYTES])
        return
    while views:
        _check_deadline(deadline)
        try:
            sent = sock.sendmsg(views)
        except BlockingIOError:
            stalled()
            continue
        while sent:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def send_frame(sock: socket.socket, kind: Kind, meta: dict | bytes | None = None, *,
               ids: torch.Tensor | None = None, rows: torch.Tensor | None = None,
               positions: torch.Tensor | None = None, shared: bool = False,
               stalled: Callable[[], None] = _body_stalled,
               deadline: float | None = None) -> None:
    """One frame: ``meta`` (JSON object, or its encoding), ``ids`` (int64 (n,)),
    ``positions`` (int64 (n,), a shared PULL's) and ``rows`` ((m, dim)); ``shared``: the rows
    are in the shared buffer, where the meta's "offset" says (a request's ``rows``: already
    written there; an answer's: written there, sent for their shape and dtype); ``stalled``
    and ``deadline``: as ``send_buffers``'."""
    raw_meta = meta if isinstance(meta, bytes) else frames.encode_meta(meta) if meta else b""
    num_ids = 0 if ids is None else ids.numel()
    header = frames.pack_header(kind, raw_meta, num_ids=num_ids, rows=rows, shared=shared,
                                positions=positions is not None)
    send_buffers(sock, [header, raw_meta,
                        tensor_bytes(ids) if ids is not None else b"",
                        tensor_bytes(positions) if positions is not None else b"",
                        tensor_bytes(rows) if rows is not None and not shared else b""],
                 stalled, deadline)


@dataclass
class Frame:
    """A frame as read: its header, meta, and ids and rows (empty when the frame has none),
    and a shared PULL's positions."""

    header: Header
    meta: dict
    ids: torch.Tensor
    rows: torch.Tensor | None
    positions: torch.Tensor | None = None


def recv_header(reader: SocketReader) -> Header | None:
    """The next frame's header; None when the peer closed the connection between frames."""
    if not reader.at_frame_boundary():
        return None
    raw = bytearray(frames.HEADER.size)
    reader.read_into(memoryview(raw))
    return frames.parse_header(raw)


def recv_body(reader: SocketReader, header: Header, rows_out: torch.Tensor | None = None
              ) -> Frame:
    """The body ``header`` announces; rows land in ``rows_out`` when given (a contiguous
    tensor of the announced shape and dtype), else in a new tensor. Rows in the shared buffer
    are not in the body: the frame's rows are None and ``rows_out`` is not written."""
    return recv_payload(reader, header, recv_meta(reader, header), rows_out)


def recv_meta(reader: SocketReader, header: Header) -> dict:
    """The meta of the frame ``header`` announces, which comes first in its body: a shard
    reads it, and checks the rest of the body against the table it names, before it
    allocates anything for the rest (``recv_payload``)."""
    meta = bytearray(header.meta_bytes)
    reader.read_into(memoryview(meta))
    return frames.decode_meta(meta)


def recv_payload(reader: SocketReader, header: Header, meta: dict,
                 rows_out: torch.Tensor | None = None) -> Frame:
    """The rest of the body after its ``meta`` (``recv_meta``): ids, positions and rows, as
    ``recv_body`` reads them."""
    ids = torch.empty(header.num_ids * (2 if header.positions else 1), dtype=torch.int64)
    reader.read_into(tensor_bytes(ids))
    positions = None
    if header.positions:
        ids, positions = ids[:header.num_ids], ids[header.num_ids:]
    rows = None
    if header.dtype is not None and not header.shared:
        rows = rows_out if rows_out is not None \
            else torch.empty((header.num_rows, header.dim), dtype=header.dtype)
        reader.read_into(tensor_bytes(rows))
    return Frame(header, meta, ids, rows, positions)

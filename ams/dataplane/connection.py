"""The client's end of the data plane: one greeted connection to a shard's data port, its
pulls, pushes and scans as pipelined requests.

A pull or push of one shard travels as pieces (``ams.wire.pieces``), each one request; up to
``window`` of them are on the wire while earlier answers arrive, so the shard applies one while
the next arrives. Each request is a small object with a ``send`` and a ``receive``
(``PullRequest``, ``PushRequest``), and ``DataConnection.pipeline`` runs them in order.
"""

from __future__ import annotations

import collections
import logging
import socket
import ssl
import time
from collections.abc import Callable, Sequence

import torch

from ams.dataplane.placements import Landing, PullTarget
from ams.dataplane.shm import MIN_SHARED_BYTES, SharedArena
from ams.dataplane.sockets import (
    Frame,
    SocketReader,
    recv_body,
    recv_header,
    send_frame,
    set_kernel_timeout,
)
from ams.errors import AmsError, error_from_code
from ams.wire.frames import FrameError, Header, Kind
from ams.wire.pieces import PushPieces

log = logging.getLogger(__name__)


class DataConnection:
    """One connection to a shard's data port, greeted (token, expected incarnation: another
    process of the shard refuses the HELLO with ABORTED). Not thread-safe; ``RemoteShard``
    keeps a pool.

    ``arena``: the client's shared buffer (``ams.dataplane.shm``), offered to the shard; a
    shard on the same host maps it, and the rows of large pulls and pushes then bypass the
    socket (``shared`` is the arena; None: rows travel in the frames). Never with TLS.
    """

    def __init__(self, host: str, port: int, *, token: str | None, tls_ca: bytes | None,
                 expect_incarnation: str | None, timeout: float,
                 arena: SharedArena | None = None) -> None:
        self.shared: SharedArena | None = None
        # The deadline of the call under way, and the kernel timeout of the socket's receives
        # and sends (a plain socket's: ``set_kernel_timeout``); None: a timed TLS socket.
        self._deadline = time.monotonic() + timeout
        self._armed: float | None = None
        # Each request sent and not answered yet: the shared region it writes or reads
        # (None: none), and whether that region is given back once the answer is in.
        self._unanswered: collections.deque[tuple[int | None, bool]] = collections.deque()
        sock = socket.create_connection((host, port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls_ca is not None:
                context = ssl.create_default_context(cadata=tls_ca.decode())
                sock = context.wrap_socket(sock, server_hostname=host)
            hello: dict = {}
            if token:
                hello["token"] = token
            if expect_incarnation:
                hello["expect_incarnation"] = expect_incarnation
            if arena is not None and tls_ca is None:
                hello["shared"] = arena.offer
            self.sock, self.reader = sock, SocketReader(sock, self._stalled)
            self.send(Kind.HELLO, hello)
            # a HELLO the shard refuses raises its error here
            granted = self.expect(Kind.WELCOME).meta.get("shared") is True
            if tls_ca is None:
                self._arm(max(1e-3, self._deadline - time.monotonic()))
        except BaseException:
            sock.close()
            raise
        if granted:
            self.shared = arena

    # ---- the calls ---------------------------------------------------------------------

    def pull(self, table: str, pieces: Sequence[torch.Tensor],
             into: tuple[torch.Tensor, torch.Tensor | None], window: int, deadline: float
             ) -> None:
        """The rows of the ids of every piece (each int64 (n_i,)) into ``into`` = (out,
        positions): out (m, dim) of the table's row dtype, contiguous; positions None (the
        rows fill out in order) or int64 (sum n_i,) (row j goes to out[positions[j]]). Up to
        ``window`` requests are on the wire at once; each piece's rows land where
        ``PullTarget.landing`` says (``ams.dataplane.placements``)."""
        target = PullTarget(*into, self.shared)
        requests, start = [], 0
        for ids in pieces:
            requests.append(PullRequest(table, ids, target, start))
            start += ids.numel()
        self.pipeline(requests, window, deadline)

    def push(self, table: str, pieces: PushPieces, lr: float, client_id: str,
             decay_clock: float | None, window: int, deadline: float) -> list[bool]:
        """Each piece as one push, pipelined like ``pull``; whether each was applied now
        (False: before, by its sequence)."""
        meta: dict = {"table": table, "lr": lr, "client_id": client_id}
        if decay_clock is not None:
            meta["decay_clock"] = decay_clock
        requests = [PushRequest(meta, pieces, i) for i in range(len(pieces))]
        self.pipeline(requests, window, deadline)
        return [request.applied for request in requests]

    def scan_block(self, table: str, start: int, rows: int | None, deadline: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The shard's block of rows from its ``start``-th on (ids int64 (b,), rows (b, dim));
        b = 0 past the end. ``rows`` None: the shard's default block size."""
        meta = {"table": table, "start": start}
        if rows is not None:
            meta["rows"] = rows
        self.set_deadline(deadline)
        self.send(Kind.SCAN, meta)
        self.set_deadline(deadline)
        block = self.expect(Kind.ROWS)
        if block.rows is None or block.ids.numel() != block.rows.shape[0]:
            raise FrameError("frame: a scan block whose ids and rows differ in number")
        return block.ids, block.rows

    # ---- requests and answers ------------------------------------------------------------

    def pipeline(self, requests: Sequence[PullRequest | PushRequest], window: int,
                 deadline: float) -> None:
        """Send the requests in order, the next while at most ``window`` are unanswered, and
        receive their answers. A request is small next to the socket's buffers or its answer
        is, so neither end blocks on the other."""
        sent = 0
        for i, request in enumerate(requests):
            while sent < len(requests) and sent < i + window:
                self.set_deadline(deadline)
                requests[sent].send(self)
                sent += 1
            self.set_deadline(deadline)
            try:
                request.receive(self)
            except FrameError:
                raise  # the stream is lost; the connection is dropped
            except AmsError:
                # A refusal of request i leaves the later ones on the wire: their answers are
                # read and dropped here, or the connection's next request would take one of
                # them for its own (another request's rows, silently).
                self._drop_answers(sent - i - 1, deadline)
                raise

    def send(self, kind: Kind, meta: dict | None = None, *, ids: torch.Tensor | None = None,
             rows: torch.Tensor | None = None, positions: torch.Tensor | None = None,
             region: int | None = None, release: bool = False) -> None:
        """Send one request, remembered until its answer is read: ``region``, the offset of
        the shared region it uses (its rows are there, not in the frame), given back then
        where ``release``."""
        self._unanswered.append((region, release))
        send_frame(self.sock, kind, meta, ids=ids, rows=rows, positions=positions,
                   shared=region is not None, stalled=self._stalled)

    def expect(self, kind: Kind, rows_out: Callable[[Header], torch.Tensor | None] | None = None,
               consume: Callable[[Frame], None] | None = None) -> Frame:
        """The answer of the oldest request: a frame of ``kind``, its rows received into
        ``rows_out(header)``, then ``consume(answer)`` before the request's shared region is
        given back; an ERROR frame raises its typed error (the connection stays usable),
        anything else ``FrameError`` (it does not)."""
        header = self._next_header()
        if header.kind == Kind.ERROR:
            meta = recv_body(self.reader, header).meta
            self._answered()
            raise error_from_code(str(meta.get("code", "UNKNOWN")),
                                  str(meta.get("message", "")))
        if header.kind != kind:
            raise FrameError(f"frame: a {header.kind.name} where a {kind.name} was due")
        into = rows_out(header) if rows_out is not None and not header.shared else None
        answer = recv_body(self.reader, header, into)
        try:
            if consume is not None:
                consume(answer)
        finally:  # the answer is read whole: the shard writes its region no more
            self._answered()
        return answer

    def _answered(self) -> None:
        region, release = self._unanswered.popleft()
        if release and region is not None and self.shared is not None:
            self.shared.release(region)

    def _next_header(self) -> Header:
        """The header of the oldest request's answer; ConnectionError when the shard closed
        the connection instead."""
        header = recv_header(self.reader)
        if header is None:
            raise ConnectionError("the shard closed the data connection")
        return header

    def _drop_answers(self, count: int, deadline: float) -> None:
        """Read and discard the answers of ``count`` requests on the wire. Where they cannot
        be read the connection is closed (``lost``), so that it is not used again."""
        try:
            for _ in range(count):
                self.set_deadline(deadline)
                recv_body(self.reader, self._next_header())
                self._answered()
        except (OSError, FrameError) as e:
            log.debug("data_connection_lost while=dropping_answers error=%s", e)
            self.close()

    # ---- deadlines -----------------------------------------------------------------------

    def set_deadline(self, deadline: float) -> None:
        """Give up waiting on the shard at ``deadline`` (``TimeoutError``).

        A plain socket's kernel timeout is set again only when it would outlast the deadline
        or is under half the time left: calls whose deadlines are the client's timeout from
        their start keep one setting, and a receive that gives up before the deadline is
        tried again with the time that is left (``_stalled``)."""
        self._deadline = deadline
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("deadline exceeded")
        if self._armed is None:
            self.sock.settimeout(remaining)
        elif not remaining / 2 <= self._armed <= remaining:
            self._arm(remaining)

    def _arm(self, seconds: float) -> None:
        set_kernel_timeout(self.sock, seconds)
        self._armed = seconds

    def _stalled(self) -> None:
        """A receive or send gave up after the kernel timeout: past the deadline that is
        ``TimeoutError``, before it the socket waits on with the time that is left."""
        remaining = self._deadline - time.monotonic()
        if remaining <= 0 or self._armed is None:
            raise TimeoutError("deadline exceeded")
        self._arm(remaining)

    @property
    def lost(self) -> bool:
        """Closed, by ``close`` or because its stream could not be kept in step."""
        return self.sock.fileno() == -1

    def close(self) -> None:
        """Close the socket. The shared regions of requests still unanswered may yet be
        written by the shard: they are never reused."""
        self.sock.close()
        while self._unanswered:
            region, _ = self._unanswered.popleft()
            if region is not None and self.shared is not None:
                self.shared.abandon(region)


class PullRequest:
    """One PULL: the rows of ``ids`` (int64 (n,)), rows ``start:start + n`` of ``target``."""

    def __init__(self, table: str, ids: torch.Tensor, target: PullTarget, start: int) -> None:
        self.table, self.ids, self.target, self.start = table, ids, target, start
        self.landing: Landing | None = None

    def send(self, conn: DataConnection) -> None:
        # the landing is chosen now: a staged region is taken only while its request is out
        self.landing = self.target.landing(self.start, self.start + self.ids.numel())
        place = self.landing.place()
        conn.send(Kind.PULL, {"table": self.table, **place.meta}, ids=self.ids,
                  positions=place.positions, region=place.region, release=place.release)

    def receive(self, conn: DataConnection) -> None:
        conn.expect(Kind.ROWS, self.landing.rows_out, self.landing.take)


class PushRequest:
    """One PUSH: piece ``i`` of ``pieces`` with the push's ``meta`` and the piece's sequence.
    Its gradients are gathered when it is sent, straight into a region of the shared buffer
    when it carries at least ``MIN_SHARED_BYTES`` and one is free (given back once the push is
    answered), else into the frame."""

    def __init__(self, meta: dict, pieces: PushPieces, i: int) -> None:
        self.meta, self.pieces, self.i = meta, pieces, i
        self.applied = False

    def send(self, conn: DataConnection) -> None:
        shape, dtype = (self.pieces.rows_of(self.i), self.pieces.dim), self.pieces.values.dtype
        shared = conn.shared
        nbytes = shape[0] * shape[1] * dtype.itemsize
        region = shared.allocate(nbytes) \
            if shared is not None and nbytes >= MIN_SHARED_BYTES else None
        if region is None:
            ids, grads, sequence = self.pieces.gather(self.i)
            conn.send(Kind.PUSH, {**self.meta, "sequence": sequence}, ids=ids, rows=grads)
            return
        try:
            ids, grads, sequence = self.pieces.gather(self.i, out=shared.rows(region, dtype,
                                                                              *shape))
        except BaseException:
            shared.release(region)
            raise
        conn.send(Kind.PUSH, {**self.meta, "sequence": sequence, "offset": region}, ids=ids,
                  rows=grads, region=region, release=True)

    def receive(self, conn: DataConnection) -> None:
        self.applied = bool(conn.expect(Kind.PUSHED).meta.get("applied"))

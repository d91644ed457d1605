"""The AMS data plane: pulls and pushes as binary frames (``ams.wire.frames``) on a TCP port beside
the shard's gRPC port.

gRPC stays the control plane (tables, snapshots, stats, graphs, health). Row payloads take
this path because a gRPC call cannot move megabytes at the socket's speed in Python: measured
here, grpcio returning a ready 5 MB reply with no serializer at all reaches about a quarter of
a raw loopback socket (benchmarks/RESULTS.md, "AMS pull/push"). A frame moves with one copy
per side: the shard gathers rows into the buffer it sends and receives ids and gradients into
the tensors it applies; the client receives rows straight into the result.

Both ends are here: ``DataPlaneServer`` (one thread per connection, requests answered in
order) and ``DataConnection`` (one connection; pipelined requests). The token of the gRPC
port guards this one too (a HELLO frame carries it), and with TLS both ports use the same
certificate.
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
import select
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ams.dataplane.shm import MIN_SHARED_BYTES, SharedArena, SharedBuffer
from ams.errors import (
    AmsError,
    InvalidArgument,
    ShardRestarted,
    Unauthenticated,
    Unavailable,
    error_from_code,
)
from ams.shard import rowcopy
from ams.shard.metrics import record_call
from ams.shard.store import ShardStore
from ams.wire import frames
from ams.wire.frames import FrameError, Header, Kind
from ams.wire.pieces import PushPieces

log = logging.getLogger(__name__)

# A client that sent a header has this long to send the body (a stalled peer frees its thread).
BODY_TIMEOUT_S = 60.0
# How long a closing server waits for its connections' threads once it cut them: a request
# computing then still finishes in the store
THREADS_EXIT_S = 30.0
IDLE_TIMEOUT_S = 3600.0
# The ids of a frame that has none (most answers): one tensor for all of them, nothing writes it.
_NO_IDS = torch.empty(0, dtype=torch.int64)
MAX_CONNECTIONS = 256


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
    raise TimeoutError(f"no byte for {BODY_TIMEOUT_S:.0f} s")


class SocketReader:
    """Reads a socket through a 64 KiB buffer: a small frame, header and body, arrives with
    one system call; a large body goes from the socket straight into its destination.

    ``stalled``: called when a receive of a socket with a kernel timeout
    (``set_kernel_timeout``) gives up; it raises ``TimeoutError``, or returns to have the
    receive tried again."""

    SIZE = 64 << 10

    def __init__(self, sock: socket.socket, stalled: Callable[[], None] = _body_stalled
                 ) -> None:
        self.sock = sock
        self.stalled = stalled
        self._buffer = memoryview(bytearray(self.SIZE))
        self._start = self._end = 0
        self._poller: select.poll | None = None

    def _recv_into(self, out: memoryview) -> int:
        while True:
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


def send_buffers(sock: socket.socket, buffers: Sequence[bytes | memoryview],
                 stalled: Callable[[], None] = _body_stalled) -> None:
    """Send ``buffers`` back to back: one gather-write system call where the socket allows.
    ``stalled``: as ``SocketReader``'s, for a send that gives up."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    if isinstance(sock, ssl.SSLSocket):  # TLS has no sendmsg
        for view in views:
            sock.sendall(view)
        return
    while views:
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
               stalled: Callable[[], None] = _body_stalled) -> None:
    """One frame: ``meta`` (JSON object, or its encoding), ``ids`` (int64 (n,)),
    ``positions`` (int64 (n,), a shared PULL's) and ``rows`` ((m, dim)); ``shared``: the rows
    are in the shared buffer, where the meta's "offset" says (a request's ``rows``: already
    written there; an answer's: written there, sent for their shape and dtype); ``stalled``:
    as ``send_buffers``'."""
    raw_meta = meta if isinstance(meta, bytes) else frames.encode_meta(meta) if meta else b""
    num_ids = 0 if ids is None else ids.numel()
    header = frames.pack_header(kind, raw_meta, num_ids=num_ids, rows=rows, shared=shared,
                                positions=positions is not None)
    send_buffers(sock, [header, raw_meta,
                        tensor_bytes(ids) if ids is not None else b"",
                        tensor_bytes(positions) if positions is not None else b"",
                        tensor_bytes(rows) if rows is not None and not shared else b""],
                 stalled)


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
    meta = bytearray(header.meta_bytes)
    reader.read_into(memoryview(meta))
    ids, positions = _NO_IDS, None
    if header.num_ids:
        # numpy's allocation and view: torch's cost several times more per call, and most
        # requests carry a few ids
        raw = np.empty(header.num_ids * (2 if header.positions else 1), dtype=np.int64)
        reader.read_into(memoryview(raw).cast("B"))
        ids = torch.from_numpy(raw)
        if header.positions:
            ids, positions = ids[:header.num_ids], ids[header.num_ids:]
    elif header.positions:
        positions = _NO_IDS
    rows = None
    if header.dtype is not None and not header.shared:
        rows = rows_out if rows_out is not None \
            else torch.empty((header.num_rows, header.dim), dtype=header.dtype)
        reader.read_into(tensor_bytes(rows))
    return Frame(header, frames.decode_meta(meta), ids, rows, positions)


# ---- the shard's end -----------------------------------------------------------------------


class DataPlaneServer:
    """Serves ``store``'s pulls and pushes on ``host:port`` (0: a free port, see ``port``).

    ``token``: required in each connection's HELLO; ``tls_cert``/``tls_key``: PEM bytes, TLS
    on every connection; ``incarnation``: this process of the shard (the WELCOME says it, and
    a HELLO that expects another is refused with ABORTED); ``ready``: set once the store is
    complete (requests before it get UNAVAILABLE).
    """

    def __init__(self, store: ShardStore, *, host: str, port: int, token: str | None,
                 tls_cert: bytes | None, tls_key: bytes | None, incarnation: str,
                 ready: threading.Event) -> None:
        self.store, self.incarnation, self.ready = store, incarnation, ready
        self._token = token.encode() if token else None
        self._tls = _server_tls(tls_cert, tls_key) if tls_cert is not None else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._listener = socket.create_server((host, port), family=family, backlog=128)
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port} for the data plane: {e.strerror}") \
                from None
        self.port: int = self._listener.getsockname()[1]
        self._connections: set[socket.socket] = set()
        self._busy: set[socket.socket] = set()  # those between a request's first byte and answer
        # at close: connections whose next request's first bytes had arrived, not yet read
        self._finishing: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()  # one per connection, until it ends
        self._lock = threading.Lock()
        self._closed = False
        self._accepting = threading.Thread(target=self._accept_loop, name="dataplane-accept",
                                           daemon=True)
        self._accepting.start()

    def close(self, grace: float = 30.0) -> None:
        """Stop accepting and stop idle connections; a connection answering a request
        finishes it (up to ``grace`` seconds), then closes. Past ``grace`` the connections are
        cut, and a request still computing loses its answer. Returns once every connection's
        thread has ended (at most ``THREADS_EXIT_S`` after the cut): one still inside the
        store when the interpreter finalizes aborts the process (torch and the kernels run
        without the GIL, and a thread that takes it back then is unwound through C++)."""
        with self._lock:
            self._closed = True
            waiting = self._connections - self._busy
            # A request whose bytes wait in the socket has begun, even if its thread has not
            # been scheduled to read them yet: it is finished like a busy one.
            self._finishing = with_bytes_waiting(waiting)
            _shut(waiting - self._finishing, socket.SHUT_RD)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop
        except OSError:
            pass
        self._listener.close()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            with self._lock:
                if not self._busy and not self._finishing & self._connections:
                    break
            time.sleep(0.02)
        self._accepting.join(timeout=5)
        with self._lock:
            # both ways: a thread blocked sending to a peer that stopped reading fails now
            _shut(self._connections, socket.SHUT_RDWR)
            threads = list(self._threads)
        deadline = time.monotonic() + THREADS_EXIT_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        left = sum(t.is_alive() for t in threads)
        if left:
            log.warning("dataplane_threads_left count=%d waited_s=%.0f", left, THREADS_EXIT_S)

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                crowded = len(self._connections) >= MAX_CONNECTIONS
                if not crowded:
                    self._connections.add(conn)
                    thread = threading.Thread(target=self._serve_connection, args=(conn,),
                                              name="dataplane-conn", daemon=True)
                    self._threads.add(thread)
            if crowded:
                conn.close()
                log.warning("dataplane_refused reason=too_many_connections limit=%d",
                            MAX_CONNECTIONS)
                continue
            thread.start()

    def _serve_connection(self, conn: socket.socket) -> None:
        sock = conn
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # one timeout throughout, never switched: switching costs system calls on every
            # request
            if self._tls is None:
                set_kernel_timeout(conn, BODY_TIMEOUT_S)
            else:
                conn.settimeout(BODY_TIMEOUT_S)
                sock = self._tls.wrap_socket(conn, server_side=True)
                with self._lock:  # the wrapped socket takes over the descriptor
                    self._connections.discard(conn)
                    if self._closed:
                        return
                    self._connections.add(sock)
            self._serve_requests(sock)
        except (OSError, ssl.SSLError) as e:
            log.debug("dataplane_connection_lost error=%s", e)
        except Exception:  # a fault of this code: the connection goes, the shard serves on
            log.exception("dataplane_connection_failed")
        finally:
            with self._lock:
                self._connections.discard(conn)
                self._connections.discard(sock)
                self._busy.discard(sock)
                self._threads.discard(threading.current_thread())
            sock.close()

    def _serve_requests(self, sock: socket.socket) -> None:
        """Answer frames in order until the peer closes, the server closes, or a frame leaves
        the stream unreadable (answered with an ERROR frame, then the connection is closed)."""
        shared: list[SharedBuffer] = []  # the one the HELLO offered, once mapped
        try:
            self._serve_frames(sock, shared)
        finally:
            for buffer in shared:
                buffer.close()

    def _serve_frames(self, sock: socket.socket, shared: list[SharedBuffer]) -> None:
        greeted = False
        reader = SocketReader(sock)
        while True:
            with self._lock:
                self._busy.discard(sock)
                if self._closed:
                    return
            if not reader.wait_for_bytes(IDLE_TIMEOUT_S):
                continue  # an idle pooled connection: wait on for its next request
            with self._lock:
                # the bytes are still unread, so ``close`` saw them and lets this one finish
                if self._closed and sock not in self._finishing:
                    return
                self._busy.add(sock)
            try:
                header = recv_header(reader)
                if header is None:
                    return  # the peer closed between requests
                frames.check_request(header, self.store.max_rows_per_request)
                if not greeted and header.kind != Kind.HELLO:
                    raise Unauthenticated("data plane: the first frame must be a HELLO")
                frame = recv_body(reader, header)
            except AmsError as e:
                self._send_error(sock, e)
                return
            except (ConnectionError, TimeoutError):
                self._send_error(sock, FrameError("frame: truncated (the connection closed or "
                                                  "stalled before the body's last byte)"))
                return
            if frame.header.kind == Kind.HELLO:
                welcome = {"incarnation": self.incarnation, "shard_id": self.store.shard_id,
                           "num_shards": self.store.num_shards}
                try:
                    self._check_hello(frame.meta)
                    if "shared" in frame.meta:
                        welcome["shared"] = self._map_shared(frame.meta["shared"], shared)
                except AmsError as e:
                    self._send_error(sock, e)
                    return
                greeted = True
                send_frame(sock, Kind.WELCOME, welcome)
                continue
            self._answer(sock, frame, shared[0] if shared else None)

    def _check_hello(self, meta: dict) -> None:
        if self._token is not None:
            token = meta.get("token")
            if not isinstance(token, str) or not hmac.compare_digest(token.encode(),
                                                                     self._token):
                raise Unauthenticated("data plane: missing or wrong auth token")
        expected = frames.meta_field(meta, "expect_incarnation", str, required=False)
        if expected is not None and expected != self.incarnation:
            raise ShardRestarted.refusal(
                f"shard {self.store.shard_id} of {self.store.num_shards}", self.incarnation,
                expected)

    def _map_shared(self, offer: object, shared: list[SharedBuffer]) -> bool:
        """Map the buffer a HELLO offers into ``shared`` (replacing one mapped before);
        whether it was. Never with TLS: its peers are meant to be across a network."""
        for buffer in shared:
            buffer.close()
        shared.clear()
        buffer = SharedBuffer.attach(offer)  # InvalidArgument for an offer that is not one
        granted = buffer is not None and self._tls is None
        log.debug("dataplane_shared_buffer granted=%s", granted)
        if not granted:
            if buffer is not None:
                buffer.close()
            return False
        shared.append(buffer)
        return True

    def _answer(self, sock: socket.socket, frame: Frame, shared: SharedBuffer | None) -> None:
        """Apply one PULL or PUSH and answer it; its errors become ERROR frames (the stream
        stays readable, so the connection stays open). ``shared``: the connection's shared
        buffer, for frames whose rows are there."""
        method = frame.header.kind.name.capitalize()  # Pull, Push, Scan in the metrics
        started = time.perf_counter()
        code: str | None = None
        try:
            if not self.ready.is_set():
                raise Unavailable("the shard is restoring its snapshot; it serves once health "
                                  "says SERVING")
            table = frames.meta_field(frame.meta, "table", str)
            if frame.header.shared and shared is None:
                raise InvalidArgument("frame: rows in a shared buffer, but this connection "
                                      "has none (its HELLO offered none, or it was refused)")
            if frame.header.kind == Kind.PULL:
                if frame.header.shared:
                    rows = self._pull_into_shared(table, frame, shared)
                else:
                    rows = self.store.pull(table, frame.ids)
                send_frame(sock, Kind.ROWS, rows=rows, shared=frame.header.shared)
            elif frame.header.kind == Kind.SCAN:
                ids, rows = self.store.scan_block(
                    table, frames.meta_field(frame.meta, "start", int),
                    frames.meta_field(frame.meta, "rows", int, required=False))
                send_frame(sock, Kind.ROWS, ids=ids, rows=rows)
            else:
                if frame.header.shared and frame.header.dtype is not None:
                    frame.rows = shared.rows(
                        frames.meta_field(frame.meta, "offset", int), frame.header.dtype,
                        frame.header.num_rows, frame.header.dim)
                applied = self._push(table, frame)
                send_frame(sock, Kind.PUSHED, {"applied": applied})
        except AmsError as e:
            code = e.code
            self._send_error(sock, e)
        except Exception as e:  # answer and keep serving; the log has the trace
            log.exception("dataplane_failed method=%s", method)
            code = "INTERNAL"
            self._send_error(sock, error_from_code("INTERNAL", f"{type(e).__name__}: {e}"))
        finally:
            record_call(method, time.perf_counter() - started, code)

    def _pull_into_shared(self, table: str, frame: Frame, shared: SharedBuffer
                          ) -> torch.Tensor:
        """A shared PULL: its rows written to the region of "bytes" at "offset" of the shared
        buffer, in order from its start, or row j at row positions[j] of it; the rows
        returned (for the answer's shape). Nothing is written when it is refused."""
        spec = self.store.table(table).spec
        offset = frames.meta_field(frame.meta, "offset", int)
        room = frames.meta_field(frame.meta, "bytes", int)
        shared.check_offset(offset, spec.dtype)
        if room < 0 or not shared.fits(offset, room):
            raise InvalidArgument(f"frame meta: {room} bytes at offset {offset} are not in the "
                                  f"{shared.capacity}-byte shared buffer")
        region_rows = room // (spec.dim * spec.dtype.itemsize)
        n = frame.ids.numel()
        if frame.positions is None:
            if n > region_rows:
                raise InvalidArgument(f"frame: {n} rows of {spec.dim} x {spec.dtype} do not "
                                      f"fit in the {room} bytes at offset {offset}")
            return self.store.pull(table, frame.ids,
                                   shared.rows(offset, spec.dtype, n, spec.dim))
        if n:
            lo, hi = rowcopy.bounds(frame.positions)
            if lo < 0 or hi >= region_rows:
                raise InvalidArgument(f"frame: position {lo if lo < 0 else hi} is outside the "
                                      f"{region_rows} rows at offset {offset}")
        rows = self.store.pull(table, frame.ids)
        rowcopy.scatter(shared.rows(offset, spec.dtype, region_rows, spec.dim),
                        frame.positions, rows)
        return rows

    def _push(self, table: str, frame: Frame) -> bool:
        meta = frame.meta
        lr = frames.meta_field(meta, "lr", (int, float))
        client_id = frames.meta_field(meta, "client_id", str)
        sequence = frames.meta_field(meta, "sequence", int)
        clock = frames.meta_field(meta, "decay_clock", (int, float), required=False)
        if frame.rows is None or not frame.rows.is_floating_point():
            raise InvalidArgument(f"frame: push gradients must be float rows, got "
                                  f"{frame.header.dtype}")
        return self.store.push(table, frame.ids, frame.rows, lr, client_id, sequence, clock)

    @staticmethod
    def _send_error(sock: socket.socket, error: AmsError) -> None:
        try:
            send_frame(sock, Kind.ERROR, {"code": error.code, "message": str(error)})
        except OSError:
            pass  # the peer is gone; nothing to tell


def with_bytes_waiting(connections: set[socket.socket]) -> set[socket.socket]:
    """Those of ``connections`` with bytes (or the peer's end) ready to read now."""
    poller = select.poll()
    by_fd = {conn.fileno(): conn for conn in connections}
    by_fd.pop(-1, None)  # a socket already closed
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    return {by_fd[fd] for fd, _ in poller.poll(0)}


def _shut(connections: set[socket.socket], how: int) -> None:
    """Shut each connection down (``socket.SHUT_RD``: its thread waiting for a request sees
    the end)."""
    for conn in connections:
        try:
            conn.shutdown(how)
        except OSError:
            pass


def _server_tls(cert: bytes, key: bytes) -> ssl.SSLContext:
    """A server context from PEM bytes (``ssl`` loads a chain from files only: a private
    temporary file holds them for the load)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory(prefix="xcls-tls-") as tmp:
        path = os.path.join(tmp, "chain.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(cert.rstrip(b"\n") + b"\n" + key)
        context.load_cert_chain(path)
    return context


# ---- the client's end ----------------------------------------------------------------------


class DataConnection:
    """One connection to a shard's data port, greeted (token, expected incarnation: another
    process of the shard refuses the HELLO with ABORTED). Not thread-safe; ``RemoteShard``
    keeps a pool.

    ``arena``: the client's shared buffer (``ams.dataplane.shm``), offered to the shard; a
    shard on the same host maps it, and the rows of large pulls and pushes then bypass the socket
    (``shared`` is the arena; None: rows travel in the frames). Never with TLS.
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
            self._send(Kind.HELLO, hello)
            # a HELLO the shard refuses raises its error here
            granted = self._expect(Kind.WELCOME).meta.get("shared") is True
            if tls_ca is None:
                self._arm(max(1e-3, self._deadline - time.monotonic()))
        except BaseException:
            sock.close()
            raise
        if granted:
            self.shared = arena

    def _send(self, kind: Kind, meta: dict | bytes | None = None, *,
              ids: torch.Tensor | None = None,
              rows: torch.Tensor | None = None, positions: torch.Tensor | None = None,
              region: int | None = None, release: bool = False) -> None:
        """``send_frame``, the request remembered until its answer is read: ``region``, the
        offset of the shared region it uses, given back then where ``release``; rows in the
        shared buffer where ``region`` is given."""
        self._unanswered.append((region, release))
        send_frame(self.sock, kind, meta, ids=ids, rows=rows, positions=positions,
                   shared=region is not None, stalled=self._stalled)

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

    def _read_answer(self) -> None:
        """Read and drop the oldest request's answer, whatever it is."""
        recv_body(self.reader, self._next_header())
        self._answered()

    def _expect(self, kind: Kind, rows_out: Callable[[Header], torch.Tensor] | None = None,
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
        answer = recv_body(self.reader, header, rows_out(header)
                           if rows_out is not None and not header.shared else None)
        try:
            if consume is not None:
                consume(answer)
        finally:  # the answer is read whole: the shard writes its region no more
            self._answered()
        return answer

    def pull(self, table: str, pieces: Sequence[torch.Tensor], window: int, deadline: float,
             into: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        """Rows of the ids of all ``pieces`` (each int64 (n_i,)) into ``into`` = (out,
        positions): out (m, dim) of the table's row dtype, contiguous; positions None (the
        rows fill out in order, m = sum n_i) or int64 (sum n_i,) (row j goes to
        out[positions[j]]). Up to ``window`` requests are on the wire while earlier answers
        arrive.

        Where out lies in the shared buffer the shard writes each row to its place there.
        Otherwise a piece of at least ``MIN_SHARED_BYTES`` is written to a region of the
        shared buffer of its own (where one is free), and its rows copied or scattered from
        there to their places before the region is given back; the others come in the
        frames, received straight into their slice of out or scattered from there."""
        out, positions = into
        starts = [0]
        for piece in pieces:
            starts.append(starts[-1] + piece.numel())
        row_bytes = out.shape[1] * out.element_size()
        shared = self.shared
        base = shared.offset_of(out) if shared is not None else None
        staged: dict[int, int] = {}  # piece -> the region its rows are written to

        def check(i: int, header: Header) -> None:
            """Piece i's answer announces its rows' count and out's width and dtype."""
            want = (starts[i + 1] - starts[i], out.shape[1], out.dtype)
            if (header.num_rows, header.dim, header.dtype) != want:
                raise FrameError(
                    f"frame: {header.num_rows} rows of {header.dim} x {header.dtype} "
                    f"where {want[0]} of {want[1]} x {want[2]} was due")

        def rows_out(i: int, header: Header) -> torch.Tensor:
            check(i, header)
            if positions is not None:
                return torch.empty((header.num_rows, header.dim), dtype=header.dtype)
            return out if len(pieces) == 1 else out[starts[i]:starts[i + 1]]

        def send(i: int) -> None:
            if base is None:
                nbytes = (starts[i + 1] - starts[i]) * row_bytes
                region = shared.allocate(nbytes) if shared is not None \
                    and nbytes >= MIN_SHARED_BYTES else None
                if region is None:
                    self._send(Kind.PULL, frames.table_meta(table), ids=pieces[i])
                    return
                staged[i] = region
                self._send(Kind.PULL, {"table": table, "offset": region, "bytes": nbytes},
                           ids=pieces[i], region=region, release=True)
            elif positions is None:
                offset = base + starts[i] * row_bytes
                self._send(Kind.PULL, {"table": table, "offset": offset,
                                       "bytes": (starts[i + 1] - starts[i]) * row_bytes},
                           ids=pieces[i], region=offset)
            else:
                self._send(Kind.PULL, {"table": table, "offset": base,
                                       "bytes": out.shape[0] * row_bytes},
                           ids=pieces[i], region=base,
                           positions=positions[starts[i]:starts[i + 1]])

        def take(i: int, answer: Frame) -> None:
            """Piece i's rows to their places, from its staged region while it is still
            this request's."""
            wanted = None if positions is None else positions[starts[i]:starts[i + 1]]
            if answer.header.shared:
                if base is None and i not in staged:
                    raise FrameError("frame: rows in a shared buffer where none was asked for")
                check(i, answer.header)
                if i in staged:
                    got = shared.rows(staged[i], out.dtype, starts[i + 1] - starts[i],
                                      out.shape[1])
                    if wanted is None:
                        rowcopy.copy(out[starts[i]:starts[i + 1]], got)
                    else:
                        rowcopy.scatter(out, wanted, got)
            elif wanted is not None:
                rowcopy.scatter(out, wanted, answer.rows)

        def receive(i: int) -> None:
            self._expect(Kind.ROWS, lambda h: rows_out(i, h), lambda a: take(i, a))

        self._pipelined(len(pieces), send, receive, window, deadline)

    def scan_block(self, table: str, start: int, rows: int | None, deadline: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The shard's block of rows from its ``start``-th on (ids int64 (b,), rows (b, dim));
        b = 0 past the end. ``rows`` None: the shard's default block size."""
        meta = {"table": table, "start": start}
        if rows is not None:
            meta["rows"] = rows
        self._set_deadline(deadline)
        self._send(Kind.SCAN, meta)
        self._set_deadline(deadline)
        block = self._expect(Kind.ROWS)
        if block.rows is None or block.ids.numel() != block.rows.shape[0]:
            raise FrameError("frame: a scan block whose ids and rows differ in number")
        return block.ids, block.rows

    def push(self, table: str, pieces: PushPieces, lr: float, client_id: str,
             decay_clock: float | None, window: int, deadline: float) -> list[bool]:
        """Each piece as one push, pipelined like ``pull``; whether each was applied now
        (False: before). A piece's gradients are gathered straight into a region of the
        shared buffer when it carries them, given back once the push is answered."""
        applied: list[bool] = []
        shared = self.shared

        def send(i: int) -> None:
            shape, dtype = (pieces.rows_of(i), pieces.dim), pieces.values.dtype
            meta: dict = {"table": table, "lr": lr, "client_id": client_id}
            if decay_clock is not None:
                meta["decay_clock"] = decay_clock
            nbytes = shape[0] * shape[1] * dtype.itemsize
            region = shared.allocate(nbytes) if shared is not None \
                and nbytes >= MIN_SHARED_BYTES else None
            if region is not None:
                meta["offset"] = region
                try:
                    ids, rows, meta["sequence"] = pieces.gather(
                        i, out=shared.rows(region, dtype, *shape))
                except BaseException:
                    shared.release(region)
                    raise
                self._send(Kind.PUSH, meta, ids=ids, rows=rows, region=region, release=True)
                return
            ids, grads, meta["sequence"] = pieces.gather(i)
            self._send(Kind.PUSH, meta, ids=ids, rows=grads)

        def receive(i: int) -> None:
            applied.append(bool(self._expect(Kind.PUSHED).meta.get("applied")))

        self._pipelined(len(pieces), send, receive, window, deadline)
        return applied

    def _pipelined(self, count: int, send: Callable[[int], None],
                   receive: Callable[[int], None], window: int, deadline: float) -> None:
        """Requests 0..count-1, the next sent while at most ``window`` are unanswered. A
        request is small next to the socket's buffers or its answer is, so neither end
        blocks on the other."""
        sent = 0
        for i in range(count):
            while sent < count and sent < i + window:
                self._set_deadline(deadline)
                send(sent)
                sent += 1
            self._set_deadline(deadline)
            try:
                receive(i)
            except FrameError:
                raise  # the stream is lost; the connection is dropped
            except AmsError:
                # A refusal of request i leaves the later ones on the wire: their answers are
                # read and dropped here, or the connection's next request would take one of
                # them for its own (another request's rows, silently).
                self._drop_answers(sent - i - 1, deadline)
                raise

    def _drop_answers(self, count: int, deadline: float) -> None:
        """Read and discard the answers of ``count`` requests on the wire. Where they cannot
        be read the connection is closed (``lost``), so that it is not used again."""
        try:
            for _ in range(count):
                self._set_deadline(deadline)
                self._read_answer()
        except (OSError, FrameError) as e:
            log.debug("data_connection_lost while=dropping_answers error=%s", e)
            self.close()

    @property
    def lost(self) -> bool:
        """Closed, by ``close`` or because its stream could not be kept in step."""
        return self.sock.fileno() == -1

    def _set_deadline(self, deadline: float) -> None:
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

    def close(self) -> None:
        """Close the socket. The shared regions of requests still unanswered may yet be
        written by the shard: they are never reused."""
        self.sock.close()
        while self._unanswered:
            region, _ = self._unanswered.popleft()
            if region is not None and self.shared is not None:
                self.shared.abandon(region)

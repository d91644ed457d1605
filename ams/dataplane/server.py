"""The shard's end of the data plane: ``DataPlaneServer`` answers pulls, pushes and scans of a
``ShardStore`` on its own TCP port, one thread per connection, requests answered in order.

gRPC stays the control plane (tables, snapshots, stats, graphs, health). Row payloads take this
path because a gRPC call cannot move megabytes at the socket's speed in Python (docs/decisions.md,
"Frames beside gRPC"). A frame moves with one copy per side: the shard gathers rows into the
buffer it sends and receives ids and gradients into the tensors it applies. The token of the
gRPC port guards this one too (a HELLO frame carries it), and with TLS both ports use the same
certificate.
"""

from __future__ import annotations

import hmac
import logging
import os
import select
import socket
import ssl
import tempfile
import threading
import time

import torch

from ams.dataplane.shm import SharedBuffer
from ams.dataplane.sockets import (
    BODY_TIMEOUT_S,
    Frame,
    SocketReader,
    recv_body,
    recv_header,
    send_frame,
    set_kernel_timeout,
)
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
from ams.wire.frames import FrameError, Kind

log = logging.getLogger(__name__)

# How long a closing server waits for its connections' threads once it cut them: a request
# computing then still finishes in the store
THREADS_EXIT_S = 30.0
IDLE_TIMEOUT_S = 3600.0
MAX_CONNECTIONS = 256


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

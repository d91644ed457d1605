"""The shard's end of the data plane: ``DataPlaneServer`` answers pulls, pushes and scans of a
``ShardStore`` on its own TCP port, one thread per connection, requests answered in order.

gRPC stays the control plane (tables, snapshots, stats, graphs, health). Row payloads take this
path because a gRPC call cannot move megabytes at the socket's speed in Python (docs/decisions.md,
"Frames beside gRPC"). A frame moves with one copy per side: the shard gathers rows into the
buffer it sends and receives ids and gradients into the tensors it applies. The token of the
gRPC port guards this one too (a HELLO frame carries it), and with TLS both ports use the same
certificate.

Strangers hold little: a connection must greet within ``HELLO_TIMEOUT_S`` in places of its
own (``ams.dataplane.admission``), and a request's body is checked against its table, and
counted against the shard's budget of bodies held, before anything is allocated for it; it
must then arrive within a deadline that grows with its size, not only byte by byte.
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

from ams.dataplane import answers
from ams.dataplane.admission import HELLO_TIMEOUT_S, MAX_GREETED, Admission, BodyBudget
from ams.dataplane.shm import SharedBuffer
from ams.dataplane.sockets import (
    BODY_TIMEOUT_S,
    Frame,
    SocketReader,
    recv_header,
    recv_meta,
    recv_payload,
    send_frame,
    set_kernel_timeout,
)
from ams.errors import (
    AmsError,
    ShardRestarted,
    Unauthenticated,
    Unavailable,
    error_from_code,
)
from ams.limits import MAX_IDS_PER_REQUEST
from ams.shard.metrics import record_call
from ams.shard.store import ShardStore
from ams.wire import frames
from ams.wire.frames import FrameError, Header, Kind

log = logging.getLogger(__name__)

# How long a closing server waits for its connections' threads once it cut them: a request
# computing then still finishes in the store
THREADS_EXIT_S = 30.0
IDLE_TIMEOUT_S = 3600.0
# A frame has BODY_TIMEOUT_S from its first byte, and one second more for each of these
# bytes of its body: a peer sending (or reading an answer) slower than this holds its
# memory no longer.
MIN_BODY_BYTES_PER_S = 1 << 20
# Strangers evicted are logged at most this often (they may come by the thousand).
EVICTIONS_LOG_S = 60.0


class _Link:
    """One accepted connection: its socket (the TLS one once wrapped) and its peer."""

    __slots__ = ("sock", "peer")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock, self.peer = sock, peer


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
        self._admission: Admission[_Link] = Admission()
        self._bodies = BodyBudget()
        self._evicted, self._evictions_logged = 0, -EVICTIONS_LOG_S
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
                conn, address = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                link = _Link(conn, address[0])
                evicted = self._admission.arrive(link, link.peer)
                # both ways: the stranger's thread, waiting for its HELLO, sees the end
                _shut({e.sock for e in evicted}, socket.SHUT_RDWR)
                self._connections.add(conn)
                thread = threading.Thread(target=self._serve_connection, args=(link,),
                                          name="dataplane-conn", daemon=True)
                self._threads.add(thread)
            if evicted:
                self._log_evictions(len(evicted))
            thread.start()

    def _log_evictions(self, count: int) -> None:
        self._evicted += count
        now = time.monotonic()
        if now - self._evictions_logged >= EVICTIONS_LOG_S:
            log.warning("dataplane_strangers_evicted count=%d (connections that had not "
                        "greeted made way for new ones; logged at most every %.0f s)",
                        self._evicted, EVICTIONS_LOG_S)
            self._evicted, self._evictions_logged = 0, now

    def _serve_connection(self, link: _Link) -> None:
        conn = sock = link.sock
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # the HELLO's time until greeted, then one timeout throughout, never switched
            # again: switching costs system calls on every request
            if self._tls is None:
                set_kernel_timeout(conn, HELLO_TIMEOUT_S)
            else:
                conn.settimeout(HELLO_TIMEOUT_S)
                sock = self._tls.wrap_socket(conn, server_side=True,
                                             do_handshake_on_connect=False)
                with self._lock:  # the wrapped socket takes over the descriptor
                    self._connections.discard(conn)
                    if self._closed:
                        return
                    self._connections.add(sock)
                    link.sock = sock  # an eviction now shuts the handshake down
                sock.do_handshake()
            self._serve_requests(link)
        except (OSError, ssl.SSLError) as e:
            log.debug("dataplane_connection_lost error=%s", e)
        except Exception:  # a fault of this code: the connection goes, the shard serves on
            log.exception("dataplane_connection_failed")
        finally:
            with self._lock:
                self._admission.leave(link)
                self._connections.discard(conn)
                self._connections.discard(sock)
                self._busy.discard(sock)
                self._threads.discard(threading.current_thread())
            sock.close()

    def _serve_requests(self, link: _Link) -> None:
        """Answer frames in order until the peer closes, the server closes, or a frame leaves
        the stream unreadable (answered with an ERROR frame, then the connection is closed)."""
        shared: list[SharedBuffer] = []  # the one the HELLO offered, once mapped
        try:
            self._serve_frames(link, shared)
        finally:
            for buffer in shared:
                buffer.close()

    def _serve_frames(self, link: _Link, shared: list[SharedBuffer]) -> None:
        sock = link.sock
        greeted = False
        reader = SocketReader(sock)
        hello_by = reader.deadline = time.monotonic() + HELLO_TIMEOUT_S
        while True:
            with self._lock:
                self._busy.discard(sock)
                if self._closed:
                    return
            if not greeted:
                if not reader.wait_for_bytes(max(0.0, hello_by - time.monotonic())):
                    log.debug("dataplane_hello_missing peer=%s", link.peer)
                    self._send_error(sock, error_from_code(
                        "DEADLINE_EXCEEDED",
                        f"data plane: no HELLO within {HELLO_TIMEOUT_S:.0f} s of connecting"))
                    return
            elif not reader.wait_for_bytes(IDLE_TIMEOUT_S):
                continue  # an idle pooled connection: wait on for its next request
            with self._lock:
                # the bytes are still unread, so ``close`` saw them and lets this one finish
                if self._closed and sock not in self._finishing:
                    return
                self._busy.add(sock)
            if greeted:
                reader.deadline = time.monotonic() + BODY_TIMEOUT_S
            try:
                header = recv_header(reader)
                if header is None:
                    return  # the peer closed between requests
                frames.check_request(header, MAX_IDS_PER_REQUEST)
                if not greeted and header.kind != Kind.HELLO:
                    raise Unauthenticated("data plane: the first frame must be a HELLO")
                if greeted:
                    reader.deadline += header.body_bytes / MIN_BODY_BYTES_PER_S
                meta = recv_meta(reader, header)
            except AmsError as e:
                self._send_error(sock, e)
                return
            except (ConnectionError, TimeoutError) as e:
                self._send_error(sock, _truncated(e))
                return
            if header.kind == Kind.HELLO:
                welcome = {"incarnation": self.incarnation, "shard_id": self.store.shard_id,
                           "num_shards": self.store.num_shards}
                try:
                    self._check_hello(meta)
                    if not greeted:
                        self._greet(link)
                    if "shared" in meta:
                        welcome["shared"] = self._map_shared(meta["shared"], shared)
                except AmsError as e:
                    self._send_error(sock, e)
                    return
                send_frame(sock, Kind.WELCOME, welcome)
                if not greeted:
                    greeted = True
                    if self._tls is None:
                        set_kernel_timeout(sock, BODY_TIMEOUT_S)
                    else:
                        sock.settimeout(BODY_TIMEOUT_S)
                continue
            if not self._answer(sock, reader, header, meta, shared[0] if shared else None):
                return

    def _greet(self, link: _Link) -> None:
        """Count ``link`` as greeted; Unavailable when every greeted place is taken."""
        with self._lock:
            greeted = self._admission.greet(link)
        if not greeted:
            log.warning("dataplane_refused peer=%s reason=too_many_connections limit=%d",
                        link.peer, MAX_GREETED)
            raise Unavailable(f"data plane: the shard serves {MAX_GREETED} connections "
                              "already")

    def _check_hello(self, meta: dict) -> None:
        if self._token is not None:
            token = meta.get("token")
            # surrogatepass: JSON may carry a lone surrogate, which UTF-8 cannot encode; its
            # bytes then match no token (a token file is UTF-8)
            if not isinstance(token, str) or not hmac.compare_digest(
                    token.encode(errors="surrogatepass"), self._token):
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

    def _answer(self, sock: socket.socket, reader: SocketReader, header: Header, meta: dict,
                shared: SharedBuffer | None) -> bool:
        """Receive the rest of one PULL, PUSH or SCAN (``meta`` read), apply it and answer it;
        its errors become ERROR frames and the stream stays in step. False when the
        connection must close: its body did not arrive whole, or its peer is gone.
        ``shared``: the connection's shared buffer, for frames whose rows are there."""
        method = header.kind.name.capitalize()  # Pull, Push, Scan in the metrics
        started = time.perf_counter()
        code: str | None = None
        held = 0  # bytes of the budget this request holds
        try:
            try:  # nothing is allocated for the body before these
                self._check_body(header, meta)
                held = self._bodies.take(header.body_bytes - header.meta_bytes)
            except AmsError as e:
                code = e.code
                self._send_error(sock, e)
                return self._discard_body(reader, header)
            try:
                frame = recv_payload(reader, header, meta)
            except (ConnectionError, TimeoutError) as e:
                code = "CANCELLED" if isinstance(e, ConnectionError) else "INVALID_ARGUMENT"
                self._send_error(sock, _truncated(e))
                return False
            kind, reply, code = self._apply(frame, shared, method)
            del frame  # the request's body is no longer held, its answer is
            self._bodies.give_back(held)
            held = 0
            answer_bytes = _answer_bytes(reply)
            try:
                held = self._bodies.take(answer_bytes)
            except Unavailable as e:  # a pull or scan: nothing was changed, a retry may pass
                code = e.code
                self._send_error(sock, e)
                return True
            try:
                # an answer, like a body, has BODY_TIMEOUT_S and a second per MiB: a peer that
                # reads a byte now and then cannot hold its memory for long
                send_frame(sock, kind, **reply, deadline=time.monotonic() + BODY_TIMEOUT_S
                           + answer_bytes / MIN_BODY_BYTES_PER_S)
            except OSError as e:  # the peer left before its answer, or took too long
                log.debug("dataplane_answer_lost method=%s error=%s", method, e)
                code = "CANCELLED"
                return False
            return True
        finally:
            self._bodies.give_back(held)
            record_call(method, time.perf_counter() - started, code)

    def _check_body(self, header: Header, meta: dict) -> None:
        """What a request must be before its ids and rows are received into memory: the
        shard serving, and its body fitting its table (``answers.check_body``)."""
        if not self.ready.is_set():
            raise Unavailable("the shard is restoring its snapshot; it serves once health "
                              "says SERVING")
        answers.check_body(self.store, header, meta)

    @staticmethod
    def _discard_body(reader: SocketReader, header: Header) -> bool:
        """Read past the ids and rows of a request refused before they were received, so
        that the connection stays in step; False when they did not come."""
        try:
            reader.discard(header.body_bytes - header.meta_bytes)
        except (ConnectionError, TimeoutError) as e:
            log.debug("dataplane_connection_lost while=discarding error=%s", e)
            return False
        return True

    def _apply(self, frame: Frame, shared: SharedBuffer | None, method: str
               ) -> tuple[Kind, dict, str | None]:
        """``answers.answer``, its refusals and faults as ERROR answers: (the answer's kind,
        ``send_frame``'s arguments, the status code for the metrics: None when it
        succeeded)."""
        try:
            return *answers.answer(self.store, frame, shared), None
        except AmsError as e:
            return Kind.ERROR, {"meta": _error_meta(e)}, e.code
        except Exception as e:  # answer and keep serving; the log has the trace
            log.exception("dataplane_failed method=%s", method)
            error = error_from_code("INTERNAL", f"{type(e).__name__}: {e}")
            return Kind.ERROR, {"meta": _error_meta(error)}, "INTERNAL"

    @staticmethod
    def _send_error(sock: socket.socket, error: AmsError) -> None:
        try:
            send_frame(sock, Kind.ERROR, _error_meta(error))
        except OSError:
            pass  # the peer is gone; nothing to tell


def _answer_bytes(reply: dict) -> int:
    """Bytes of the ids and rows an answer (``send_frame``'s arguments) sends from memory."""
    return sum(t.numel() * t.element_size() for key in ("ids", "rows", "positions")
               if (t := reply.get(key)) is not None and not (key == "rows" and reply.get("shared")))


def _error_meta(error: AmsError) -> dict:
    """The meta of the ERROR frame that answers with ``error``."""
    return {"code": error.code, "message": str(error)}


def _truncated(error: OSError) -> FrameError:
    """The refusal of a frame whose bytes stopped coming (``error``: why)."""
    return FrameError(f"frame: truncated (the connection closed or stalled before the "
                      f"frame's last byte: {error})")


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

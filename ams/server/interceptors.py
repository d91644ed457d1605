"""The interceptors every gRPC call of a shard (and of the scheduler) passes, in this order:
metrics (it sees every refusal), the token, readiness, the incarnation, and request decoding,
next to the servicer's handlers. Each refuses with a status and a message a person can act on,
before the servicer runs."""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable, Iterable

import grpc
from google.protobuf.message import DecodeError

from ams.api import shard_pb2 as pb
from ams.errors import ShardRestarted
from ams.limits import EXPECT_INCARNATION_KEY, INCARNATION_KEY
from ams.shard.metrics import record_call

# Calls of the shard service only; health checks would drown the latencies that matter.
SHARD_METHOD_PREFIX = "/xcls.ams.Shard/"


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` on every call except health checks."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(request: object, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong auth token (metadata 'authorization: Bearer ...')")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable, handler_call_details: object) -> object:
        if _is_health_check(handler_call_details):
            return continuation(handler_call_details)
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                got = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(got, self._expected):
                    return continuation(handler_call_details)
        return self._deny


class _Undecodable:
    """A request whose bytes did not parse as its message, with the parser's error."""

    def __init__(self, error: DecodeError) -> None:
        self.error = error


class RequestDecodingInterceptor(grpc.ServerInterceptor):
    """Refuses a request whose bytes are not a valid message (truncated, corrupt, nested past
    protobuf's limit) with INVALID_ARGUMENT: grpcio's own answer is INTERNAL, with a
    traceback in the server's log, for what is the caller's error. Put it last among the
    server's interceptors, next to the services' handlers."""

    def intercept_service(self, continuation: Callable, handler_call_details: object) -> object:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None or handler.request_deserializer is None:
            return handler
        parse, behavior = handler.request_deserializer, handler.unary_unary
        method = handler_call_details.method

        def parse_or_keep_error(raw: bytes) -> object:
            try:
                return parse(raw)
            except DecodeError as e:
                return _Undecodable(e)

        def checked(request: object, context: grpc.ServicerContext) -> object:
            if isinstance(request, _Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{method}: the request is not a valid message ({request.error})")
            return behavior(request, context)

        return handler._replace(request_deserializer=parse_or_keep_error, unary_unary=checked)


def _is_health_check(handler_call_details: grpc.HandlerCallDetails) -> bool:
    return handler_call_details.method.startswith("/grpc.health.v1.Health/")


def _metadata_value(metadata: Iterable[tuple[str, str | bytes]] | None, key: str) -> str | None:
    for k, value in metadata or ():
        if k == key:
            return value.decode() if isinstance(value, bytes) else value
    return None


def _with_behavior(handler: grpc.RpcMethodHandler,
                   wrap: Callable[[Callable], Callable]) -> grpc.RpcMethodHandler:
    """``handler`` with its behavior replaced by ``wrap(behavior)`` (the shard's calls are
    unary; rows stream over the data plane)."""
    if handler.unary_unary is not None:
        return handler._replace(unary_unary=wrap(handler.unary_unary))
    return handler


class IncarnationInterceptor(grpc.ServerInterceptor):
    """Ties every call to one process of the shard.

    Each reply carries ``incarnation`` (trailing metadata ``xcls-incarnation``, and the
    ``incarnation`` field of a StatsReply). A call whose ``xcls-expect-incarnation`` metadata
    names another incarnation is refused with ABORTED before the servicer runs: its client
    learned an earlier process of this shard, whose state this one need not have (a restart
    comes back empty or at a snapshot), so a push from it must not be applied. Calls without
    the key (first contact, tools) and health checks pass.
    """

    def __init__(self, incarnation: str, shard_id: int, num_shards: int) -> None:
        self.incarnation = incarnation
        self._where = f"shard {shard_id} of {num_shards}"
        self._trailer = ((INCARNATION_KEY, incarnation),)

    def intercept_service(self, continuation: Callable, handler_call_details: object) -> object:
        handler = continuation(handler_call_details)
        if handler is None or _is_health_check(handler_call_details):
            return handler
        expected = _metadata_value(handler_call_details.invocation_metadata,
                                   EXPECT_INCARNATION_KEY)
        if expected is not None and expected != self.incarnation:
            return _with_behavior(handler, lambda _behavior: self._refusal(expected))
        return _with_behavior(handler, self._stamped)

    def _stamped(self, behavior: Callable) -> Callable:
        def stamped(request: object, context: grpc.ServicerContext) -> object:
            context.set_trailing_metadata(self._trailer)
            reply = behavior(request, context)
            if isinstance(reply, pb.StatsReply):
                reply.incarnation = self.incarnation
            return reply

        return stamped

    def _refusal(self, expected: str) -> Callable:
        message = str(ShardRestarted.refusal(self._where, self.incarnation, expected))

        def refuse(request: object, context: grpc.ServicerContext) -> None:
            context.set_trailing_metadata(self._trailer)
            context.abort(grpc.StatusCode.ABORTED, message)

        return refuse


class ReadinessGate(grpc.ServerInterceptor):
    """Refuses the shard's calls with UNAVAILABLE until ``open`` (health checks pass): a shard
    binds its port before it restores its snapshot, so that a health check tells "starting"
    (NOT_SERVING) from "dead" (no answer), and no call sees a half-restored table."""

    def __init__(self, ready: bool) -> None:
        self.ready = threading.Event()
        if ready:
            self.ready.set()

    def open(self) -> None:
        self.ready.set()

    def intercept_service(self, continuation: Callable, handler_call_details: object) -> object:
        handler = continuation(handler_call_details)
        if handler is None or self.ready.is_set() or _is_health_check(handler_call_details):
            return handler

        def refuse(request: object, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          "the shard is restoring its snapshot; it serves once health says "
                          "SERVING")

        return _with_behavior(handler, lambda _behavior: refuse)


class RequestMetricsInterceptor(grpc.ServerInterceptor):
    """Times each call of the shard service and counts how it ended. Put it first among the
    server's interceptors: the handler it wraps is then whatever the others chose, so a call
    they refuse (authentication, a stale incarnation) is counted too."""

    def intercept_service(self, continuation: Callable, handler_call_details: object) -> object:
        handler = continuation(handler_call_details)
        name: str = handler_call_details.method
        if handler is None or not name.startswith(SHARD_METHOD_PREFIX):
            return handler
        method = name[len(SHARD_METHOD_PREFIX):]
        if handler.unary_unary is not None:  # every shard call is unary
            return handler._replace(unary_unary=_timed_unary(method, handler.unary_unary))
        return handler


def _outcome(context: grpc.ServicerContext, failed: bool) -> str | None:
    """The name of the status a call ends with: the one it aborted or set, UNKNOWN for an
    escaped error, None for OK."""
    code = context.code()
    if code is None:
        return "UNKNOWN" if failed else None
    return code.name


def _timed_unary(method: str, behavior: Callable) -> Callable:
    def timed(request: object, context: grpc.ServicerContext) -> object:
        started, failed = time.perf_counter(), True
        try:
            reply = behavior(request, context)
            failed = False
            return reply
        finally:
            record_call(method, time.perf_counter() - started, _outcome(context, failed))

    return timed

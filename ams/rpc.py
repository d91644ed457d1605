"""What the xcls gRPC services share: typed errors to and from gRPC status codes, the
shared-secret check, and starting a server with its health service."""

from __future__ import annotations

import functools
import hmac
import logging
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ams.errors import AmsError, error_from_code

log = logging.getLogger(__name__)


def rpc_method(method: Callable) -> Callable:
    """Turn AmsError into its gRPC status; anything else into INTERNAL (and a log line)."""

    @functools.wraps(method)
    def wrapper(self: object, request: object, context: grpc.ServicerContext) -> object:
        try:
            return method(self, request, context)
        except AmsError as e:
            context.abort(getattr(grpc.StatusCode, e.code), str(e))
        except Exception as e:
            log.exception("rpc_failed method=%s", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    return wrapper


def error_from_rpc(e: grpc.RpcError, where: str, method: str) -> AmsError:
    """The typed ``ams.errors`` class of a failed call's status; ``where`` names the peer
    (e.g. ``"shard 127.0.0.1:5000"``) in the message."""
    code = e.code()
    return error_from_code(code.name if code else "UNKNOWN", f"{where} {method}: {e.details()}")


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` on every call except health checks."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(request: object, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong auth token (metadata 'authorization: Bearer ...')")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable, handler_call_details: object) -> object:
        if handler_call_details.method.startswith("/grpc.health.v1.Health/"):
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


def start_serving(server: grpc.Server, service_name: str, host: str, port: int,
                  credentials: grpc.ServerCredentials | None = None, serving: bool = True
                  ) -> tuple[int, health.HealthServicer]:
    """Bind ``server`` (its services already added) to ``host:port`` (TLS with
    ``credentials``), add the gRPC health service, start, and report ``service_name`` SERVING
    (NOT_SERVING with ``serving=False``: the caller sets it once it is ready).
    Returns (the bound port, the health servicer); OSError if the address cannot be bound."""
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials is not None \
            else server.add_insecure_port(address)
    except RuntimeError:  # grpcio's way of saying the bind failed
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {address}: the port is in use, or the address is not "
                      "one of this host's")
    server.start()
    set_serving(health_servicer, service_name, serving)
    return bound, health_servicer


def set_serving(health_servicer: health.HealthServicer, service_name: str, serving: bool) -> None:
    """Report SERVING (or NOT_SERVING) for ``service_name`` and for the server as a whole."""
    status = health_pb2.HealthCheckResponse.SERVING if serving \
        else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", service_name):
        health_servicer.set(name, status)

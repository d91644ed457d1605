"""Typed errors (``ams.errors``) to and from gRPC status codes: a servicer method raises an
``AmsError`` and the caller catches the same class, local and remote alike."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import grpc

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


def error_from_rpc(e: grpc.RpcError, where: str) -> AmsError:
    """The typed ``ams.errors`` class of a failed call's status; ``where`` names the peer and
    the method (e.g. ``"shard 127.0.0.1:5000 Stats"``) in the message."""
    code = e.code()
    return error_from_code(code.name if code else "UNKNOWN", f"{where}: {e.details()}")

"""What every xcls gRPC servicer method shares: typed errors become their gRPC status."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import grpc

from ams.errors import AmsError

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

"""The one retry rule of the client's remote calls, control plane and data plane alike.

A call has one deadline, its timeout from its start; its attempts share it, with a jittered
exponential pause between them. A failure is retried when it may be transient (UNAVAILABLE,
DEADLINE_EXCEEDED, a lost connection) and time is left; every other failure, and the last one,
raises its typed ``ams.errors`` class at once. Pushes are safe to retry: each carries (client
id, sequence) and a shard applies a sequence once.

    for attempt in retry.attempts(f"shard {address} Stats"):
        with attempt:
            return stub.Stats(request, timeout=attempt.remaining())
"""

from __future__ import annotations

import logging
import random
import ssl
import time
from collections.abc import Iterator
from types import TracebackType

import grpc

from ams.errors import AmsError, InvalidArgument, error_from_code
from ams.wire.frames import FrameError
from ams.wire.status import error_from_rpc

log = logging.getLogger(__name__)

RETRYABLE_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})


def typed_failure(error: BaseException, where: str) -> AmsError | None:
    """``error`` as the typed error a caller sees, its message led by ``where``; None for an
    error that is not a remote call's failure (a bug, a KeyboardInterrupt: left as it is)."""
    if isinstance(error, grpc.RpcError):
        return error_from_rpc(error, where)
    if isinstance(error, FrameError):  # a reply this client cannot read: the stream is lost
        return InvalidArgument(f"{where}: {error}")
    if isinstance(error, AmsError):
        return error_from_code(error.code, f"{where}: {error}")
    if isinstance(error, (OSError, ssl.SSLError)):  # TimeoutError included
        code = "DEADLINE_EXCEEDED" if isinstance(error, TimeoutError) else "UNAVAILABLE"
        return error_from_code(code, f"{where}: {error or type(error).__name__}")
    return None


class Attempt:
    """One try of a call: a context manager that lets a retryable failure pass (the loop over
    ``Retry.attempts`` then tries again) and raises every other one as its typed error."""

    def __init__(self, where: str, deadline: float, last: bool) -> None:
        self.where, self.deadline, self.last = where, deadline, last
        self.failure: AmsError | None = None

    def remaining(self) -> float:
        """Seconds left before the call's deadline (at least a millisecond, so that a timeout
        computed from it is never zero, which gRPC and sockets read as no timeout)."""
        return max(1e-3, self.deadline - time.monotonic())

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> bool:
        if error is None:
            return False
        failure = typed_failure(error, self.where)
        if failure is None:
            return False
        if failure.code not in RETRYABLE_CODES or self.last \
                or time.monotonic() >= self.deadline:
            raise failure from None
        self.failure = failure
        return True


class Retry:
    """Attempts of a call within ``timeout`` seconds, at most ``retries`` + 1 of them."""

    def __init__(self, timeout: float, retries: int) -> None:
        self.timeout, self.retries = timeout, retries

    def attempts(self, where: str, timeout: float | None = None) -> Iterator[Attempt]:
        """The attempts of one call (``timeout``: this call's, instead of the client's); the
        loop ends when an attempt succeeds or its failure was raised. ``where`` names the peer
        and method in the messages."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        for number in range(self.retries + 1):
            attempt = Attempt(where, deadline, last=number == self.retries)
            yield attempt
            if attempt.failure is None:
                return
            pause = min(2.0, 0.05 * 2**number) * (0.5 + random.random())
            log.debug("retry where=%s error=%s pause=%.2f", where, attempt.failure, pause)
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))

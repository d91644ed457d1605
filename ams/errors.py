"""Typed AMS errors. Each carries the name of its gRPC status code (a string, so that the pure
modules that raise them never import grpc); the server maps the name to ``grpc.StatusCode`` and
the client maps a status back to the same class, so local and remote callers catch one type."""

from __future__ import annotations

# How much of a caller's value an error message quotes: a request may carry a name megabytes
# long, and an error echoes it into logs and replies.
ECHO_CHARS = 80


def clip(text: str, limit: int = ECHO_CHARS) -> str:
    """``text`` for an error message, cut to its first ``limit`` characters plus "…(N chars)"
    when longer."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…({len(text)} chars)"


def shorten(value: object, limit: int = ECHO_CHARS) -> str:
    """``repr(value)`` for an error message, clipped as ``clip`` does."""
    return clip(repr(value), limit)


class AmsError(Exception):
    """Base class. ``code`` is a ``grpc.StatusCode`` member name."""

    code = "UNKNOWN"


class InvalidArgument(AmsError, ValueError):
    """Wrong dtype, shape, byte length, non-finite value, bad spec."""

    code = "INVALID_ARGUMENT"


class IdOutOfRange(AmsError, IndexError):
    """An id < 0, >= num_rows, or not owned by the shard that was asked."""

    code = "OUT_OF_RANGE"


class TableNotFound(AmsError, KeyError):
    """No table of that name on this shard."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class TableExists(AmsError):
    """A table of that name exists with a different spec."""

    code = "ALREADY_EXISTS"


class FailedPrecondition(AmsError):
    """The request is valid but the state is not ready for it (e.g. no graph built yet)."""

    code = "FAILED_PRECONDITION"


class RequestTooLarge(AmsError):
    """Over the shard's message or row limit; the client splits requests below it."""

    code = "RESOURCE_EXHAUSTED"


class StorageFull(RequestTooLarge):
    """A table's files do not fit the shard's storage dir (free disk space, quota or the
    process's file-size limit). A ``RequestTooLarge``, which is what a remote caller gets."""


class StorageError(FailedPrecondition):
    """A table's files under the storage dir cannot be used: damaged, of another table or
    shard layout, unwritable, or in use by another store."""


class Unauthenticated(AmsError):
    """Missing or wrong shared-secret token."""

    code = "UNAUTHENTICATED"


class Unavailable(AmsError, ConnectionError):
    """The shard could not be reached (after retries, where retrying is safe)."""

    code = "UNAVAILABLE"


class SnapshotError(AmsError):
    """A snapshot is missing, partial, corrupt or does not fit the tables."""

    code = "FAILED_PRECONDITION"


class ShardRestarted(AmsError):
    """A shard is not the process this client first talked to (it restarted, so its state
    may be another step's), or the client was invalidated: the call was refused before it
    touched state. Every shard and worker must roll back to one checkpoint's step."""

    code = "ABORTED"

    @classmethod
    def refusal(cls, shard: str, incarnation: str, expected: str) -> ShardRestarted:
        """The refusal of a call that expected incarnation ``expected`` of ``shard`` (e.g.
        "shard 1 of 2"), which is now ``incarnation``."""
        return cls(f"{shard} restarted: it is incarnation {incarnation}, the caller expected "
                   f"{expected}; nothing was changed (roll back to a checkpoint, then relearn "
                   "the incarnations)")


ERRORS_BY_CODE: dict[str, type[AmsError]] = {
    cls.code: cls
    for cls in (InvalidArgument, IdOutOfRange, TableNotFound, TableExists, FailedPrecondition,
                RequestTooLarge, Unauthenticated, Unavailable, ShardRestarted)
}


def error_from_code(code: str, message: str) -> AmsError:
    """The typed error of a gRPC status code name (``AmsError`` carrying the code for one
    without a class of its own, e.g. DEADLINE_EXCEEDED)."""
    cls = ERRORS_BY_CODE.get(code, AmsError)
    err = cls(message)
    if cls is AmsError:
        err.code = code
    return err

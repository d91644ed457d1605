"""Typed errors of the gear bridge.

Both are raised by the codecs in :mod:`bridge.codec`. The caches and the gradient consumer catch
them, count them and treat the entry as missing (features) or dead-letter it (gradients), so a
garbage entry is never trained on and never stops training.
"""

from __future__ import annotations


class BridgeError(Exception):
    """Base class of every error the bridge raises on purpose."""


class CorruptEntryError(BridgeError, ValueError):
    """A cached feature entry is not what this cache writes: bad magic, unknown dtype code,
    wrong dim, wrong length or non-finite values."""


class MalformedGradientError(BridgeError, ValueError):
    """A gradient stream entry or accumulator record cannot be decoded: missing field, wrong
    dtype, wrong dim, payload length that does not match dim x itemsize, non-finite values."""

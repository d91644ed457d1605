"""Counters of the caches and the gradient accumulators (plain numbers, read them any time)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class CacheMetrics:
    """Counts since the cache was opened.

    ``expired``: found but older than ``ttl_s``; ``corrupt``: found but undecodable (see
    :class:`bridge.errors.CorruptEntryError`); ``unavailable``: ids answered as misses because the
    backend could not be reached. Every id of a ``get`` lands in exactly one of ``hits`` or
    ``misses``; expired/corrupt/unavailable ids are also counted as misses.
    """

    hits: int = 0
    misses: int = 0
    expired: int = 0
    corrupt: int = 0
    unavailable: int = 0
    puts: int = 0
    dropped_puts: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class AccumulatorMetrics:
    """Counts of one accumulator or consumer since it was created.

    ``added``: gradients accepted; ``emitted``: means handed to the slow gear; ``delivered``:
    means returned by ``read``; ``applied``: means acked; ``duplicates``: entries skipped because
    their (sample id, version, seq) was already applied; ``corrupt``: records or stream entries
    rejected; ``claimed``: entries taken over from a dead consumer; ``dropped``: gradients lost
    (the backend could not be reached and no fallback had room, or other workers kept touching
    the same samples); ``bytes``: gradient payload bytes moved. ``outages``: times the backend
    stopped answering; ``outage_s``: seconds of the outages that ended; ``fallback``: gradients
    handed to the in-process fallback while the backend was down
    (:class:`bridge.redis_accumulator.RedisGradientAccumulator`).
    """

    added: int = 0
    emitted: int = 0
    delivered: int = 0
    applied: int = 0
    duplicates: int = 0
    corrupt: int = 0
    claimed: int = 0
    dropped: int = 0
    bytes: int = 0
    outages: int = 0
    outage_s: float = 0.0
    fallback: int = 0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

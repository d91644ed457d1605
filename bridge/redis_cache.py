"""Feature cache in Redis, shared by every worker and host of a job.

Keys are ``{prefix}:f:{sample id}`` so jobs sharing a server never see each other's entries.
Every write is ``SET key value EX ttl`` (pipelined, no transaction): Redis expiry keeps memory
bounded even if nobody reads, and a rewrite gets a fresh TTL. EX is whole seconds, rounded up;
the exact ``ttl_s`` is enforced on read from the entry's own timestamp. Reads are MGETs of
``CHUNK`` keys, all in one pipeline (one round trip).

Redis down: ``get`` answers all-miss, ``put`` is dropped, a rate-limited warning is logged, and
for ``bridge.redis_util.RETRY_AFTER_S`` seconds no call touches the network; after that the next
call tries again and redis-py reconnects. Training never sees an exception from here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import redis

from bridge.cache import FeatureCacheBase
from bridge.redis_util import RedisGuard, glob_escape

# Keys per MGET (and per SCAN step when dropping entries): Redis runs one command at a time, so
# a large batch is read in commands of about 1 MiB of replies (1024 fp16 features of d=512)
# that let other workers' commands in between.
CHUNK = 1024


class RedisFeatureCache(FeatureCacheBase):
    """Feature cache over ``client`` (make it with :func:`bridge.redis_util.make_client` for
    short timeouts). ``prefix`` names the job; ``ttl_s`` is required (it is the only bound on
    Redis memory besides ``maxmemory``). Other arguments as in
    :class:`bridge.cache.FeatureCacheBase`."""

    def __init__(self, client: redis.Redis, dim: int, prefix: str, ttl_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        if ttl_s is None:
            raise ValueError("RedisFeatureCache needs ttl_s: unexpiring keys would fill Redis")
        super().__init__(dim, ttl_s, clock)
        if not prefix or ":" in prefix:
            raise ValueError(f"prefix must be a non-empty name without ':', got {prefix!r}")
        self.client = client
        self.prefix = prefix
        self.ex_s = max(1, math.ceil(ttl_s))
        self.guard = RedisGuard(f"feature_cache:{prefix}")

    def key(self, sample_id: int) -> bytes:
        """The Redis key of one sample's entry."""
        return f"{self.prefix}:f:{sample_id}".encode()

    def _fetch(self, ids: np.ndarray) -> list[bytes | None] | None:
        if not self.guard.usable():
            return None
        keys = [self.key(i) for i in ids.tolist()]
        try:
            pipe = self.client.pipeline(transaction=False)
            chunk = CHUNK
            for start in range(0, len(keys), chunk):
                pipe.mget(keys[start:start + chunk])
            parts = pipe.execute()
        except redis.RedisError as e:
            self.guard.failed("get", e)
            return None
        self.guard.ok()
        return [blob for part in parts for blob in part]

    def _store(self, ids: np.ndarray, blobs: list[bytes]) -> int:
        if not self.guard.usable():
            return 0
        try:
            pipe = self.client.pipeline(transaction=False)
            for i, blob in zip(ids.tolist(), blobs, strict=True):
                pipe.set(self.key(i), blob, ex=self.ex_s)
            # raise_on_error=False: one rejected SET (e.g. OOM under maxmemory noeviction)
            # must not hide that the others landed; failures are counted below.
            results = pipe.execute(raise_on_error=False)
        except redis.RedisError as e:
            self.guard.failed("put", e)
            return 0
        self.guard.ok()
        failed = [r for r in results if isinstance(r, Exception)]
        if failed:
            self._warn.warn("redis_set_rejected", prefix=self.prefix, count=len(failed),
                            error=repr(str(failed[0])))
        return len(blobs) - len(failed)

    def _delete_where(self, doomed: Callable[[bytes], bool]) -> int:
        if not self.guard.usable():
            return 0
        deleted = 0
        try:
            chunk = CHUNK
            keys = list(self.client.scan_iter(match=glob_escape(self.prefix) + b":f:*",
                                              count=chunk))
            for start in range(0, len(keys), chunk):
                part = keys[start:start + chunk]
                gone = [key for key, blob in zip(part, self.client.mget(part), strict=True)
                        if blob is not None and doomed(blob)]
                if gone:
                    deleted += self.client.delete(*gone)
        except redis.RedisError as e:
            self.guard.failed("drop", e)
            return deleted
        self.guard.ok()
        return deleted

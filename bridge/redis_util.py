"""Redis connection settings and the circuit breaker shared by the Redis cache and accumulator.

Training must not wait on a dead Redis: sockets time out fast, redis-py retries a failed command
once at once (that reconnects a pooled connection that died with a restarted server), and after
a failure :class:`RedisGuard` answers "down" without touching the network for ``RETRY_AFTER_S``
seconds, then lets the next call try again. redis-py reconnects by itself when that call runs.
"""

from __future__ import annotations

import logging
import re
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from bridge.ratelimit import RateLimitedLog

log = logging.getLogger(__name__)

# Seconds a socket waits for Redis to connect or answer: a healthy Redis on the job's network
# answers in milliseconds, and a training step must not stall longer on a dead one.
SOCKET_TIMEOUT_S = 0.5
# Seconds a guard answers "down" after a failure before a call tries Redis again: a dead Redis
# then costs one failed call a second (a socket timeout at most), not one per training step.
RETRY_AFTER_S = 1.0


def make_client(host: str = "127.0.0.1", port: int = 6379, db: int = 0,
                password: str | None = None, username: str | None = None) -> redis.Redis:
    """A bytes-in/bytes-out client with short timeouts (``SOCKET_TIMEOUT_S``) and a single
    immediate retry (``username``: a Redis ACL user; None is the default user)."""
    return redis.Redis(
        host=host, port=port, db=db, username=username, password=password,
        socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S,
        retry=Retry(NoBackoff(), 1), decode_responses=False,
    )


class RedisGuard:
    """Circuit breaker around one client: ``usable()`` is False for ``RETRY_AFTER_S`` seconds
    after ``failed()``; ``ok()`` closes it again.

    An outage runs from the first failed call to the next successful one: :meth:`failed` says
    whether it began one, :meth:`ok` how long the one it ended lasted; both are logged
    (rate-limited), the end with its length.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._down_until = 0.0
        self._down_since: float | None = None
        self._log = RateLimitedLog(log)

    def usable(self) -> bool:
        return time.monotonic() >= self._down_until

    def failed(self, op: str, err: Exception) -> bool:
        """Record a failed call; True when it began an outage."""
        now = time.monotonic()
        began = self._down_since is None
        if began:
            self._down_since = now
        self._down_until = now + RETRY_AFTER_S
        self._log.warn("redis_unavailable", who=self.name, op=op,
                       error=type(err).__name__, retry_after_s=RETRY_AFTER_S)
        return began

    def ok(self) -> float | None:
        """Record a successful call; the seconds the outage it ended lasted, or None."""
        if self._down_since is None:
            return None
        seconds = time.monotonic() - self._down_since
        self._down_since = None
        self._log.info("redis_recovered", who=self.name, outage_s=f"{seconds:.1f}")
        return seconds

    def down_for(self) -> float:
        """Seconds the outage under way has lasted (0.0 while Redis answers)."""
        return 0.0 if self._down_since is None else time.monotonic() - self._down_since


def glob_escape(name: str) -> bytes:
    """``name`` as a literal in a Redis MATCH pattern (a job prefix may hold ``*?[]\\``)."""
    return re.sub(rb"([*?\[\]\\])", rb"\\\1", name.encode())

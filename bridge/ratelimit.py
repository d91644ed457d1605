"""A warning that is logged at most once per interval, with the number it swallowed.

A cache on a dead Redis would otherwise log once per training step (thousands of lines a
minute) and bury everything else.
"""

from __future__ import annotations

import logging
import threading
import time

# Seconds between two lines of one event: a dead Redis fails every step, and a line every
# 10 s (with the count it swallowed) says it still does without burying the rest of the log.
INTERVAL_S = 10.0


class RateLimitedLog:
    """``warn(event, **fields)`` (or ``info``) logs ``event key=value ... suppressed=N`` at most
    once per ``INTERVAL_S`` seconds per event name."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warn(self, event: str, **fields: object) -> None:
        self.log(logging.WARNING, event, **fields)

    def info(self, event: str, **fields: object) -> None:
        self.log(logging.INFO, event, **fields)

    def log(self, level: int, event: str, **fields: object) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(event)
            if last is not None and now - last < INTERVAL_S:
                self._suppressed[event] = self._suppressed.get(event, 0) + 1
                return
            self._last[event] = now
            suppressed = self._suppressed.pop(event, 0)
        kv = " ".join(f"{k}={v}" for k, v in fields.items())
        self._logger.log(level, "%s %s suppressed=%d", event, kv, suppressed)

"""What a serving or supervising role's main thread waits for: SIGTERM, SIGINT, or another
thread's word.

Not a ``threading.Event`` set by a signal handler. Python runs a handler on the main thread
between two bytecodes, and the main thread is the one blocked in the wait: a signal that
arrives after the wait's last check for pending signals and before it blocks runs no handler
until something else wakes the thread, so a process waiting without a timeout sleeps through
SIGTERM until its supervisor kills it; and ``Event.set`` in a handler that lands while the
main thread's ``Event.wait`` holds the event's lock deadlocks. Here the interpreter's own
C-level handler writes the signal's number to a pipe (``signal.set_wakeup_fd``) the moment the
signal arrives, and the waiter blocks in ``poll`` on that pipe: a byte written before the
wait is still there when it starts.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import time

log = logging.getLogger("xcls.stop")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_SET = 0  # the byte ``set`` writes; no signal has number 0
_STOP_BYTES = frozenset((_SET, *STOP_SIGNALS))


class StopRequest:
    """Set by SIGTERM or SIGINT or by ``set`` from any thread. The constructor installs the
    handlers and the interpreter's wakeup fd, so it runs on the main thread, once per
    process; ``wait`` and ``is_set`` belong to the main thread too."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # a full pipe already says "stop"
        # poll, not select: a shard may hold more than select's 1,024 descriptors
        self._news = select.poll()
        self._news.register(self._read, select.POLLIN)
        self._asked: int | None = None  # None: not yet; 0: ``set``; else the signal's number
        for sig in STOP_SIGNALS:
            # the wakeup fd has the news; the handler only replaces the default action (exit)
            signal.signal(sig, lambda signum, frame: None)
        signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)

    def set(self) -> None:
        """Ask for a stop (from any thread)."""
        try:
            os.write(self._write, bytes([_SET]))
        except BlockingIOError:
            pass

    def is_set(self) -> bool:
        """Whether a stop was asked for."""
        return self.wait(0)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a stop is asked for (at once if it already was), or for ``timeout``
        seconds; whether one was."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._asked is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._read_news(left)
            if left == 0:
                break
        return self._asked is not None

    @property
    def signum(self) -> int:
        """The number of the signal that asked for the stop; 0 when none did (not yet, or
        ``set`` asked first)."""
        self.is_set()
        return self._asked or 0

    def _read_news(self, timeout: float | None) -> None:
        if not self._news.poll(None if timeout is None else timeout * 1000):
            return
        # Other signals with Python handlers write their numbers too; only ours mean stop.
        for byte in os.read(self._read, 4096):
            if byte in _STOP_BYTES and self._asked is None:
                self._asked = byte
                log.info("stop_requested signal=%s",
                         signal.Signals(byte).name if byte != _SET else "none")

"""What a serving role's main thread waits for: SIGTERM, SIGINT, or another thread's word.

Not a ``threading.Event`` set by a signal handler. Python runs a handler on the main thread
between two bytecodes, and the main thread is the one blocked in the wait: a signal that
arrives after the wait's last check for pending signals and before it blocks runs no handler
until something else wakes the thread, so the process sleeps through SIGTERM until its
supervisor kills it (and ``Event.set`` in a handler that lands while ``Event.wait`` holds the
event's lock deadlocks). Here the interpreter's own C-level handler writes the signal's number
to a pipe (``signal.set_wakeup_fd``) the moment the signal arrives, and the waiter blocks in
``select`` on that pipe: a byte written before the wait is still there when it starts.
"""

from __future__ import annotations

import os
import select
import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_SET = 0  # the byte ``set`` writes; no signal has number 0
_STOP_BYTES = frozenset((_SET, *STOP_SIGNALS))


class StopRequest:
    """Set by SIGTERM or SIGINT or by ``set`` from any thread; ``wait`` blocks until then.
    The constructor installs the handlers and the interpreter's wakeup fd, so it runs on the
    main thread, once per process."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # a full pipe already says "stop"
        self._stopped = False
        for sig in STOP_SIGNALS:
            # the wakeup fd has the news; the handler only replaces the default action (exit)
            signal.signal(sig, lambda signum, frame: None)
        signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)

    def set(self) -> None:
        """Ask the waiter to stop (from any thread)."""
        try:
            os.write(self._write, bytes([_SET]))
        except BlockingIOError:
            pass

    def is_set(self) -> bool:
        """Whether a stop was asked for."""
        return self._stopped or self._read_news(timeout=0)

    def wait(self) -> None:
        """Block until a stop is asked for (at once if it already was)."""
        while not (self._stopped or self._read_news(timeout=None)):
            pass

    def _read_news(self, timeout: float | None) -> bool:
        # Other signals with Python handlers write their numbers too; only ours mean stop.
        if select.select([self._read], [], [], timeout)[0]:
            self._stopped = not _STOP_BYTES.isdisjoint(os.read(self._read, 4096))
        return self._stopped

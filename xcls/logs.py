"""Structured (logfmt) logging for the command line.

Library modules use plain ``logging.getLogger(__name__)`` with ``event key=value`` messages;
only the command line decides where logs go and how loud they are.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO


class LogfmtFormatter(logging.Formatter):
    """``ts=... level=... logger=... <message>``: one greppable line per event."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        line = f"ts={ts}.{int(record.msecs):03d} level={record.levelname.lower()} " \
               f"logger={record.name} {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class StderrHandler(logging.StreamHandler):
    """A stream handler that writes to ``sys.stderr`` as it is when each record comes: the
    command line may be run in process (tests, notebooks), where the stream there was at
    setup is later replaced and closed."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def setup_logging(verbosity: int = 0) -> None:
    """Route logs to stderr. ``verbosity``: -1 warnings only, 0 key events, 1+ debug."""
    level = logging.WARNING if verbosity < 0 else logging.INFO if verbosity == 0 else logging.DEBUG
    handler = StderrHandler()
    handler.setFormatter(LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Third-party chatter stays at warnings unless debugging.
    for noisy in ("grpc", "urllib3", "PIL", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbosity > 1 else logging.WARNING)

"""Command-line logging (xcls.logs): logfmt lines on whatever stderr is at each record."""

from __future__ import annotations

import io
import logging
import re
import sys

from xcls.logs import setup_logging


def test_records_go_to_the_stderr_of_the_moment(monkeypatch):
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging(0)
        logging.getLogger("xcls.test").info("event=one n=%d", 1)
        first.close()  # as pytest closes a test's captured stream, or a notebook its own
        second = io.StringIO()
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger("xcls.test").warning("event=two")
        logging.getLogger("xcls.test").debug("event=hidden")  # verbosity 0: not shown
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
    lines = second.getvalue().splitlines()
    assert len(lines) == 1
    assert re.fullmatch(r"ts=\S+ level=warning logger=xcls\.test event=two", lines[0])

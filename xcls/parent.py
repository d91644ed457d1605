"""A process started by ``xcls cluster up`` (or any xcls launcher) ends with its launcher.

The launcher starts its shards and torchrun launchers in sessions of their own, so that a
Ctrl-C at its terminal reaches it alone and it stops them in order; nothing else tied them to
its life, and a launcher killed with SIGKILL left them serving. It names itself in
``XCLS_PARENT_PID``, and the child asks the kernel for a SIGTERM when its parent dies (Linux's
``PR_SET_PDEATHSIG``), which it then handles as any stop. The child takes the variable out of
its environment first: its own children (torchrun's workers) follow their launcher, not it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_PID_ENV = "XCLS_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def exit_with_parent() -> None:
    """Ask for SIGTERM when the launcher named in ``XCLS_PARENT_PID`` dies, and end now if it
    died already; nothing without the variable, or off Linux."""
    parent = os.environ.pop(PARENT_PID_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    if ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return
    if os.getppid() != int(parent):  # it died before the request was made
        sys.exit(128 + signal.SIGTERM)

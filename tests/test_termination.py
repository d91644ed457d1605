"""SIGTERM at step boundaries (workers.termination), in a process of its own: the signals go
to that process, not to the test runner."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from workers.termination import TerminationRequest
    with TerminationRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested
    # on its way out, as a rank is when torchrun stops the ranks still running because
    # another has exited 143: the second signal must not end it before it says where it stopped
    os.kill(os.getpid(), signal.SIGTERM)
    print("stopped by SIGTERM, checkpoint saved")
    sys.exit(143)
""")


def test_a_second_sigterm_after_a_stop_does_not_cut_the_way_out():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=60)
    assert (done.returncode, done.stdout) == (143, "stopped by SIGTERM, checkpoint saved\n"), \
        (done.returncode, done.stderr)


def test_without_a_stop_sigterm_acts_as_before_after_the_context():
    script = SCRIPT.replace("os.kill(os.getpid(), signal.SIGTERM)\n    assert stop.requested",
                            "pass")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == -signal.SIGTERM and done.stdout == ""

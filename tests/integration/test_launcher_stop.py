"""Stopping a launcher role of ``xcls cluster up`` (``xcls.shards.stop``) whose processes do
not stop in time: a torchrun whose worker hangs on its way out."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest

from xcls.shards import spawn, stop

# A launcher as torchrun is one: it waits for its worker, which it started in a session of its
# own, and the worker ignores SIGTERM (stuck in a collective, say).
LAUNCHER = textwrap.dedent("""
    import signal, subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('worker up', flush=True); time.sleep(120)"], start_new_session=True)
    print(f"worker pid {worker.pid}", flush=True)
    signal.signal(signal.SIGTERM, lambda *a: None)
    worker.wait()
""")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    return state != "Z"


@pytest.mark.parametrize("signal_children", [True, False])
def test_a_launcher_past_its_stop_timeout_goes_with_its_workers(tmp_path, signal_children):
    """Its workers asked to stop (the slow gear's torchrun) or not (the trainers')."""
    log = tmp_path / "launcher.log"
    child = spawn("slow-gear", [sys.executable, "-c", LAUNCHER], log_path=log)
    deadline = time.monotonic() + 60
    while "worker up" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    worker = int(log.read_text().split("worker pid ")[1].split()[0])
    started = time.monotonic()
    stop([child], timeout=1.0, signal_children=signal_children)
    assert time.monotonic() - started < 30
    assert child.proc.returncode is not None
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(worker)  # it was left serving, parented to init, until it chose to end


def test_a_relayed_launcher_whose_worker_holds_the_pipe_does_not_hold_the_stop():
    child = spawn("slow-gear", [sys.executable, "-c", LAUNCHER], prefix="[slow-gear] ")
    time.sleep(2)  # the worker is up and holds the relay's pipe
    started = time.monotonic()
    stop([child], timeout=1.0, signal_children=True)
    assert time.monotonic() - started < 30  # it waited for the worker's 120 s

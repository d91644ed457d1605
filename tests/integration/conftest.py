"""Real shard processes (``python -m xcls serve shard``, through ``xcls.shards``) on 127.0.0.1
for integration tests."""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

import ams
from xcls.shards import ShardProcess, shard_processes


class ClusterFactory:
    """``factory(num_shards, extra_args, data_dir, **options)`` -> serving ShardProcesses
    (options: those of ``xcls.shards.shard_processes``); ``close`` stops them all."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.stack = ExitStack()

    def __call__(self, num_shards: int, extra: list[str] | None = None,
                 data_dir: Path | None = None, **options: object) -> list[ShardProcess]:
        d = data_dir or self.base_dir
        return self.stack.enter_context(shard_processes(
            num_shards, data_dir=d, extra_args=extra or (), log_dir=d, **options))

    def close(self) -> None:
        self.stack.close()


@pytest.fixture
def shard_cluster(tmp_path):
    """Shard processes for one test, stopped after it."""
    factory = ClusterFactory(tmp_path)
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def module_cluster(tmp_path_factory):
    """Shard processes shared by a module's tests (for tests that leave state unchanged)."""
    factory = ClusterFactory(tmp_path_factory.mktemp("cluster"))
    yield factory
    factory.close()


def our_processes(tag: Path) -> list[int]:
    """Pids of live processes whose command line mentions ``tag`` (this test's tmp dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if str(tag) in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


@pytest.fixture
def no_orphans(tmp_path):
    """Fails the test if any process it started outlives it (and kills those, by pid)."""
    yield tmp_path
    left = our_processes(tmp_path)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left running: {left}"


@pytest.fixture
def stopped_for(shard_cluster):
    """(address, stop): one shard process with table "fc" (1,000 rows of 16 float32, seed 4,
    snapshots in its data dir); ``stop(seconds)`` freezes it (SIGSTOP: its sockets still take
    bytes, it answers nothing) for that long."""
    proc = shard_cluster(1)[0]
    client = ams.connect([proc.address])
    client.create_table("fc", num_rows=1000, dim=16, seed=4)
    client.close()
    timers: list[threading.Timer] = []

    def state() -> str:
        return Path(f"/proc/{proc.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    def stop(seconds: float) -> None:
        for timer in timers:  # an earlier stop's resume may not land inside this one
            timer.join()
        proc.proc.send_signal(signal.SIGSTOP)
        give_up = time.monotonic() + 5
        while state() != "T" and time.monotonic() < give_up:  # the signal has landed
            time.sleep(0.001)
        timers.append(threading.Timer(seconds, proc.proc.send_signal, (signal.SIGCONT,)))
        timers[-1].start()

    yield proc.address, stop
    for timer in timers:
        timer.cancel()
    proc.proc.send_signal(signal.SIGCONT)

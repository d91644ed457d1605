"""Real shard processes (``python -m xcls serve shard``) on 127.0.0.1 for integration tests."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest


@dataclass
class ShardProcess:
    """One ``xcls serve shard`` process; ``address`` once it is serving."""

    shard_id: int
    num_shards: int
    data_dir: Path
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    port: int = 0
    log_path: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def port_file(self) -> Path:
        return self.data_dir / f"port-{self.shard_id}-of-{self.num_shards}"

    def launch(self) -> ShardProcess:
        """Start the process (reusing the last port on a restart); see ``wait_serving``."""
        self.port_file.unlink(missing_ok=True)
        self.log_path = self.data_dir / f"shard-{self.shard_id}.log"
        cmd = [sys.executable, "-m", "xcls", "serve", "shard", "--shard-id", str(self.shard_id),
               "--num-shards", str(self.num_shards), "--port", str(self.port),
               "--port-file", str(self.port_file), "--data-dir", str(self.data_dir),
               *self.extra]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        return self

    def start(self, timeout: float = 60.0) -> ShardProcess:
        return self.launch().wait_serving(timeout)

    def wait_serving(self, timeout: float = 60.0) -> ShardProcess:
        port_file = self.port_file
        deadline = time.monotonic() + timeout
        while not port_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"shard exited {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"shard did not start in {timeout}s:\n{self.log()}")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        return self

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


class ClusterFactory:
    """``factory(num_shards, extra_args, data_dir)`` -> started ShardProcesses; ``close`` kills."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.started: list[ShardProcess] = []

    def __call__(self, num_shards: int, extra: list[str] | None = None,
                 data_dir: Path | None = None) -> list[ShardProcess]:
        d = data_dir or self.base_dir
        procs = [ShardProcess(s, num_shards, d, list(extra or [])) for s in range(num_shards)]
        self.started.extend(procs)
        for p in procs:  # boot in parallel, then wait for each
            p.launch()
        for p in procs:
            p.wait_serving()
        return procs

    def close(self) -> None:
        for p in self.started:
            if p.proc is not None and p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait(10)


@pytest.fixture
def shard_cluster(tmp_path):
    """Shard processes for one test, killed after it."""
    factory = ClusterFactory(tmp_path)
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def module_cluster(tmp_path_factory):
    """Shard processes shared by a module's tests (for tests that leave state unchanged)."""
    factory = ClusterFactory(tmp_path_factory.mktemp("cluster"))
    yield factory
    factory.close()

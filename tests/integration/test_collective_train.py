"""Collective placement end to end: ``xcls train`` under torchrun with the rows sliced over two
gloo ranks; a rank killed with SIGKILL, the group restarted by torchrun and resumed from its
checkpoint; then one rank resuming the same run (the slices resharded) and ``xcls export``."""

from __future__ import annotations

import csv
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import free_port, wait_until
from tests.integration.conftest import our_processes


def write_config(glyphs: Path, out: Path, path: Path) -> Path:
    path.write_text(f"""
[data]
train = "{glyphs / 'train'}"
test = "{glyphs / 'test'}"
batch_size = 16
num_workers = 0

[model]
dim = 32

[head]
kind = "knn"
placement = "collective"
k = 4
budget = 40

[optim]
warmup_steps = 5

[graph]
k = 8
rebuild_every = 10

[train]
max_steps = 40
checkpoint_every = 10
log_every = 5
threads = 1
out_dir = "{out}"
""")
    return path


def rank_pid(tag: Path, rank: int) -> int | None:
    """The pid of this test's ``xcls train`` process of global rank ``rank``."""
    for pid in our_processes(tag):
        try:
            env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
            cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes()
        except OSError:
            continue
        if b"torch.distributed.run" not in cmdline and f"RANK={rank}".encode() in env:
            return pid
    return None


def test_a_killed_rank_rolls_the_group_back_then_one_rank_reshards(glyphs_small, no_orphans):
    tmp = no_orphans
    out = tmp / "run"
    config = write_config(glyphs_small, out, tmp / "collective.toml")
    log_path = tmp / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--max-restarts", "1", "--standalone", "-m", "xcls", "train",
           str(config)]
    with open(log_path, "wb") as log:
        # c10d rendezvous with a store per group restart, as 'xcls cluster up' runs torchrun
        # (docs/reliability.md)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={
            **os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    try:
        wait_until((out / "checkpoints" / f"step-{10:012d}" / "worker.pt").exists,
                   "the first periodic checkpoint", 240, [proc], log_path.read_text)
        pid = rank_pid(tmp, 1)
        assert pid is not None, log_path.read_text()
        os.kill(pid, signal.SIGKILL)
        code = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert code == 0, text
    assert "rollback restart=1" in text, text
    assert "resumed step=" in text, text
    with open(out / "train.csv") as f:
        rows = list(csv.DictReader(f))
    assert int(rows[-1]["step"]) == 40
    assert all(math.isfinite(float(r["loss"])) for r in rows)
    # every rank's slice went into one AMS snapshot of two shards
    assert sorted(p.name for p in (out / "ams" / "snapshots" / f"step-{40:012d}").iterdir()) \
        == ["shard-00000-of-00002", "shard-00001-of-00002"]

    # one rank carries on: the two slices come back as one
    one = subprocess.run([sys.executable, "-m", "xcls", "train", str(config), "--set",
                          "train.max_steps=50"], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stdout + one.stderr
    assert "resumed step=40" in one.stderr
    assert (out / "ams" / "snapshots" / f"step-{50:012d}" / "shard-00000-of-00001").exists()
    exported = subprocess.run([sys.executable, "-m", "xcls", "export", str(config), "--out",
                               str(tmp / "export")], capture_output=True, text=True,
                              timeout=300)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert "exported step 50" in exported.stdout


def test_a_rank_whose_agent_counted_no_failure_rolls_back_with_its_group(glyphs_small,
                                                                          no_orphans):
    """After a failure on one host, torchrun's agent there restarts its workers and counts the
    restart (TORCHELASTIC_RESTART_COUNT=1); the agent of a host whose workers were healthy
    restarts them when the first comes back to the rendezvous, and counts none (0). The two
    workers below are that restarted group, as the two agents start it: every rank rolls back
    to the newest checkpoint, rank 0 says so, even with train.resume off."""
    tmp = no_orphans
    out = tmp / "run"
    config = write_config(glyphs_small, out, tmp / "collective.toml")
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    first = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                            "2", "--standalone", "-m", "xcls", "train", str(config), "--set",
                            "train.max_steps=10"], capture_output=True, text=True, timeout=300,
                           env=env)
    assert first.returncode == 0, first.stdout + first.stderr

    port = free_port()
    procs, logs = [], [tmp / f"rank{rank}.log" for rank in range(2)]
    try:
        for rank, agent_restarts in ((0, 0), (1, 1)):
            with open(logs[rank], "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "xcls", "train", str(config), "--set",
                     "train.max_steps=20", "--set", "train.resume=false"],
                    stdout=log, stderr=subprocess.STDOUT, env={
                        **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "1",
                        "TORCHELASTIC_RESTART_COUNT": str(agent_restarts)}))
        codes = [proc.wait(timeout=300) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    texts = [path.read_text(errors="replace") for path in logs]
    assert codes == [0, 0], texts
    assert "rollback restart=1 to_step=10" in texts[0], texts[0]
    assert all("resumed step=10" in text for text in texts), texts
    with open(out / "train.csv") as f:
        assert [int(row["step"]) for row in csv.DictReader(f)] == [5, 10, 15, 20]

"""``xcls cluster up``: real shard processes and torchrun workers on 127.0.0.1, small glyph set."""

from __future__ import annotations

import csv
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ams.shard.restore import read_piece
from tests.conftest import wait_until
from tests.integration.conftest import our_processes

CHECKPOINTS = "checkpoints"


def write_config(glyphs: Path, out: Path, path: Path, max_steps: int, test: str = "") -> Path:
    """A small knn run's config (evaluating on ``test`` when given), checkpointing every 10
    steps."""
    path.write_text(f"""
[data]
train = "{glyphs / 'train'}"
test = "{test}"
batch_size = 32
num_workers = 0

[model]
dim = 64

[head]
kind = "knn"
k = 8
budget = 48

[optim]
warmup_steps = 5

[graph]
k = 16
rebuild_every = 10

[train]
max_steps = {max_steps}
checkpoint_every = 10
log_every = 5
threads = 1
out_dir = "{out}"
""")
    return path


def cluster_cmd(config: Path, workers: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "xcls", "cluster", "up", str(config), "--shards", "2",
            "--workers", str(workers), *extra]


def pushes_per_shard(output: str) -> list[int]:
    return [int(n) for n in re.findall(r"^shard \d+ table fc: (\d+) pushes", output, re.M)]


def train_rows(out: Path) -> list[dict]:
    with open(out / "train.csv") as f:
        return list(csv.DictReader(f))


def test_cluster_trains_then_resumes_with_fewer_workers(glyphs_small, no_orphans):
    """Two workers whose backbone gradients go through top-k compression train and are
    reproducible; one worker then carries on from the shards' snapshot without the two ranks'
    residuals."""
    tmp = no_orphans
    out = tmp / "run"
    config = write_config(glyphs_small, out, tmp / "exp.toml", max_steps=20)
    topk = ("--set", "comm.compression=topk", "--set", "comm.density=0.05",
            "--set", "comm.warmup_steps=2")

    first = subprocess.run(cluster_cmd(config, 2, *topk), capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    assert our_processes(tmp) == []
    rows = train_rows(out)
    losses = [float(r["loss"]) for r in rows]
    assert [int(r["step"]) for r in rows] == [5, 10, 15, 20]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    # the ranks' row gradients go out as one combined push per step
    assert pushes_per_shard(first.stdout) == [20, 20], first.stdout
    assert (out / CHECKPOINTS / f"step-{20:012d}" / "worker.pt").exists()
    assert (out / CHECKPOINTS / f"step-{20:012d}" / "rank-00001.pt").exists()
    assert sorted(p.name for p in (out / "ams" / "snapshots" / f"step-{20:012d}").iterdir()) \
        == ["shard-00000-of-00002", "shard-00001-of-00002"]
    assert re.findall(r"stopped role=(\S+) exit_code=(-?\d+)", first.stderr) == [
        ("workers", "0"), ("shard-0", "0"), ("shard-1", "0")]
    rank1 = torch.load(out / CHECKPOINTS / f"step-{20:012d}" / "rank-00001.pt",
                       weights_only=True)["comm"]
    # rank 1's unsent gradients of the backbone's sparse layers, kept for its next step
    assert rank1["step"] == 20
    assert any(bool(t.abs().sum() > 0) for t in rank1["residual"].values())

    # two workers are reproducible: the same run again gives bit-identical rows and momentum
    again = tmp / "again"
    config2 = write_config(glyphs_small, again, tmp / "exp2.toml", max_steps=20)
    repeat = subprocess.run(cluster_cmd(config2, 2, *topk), capture_output=True, text=True,
                            timeout=300)
    assert repeat.returncode == 0, repeat.stdout + repeat.stderr
    for piece in ("shard-00000-of-00002", "shard-00001-of-00002"):
        a = read_piece(out / "ams" / "snapshots" / f"step-{20:012d}" / piece)[1]["fc"]
        b = read_piece(again / "ams" / "snapshots" / f"step-{20:012d}" / piece)[1]["fc"]
        assert torch.equal(a["rows"], b["rows"]) and torch.equal(a["state"], b["state"])
    backbones = [torch.load(d / CHECKPOINTS / f"step-{20:012d}" / "worker.pt",
                            weights_only=True)["backbone"] for d in (out, again)]
    assert all(torch.equal(backbones[0][k], backbones[1][k]) for k in backbones[0])

    # the same out_dir with one worker: the rows come back from the shards' snapshot
    second = subprocess.run(cluster_cmd(config, 1, *topk, "--set", "train.max_steps=30"),
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resumed step=20" in second.stderr
    # a lone worker sends nothing: its optimizer takes the momentum and weight decay back
    # from the hook
    optimizer = torch.load(out / CHECKPOINTS / f"step-{30:012d}" / "worker.pt",
                           weights_only=True)["optimizer"]
    assert optimizer["param_groups"][0]["momentum"] == 0.9
    assert optimizer["param_groups"][0]["weight_decay"] == 5e-4  # the config's default
    assert all("momentum_buffer" in state for state in optimizer["state"].values())
    assert [int(r["step"]) for r in train_rows(out)] == [5, 10, 15, 20, 25, 30]
    assert pushes_per_shard(second.stdout) == [10, 10], second.stdout
    assert (out / CHECKPOINTS / f"step-{30:012d}" / "worker.pt").exists()


def training_cluster(glyphs_small, tmp: Path) -> tuple[subprocess.Popen, Path]:
    """``cluster up`` of 2 shards and 1 worker on a long run, once it logged its first step:
    (its process, its log)."""
    out = tmp / "run"
    config = write_config(glyphs_small, out, tmp / "exp.toml", max_steps=100_000)
    log_path = tmp / "cluster.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cluster_cmd(config, 2), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until((out / "train.csv").exists, "training to log its first step", 240, [proc],
                   log_path.read_text)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, log_path


def test_sigterm_stops_workers_then_shards(glyphs_small, no_orphans):
    tmp = no_orphans
    proc, log_path = training_cluster(glyphs_small, tmp)
    try:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert code == 128 + signal.SIGTERM, text
    assert "stop_requested signal=SIGTERM" in text
    stops = re.findall(r"stopped role=(\S+) exit_code=(-?\d+)", text)
    assert [role for role, _ in stops] == ["workers", "shard-0", "shard-1"], text
    assert [c for role, c in stops if role.startswith("shard")] == ["0", "0"], text
    assert our_processes(tmp) == []


def test_a_cluster_killed_with_sigkill_takes_its_shards_and_workers_with_it(glyphs_small,
                                                                           no_orphans):
    """SIGKILL gives ``cluster up`` no time to stop its children, which run in sessions of
    their own: each asked the kernel for a SIGTERM at its launcher's death (xcls.parent) and
    stops on it, the workers through their torchrun launcher (they went on serving)."""
    tmp = no_orphans
    proc, _ = training_cluster(glyphs_small, tmp)
    try:
        assert len(our_processes(tmp)) >= 4  # 2 shards, torchrun, its worker
        proc.kill()
        proc.wait(timeout=30)
        wait_until(lambda: not our_processes(tmp), "the shards and workers to stop", 120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cluster_with_a_data_parallel_slow_gear(glyphs_small, no_orphans, redis_server):
    tmp = no_orphans
    out = tmp / "run"
    config = write_config(glyphs_small, out, tmp / "exp.toml", max_steps=12)
    gear = ["gear.enabled=true", "gear.slow=external", "gear.backend=redis", "gear.m=1",
            "gear.ttl=1000", f"gear.prefix=cluster{os.getpid()}", "gear.publish_every=2",
            "gear.sync_every=2", f"gear.redis_url=redis://{redis_server.host}:"
                                 f"{redis_server.port}/0"]
    sets = [x for item in gear for x in ("--set", item)]
    # a gear config without --slow-workers' requirements is refused before anything starts
    bad = subprocess.run(cluster_cmd(config, 1, "--slow-workers", "2"), capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "--slow-workers needs gear.enabled=true" in bad.stderr

    run = subprocess.run(cluster_cmd(config, 1, "--slow-workers", "2", *sets),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert our_processes(tmp) == []
    assert re.findall(r"stopped role=(\S+) exit_code=(-?\d+)", run.stderr) == [
        ("workers", "0"), ("slow-gear", "0"), ("shard-0", "0"), ("shard-1", "0")], run.stderr
    ranks = re.findall(r"\[slow-gear\] slow gear rank (\d)/2: (\d+) backbone steps, (\d+) means "
                       r"applied.*version (\d+), weights (\w+)", run.stderr)
    assert sorted(r[0] for r in ranks) == ["0", "1"], run.stderr
    # one backbone, stepped together: same step count, version and weights on both ranks
    assert len({r[1:2] + r[3:] for r in ranks}) == 1, ranks
    # every gradient the trainer sent (12 steps x 32 samples, m=1) was applied once
    assert sum(int(r[2]) for r in ranks) == 12 * 32


def shard_pid(tag: Path, shard_id: int) -> int:
    """The pid of this test's ``xcls serve shard --shard-id <shard_id>`` process."""
    for pid in our_processes(tag):
        cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
        if b"shard" in cmdline and cmdline[cmdline.index(b"--shard-id") + 1] == str(
                shard_id).encode():
            return pid
    raise AssertionError(f"no process of shard {shard_id}")


def test_a_killed_shard_is_restarted_and_the_workers_roll_back(glyphs_small, no_orphans):
    tmp = no_orphans
    out = tmp / "run"
    config = write_config(glyphs_small, out, tmp / "exp.toml", max_steps=30)
    log_path = tmp / "cluster.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cluster_cmd(config, 2), stdout=log, stderr=subprocess.STDOUT)
    try:
        marker = out / CHECKPOINTS / f"step-{10:012d}" / "worker.pt"
        wait_until(marker.exists, "the first periodic checkpoint", 240, [proc], log_path.read_text)
        os.kill(shard_pid(tmp, 1), signal.SIGKILL)
        code = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert code == 0, text
    assert re.findall(r"shard_restarted shard=(\d+) restarts=(\d+)", text) == [("1", "1")], text
    assert "rollback_needed" in text
    # the restarted group went back to a checkpoint written before the kill
    (back_to,) = re.findall(r"rollback restart=1 to_step=(\d+)", text)
    assert int(back_to) in (10, 20), text
    assert f"resumed step={back_to}" in text
    # training finished, and its last checkpoint has every shard's snapshot of the same step
    assert int(train_rows(out)[-1]["step"]) == 30
    assert (out / CHECKPOINTS / f"step-{30:012d}" / "worker.pt").exists()
    assert sorted(p.name for p in (out / "ams" / "snapshots" / f"step-{30:012d}").iterdir()) \
        == ["shard-00000-of-00002", "shard-00001-of-00002"]
    assert our_processes(tmp) == []


@pytest.mark.parametrize("args, message", [
    (["--workers", "0"], "--workers 0 must be >= 1"),
    (["--shards", "0"], "--shards 0 must be >= 1"),
    (["--slow-workers", "-1"], "--slow-workers -1 must be >= 0"),
    (["--base-port", "65535"], "--base-port 65535"),
    # shard 1 would find its gRPC port taken by shard 0's metrics
    (["--base-port", "17020", "--metrics-port", "17021"],
     "--metrics-port 17021: its ports 17021..17023 overlap the shards' 17020..17021"),
    (["--stop-timeout", "0"], "--stop-timeout"),
    (["--max-restarts", "-1"], "--max-restarts -1 must be >= 0"),
    (["--hang-timeout", "0"], "--hang-timeout 0 must be > 0"),
    (["--hang-timeout", "inf"], "--hang-timeout inf must be > 0 and finite"),
    (["--start-timeout", "nan"], "--start-timeout nan"),
    # a typo must not fork the host out of memory
    (["--workers", "100000"], "start 100002 processes on this host; at most 256"),
    (["--shards", "100000"], "start 100001 processes"),
    (["--data-dir", sys.executable], "is not a directory"),
    (["--set", "head.kind=nope"], "head.kind"),
])
def test_bad_arguments_are_refused_before_anything_starts(glyphs_small, no_orphans, args,
                                                          message):
    config = write_config(glyphs_small, no_orphans / "run", no_orphans / "exp.toml", 5)
    out = subprocess.run([sys.executable, "-m", "xcls", "cluster", "up", str(config), *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and message in out.stderr, out.stderr
    assert not (no_orphans / "run").exists()


def test_a_fresh_run_refuses_shards_that_hold_another_runs_table(glyphs_small, shard_cluster,
                                                                 tmp_path):
    """Runs sharing shards (compose's long-lived shards) contaminated each other: a run with a
    new train.out_dir trained on from the last run's rows. It is refused; the first run, which
    owns the table, still resumes."""
    from xcls.config import ConfigError, load_config
    from xcls.run import build_run

    shards = shard_cluster(2)
    addresses = ",".join(s.address for s in shards)

    def config(out: Path, steps: int) -> object:
        path = write_config(glyphs_small, out, tmp_path / f"{out.name}.toml", steps)
        return load_config(path, [f"ams.addresses={addresses}"])

    first = build_run(config(tmp_path / "first", 3))
    assert first.trainer.train().steps == 3
    first.client.close()
    with pytest.raises(ConfigError, match="already hold a table 'fc'.*another run's"):
        build_run(config(tmp_path / "second", 3))
    again = build_run(config(tmp_path / "first", 5))  # the owner resumes from its checkpoint
    assert again.trainer.train().steps == 5
    again.client.close()

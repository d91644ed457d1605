"""How a torchrun worker group ends under the launchers (``python -m xcls.torchrun``, run by
scripts/launch_worker.sh, ``xcls cluster up`` and the compose worker): a config refusal is
exit 2 and one line, once, never a restart into a hung rendezvous; SIGTERM is a checkpoint and
exit 143 with one line (beside the run's logs), never a traceback. Real torchrun, real workers."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "scripts" / "launch_worker.sh"


def launch(*args: str, cwd: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AMS_", "MASTER_"))}
    return subprocess.Popen(["bash", str(WORKER), "--nproc-per-node", "2",
                             "--max-restarts", "3", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"still running after {timeout} s (a restarted group hung):\n{err[-3000:]}")
    return proc.returncode, out + err


@pytest.mark.parametrize("overrides, message", [
    # valid alone, refused for two workers: it was raised inside the process group
    (["--set", "gear.enabled=true"], "error: gear.slow: an in-process slow gear"),
    (["--set", "train.max_stepz=5"], "error: --set train.max_stepz: unknown key"),  # a typo
])
def test_a_refused_config_exits_2_with_one_line_and_is_not_restarted(tmp_path, overrides,
                                                                     message):
    proc = launch("--ams", "127.0.0.1:1", str(ROOT / "configs" / "glyphs-2k-knn.toml"),
                  "--set", f"train.out_dir={tmp_path / 'run'}", *overrides, cwd=tmp_path)
    code, output = finish(proc, timeout=120)
    assert code == 2, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(message), output
    assert "rollback" not in output and "Traceback" not in output


@pytest.mark.parametrize("to", ["the launcher", "one worker"])
def test_sigterm_checkpoints_and_exits_143_with_one_line(glyphs_small, tmp_path, to):
    """SIGTERM to the launcher (docker stop, a scheduler) or to one worker alone (the ranks
    agree to stop): the group is not restarted past the stop (it was, and trained on)."""
    out = tmp_path / "run"
    config = tmp_path / "c.toml"
    config.write_text(f"""
[data]
train = "{glyphs_small / 'train'}"
test = ""
batch_size = 16
num_workers = 0
[model]
dim = 32
[head]
kind = "partial"
[train]
max_steps = 100000
epochs = 1000
checkpoint_every = 0
log_every = 1
threads = 1
out_dir = "{out}"
""")
    proc = launch("--collective", str(config), cwd=tmp_path)
    # a step's line in train.csv: the loop that takes SIGTERM at a step boundary is running
    # (before it, the process still has the default action: a stop while it starts loses nothing)
    wait_until(lambda: (out / "train.csv").exists(), "the first step's line", 180, [proc],
               lambda: finish(proc, 10)[1])
    # launch_worker.sh execs the launcher: its pid; the workers are its children
    target = proc.pid if to == "the launcher" else children(proc.pid)[-1]
    os.kill(target, signal.SIGTERM)
    code, output = finish(proc, timeout=120)
    assert code == 143, output
    assert "Traceback" not in output and "SignalException" not in output, output
    stops = [line for line in output.splitlines() if not line.startswith("ts=")]
    assert len(stops) == 1 and stops[0].startswith("stopped by SIGTERM after step "), output
    steps = sorted(out.glob("checkpoints/step-*[0-9]"))
    assert len(steps) >= 2, steps  # the stop's checkpoint beside step 0


def test_a_rendezvous_nobody_serves_is_one_line_and_exit_1(tmp_path):
    """A worker host whose rendezvous endpoint nobody serves (its host not up yet, a typo in
    the port) ends with one line naming the endpoint and why, not torchrun's Python traceback
    (torch's C++ socket layer still logs its own error above it)."""
    from tests.conftest import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    proc = launch("--ams", "127.0.0.1:1", "--nnodes", "2", "--rdzv-endpoint", endpoint,
                  "--torchrun", "--rdzv-conf=is_host=false,read_timeout=2",
                  str(ROOT / "configs" / "glyphs-2k-knn.toml"), cwd=tmp_path)
    code, output = finish(proc, timeout=120)
    assert code == 1, output
    last = output.strip().splitlines()[-1]
    assert f"rendezvous_failed endpoint={endpoint}" in last and "timed out" in last, output
    assert "Traceback" not in output

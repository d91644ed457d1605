"""workers.distributed: the torchrun environment and a process group that really goes away.

Two real gloo processes; the regression is torch.distributed.nn pinning the default group when
torch first imports it after the group exists (building an optimizer does), which left gloo's
threads running into interpreter shutdown, where they now and then aborted the process.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tests.conftest import free_port, refused_in_process, set_torchrun_env
from workers.distributed import process_group, torchrun_env, worker_device

GLOO_THREADS = ("gloo", "pt_gloo")


def thread_names() -> list[str]:
    tasks = Path("/proc/self/task")
    names = []
    for tid in os.listdir(tasks):
        try:
            names.append((tasks / tid / "comm").read_text().strip())
        except FileNotFoundError:  # the thread exited between listdir and the read
            continue
    return sorted(names)


def gloo_threads_after_exit(grace_s: float = 5.0) -> list[str]:
    """Thread names once gloo's threads had grace_s to exit; the regression pinned them forever."""
    deadline = time.monotonic() + grace_s
    while True:
        names = thread_names()
        if not any(name.startswith(GLOO_THREADS) for name in names) or time.monotonic() > deadline:
            return names
        time.sleep(0.05)


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    set_torchrun_env(rank, world, port)
    env = torchrun_env()
    with process_group(world, torch.device("cpu")):
        during = thread_names()
        model = nn.Linear(4, 2)
        torch.optim.SGD(model.parameters(), lr=0.1)  # makes torch import torch.distributed.nn
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
    after = gloo_threads_after_exit()
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        {"env": env, "total": float(total), "during": during, "after": after,
         "initialized": dist.is_initialized()}))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
def test_process_group_is_gone_after_the_block(tmp_path):
    mp.spawn(_rank_main, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["env"] == [rank, 2, rank]
        assert result["total"] == 3.0  # 1 + 2
        assert any(name.startswith(GLOO_THREADS) for name in result["during"])
        assert not result["initialized"]
        left = [name for name in result["after"] if name.startswith(GLOO_THREADS)]
        assert not left, f"rank {rank}: gloo threads outlived the process group: {left}"


def test_one_process_has_no_group(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert torchrun_env() == (0, 1, 0)
    with process_group(1, torch.device("cpu")):
        assert not dist.is_initialized()


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "one"}, "RANK='one': torchrun sets it to an integer"),
    ({"WORLD_SIZE": ""}, "WORLD_SIZE='': torchrun sets it to an integer"),
    ({"LOCAL_RANK": "0x1"}, "LOCAL_RANK='0x1'"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "0 <= RANK, LOCAL_RANK < WORLD_SIZE"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE >= 1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "5"}, "LOCAL_RANK=5"),
])
def test_bad_torchrun_environment_is_named(monkeypatch, env, message):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        torchrun_env()


def refused_command_stderr(tmp_path: Path, command: list[str], config_text: str,
                           capsys: pytest.CaptureFixture[str]) -> str:
    """stderr of ``xcls COMMAND CONFIG`` (run in this process, whose environment the caller
    set), which must refuse in one line with exit code 2."""
    config = tmp_path / "x.toml"
    config.write_text('[gear]\nbackend = "redis"\n' + config_text)
    return refused_in_process([*command, str(config)], capsys)


@pytest.mark.parametrize("command", [["train"], ["gear", "slow"]])
def test_commands_report_a_bad_torchrun_environment(tmp_path, command, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "error: RANK=3, WORLD_SIZE=2" in refused_command_stderr(tmp_path, command, "",
                                                                  capsys)


def test_worker_device_follows_the_setting():
    assert worker_device("cpu", 0) == torch.device("cpu")
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert worker_device("auto", 0) == expected
    with pytest.raises(ValueError, match="'gpu': use auto, cpu or cuda"):
        worker_device("gpu", 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
def test_cuda_without_a_gpu_is_refused():
    with pytest.raises(ValueError, match="'cuda' but no CUDA device is available"):
        worker_device("cuda", 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a host without CUDA")
@pytest.mark.parametrize("command", [["train"], ["gear", "slow"]])
def test_commands_report_cuda_without_a_gpu(tmp_path, command, monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    stderr = refused_command_stderr(tmp_path, command, '[train]\ndevice = "cuda"\n', capsys)
    assert "error: train.device: 'cuda' but no CUDA device is available" in stderr


@pytest.mark.parametrize("peer, expect", [("127.0.0.1", "127.0.0.1"), ("localhost", "127.0.0.1"),
                                          ("::1", "::1")])
def test_the_address_toward_a_loopback_peer_is_loopback(peer, expect):
    from workers.distributed import address_toward

    assert address_toward(peer) == expect


@pytest.mark.parametrize("peer, message", [("", "MASTER_ADDR is not set"),
                                           ("no-such-host.invalid", "no route to")])
def test_the_address_toward_no_peer_is_a_clear_error(peer, message):
    from workers.distributed import address_toward

    with pytest.raises(ValueError, match=message):
        address_toward(peer)

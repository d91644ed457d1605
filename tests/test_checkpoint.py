"""Worker checkpoints: what a saved run holds loads as plain data, and a hostile or broken file
gives a clear error naming it without running anything it carries."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers import checkpoint
from workers.checkpoint import CheckpointError


class TouchPayload:
    """Unpickled, it creates ``marker``: the shape of a crafted checkpoint's hidden code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def crafted_checkpoint(out: Path, step: int, marker: Path) -> Path:
    """A published checkpoint whose worker.pt runs a payload when unpickled in full."""
    d = checkpoint.checkpoint_dir(out, step)
    d.mkdir(parents=True)
    path = d / "worker.pt"
    torch.save({"step": step, "backbone": {}, "extra": TouchPayload(marker)}, path)
    return path


def test_payload_is_live_when_unpickled_in_full(tmp_path):
    # the crafted file is a real threat: the loader this module used to call runs it
    marker = tmp_path / "ran"
    path = crafted_checkpoint(tmp_path / "run", 3, marker)
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_crafted_checkpoint_is_refused_without_running_its_payload(tmp_path):
    marker = tmp_path / "ran"
    out = tmp_path / "run"
    path = crafted_checkpoint(out, 3, marker)
    assert checkpoint.latest_step(out) == 3
    with pytest.raises(CheckpointError, match="refused") as info:
        checkpoint.load(out, 3, rank=0)
    assert str(path) in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty", "not_a_dict"])
def test_broken_checkpoint_gives_an_error_naming_the_file(tmp_path, damage):
    out = tmp_path / "run"
    d = checkpoint.checkpoint_dir(out, 5)
    d.mkdir(parents=True)
    path = d / "worker.pt"
    torch.save({"step": 5, "backbone": {"w": torch.ones(4096)}}, path)
    blob = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(blob[:len(blob) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\x80\x02 this is not a checkpoint" * 10)
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        torch.save([torch.ones(2)], path)
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(out, 5, rank=0)
    assert str(path) in str(info.value)


def _whole_checkpoint(step: int) -> tuple[dict, dict]:
    shared = {"step": step, "position": (0, 256), "backbone": {"w": torch.ones(2)},
              "optimizer": {"state": {}, "param_groups": []}, "scaler": None, "world": 1}
    private = {"prepared": [], "selector_rng": None, "world": 1}
    return shared, private


@pytest.mark.parametrize("part, field, value, message", [
    ("shared", "backbone", None, "has no field 'backbone'"),
    ("shared", "optimizer", None, "has no field 'optimizer'"),
    ("shared", "backbone", torch.ones(3), "'backbone' must be a dict"),
    ("shared", "position", 5, "'position' must be an .epoch, samples. pair"),
    ("shared", "position", (0, -1), "'position' must be"),
    ("shared", "step", -3, "'step' must be a non-negative integer"),
    ("shared", "step", True, "'step' must be"),
    ("private", "prepared", None, "has no field 'prepared'"),
    ("private", "selector_rng", "seed", "'selector_rng' must be a tensor or None"),
])
def test_a_checkpoint_without_what_a_resume_reads_is_refused_by_field(tmp_path, part, field,
                                                                      value, message):
    out = tmp_path / "run"
    shared, private = _whole_checkpoint(4)
    state = shared if part == "shared" else private
    if value is None:
        del state[field]
    else:
        state[field] = value
    checkpoint.save_rank(out, 4, 0, private)
    checkpoint.save_shared(out, 4, shared)
    with pytest.raises(CheckpointError, match=message) as info:
        checkpoint.load(out, 4, rank=0)
    name = "worker.pt" if part == "shared" else "rank-00000.pt"
    assert str(checkpoint.checkpoint_dir(out, 4) / name) in str(info.value)


def test_saved_state_of_plain_containers_round_trips(tmp_path):
    out = tmp_path / "run"
    shared = {"step": 7, "position": (1, 128), "world": 1, "scaler": None,
              "backbone": {"w": torch.arange(6.0).view(2, 3)}, "optimizer": {"state": {}}}
    private = {"prepared": [{"active_ids": torch.arange(3), "rows": torch.ones(3, 2)}],
               "selector_rng": torch.Generator().manual_seed(1).get_state(), "world": 1,
               "gear": {"version": 2, "counts": {"samples": 9}, "cache": None}}
    checkpoint.save_rank(out, 7, 0, private)
    checkpoint.save_shared(out, 7, shared)
    got_shared, got_private = checkpoint.load(out, 7, rank=0)
    assert got_shared["position"] == (1, 128) and got_shared["scaler"] is None
    assert torch.equal(got_shared["backbone"]["w"], torch.arange(6.0).view(2, 3))
    assert torch.equal(got_private["prepared"][0]["rows"], torch.ones(3, 2))
    assert torch.equal(got_private["selector_rng"], private["selector_rng"])
    assert got_private["gear"] == private["gear"]


def test_eval_of_a_run_with_a_crafted_checkpoint_fails_cleanly(glyphs_small, tmp_path):
    marker = tmp_path / "ran"
    out = tmp_path / "run"
    crafted_checkpoint(out, 1, marker)
    sets = {"data.train": glyphs_small / "train", "data.test": glyphs_small / "test",
            "data.num_workers": 0, "model.dim": 32, "head.kind": "full",
            "train.out_dir": out, "train.threads": 2}
    cmd = [sys.executable, "-m", "xcls", "eval", "/dev/null",
           *sum((["--set", f"{k}={v}"] for k, v in sets.items()), [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "worker.pt" in done.stderr and "refused" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert not marker.exists()

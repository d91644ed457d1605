"""When the drawn classes' logQ weights start: a knn run that starts them after the rows'
warm-up trains, step for step, as the plain softmax until then and as the weighted one after;
partial weights them from the first step."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from xcls.config import ConfigError, load_config
from xcls.run import build_run


def logged_losses(glyphs: Path, out: Path, kind: str = "knn", **head: object) -> list[float]:
    """Per-step losses of 3 epochs of the knn head (or ``kind``) on 120 classes in batches of
    64 (the rows' automatic warm-up: ceil(3 * 120 / 64) = 6 steps)."""
    sets = {"data.train": str(glyphs / "train"), "data.batch_size": 64, "data.num_workers": 0,
            "model.dim": 16, "head.sample_rate": 0.8, "head.k": 4, "graph.k": 8,
            "optim.warmup_steps": 2, "train.epochs": 3, "train.out_dir": str(out),
            "train.threads": 1, "train.log_every": 1, "train.seed": 3,
            "head.kind": kind, **{f"head.{k}": v for k, v in head.items()}}
    build_run(load_config(None, [f"{k}={v}" for k, v in sets.items()])).trainer.train()
    with open(out / "train.csv", newline="") as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


@pytest.mark.parametrize("placement", ["ams", "collective"])
def test_logq_weights_start_after_the_rows_warmup(glyphs_small, tmp_path, placement):
    plain = logged_losses(glyphs_small, tmp_path / "plain", logq_correction="false",
                          placement=placement)
    weighted = logged_losses(glyphs_small, tmp_path / "weighted", logq_correction="true",
                             logq_start_step=0, placement=placement)
    scheduled = logged_losses(glyphs_small, tmp_path / "scheduled", logq_correction="true",
                              placement=placement)  # the default: -1
    assert len(plain) == len(weighted) == len(scheduled) > 7
    # the same seed draws the same classes: only the weights tell the runs apart
    assert scheduled[:6] == plain[:6]
    assert weighted[0] != pytest.approx(plain[0], abs=1e-3)
    assert scheduled[6] != pytest.approx(plain[6], abs=1e-3)


def test_a_given_start_step_and_off_never_weight_before_it(glyphs_small, tmp_path):
    plain = logged_losses(glyphs_small, tmp_path / "plain", logq_correction="false")
    late = logged_losses(glyphs_small, tmp_path / "late", logq_correction="true",
                         logq_start_step=4)
    unused = logged_losses(glyphs_small, tmp_path / "unused", logq_correction="false",
                           logq_start_step=2)
    assert late[:4] == plain[:4] and late[4] != pytest.approx(plain[4], abs=1e-3)
    assert unused == plain


def test_partial_weights_its_draws_from_the_first_step(glyphs_small, tmp_path):
    first = logged_losses(glyphs_small, tmp_path / "first", "partial", logq_start_step=0)
    default = logged_losses(glyphs_small, tmp_path / "default", "partial")
    plain = logged_losses(glyphs_small, tmp_path / "plain", "partial", logq_correction="false")
    assert default == first and default[0] != pytest.approx(plain[0], abs=1e-3)


@pytest.mark.parametrize("value", ["-2", "1.5", "soon"])
def test_bad_start_steps_are_refused(value):
    with pytest.raises(ConfigError, match="head.logq_start_step"):
        load_config(None, [f"head.logq_start_step={value}"])
    assert load_config(None, []).head.logq_start_step == -1

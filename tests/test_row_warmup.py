"""The class rows' warm-up: its length (given, or until each class has been a label about three
times) and the rows' learning rates a trainer pushes with, against arithmetic done here."""

from __future__ import annotations

import csv
import math

import pytest

from tests.conftest import record_push_rates
from workers.data.lmdb_dataset import LmdbImageDataset
from workers.schedule import row_warmup_steps
from xcls.config import ConfigError, load_config
from xcls.run import build_run


@pytest.mark.parametrize("configured, warmup, classes, batch, steps", [
    (250, 100, 40000, 128, 250),   # given: taken as it is, even below the backbone's
    (0, 100, 40000, 128, 0),
    (-1, 100, 40000, 128, 938),    # 3 * 40000 / 128 = 937.5 steps of 128 labels
    (-1, 100, 2000, 128, 100),     # 47 steps: the backbone's 100 are longer
    (-1, 10, 1_000_000, 1024, 2930),
])
def test_warmup_length(configured, warmup, classes, batch, steps):
    assert row_warmup_steps(configured, warmup, classes, batch) == steps


def test_other_negative_lengths_are_refused():
    with pytest.raises(ValueError, match="-1"):
        row_warmup_steps(-2, 100, 1000, 128)
    with pytest.raises(ConfigError, match="optim.head_warmup_steps"):
        load_config(None, ["optim.head_warmup_steps=-2"])
    assert load_config(None, []).optim.head_warmup_steps == -1


@pytest.mark.parametrize("configured, expected_warmup", [(-1, 6), (0, 0), (4, 4)])
def test_trainer_pushes_rows_with_the_row_warmup(glyphs_small, tmp_path, configured,
                                                 expected_warmup):
    """120 classes in batches of 64: the automatic warm-up is ceil(3 * 120 / 64) = 6 steps,
    longer than the backbone's 2; the backbone keeps its own."""
    n = len(LmdbImageDataset(glyphs_small / "train"))
    sets = {"data.train": str(glyphs_small / "train"), "data.batch_size": 64,
            "data.num_workers": 0, "model.dim": 16, "head.kind": "full", "optim.lr": 0.1,
            "optim.head_lr": 0.5, "optim.warmup_steps": 2,
            "optim.head_warmup_steps": configured, "train.epochs": 3,
            "train.out_dir": str(tmp_path), "train.threads": 1, "train.log_every": 1}
    run = build_run(load_config(None, [f"{k}={v}" for k, v in sets.items()]))
    trainer = run.trainer
    total = 3 * (n // 64)
    assert trainer.total_steps == total and trainer.head_warmup_steps == expected_warmup
    pushed = record_push_rates(run.client)  # one push per step, with its rate

    def cosine(peak: float, warmup: int, t: int) -> float:
        if t < warmup:
            return peak * (t + 1) / warmup
        return peak * 0.5 * (1 + math.cos(math.pi * (t - warmup) / (total - warmup)))

    trainer.train()
    assert pushed == pytest.approx([cosine(0.5, expected_warmup, t) for t in range(total)],
                                   rel=1e-12, abs=0)
    with open(tmp_path / "train.csv", newline="") as f:
        logged = [(int(r["step"]), float(r["lr"])) for r in csv.DictReader(f)]
    assert [step for step, _ in logged] == list(range(1, total + 1))
    assert [lr for _, lr in logged] == pytest.approx(
        [cosine(0.1, 2, step - 1) for step, _ in logged], rel=1e-12, abs=0)

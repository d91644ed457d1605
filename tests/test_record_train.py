"""benchmarks/record_train.py: a real ``xcls train`` run on glyph data becomes an accuracy.csv
row the tables read, and a run's missing, empty or malformed files are refused by name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workers.data.lmdb_dataset import LmdbImageDataset
from xcls.config import load_config
from xcls.run import build_run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import accuracy_tables  # noqa: E402
import results  # noqa: E402

CONFIG = ROOT / "configs" / "glyphs-2k-knn.toml"
STEPS = 30


def sets(data: Path, out: Path) -> list[str]:
    """The demo config shrunk to a test: what is learned (data, batch, budget, steps) and where
    it runs (out_dir, threads, loader processes, logging)."""
    return [f"data.train={data / 'train'}", f"data.test={data / 'test'}",
            "data.batch_size=32", "head.budget=48", "graph.rebuild_every=20",
            f"train.max_steps={STEPS}", f"train.out_dir={out}", "train.threads=2",
            "data.num_workers=0", "train.log_every=10"]


@pytest.fixture(scope="module")
def trained(glyphs_small, tmp_path_factory):
    """A finished run of the demo config on the 120-class glyph set, and its result."""
    out = tmp_path_factory.mktemp("record") / "run"
    overrides = sets(glyphs_small, out)
    result = build_run(load_config(CONFIG, overrides)).trainer.train()
    return overrides, out, result


def record(argv: list[str], results: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "record_train.py"), *argv],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT),
                               "XCLS_RESULTS_DIR": str(results), "XCLS_RESULTS_COMMIT": "abc1234"})


def test_a_finished_run_becomes_the_row_the_tables_read(trained, glyphs_small, tmp_path):
    overrides, _, result = trained
    means = tmp_path / "means.txt"
    means.write_text("knn rows: top-1 50.00%\nclass-means rows: top-1 61.25% top-5 80.00%\n")
    done = record([str(CONFIG), *(a for o in overrides for a in ("--set", o)),
                   "--eval-output", str(means), "--ranks", "2"], tmp_path / "results")
    assert done.returncode == 0, done.stderr
    runs = accuracy_tables.load_runs(tmp_path / "results" / "accuracy.csv")
    assert len(runs) == 1
    run = runs[0]
    train = LmdbImageDataset(glyphs_small / "train")
    classes = len(set(train.labels().tolist()))
    assert (run.classes, run.head, run.budget, run.k, run.seed) == (classes, "knn", 48, 16, 0)
    # two ranks of 32 images for 30 steps, over the training split
    assert run.epochs == pytest.approx(round(STEPS * 2 * 32 / len(train), 1))
    assert run.top1 == pytest.approx(100 * result.eval["top1"], abs=0.005)
    assert run.class_means_top1 == 61.25
    assert run.commit == "abc1234"
    # the settings that change what is learned, not where the run went or how fast
    assert run.settings == (f"config={CONFIG}", f"data.train={glyphs_small / 'train'}",
                            f"data.test={glyphs_small / 'test'}", "data.batch_size=32",
                            "head.budget=48", "graph.rebuild_every=20",
                            f"train.max_steps={STEPS}", "ranks=2")


def _last_eval_scores(run: Path, top1: str, top5: str) -> None:
    """Rewrite the run's last evaluation (at its planned step) with these scores."""
    lines = (run / "eval.csv").read_text().splitlines()
    step = lines[-1].split(",")[0]
    (run / "eval.csv").write_text("\n".join([*lines[:-1], f"{step},{top1},{top5},100"]) + "\n")


@pytest.mark.parametrize("damage, named", [
    (lambda run, data: (run / "eval.csv").unlink(), "eval.csv is missing"),
    (lambda run, data: _last_eval_scores(run, "nan", "0.9"), "top1 is nan, outside [0, 1]"),
    (lambda run, data: _last_eval_scores(run, "0.5", "inf"), "top5 is inf, outside [0, 1]"),
    (lambda run, data: _last_eval_scores(run, "98.94", "0.9"), "top1 is 98.94, outside"),
    (lambda run, data: _last_eval_scores(run, "0.5", "-3"), "top5 is -3, outside"),
    (lambda run, data: (run / "eval.csv").write_text("step,top1,top5,samples\n"),
     "eval.csv has no rows"),
    (lambda run, data: (run / "eval.csv").write_text("step,top1,top5\n30,high,0.9\n"),
     "no number in column 'top1'"),
    (lambda run, data: (run / "eval.csv").write_text("step,top5\n30,0.9\n"),
     "no number in column 'top1'"),
    (lambda run, data: (data / "summary.json").unlink(), "summary.json is missing"),
    (lambda run, data: (data / "summary.json").write_text("{not json"),
     "does not give the classes"),
    (lambda run, data: (data / "summary.json").write_text(json.dumps({"classes": 120})),
     "does not give the classes"),
    (lambda run, data: (data / "summary.json").write_text(
        json.dumps({"classes": 0, "images": {"train": 10}})), "0 classes"),
])
def test_a_damaged_run_is_refused_by_name_and_records_nothing(trained, glyphs_small, tmp_path,
                                                              damage, named):
    _, out, _ = trained
    run, data = tmp_path / "run", tmp_path / "data"
    shutil.copytree(out, run, ignore=shutil.ignore_patterns("checkpoints", "ams", "tensorboard"))
    data.mkdir()
    shutil.copy(glyphs_small / "summary.json", data / "summary.json")
    damage(run, data)
    overrides = [f"data.train={data / 'train'}", f"data.test={data / 'test'}",
                 f"train.out_dir={run}"]
    done = record([str(CONFIG), *(a for o in overrides for a in ("--set", o))],
                  tmp_path / "results")
    assert done.returncode == 2
    assert named in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "results" / "accuracy.csv").exists()


def copied_run(out: Path, tmp_path: Path, last_step: int) -> Path:
    """The run's files, its eval.csv ending with an evaluation at ``last_step``."""
    run = tmp_path / "run"
    shutil.copytree(out, run, ignore=shutil.ignore_patterns("checkpoints", "ams", "tensorboard"))
    (run / "eval.csv").write_text(f"step,top1,top5,samples\n{last_step},0.5,0.75,100\n")
    return run


@pytest.mark.parametrize("last_step, setting", [
    (20, None),  # stopped early: its last evaluation was at an epoch's end, before step 30
    (STEPS, f"train.max_steps={STEPS + 10}"),  # recorded with settings it was not trained with
])
def test_a_run_that_did_not_reach_its_planned_end_is_refused(trained, tmp_path, last_step,
                                                             setting):
    overrides, out, _ = trained
    run = copied_run(out, tmp_path, last_step)
    overrides = [*overrides, f"train.out_dir={run}", *([setting] if setting else [])]
    done = record([str(CONFIG), *(a for o in overrides for a in ("--set", o))],
                  tmp_path / "results")
    planned = STEPS + 10 if setting else STEPS
    assert done.returncode == 2, done.stderr
    assert f"last evaluation is at step {last_step}, and the config as given trains {planned} " \
        "steps" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "results" / "accuracy.csv").exists()


def test_the_epochs_of_a_growing_batch_count_each_epochs_batch(trained, glyphs_small,
                                                                tmp_path):
    """Two epochs, of batches of 32 and then 64: the images trained on are both epochs' whole
    batches, two passes over the split less what the last batch of each leaves over."""
    overrides, out, _ = trained
    n = len(LmdbImageDataset(glyphs_small / "train"))
    steps = n // 32 + n // 64
    run = copied_run(out, tmp_path, steps)
    overrides = [*overrides, f"train.out_dir={run}", "train.max_steps=0", "train.epochs=2",
                 "train.batch_schedule=[32, 64]"]
    done = record([str(CONFIG), *(a for o in overrides for a in ("--set", o))],
                  tmp_path / "results")
    assert done.returncode == 0, done.stderr
    [row] = accuracy_tables.load_runs(tmp_path / "results" / "accuracy.csv")
    # (counting every step as a batch of 32, as if the batch never grew, gives about 1.5)
    assert row.epochs == pytest.approx(round((n // 32 * 32 + n // 64 * 64) / n, 1))


@pytest.mark.parametrize("argv, named", [
    (["--ranks", "0"], "at least one process"),
    (["--set", "head.k=-1"], "head.k"),
    (["--set", "no_such.field=1"], "no_such"),
])
def test_wrong_options_are_refused(trained, tmp_path, argv, named):
    overrides, _, _ = trained
    done = record([str(CONFIG), *(a for o in overrides for a in ("--set", o)), *argv],
                  tmp_path / "results")
    assert done.returncode == 2 and named in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "results" / "accuracy.csv").exists()


def test_a_config_that_is_not_toml_is_refused(tmp_path):
    config = tmp_path / "x.toml"
    config.write_text("[data\n")
    done = record([str(config)], tmp_path / "results")
    assert done.returncode == 2 and "not valid TOML" in done.stderr
    assert not (tmp_path / "results" / "accuracy.csv").exists()


def demo(argv: list[str], results_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "demo.py"), *argv],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT),
                               "XCLS_RESULTS_DIR": str(results_dir)})


def test_a_recorded_demo_appends_its_time_and_its_top1(trained, tmp_path):
    """scripts/demo.sh's last step (benchmarks/demo.py --record), on the run's own resolved
    config: the time goes to demo.jsonl, the top-1 to accuracy.csv; a resumed run to neither."""
    _, out, result = trained
    means = tmp_path / "means.txt"
    means.write_text("class-means rows: top-1 61.25% top-5 80.00%\n")
    argv = [str(out / "config.toml"), "--started", str(time.time() - 5), "--load", "1.5",
            "--eval-output", str(means), "--record"]
    resumed = demo([*argv, "--resumed"], tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr
    assert "not recorded" in resumed.stdout and not (tmp_path / "resumed").exists()
    done = demo(argv, tmp_path / "results")
    assert done.returncode == 0, done.stderr
    [timed] = results.load(tmp_path / "results" / "demo.jsonl")
    assert timed.command == "bash scripts/demo.sh"
    assert timed.figures["steps"] == STEPS and timed.figures["total s"] >= 5
    assert timed.figures["top-1 %"] == round(100 * result.eval["top1"], 2)
    [run] = accuracy_tables.load_runs(tmp_path / "results" / "accuracy.csv")
    assert run.top1 == pytest.approx(100 * result.eval["top1"], abs=0.005)
    assert (run.class_means_top1, run.settings) == (61.25, (f"config={out / 'config.toml'}",))


def test_a_missing_eval_output_is_named_and_records_nothing(tmp_path):
    done = record([str(CONFIG), "--eval-output", str(tmp_path / "means.txt")],
                  tmp_path / "results")
    assert done.returncode == 2, done.stderr
    assert f"{tmp_path / 'means.txt'}: cannot read it" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "results" / "accuracy.csv").exists()

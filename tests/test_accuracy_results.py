"""benchmarks/accuracy_study.py's results file: its schema and its rows, against rows written
out here (the commit and device a row is stamped with: tests/test_results_tables.py)."""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import accuracy_study as study  # noqa: E402
import accuracy_tables  # noqa: E402

HEADER = ("date,commit,device,classes,epochs,head,budget,k,random_share,seed,top1,top5,"
          "class_means_top1,seconds_per_epoch,notes")


def study_args(*extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    study.add_config_options(p)
    p.add_argument("--notes", default="")
    return p.parse_args(["--data", "d", "--epochs", "2", "--seed", "3", *extra])


def run_dict(**overrides) -> dict:
    base = {"top1": 0.973, "top5": 0.99874, "top1_class_means": None,
            "seconds_per_epoch": 612.4, "budget": 4000, "k": 16, "random_share": 0.5,
            "resumed_at": None}
    return {**base, **overrides}


def test_rows_follow_the_schema_and_leave_what_a_head_lacks_empty(tmp_path):
    """...with the "\\n" line ends of the tracked file, and the tables read every row back
    (full's budget is all its classes)."""
    args = study_args("--rebuild-every", "300")
    results = tmp_path / "sub" / "accuracy.csv"
    for head in ("knn", "partial", "full"):
        row = study.result_row(run_dict(top1_class_means=0.98016 if head == "knn" else None),
                               head, args, 40000, "abc1234", "2-core CPU VM")
        study.append_result(results, row)
    assert b"\r" not in results.read_bytes()
    lines = results.read_text().splitlines()
    assert lines[0] == HEADER
    rows = list(csv.DictReader(lines))
    day = rows[0]["date"]
    assert len(day) == 10 and day[4] == day[7] == "-"
    common = f"{day},abc1234,2-core CPU VM,40000,2,"
    assert lines[1] == common + "knn,4000,16,0.5,3,97.30,99.87,98.02,612,"
    assert lines[2] == common + "partial,4000,,,3,97.30,99.87,,612,"
    assert lines[3] == common + "full,40000,,,3,97.30,99.87,,612,"
    runs = accuracy_tables.load_runs(results)
    assert [(r.head, r.budget, r.k) for r in runs] == [("knn", 4000, 16), ("partial", 4000, None),
                                                       ("full", 40000, None)]


def test_notes_name_what_differs_from_the_defaults():
    args = study_args("--rebuild-every", "25", "--head-lr", "0.5", "--random-share",
                      "0.25", "--set", "optim.head_warmup_steps=300", "--max-steps", "9",
                      "--notes", "rerun")
    assert study.run_notes("knn-ivf", args) == (
        "graph.rebuild_every=25; graph.method=ivf; head_lr=0.5; random_share=0.25; "
        "optim.head_warmup_steps=300; max_steps=9; rerun")
    # partial has no graph and no random share to set
    assert study.run_notes("partial", args) == (
        "head_lr=0.5; optim.head_warmup_steps=300; max_steps=9; rerun")


def test_a_file_with_another_header_is_refused(tmp_path):
    results = tmp_path / "accuracy.csv"
    results.write_text("date,head,top1\n2024-01-01,knn,97.00\n")
    row = study.result_row(run_dict(), "knn", study_args(), 100, "abc", "cpu")
    with pytest.raises(ValueError, match="header"):
        study.append_result(results, row)
    assert results.read_text() == "date,head,top1\n2024-01-01,knn,97.00\n"

"""Append a finished ``xcls train`` run to the accuracy results file (the row
``accuracy_study.py`` writes for its own runs), so that a run of a config is data like a study
run and the tables of docs/accuracy.md and the README show it without anyone typing a figure.

    xcls train CONFIG [--set KEY=VALUE ...]
    xcls eval --rows class-means CONFIG [--set KEY=VALUE ...] > means.txt     # optional
    python benchmarks/record_train.py CONFIG [--set KEY=VALUE ...] [--eval-output means.txt]
        [--ranks N]

Give it the config and the ``--set`` overrides the run was trained with: it reads the last
row of the run's ``eval.csv`` in ``train.out_dir`` (the step, top-1 and top-5 at the end; a run
whose last evaluation is not at the step the config plans as its last is refused) and
the dataset's ``summary.json`` beside ``data.train``. The row's ``notes`` name the config and
the overrides that change what is learned; those that only say where or how fast it runs
(``EXECUTION_FIELDS``: the device, the run directory, threads, loader processes, logging) are
left out, and the ``device`` column names the machine. ``epochs`` is the images trained on over
the training split's size (1.4 for the demo's 900 steps of 128 on 82,226 images; a torchrun run
of N processes, ``--ranks N``, trains N batches of ``data.batch_size`` a step and is noted
``ranks=N``); ``seconds_per_epoch`` stays empty (the run's own time is not in its files).
Record on the tree that trained the run: the commit is this one's.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import re
import sys
from pathlib import Path

from accuracy_study import append_result
from results import current_commit, describe_device, results_dir

from ams.cluster.plan import Job, active_classes
from workers.batch_plan import BatchPlan
from workers.distributed import worker_device
from xcls.config import load_config

# Fields that choose where and how fast a run goes, not what it learns.
EXECUTION_FIELDS = frozenset({"train.out_dir", "train.device", "train.threads",
                              "train.resume", "train.log_every", "data.num_workers"})
CLASS_MEANS = re.compile(r"class-means rows: top-1 ([\d.]+)%")


def _csv_rows(path: Path) -> list[dict[str, str]]:
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except FileNotFoundError:
        raise ValueError(f"{path} is missing: has the run finished?") from None
    if not rows:
        raise ValueError(f"{path} has no rows: has the run finished?")
    return rows


def _number(row: dict[str, str], column: str, path: Path, *, most: float = math.inf) -> float:
    """The last row's ``column``, a finite number in [0, ``most``]."""
    try:
        value = float(row[column])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: its last row has no number in column {column!r}") from None
    if not 0 <= value <= most:  # also refuses nan; inf only where most is
        raise ValueError(f"{path}: its last row's {column} is {row[column]}, outside [0, {most:g}]")
    return value


def class_means_top1(eval_output: str) -> float | None:
    """Top-1 % that ``xcls eval --rows class-means`` printed, or None when it printed none."""
    found = CLASS_MEANS.search(eval_output)
    return float(found.group(1)) if found else None


def train_row(config: Path, overrides: list[str], *, ranks: int = 1,
              class_means: float | None = None) -> dict:
    """The results file's row (``accuracy_study.RESULT_COLUMNS``) of the ``xcls train`` run of
    ``config`` with ``overrides`` ("KEY=VALUE") on ``ranks`` processes, read from its files and
    stamped with this tree's commit and the machine of ``train.device``; ``class_means`` is the
    top-1 % by class means when measured. Raises ValueError naming the file that is missing,
    empty or malformed."""
    if ranks < 1:
        raise ValueError(f"ranks {ranks}: a run has at least one process")
    cfg = load_config(config, overrides)
    run = Path(cfg.train.out_dir)
    summary_path = Path(cfg.data.train).parent / "summary.json"
    try:
        summary = json.loads(summary_path.read_text())
        classes = int(summary["classes"])
        images = int(summary["images"]["train"])
    except FileNotFoundError:
        raise ValueError(f"{summary_path} is missing: is data.train a dataset of "
                         "'xcls data glyphs'?") from None
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{summary_path} does not give the classes and train images") from None
    if classes < 1 or images < 1:
        raise ValueError(f"{summary_path}: {classes} classes, {images} train images")
    eval_csv = run / "eval.csv"
    last_eval = _csv_rows(eval_csv)[-1]  # the evaluation after the run's last step
    steps = _number(last_eval, "step", eval_csv)
    top1, top5 = (_number(last_eval, c, eval_csv, most=1.0) for c in ("top1", "top5"))
    # the trainer's own plan of the run: a run stopped early (SIGTERM, a crash) evaluated at an
    # epoch's end would otherwise pass for a shorter run, though its schedule was the longer one's
    plan = BatchPlan(images, cfg.train.batch_schedule or cfg.data.batch_size, 0, ranks,
                     cfg.train.seed)
    planned = plan.run_steps(cfg.train.epochs, cfg.train.max_steps)
    if steps != planned:
        raise ValueError(f"{eval_csv}: its last evaluation is at step {steps:g}, and the config "
                         f"as given trains {planned} steps: the run has not finished (resume it "
                         "with the same 'xcls train' command), or it was trained with other "
                         "settings or --ranks")
    kind = str(cfg.head.kind)
    # the head's own rule for its active classes (partial ignores head.budget)
    budget = active_classes(Job(num_classes=classes, dim=cfg.model.dim, head=kind,
                                batch_size=cfg.data.batch_size,
                                sample_rate=cfg.head.sample_rate, budget=cfg.head.budget))
    settings = [f"config={config}"] + [o for o in overrides
                                        if o.split("=", 1)[0].strip() not in EXECUTION_FIELDS]
    settings += [f"ranks={ranks}"] * (ranks > 1)
    trained = ranks * sum(map(plan.batch_size_at, plan.epoch_of_steps(cfg.train.epochs)[:planned]))
    epochs = round(trained / images, 1)
    return {
        "date": datetime.date.today().isoformat(), "commit": current_commit(),
        "device": describe_device(worker_device(cfg.train.device, 0)),
        "classes": classes, "epochs": f"{epochs:g}", "head": kind, "budget": budget,
        "k": cfg.head.k if kind == "knn" else "",
        "random_share": cfg.head.random_share if kind == "knn" else "",
        "seed": cfg.train.seed, "top1": f"{100 * top1:.2f}", "top5": f"{100 * top5:.2f}",
        "class_means_top1": "" if class_means is None else f"{class_means:.2f}",
        "seconds_per_epoch": "", "notes": "; ".join(settings),
    }


def record_train(config: Path, overrides: list[str], *, ranks: int = 1,
                 eval_output: str = "") -> Path:
    """Append the row of the run of ``config`` with ``overrides`` on ``ranks`` processes to
    ``accuracy.csv`` in the results directory (``results.results_dir``); returns the file."""
    row = train_row(config, overrides, ranks=ranks, class_means=class_means_top1(eval_output))
    path = results_dir() / "accuracy.csv"
    append_result(path, row)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("config", type=Path, help="the config the run was trained with")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override the run was trained with (repeatable)")
    parser.add_argument("--eval-output", type=Path,
                        help="what 'xcls eval --rows class-means' printed for the run")
    parser.add_argument("--ranks", type=int, default=1,
                        help="the run's processes under torchrun (default: 1)")
    args = parser.parse_args(argv)
    try:
        eval_output = args.eval_output.read_text() if args.eval_output else ""
        path = record_train(args.config, args.set, ranks=args.ranks, eval_output=eval_output)
    except OSError as e:
        print(f"record_train: {e.filename}: cannot read it ({e.strerror})", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"record_train: {e}", file=sys.stderr)
        return 2
    print(f"record_train: recorded in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

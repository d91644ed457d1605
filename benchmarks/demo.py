"""The figures of one run of ``scripts/demo.sh``, printed, and with ``--record`` appended to
``benchmarks/results/demo.jsonl`` (the README's demo time and RESULTS.md's "Demo" are rendered
from there) and its top-1 to ``accuracy.csv`` (``record_train.py``: the accuracy tables' demo
row). demo.sh calls it at its end with what only it knows (when it started, the
dataset's seconds, the load then, the class-means evaluation's output, whether the run
resumed); the rest is read from the run: the dataset's summary.json beside data.train, the
run's train.csv and eval.csv.

    python benchmarks/demo.py configs/glyphs-2k-knn.toml --started EPOCH_S --load 11.9 \\
        [--dataset-s 270] --eval-output FILE [--resumed] [--record]

A run that resumed an earlier one (``--resumed``: its run directory held a checkpoint when
the demo started) timed only a part of the demo: it is printed and never recorded.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time
from pathlib import Path

from record_train import class_means_top1, record_train
from results import record

from xcls.config import load_config

COMMAND = "bash scripts/demo.sh"


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def demo_figures(config: Path, *, started: float, load: float, dataset_s: float | None,
                 eval_output: str, now: float) -> dict:
    """The figures of the demo run of ``config`` that began at ``started``."""
    cfg = load_config(config, [])
    run = Path(cfg.train.out_dir)
    summary = json.loads((Path(cfg.data.train).parent / "summary.json").read_text())
    trained = rows(run / "train.csv")
    evaluated = rows(run / "eval.csv")
    figures = {
        "classes": summary["classes"], "train images": summary["images"]["train"],
        "test images": summary["images"]["test"],
        "dataset s": None if dataset_s is None else round(dataset_s, 1),
        "steps": int(trained[-1]["step"]), "batch": cfg.data.batch_size,
        "images/s": round(statistics.median(float(r["images_per_s"]) for r in trained)),
        "total s": round(now - started),
        "top-1 %": round(100 * float(evaluated[-1]["top1"]), 2),
        "class means top-1 %": class_means_top1(eval_output),
        "load (1 min)": f"{load:.1f}-{os.getloadavg()[0]:.1f}",
    }
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("config", type=Path, help="the demo's config")
    parser.add_argument("--started", type=float, required=True,
                        help="when the demo started (seconds since the epoch)")
    parser.add_argument("--load", type=float, required=True,
                        help="the host's 1-minute load average when it started")
    parser.add_argument("--dataset-s", type=float,
                        help="seconds the dataset took (none: it existed already)")
    parser.add_argument("--eval-output", type=Path, required=True,
                        help="what 'xcls eval --rows class-means' printed")
    parser.add_argument("--resumed", action="store_true",
                        help="the run resumed an earlier one: never recorded")
    parser.add_argument("--record", action="store_true",
                        help="append the figures to benchmarks/results/demo.jsonl and the "
                             "top-1 to accuracy.csv")
    args = parser.parse_args(argv)
    eval_output = args.eval_output.read_text()
    figures = demo_figures(args.config, started=args.started, load=args.load,
                           dataset_s=args.dataset_s, eval_output=eval_output, now=time.time())
    dataset = "an existing dataset" if figures["dataset s"] is None else \
        f"the dataset {figures['dataset s']:.0f} s of it"
    print(f"demo: {figures['total s']} s ({dataset}), {figures['steps']} steps at "
          f"{figures['images/s']} images/s, load {figures['load (1 min)']}; top-1 "
          f"{figures['top-1 %']:.2f}%, by class means {figures['class means top-1 %']}%")
    if args.record and args.resumed:
        print(f"demo: not recorded: the run resumed an earlier one in "
              f"{load_config(args.config, []).train.out_dir} (remove it to time a whole demo)")
    elif args.record:
        print(f"demo: recorded in {record('demo', [figures], command=COMMAND)} and "
              f"{record_train(args.config, [], eval_output=eval_output)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Accuracy study: full vs partial vs knn heads at equal active-set size on glyph data.

    python benchmarks/accuracy_study.py --data data/glyphs-2k --epochs 3

Trains the same backbone, data order and schedule once per head (embedded AMS) and prints a
markdown table: top-1 / top-5 on typeface designs never seen in training, wall time per epoch,
and rows pulled per step. Partial uses ``sample_rate``; knn gets the same number of active
classes (labels + nearest neighbors, filled at random), so the comparison is at equal cost.

Each finished run (one per head) is appended as a row to ``--results`` (default
benchmarks/results/accuracy.csv, created with its header when absent), columns
``RESULT_COLUMNS``: percents like 97.30, empty where not measured or where a setting does not
apply to the head (full has no k or random share, and its budget is every class; partial no k
or random share); ``commit`` and ``device`` are stamped as every results record is
(``results.current_commit``, ``results.describe_device``). SIGTERM stops the head in training
after its next step: nothing is recorded for it or the heads after it, and the study exits 143.
``--resume`` continues such a study (or one that was killed) from each head's newest checkpoint,
bit for bit the run it would have been; each head's ``study.json`` holds the commit and config it
was started with, and a resume with other code or other options is refused (exit 2), since its
row could name neither. A resumed row's seconds count only the steps trained after the resume,
and a head whose row was recorded already is skipped. Without ``--resume`` a head starts over, and
its earlier run's directory under ``--out`` is removed.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import difflib
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from results import current_commit, describe_device

from workers import checkpoint
from workers.termination import EXIT_TERMINATED
from xcls.config import ExperimentConfig, load_config, to_toml
from xcls.run import build_run

# knn variants: how its graph is built and refreshed (docs/scale.md)
# The study's graph rebuild period (docs/accuracy.md, "Setup"); a run at another period says so
# in its notes.
REBUILD_EVERY = 300
GRAPH_VARIANTS = {"knn": {}, "knn-ivf": {"graph.method": "ivf"},
                  "knn-touched": {"graph.refresh": "touched"}}
ROOT = Path(__file__).resolve().parents[1]
# The results file's schema; docs tables are rendered from it, so it changes only on purpose.
RESULT_COLUMNS = ("date", "commit", "device", "classes", "epochs", "head", "budget", "k",
                  "random_share", "seed", "top1", "top5", "class_means_top1",
                  "seconds_per_epoch", "notes")


class ResumeRefused(ValueError):
    """A head's run under ``--out`` cannot be resumed as the study's run (the message says
    why and what to do)."""


def study_config(name: str, args: argparse.Namespace, num_classes: int,
                 resume: bool = False) -> ExperimentConfig:
    """The config of head ``name`` (full, partial, knn or a knn graph variant) for the study's
    options ``args`` (``add_config_options``) on a dataset of ``num_classes`` classes;
    ``resume``: from the newest checkpoint in its out dir."""
    budget = max(1, round(args.sample_rate * num_classes))
    kind = "knn" if name in GRAPH_VARIANTS else name
    sets = {
        "data.train": str(args.data / "train"), "data.test": str(args.data / "test"),
        "data.batch_size": args.batch_size, "data.num_workers": args.num_workers,
        "model.dim": args.dim, "head.kind": kind, "head.sample_rate": args.sample_rate,
        "head.budget": budget, "head.k": args.k, "graph.k": max(args.k, 16),
        "graph.rebuild_every": args.rebuild_every, "optim.lr": args.lr,
        "optim.warmup_steps": args.warmup, "train.epochs": args.epochs,
        "train.out_dir": str(args.out / name), "train.resume": resume, "train.log_every": 20,
        "train.seed": args.seed, "train.threads": args.threads,
        "train.max_steps": args.max_steps,
    }
    # Options left unset keep the config's defaults, so the study trains what users get.
    optional = {"head.random_share": args.random_share,
                "head.logq_correction": args.logq_correction,
                "optim.head_momentum": args.head_momentum, "optim.head_lr": args.head_lr,
                "optim.head_weight_decay": args.head_weight_decay}
    sets.update({k: v for k, v in optional.items() if v is not None})
    sets.update(GRAPH_VARIANTS.get(name, {}))
    if name == "knn-ivf":
        sets.update({"graph.nprobe": args.nprobe,
                     **({"graph.nlist": args.nlist} if args.nlist else {})})
    if name == "knn-touched":
        sets["graph.full_every"] = args.full_every
    return load_config(None, [f"{k}={v}" for k, v in sets.items()] + list(args.set))


def resume_step(out: Path, identity: dict) -> int | None:
    """The step the run in ``out`` resumes from, None when it has no checkpoint (it starts
    afresh); ResumeRefused when it was not started as the run ``identity`` (``{"commit",
    "config"}``: the commit and the config's TOML) describes."""
    step = checkpoint.latest_step(out)
    if step is None:
        return None
    path = out / "study.json"
    try:
        started = json.loads(path.read_text())
        commit, config = started["commit"], started["config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ResumeRefused(f"{out}: its checkpoint at step {step} has no readable record of "
                            f"the study that started it ({path}: {e}); start it over without "
                            "--resume") from None
    if commit != identity["commit"]:
        raise ResumeRefused(
            f"{out}: its run was started at commit {commit} and this checkout is at "
            f"{identity['commit']}; a results row names the one commit that trained its run: "
            f"resume it from a checkout of {commit}, or start it over without --resume")
    if config != identity["config"]:
        changed = [line for line in difflib.ndiff(config.splitlines(),
                                                  identity["config"].splitlines())
                   if line[:2] in ("- ", "+ ")]
        raise ResumeRefused(
            f"{out}: its run was started with other options ({' / '.join(changed[:4])}); "
            "resume it with the options it was started with, or start it over without "
            "--resume")
    return step


def was_recorded(out: Path) -> bool:
    """Whether the run in ``out`` is finished and has its row in the results file (a resumed
    study skips it rather than record it twice)."""
    try:
        return json.loads((out / "study.json").read_text()).get("recorded") is True
    except (OSError, ValueError, AttributeError):
        return False


def mark_recorded(out: Path) -> None:
    """Note in ``out/study.json`` that its run's row is in the results file."""
    path = out / "study.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "recorded": True}, indent=1))


def run_head(name: str, args: argparse.Namespace, num_classes: int,
             commit: str) -> dict | None:
    """Train head ``name`` and measure it (with ``args.resume``: from its run's newest
    checkpoint, if it has one; ResumeRefused when that run is not this study's); None when
    SIGTERM stopped the run before its end (the trainer checkpoints and returns early: its last
    evaluation, if any, is of a run cut short, which no results row may pass off as
    finished)."""
    out = args.out / name
    cfg = study_config(name, args, num_classes)
    identity = {"commit": commit, "config": to_toml(cfg)}
    resumed_at = resume_step(out, identity) if args.resume else None
    if resumed_at is None:
        # Starting over replaces an earlier run here: its checkpoints would be what a later
        # --resume finds, and its logs (graph.csv's recalls) would count in the new run's row.
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "study.json").write_text(json.dumps(identity, indent=1))
    else:
        cfg = study_config(name, args, num_classes, resume=True)
    run = build_run(cfg)
    started = time.perf_counter()
    result = run.trainer.train()
    if result.terminated:
        return None
    seconds = time.perf_counter() - started
    steps_per_epoch = run.trainer.plan.steps_per_epoch
    trained = result.steps - (resumed_at or 0)  # by this process: the time it has
    means = run.trainer.evaluator.evaluate(rows="class-means") if args.class_means else {}
    recalls = graph_recalls(out)
    return {
        "head": name, "top1": result.eval["top1"], "top5": result.eval["top5"],
        "graph_recall": statistics.mean(recalls) if recalls else None,
        "top1_class_means": means.get("top1"),
        "seconds_per_epoch": seconds / (trained / steps_per_epoch) if trained else None,
        "resumed_at": resumed_at,
        "active_per_step": statistics.mean(row["active"] for row in result.history),
        # every row the run pulled, from the AMS's counters (graph builds scan instead)
        "rows_per_step": sum(s["tables"][cfg.ams.table]["rows_pulled"]
                             for s in run.client.stats()) / max(1, result.steps),
        "steps": result.steps, "final_loss": result.last_loss,
        "random_share": cfg.head.random_share, "logq_correction": cfg.head.logq_correction,
        "head_momentum": cfg.optim.head_momentum,
        "head_weight_decay": cfg.optim.head_weight_decay,
        "budget": cfg.head.budget, "k": cfg.head.k, "device": str(run.trainer.device),
    }


def graph_recalls(out: Path) -> list[float]:
    """recall@k of every ivf graph build the run logged in its graph.csv (none for exact)."""
    path = out / "graph.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [float(row["recall"]) for row in csv.DictReader(f) if row.get("recall")]


def run_notes(name: str, args: argparse.Namespace) -> str:
    """What set this run apart from the defaults, for the results file's ``notes``: the knn
    graph's rebuild period and variant, the options given explicitly, ``--set`` overrides,
    a step limit, and ``--notes``."""
    notes = []
    if name in GRAPH_VARIANTS:
        if args.rebuild_every != REBUILD_EVERY:
            notes.append(f"graph.rebuild_every={args.rebuild_every}")
        notes += [f"{key}={value}" for key, value in GRAPH_VARIANTS[name].items()]
    explicit = {"logq_correction": args.logq_correction, "head_momentum": args.head_momentum,
                "head_lr": args.head_lr, "head_weight_decay": args.head_weight_decay}
    if name in GRAPH_VARIANTS and args.random_share is not None:
        explicit["random_share"] = args.random_share
    notes += [f"{key}={value}" for key, value in explicit.items() if value is not None]
    for key, value, default in (("batch_size", args.batch_size, 128), ("lr", args.lr, 0.1),
                                ("warmup", args.warmup, 100), ("dim", args.dim, 128)):
        if value != default:
            notes.append(f"{key}={value}")
    notes += list(args.set)
    if args.max_steps:
        notes.append(f"max_steps={args.max_steps}")
    if args.notes:
        notes.append(args.notes)
    return "; ".join(notes)


def result_row(r: dict, name: str, args: argparse.Namespace, num_classes: int, commit: str,
               device: str) -> dict:
    """The results file's row (``RESULT_COLUMNS``) of run ``r`` (``run_head``'s dict)."""
    def percent(value: float | None) -> str:
        return "" if value is None else f"{100 * value:.2f}"

    kind = "knn" if name in GRAPH_VARIANTS else name
    resumed = ("" if r["resumed_at"] is None else
               f"resumed at step {r['resumed_at']}, seconds from the steps after it")
    return {
        "date": datetime.date.today().isoformat(), "commit": commit, "device": device,
        "classes": num_classes, "epochs": args.epochs, "head": name,
        "budget": num_classes if kind == "full" else r["budget"],
        "k": r["k"] if kind == "knn" else "",
        "random_share": r["random_share"] if kind == "knn" else "", "seed": args.seed,
        "top1": percent(r["top1"]), "top5": percent(r["top5"]),
        "class_means_top1": percent(r["top1_class_means"]),
        "seconds_per_epoch": ("" if r["seconds_per_epoch"] is None
                              else f"{r['seconds_per_epoch']:.0f}"),
        "notes": "; ".join(filter(None, [run_notes(name, args), resumed])),
    }


def append_result(path: Path, row: dict) -> None:
    """Append ``row`` to the results CSV at ``path``, writing the header first when the file
    is new; a file with another header is refused (rows must stay aligned with it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if tuple(header) != RESULT_COLUMNS:
            raise ValueError(f"{path}: its header {header} is not {list(RESULT_COLUMNS)}")
    with open(path, "a", newline="") as f:
        # "\n" like the rest of the tracked results (csv's default is "\r\n")
        writer = csv.DictWriter(f, fieldnames=RESULT_COLUMNS, lineterminator="\n")
        if new:
            writer.writeheader()
        writer.writerow(row)


def add_config_options(p: argparse.ArgumentParser) -> None:
    """The options ``study_config`` reads (also the start tracer's, benchmarks/trace_start.py,
    so that a traced run is the study's run)."""
    p.add_argument("--data", type=Path, required=True,
                   help="glyph dataset dir with train/ and test/ (xcls data glyphs)")
    p.add_argument("--nprobe", type=int, default=8, help="knn-ivf: lists each class scans")
    p.add_argument("--nlist", type=int, default=0, help="knn-ivf: inverted lists (0: auto)")
    p.add_argument("--full-every", type=int, default=10,
                   help="knn-touched: a full build after this many touched refreshes")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=0, help="stop each run here (0: all epochs)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--sample-rate", type=float, default=0.1,
                   help="partial's active fraction; knn gets the same active-set size")
    p.add_argument("--k", type=int, default=16, help="knn: neighbors per label")
    p.add_argument("--rebuild-every", type=int, default=REBUILD_EVERY,
                   help=f"knn graph rebuild period in steps (default {REBUILD_EVERY})")
    p.add_argument("--random-share", type=float,
                   help="knn: fraction of the negative slots given to uniform random classes "
                        "(default: head.random_share's default)")
    p.add_argument("--head-momentum", type=float,
                   help="the class rows' momentum (default: optim.head_momentum's default; "
                        "0.9: lazy momentum rows, as docs/accuracy.md compares)")
    p.add_argument("--head-lr", type=float,
                   help="the class rows' peak learning rate (default: optim.head_lr's default, "
                        "lr / (1 - momentum) = 1.0)")
    p.add_argument("--head-weight-decay", type=float,
                   help="the class rows' weight decay (default: optim.head_weight_decay's "
                        "default)")
    p.add_argument("--logq-correction", action=argparse.BooleanOptionalAction,
                   help="partial, knn: weight uniformly drawn classes' logits by the pool "
                        "they stand for (unbiased sampled softmax; default: "
                        "head.logq_correction's default, off = PartialFC's plain softmax)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/accuracy-study"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other config field, as 'xcls train --set' takes it (repeatable; "
                        "applied last)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_options(p)
    p.add_argument("--heads", default="full,partial,knn",
                   help="comma-separated heads to run: full, partial, knn, and knn's graph "
                        "variants knn-ivf (graph.method = ivf) and knn-touched (graph.refresh "
                        "= touched)")
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks/results/accuracy.csv",
                   help="CSV each finished run is appended to (default: %(default)s)")
    p.add_argument("--notes", default="", help="free text for the results file's notes column")
    p.add_argument("--resume", action="store_true",
                   help="continue each head whose run under --out has a checkpoint (a study "
                        "stopped by SIGTERM, or killed) from its newest one; refused when that "
                        "run was started by other code or with other options. The row's "
                        "seconds count only the steps trained after the resume. Without it "
                        "each head starts over: its earlier run's directory there is removed")
    p.add_argument("--class-means", action="store_true",
                   help="also report top-1 with each class's mean training feature as its row "
                        "(xcls eval --rows class-means; one more pass over the training split)")
    args = p.parse_args()

    summary = json.loads((args.data / "summary.json").read_text())
    num_classes = summary["classes"]
    commit = current_commit()  # before the runs: the code they run, whatever is committed after
    rows = []
    for name in args.heads.split(","):
        if args.resume and was_recorded(args.out / name):
            print(f"{name}: its run in {args.out / name} is finished and recorded already; "
                  "skipped (start it over without --resume to train it again)", file=sys.stderr)
            continue
        try:
            row = run_head(name, args, num_classes, commit)
        except ResumeRefused as e:
            print(f"{name}: {e}", file=sys.stderr)
            return 2
        if row is None:
            print(f"{name}: stopped by SIGTERM before the end of its run; nothing recorded for "
                  "it or the heads after it (run the study again with --resume to go on "
                  "from where it stopped)",
                  file=sys.stderr)
            return EXIT_TERMINATED
        rows.append(row)
        device = describe_device(row["device"])
        append_result(args.results, result_row(row, name, args, num_classes, commit, device))
        mark_recorded(args.out / name)
    if not rows:
        return 0
    print(f"\n{num_classes} classes, {args.epochs} epochs (max {args.max_steps or '-'} steps), "
          f"batch {args.batch_size}, "
          f"sample_rate {args.sample_rate}, knn k={args.k} random_share "
          f"{rows[0]['random_share']}, row momentum {rows[0]['head_momentum']}, row weight "
          f"decay {rows[0]['head_weight_decay']}, "
          f"logq correction {rows[0]['logq_correction']}\n")
    means = " top-1 by class means |" if args.class_means else ""
    print(f"| head | top-1 (unseen designs) | top-5 |{means} s / epoch | active classes / step "
          "| rows pulled / step | graph recall@k (mean of builds) |")
    print("|---|---:|---:|" + "---:|" * (5 if args.class_means else 4))
    for r in rows:
        means = f" {100 * r['top1_class_means']:.2f} % |" if args.class_means else ""
        recall = "exact" if r["graph_recall"] is None else f"{r['graph_recall']:.4f}"
        recall = recall if r["head"] in GRAPH_VARIANTS else "-"
        seconds = "-" if r["seconds_per_epoch"] is None else f"{r['seconds_per_epoch']:.0f}"
        print(f"| {r['head']} | {100 * r['top1']:.2f} % | {100 * r['top5']:.2f} % |{means} "
              f"{seconds} | {r['active_per_step']:.0f} | "
              f"{r['rows_per_step']:.0f} | {recall} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Gear training on vs off on a glyph dataset: backbone work per sample, wall time per epoch and
top-1 on unseen designs, for feature-cache ttl 0 / short / long and m 1 / 4 (the shape of the Gear
training paper's table 2 and figure 5; docs/references.md).

Every run trains the same config from scratch in this process (embedded AMS, full head, gear
backend ``memory``, in-process slow gear) and evaluates at each epoch end. Backbone work is
counted by a forward hook on the backbone, independently of the gear's own counters: a
no-grad forward is the fast gear computing a cache miss, a forward with grad is a training
forward (followed by its backward). Evaluation forwards are not counted.

    python benchmarks/gear_study.py --data /tmp/glyphs500 --epochs 3
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from results import record, table_row

from xcls.config import load_config
from xcls.run import build_run


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", type=Path, required=True,
                   help="glyph dataset directory with train/ and test/ (xcls data glyphs)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per run")
    p.add_argument("--batch-size", type=int, default=128, help="samples per step")
    p.add_argument("--dim", type=int, default=64, help="embedding width")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate (backbone and rows)")
    p.add_argument("--ttl-short", type=float, default=30.0,
                   help="short feature ttl in seconds (about one gear epoch here)")
    p.add_argument("--ttl-long", type=float, default=1e6,
                   help="long feature ttl in seconds (nothing expires within a run)")
    p.add_argument("--ms", type=int, nargs="+", default=[1, 4], help="values of gear.m")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--json", type=Path, help="also write the rows here")
    return p.parse_args()


def run_one(args: argparse.Namespace, out_dir: Path, gear: dict[str, object]) -> dict:
    """Train one config; returns its table row."""
    sets = {
        "data.train": args.data / "train", "data.test": args.data / "test",
        "data.batch_size": args.batch_size, "data.num_workers": 0, "model.dim": args.dim,
        "head.kind": "full", "optim.lr": args.lr, "optim.warmup_steps": 20,
        "train.epochs": args.epochs, "train.threads": args.threads, "train.log_every": 1000,
        "train.out_dir": out_dir, "train.resume": "false", **gear,
    }
    cfg = load_config(None, [f"{k}={v}" for k, v in sets.items()])
    run = build_run(cfg)
    trainer = run.trainer
    counts = {"nograd": 0, "grad": 0}
    evaluating = [False]
    curve: list[tuple[float, float]] = []
    started = time.perf_counter()
    eval_seconds = [0.0]

    def count(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if not evaluating[0]:
            counts["grad" if torch.is_grad_enabled() else "nograd"] += inputs[0].shape[0]

    def evaluate() -> dict:
        evaluating[0] = True
        t = time.perf_counter()
        result = plain_evaluate()
        eval_seconds[0] += time.perf_counter() - t
        evaluating[0] = False
        curve.append((round(time.perf_counter() - started - eval_seconds[0], 1),
                      round(100 * result["top1"], 2)))
        return result

    plain_evaluate = trainer.evaluator.evaluate
    trainer.evaluator.evaluate = evaluate
    run.backbone.register_forward_hook(count)
    result = trainer.train()
    train_seconds = time.perf_counter() - started - eval_seconds[0]
    samples = result.steps * args.batch_size
    return {
        "gear": bool(gear), "ttl": gear.get("gear.ttl", "-"), "m": gear.get("gear.m", "-"),
        "fwd_nograd_per_sample": round(counts["nograd"] / samples, 3),
        "fwd_bwd_per_sample": round(counts["grad"] / samples, 3),
        "seconds_per_epoch": round(train_seconds / args.epochs, 1),
        "top1": round(100 * result.eval["top1"], 2), "top5": round(100 * result.eval["top5"], 2),
        "top1_curve": curve,  # (training seconds, top-1 %) at each epoch end
    }


def main() -> None:
    args = parse_args()
    configs: list[dict[str, object]] = [{}]
    for m in args.ms:
        for ttl in (0, args.ttl_short, args.ttl_long):
            configs.append({"gear.enabled": "true", "gear.ttl": ttl, "gear.m": m})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, gear in enumerate(configs):
            row = run_one(args, Path(tmp) / f"run{i}", gear)
            rows.append(row)
            print(json.dumps(row), flush=True)
    header = ("| gear | ttl s | m | no-grad fwd / sample | fwd+bwd / sample | s / epoch | "
              "top-1 % | top-5 % | top-1 % at epoch ends (train s, %) |")
    print(f"\n{header}\n|---|---|---|---|---|---|---|---|---|")
    lines = []
    for r in rows:
        curve = " ".join(f"({t:g}, {a:g})" for t, a in r["top1_curve"])
        lines.append(f"| {'on' if r['gear'] else 'off'} | {r['ttl']} | {r['m']} | "
                     f"{r['fwd_nograd_per_sample']} | {r['fwd_bwd_per_sample']} | "
                     f"{r['seconds_per_epoch']} | {r['top1']} | {r['top5']} | {curve} |")
    print("\n".join(lines))
    record("gear_study", [table_row(header, line) for line in lines])
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

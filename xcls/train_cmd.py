"""``xcls train``, ``xcls eval``, ``xcls export`` and ``xcls config print|examples``.

The objects a config describes are built by ``xcls.run``; this module parses arguments, calls
it, and prints.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path

from workers.settings import ExperimentConfig
from xcls.cli import EXIT_BAD_INPUT
from xcls.config import ConfigError, example_configs, load_config, to_toml
from xcls.metrics_http import add_metrics_args, serve_metrics_from_args
from xcls.run import Run, build_run, check_run, worker_placement

log = logging.getLogger("xcls.train")

# The exit code of a worker that met a restarted or unreachable shard. It writes no checkpoint:
# torchrun (--max-restarts) restarts the whole group, which resumes from the newest checkpoint
# with every shard restored to that checkpoint's step (75 is EX_TEMPFAIL: try again).
ROLLBACK_EXIT_CODE = 75


def _config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("config", type=Path, nargs=None if required else "?",
                   help="experiment TOML file (see configs/ for examples)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set head.kind=partial (repeatable)")


def _rows_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", choices=("trained", "class-means"), default="trained",
                   help="class rows to classify by: the rows as trained (default), or each "
                   "class's mean feature over data.train (one pass of the backbone over it; "
                   "more accurate on unseen images, see docs/accuracy.md)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a model (embedded AMS unless ams.addresses is set)",
        description="Train the experiment in CONFIG. With no ams.addresses the shards run in "
        "this process; with addresses it talks gRPC to running shards. Under torchrun each "
        "worker trains data-parallel (gloo on CPU, NCCL on CUDA). Resumes from the newest "
        "checkpoint in train.out_dir. Exits with code 75, writing no checkpoint, when a shard "
        "restarted or stayed unreachable: run it again (torchrun --max-restarts does) to roll "
        "every shard and worker back to the newest checkpoint.")
    _config_args(p)
    add_metrics_args(p, per_rank=True)
    p.set_defaults(func=run_train)

    p = sub.add_parser("eval", help="top-1/top-5 of a trained run on its test split",
                       description="Load the newest checkpoint of CONFIG's train.out_dir and "
                       "report top-1/top-5 on data.test by nearest class row. The run's own "
                       "config.toml (written there by 'xcls train', with its --set overrides) "
                       "is used, with this command's --set on top.")
    _config_args(p)
    _rows_arg(p)
    p.set_defaults(func=run_eval)

    p = sub.add_parser("export", help="write a self-contained model directory",
                       description="Write backbone weights (safetensors), class rows, config "
                       "and class names of CONFIG's newest checkpoint to OUT; load it with "
                       "workers.predict.Classifier.load(OUT).")
    _config_args(p)
    p.add_argument("--out", type=Path, required=True, help="export directory")
    _rows_arg(p)
    p.add_argument("--rows-dtype", choices=("float32", "float16"), default="float32",
                   help="float16: the class rows L2-normalized in half the bytes (default: "
                   "float32, as trained)")
    p.add_argument("--onnx", action="store_true",
                   help="also write backbone.onnx (uint8 images in, features out) for ONNX "
                   "runtimes; needs pip install 'xcls[onnx]'")
    p.set_defaults(func=run_export)

    config = sub.add_parser("config", help="inspect experiment configs",
                            description="Config commands. See 'xcls config print --help'.")
    cmds = config.add_subparsers(dest="config_command", metavar="COMMAND")
    p = cmds.add_parser("print", help="print the fully resolved config (defaults included)",
                        description="Print CONFIG with overrides applied and every default "
                        "filled in, as TOML, each field under a comment that says what it "
                        "does. With no CONFIG: the defaults.")
    _config_args(p, required=False)
    p.set_defaults(func=run_config_print)
    p = cmds.add_parser("examples", help="list the example configs installed with xcls",
                        description="Print the path of each example config that ships with "
                        "xcls (also in the source tree under configs/). Copy one and edit it, "
                        "or pass its path to 'xcls train'.")
    p.set_defaults(func=run_config_examples)
    config.set_defaults(func=lambda args: config.print_help() or 2)


def _load(args: argparse.Namespace) -> ExperimentConfig:
    try:
        return load_config(args.config, args.overrides)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


def run_config_print(args: argparse.Namespace) -> int:
    print(to_toml(_load(args)), end="")
    return 0


def run_config_examples(args: argparse.Namespace) -> int:
    for path in example_configs():
        print(path)
    return 0


def _agent_restarts() -> int:
    """How many times this host's torchrun agent has restarted its workers after a failure (0:
    its first start). An agent whose own workers were healthy restarts them when another host's
    agent comes back to the rendezvous after a failure, and counts no restart of its own."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def _begin_rollback(cfg: ExperimentConfig, rank: int, restarts: int) -> None:
    """A restarted group continues from its newest checkpoint, whatever train.resume says:
    starting afresh would train on rows the shards kept from the failed attempt."""
    from workers.checkpoint import latest_step

    cfg.train.resume = True
    if rank == 0:
        log.warning("rollback restart=%d to_step=%s", restarts,
                    latest_step(Path(cfg.train.out_dir)))


def _refuse(error: Exception) -> int:
    """Exit 2 with one line. Under torchrun the line goes to the worker's error file, where
    torchrun's report shows it and ``python -m xcls.torchrun`` prints it once for the group
    (every worker refuses the same input, and the group is stopped as soon as one has)."""
    line = f"error: {error}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        Path(error_file).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
    else:
        print(line, file=sys.stderr)
    return EXIT_BAD_INPUT


def run_train(args: argparse.Namespace) -> int:
    from ams.errors import AmsError, ShardRestarted, Unavailable
    from bridge.errors import BridgeError
    from workers import metrics
    from workers.checkpoint import CheckpointError, latest_step
    from workers.data.errors import DatasetError
    from workers.distributed import group_max, process_group
    from workers.termination import EXIT_TERMINATED

    try:
        cfg = load_config(args.config, args.overrides)
        placement = worker_placement(cfg)
        # before the process group forms: a refusal inside it would leave the other ranks
        # waiting in it, and torchrun would restart the group into the same refusal
        check_run(cfg, placement[1])
    except ConfigError as e:
        return _refuse(e)
    rank, world, device = placement
    serve_metrics_from_args(args, metrics.REGISTRY, per_rank=True)
    with process_group(world, device):
        # the group is restarted when any host's agent counted a failure (_agent_restarts)
        restarts = group_max(_agent_restarts(), world, device)
        if restarts:
            _begin_rollback(cfg, rank, restarts)
        elif not cfg.train.resume:
            # every rank: out_dir may be a host's own
            newest = latest_step(Path(cfg.train.out_dir))
            if group_max(int(newest is not None), world, device):
                since = "" if newest is None else f" (newest step {newest})"
                return _refuse(ConfigError(
                    f"train.resume = false, but train.out_dir {cfg.train.out_dir} holds the "
                    f"checkpoints of a run{since}: a fresh run beside them would lose its own "
                    "to them (pruning keeps the newest steps, and a restart resumes the "
                    "newest). Give this run another train.out_dir, or remove its checkpoints/ "
                    "and ams/ first"))
        try:
            run = build_run(cfg, placement, restarted=restarts > 0)
            result = run.trainer.train()
            # DDP's reducer holds the process group: freed after the group is destroyed, gloo's
            # destructor can deadlock at exit, so it goes first
            del run
            gc.collect()
        except (ShardRestarted, Unavailable) as e:
            # the shards may now hold different steps: stop without a checkpoint and let the
            # restarted group put every shard and rank back at one
            log.error("rollback_needed rank=%d exit_code=%d reason=%s", rank,
                      ROLLBACK_EXIT_CODE, e)
            return ROLLBACK_EXIT_CODE
        except (ConfigError, AmsError, DatasetError, BridgeError, CheckpointError) as e:
            return _refuse(e)
    if result.terminated:
        if rank == 0:
            print(f"stopped by SIGTERM after step {result.steps}, checkpoint saved; run the "
                  "same command to resume", file=sys.stderr)
        return EXIT_TERMINATED
    if rank == 0:
        # the loss of the last log line (and train.csv's last row), not the last step's alone,
        # which a reader could not find in the log; a finished run started again trains no
        # step and logs none
        logged = result.history[-1] if result.history else None
        line = (f"trained {result.steps} steps, loss {logged['loss']:.4f} (as logged at step "
                f"{logged['step']}: the mean since the log line before)") if logged else \
            f"already trained {result.steps} steps (train.max_steps); nothing to do"
        if result.eval:
            line += (f"; test top-1 {100 * result.eval['top1']:.2f}% top-5 "
                     f"{100 * result.eval['top5']:.2f}% on {result.eval['samples']} samples "
                     "of unseen designs/images")
        print(line)
    return 0


def _resumed_run(args: argparse.Namespace, doing: str) -> Run:
    """The run of CONFIG at its newest checkpoint, for ``doing`` ("evaluating",
    "exporting"), which the log says."""
    from ams.errors import AmsError
    from workers.checkpoint import CheckpointError

    cfg = _load(args)
    # The run's own config, as it trained (its --set overrides included), with this command's
    # overrides on top: eval and export need not repeat the training's.
    saved = Path(cfg.train.out_dir) / "config.toml"
    if saved.is_file():
        try:
            cfg = load_config(saved, args.overrides)
        except ConfigError as e:
            raise SystemExit(f"error: {saved}: {e}") from None
    # eval and export read a finished run; train.resume = false only means "train afresh".
    cfg.train.resume = True
    try:
        run = build_run(cfg)
        if not run.trainer.try_resume():
            raise ConfigError(f"train.out_dir: no checkpoint in {cfg.train.out_dir}; train first")
    except (ConfigError, AmsError, CheckpointError) as e:
        raise SystemExit(f"error: {e}") from None
    log.info("%s step=%d out_dir=%s", doing, run.trainer.step, cfg.train.out_dir)
    return run


def run_eval(args: argparse.Namespace) -> int:
    run = _resumed_run(args, "evaluating")
    if run.trainer.test_set is None:
        raise SystemExit("error: data.test: no test split configured")
    result = run.trainer.evaluator.evaluate(rows=args.rows)
    print(f"step {run.trainer.step}, {args.rows} rows: top-1 {100 * result['top1']:.2f}%  top-5 "
          f"{100 * result['top5']:.2f}%  ({result['samples']} test samples)")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from workers.predict import write_export

    if args.onnx:
        try:
            import onnxscript  # noqa: F401  (checked before anything is loaded or written)
        except ImportError:
            raise SystemExit("error: --onnx needs the onnx and onnxscript packages: "
                             "pip install 'xcls[onnx]'") from None
    run = _resumed_run(args, "exporting")
    meta = run.train_set.metadata
    try:
        out = write_export(args.out, run.backbone, run.trainer.evaluator.row_blocks(args.rows),
                           backbone_name=run.cfg.model.backbone, num_classes=meta.num_classes,
                           dim=run.cfg.model.dim, image_size=meta.height,
                           channels=meta.channels, class_names=meta.class_names,
                           step=run.trainer.step, config_toml=to_toml(run.cfg),
                           row_source=args.rows, rows_dtype=args.rows_dtype, onnx=args.onnx)
    except (OSError, ValueError) as e:  # --out: not ours to replace, unwritable, disk full
        raise SystemExit(f"error: --out {args.out}: {e}") from None
    print(f"exported step {run.trainer.step} ({args.rows} rows, {args.rows_dtype}) to {out}")
    return 0

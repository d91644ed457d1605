"""``xcls train``, ``xcls eval``, ``xcls export`` and ``xcls config print``.

This module is where a config becomes objects: it builds the AMS client, backbone, head and
datasets and hands them to ``workers.trainer.Trainer``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from xcls.config import ConfigError, ExperimentConfig, load_config, to_toml

if TYPE_CHECKING:  # the command line imports torch only when a command runs
    import torch

log = logging.getLogger("xcls.train")


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
        "checkpoint in train.out_dir.")
    _config_args(p)
    p.set_defaults(func=run_train)

    p = sub.add_parser("eval", help="top-1/top-5 of a trained run on its test split",
                       description="Load the newest checkpoint of CONFIG's train.out_dir and "
                       "report top-1/top-5 on data.test by nearest class row.")
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
    config.set_defaults(func=lambda args: config.print_help() or 2)


def _load(args: argparse.Namespace) -> ExperimentConfig:
    try:
        return load_config(args.config, args.overrides)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


def run_config_print(args: argparse.Namespace) -> int:
    print(to_toml(_load(args)), end="")
    return 0


@dataclass
class Run:
    """Everything built from a config, ready to train, evaluate or export."""

    cfg: ExperimentConfig
    trainer: object
    client: object
    train_set: object
    backbone: object


def training_device(cfg: ExperimentConfig, local_rank: int = 0) -> torch.device:
    """The device ``train.device`` names for the worker with this local rank (made current when
    it is a GPU); ConfigError when it cannot be had."""
    from workers.distributed import worker_device

    try:
        return worker_device(cfg.train.device, local_rank)
    except ValueError as e:
        raise ConfigError(f"train.device: {e}") from None


def worker_placement(cfg: ExperimentConfig) -> tuple[int, int, torch.device]:
    """(rank, world size, device) of a worker under torchrun ((0, 1, ...) in a plain process);
    ConfigError, in one line, when torchrun's environment or ``train.device`` is wrong."""
    from workers.distributed import torchrun_env

    try:
        rank, world, local_rank = torchrun_env()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return rank, world, training_device(cfg, local_rank)


def build_run(cfg: ExperimentConfig,
              placement: tuple[int, int, torch.device] | None = None) -> Run:
    """Datasets, AMS client and table, backbone, optimizer, head and trainer from ``cfg``, for
    the worker at ``placement`` (``worker_placement``; default: a lone worker, rank 0 of 1)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import ams
    from ams.graph import budget_for_sample_rate
    from workers.backbones import build_backbone
    from workers.data.errors import DatasetError
    from workers.data.lmdb_dataset import LmdbImageDataset
    from workers.heads import build_head
    from workers.losses import CombinedMarginLoss
    from workers.trainer import LoopOptions, Trainer
    from xcls.gear_cmd import build_gear

    rank, world, device = placement or (0, 1, training_device(cfg))
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if not cfg.data.train:
        raise ConfigError("data.train: no training dataset given (an LMDB dataset directory)")
    if world > 1 and not cfg.ams.addresses:
        raise ConfigError("ams.addresses: several workers need shared shards (the embedded "
                          "AMS lives inside one process); start shards with 'xcls serve shard' "
                          "or use 'xcls cluster up'")
    try:
        train_set = LmdbImageDataset(cfg.data.train)
        test_set = LmdbImageDataset(cfg.data.test) if cfg.data.test else None
    except DatasetError as e:
        raise ConfigError(f"data: {e}") from None
    meta = train_set.metadata
    if test_set is not None:
        t = test_set.metadata
        if (t.num_classes, t.height, t.width, t.channels) != (meta.num_classes, meta.height,
                                                              meta.width, meta.channels):
            raise ConfigError(f"data.test: {cfg.data.test} has {t.num_classes} classes of "
                              f"{t.channels}x{t.height}x{t.width}, data.train has "
                              f"{meta.num_classes} of {meta.channels}x{meta.height}x{meta.width}")
    if meta.height != meta.width:
        raise ConfigError(f"data.train: images are {meta.height}x{meta.width}; square images "
                          "are expected")
    num_classes = meta.num_classes

    out_dir = Path(cfg.train.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    token = Path(cfg.ams.token_file).read_text().strip() if cfg.ams.token_file else None
    client = ams.connect(cfg.ams.addresses, token=token) if cfg.ams.addresses else \
        ams.connect(local_shards=cfg.ams.local_shards, data_dir=out_dir / "ams")
    client.create_table(cfg.ams.table, num_rows=num_classes, dim=cfg.model.dim,
                        dtype=cfg.ams.dtype, state_dtype=cfg.ams.state_dtype or None,
                        momentum=cfg.optim.head_momentum,
                        weight_decay=cfg.optim.head_weight_decay, seed=cfg.train.seed)

    torch.manual_seed(cfg.train.seed)  # the same initial backbone on every rank
    try:
        backbone = build_backbone(cfg.model.backbone, cfg.model.dim, meta.channels, meta.height)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None
    backbone = backbone.to(device)
    gpu_ids = [device.index] if device.type == "cuda" else None
    model = DistributedDataParallel(backbone, device_ids=gpu_ids) if world > 1 else backbone
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr,
                                momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay)
    margin = CombinedMarginLoss.from_preset(cfg.head.margin, s=cfg.head.scale)
    budget = cfg.head.budget or budget_for_sample_rate(cfg.head.sample_rate, num_classes)
    head = build_head(cfg.head.kind, client, cfg.ams.table, num_classes, margin,
                      sample_rate=cfg.head.sample_rate, k=cfg.head.k, budget=budget,
                      random_share=cfg.head.random_share,
                      logq_correction=cfg.head.logq_correction, seed=cfg.train.seed * 1000 + rank)
    build_graph = None
    if cfg.head.kind == "knn":
        graph_device = cfg.graph.device or str(device)

        def build_graph(step: int) -> None:
            client.build_graph(cfg.ams.table, k=cfg.graph.k, step=step, device=graph_device)

    options = LoopOptions(
        out_dir=out_dir, epochs=cfg.train.epochs, max_steps=cfg.train.max_steps,
        batch_size=cfg.data.batch_size, num_workers=cfg.data.num_workers,
        prefetch_depth=cfg.train.prefetch_depth, lr=cfg.optim.lr,
        head_lr=cfg.optim.effective_head_lr(), warmup_steps=cfg.optim.warmup_steps,
        schedule=cfg.optim.schedule, log_every=cfg.train.log_every,
        eval_every=cfg.train.eval_every, checkpoint_every=cfg.train.checkpoint_every,
        rebuild_every=cfg.graph.rebuild_every, seed=cfg.train.seed, amp=cfg.train.amp,
        resume=cfg.train.resume)
    gear = build_gear(cfg, model, optimizer, train_set, device, out_dir, world)
    try:
        trainer = Trainer(client=client, table=cfg.ams.table, backbone=model,
                          optimizer=optimizer, head=head, train_set=train_set,
                          test_set=test_set, options=options, device=device,
                          build_graph=build_graph, rank=rank, world=world, gear=gear)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    (out_dir / "config.toml").write_text(to_toml(cfg))
    return Run(cfg, trainer, client, train_set, backbone)


def run_train(args: argparse.Namespace) -> int:
    from ams.errors import AmsError
    from bridge.errors import BridgeError
    from workers.data.errors import DatasetError
    from workers.distributed import process_group

    cfg = _load(args)
    try:
        placement = worker_placement(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rank, world, device = placement
    with process_group(world, device):
        try:
            run = build_run(cfg, placement)
            result = run.trainer.train()
        except (ConfigError, AmsError, DatasetError, BridgeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if rank == 0:
        line = f"trained {result.steps} steps, last loss {result.last_loss:.4f}"
        if result.eval:
            line += (f"; test top-1 {100 * result.eval['top1']:.2f}% top-5 "
                     f"{100 * result.eval['top5']:.2f}% on {result.eval['samples']} samples "
                     "of unseen designs/images")
        print(line)
    return 0


def _resumed_run(args: argparse.Namespace) -> Run:
    from ams.errors import AmsError

    cfg = _load(args)
    # eval and export read a finished run; train.resume = false only means "train afresh".
    cfg.train.resume = True
    try:
        run = build_run(cfg)
        if not run.trainer.try_resume():
            raise ConfigError(f"train.out_dir: no checkpoint in {cfg.train.out_dir}; train first")
    except (ConfigError, AmsError) as e:
        raise SystemExit(f"error: {e}") from None
    return run


def run_eval(args: argparse.Namespace) -> int:
    run = _resumed_run(args)
    if run.trainer.test_set is None:
        raise SystemExit("error: data.test: no test split configured")
    result = run.trainer.evaluate(rows=args.rows)
    print(f"step {run.trainer.step}, {args.rows} rows: top-1 {100 * result['top1']:.2f}%  top-5 "
          f"{100 * result['top5']:.2f}%  ({result['samples']} test samples)")
    return 0


def run_export(args: argparse.Namespace) -> int:
    from workers.predict import write_export

    run = _resumed_run(args)
    meta = run.train_set.metadata
    out = write_export(args.out, run.backbone, run.trainer.row_blocks(args.rows),
                       backbone_name=run.cfg.model.backbone, num_classes=meta.num_classes,
                       dim=run.cfg.model.dim, image_size=meta.height, channels=meta.channels,
                       class_names=meta.class_names, step=run.trainer.step,
                       config_toml=to_toml(run.cfg), row_source=args.rows)
    print(f"exported step {run.trainer.step} ({args.rows} rows) to {out}")
    return 0

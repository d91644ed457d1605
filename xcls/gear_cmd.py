"""``xcls gear slow``: the slow-gear worker (gear mode's objects are built by ``xcls.run``).

With ``gear.slow = "external"`` the trainers (fast gears) do not step the backbone: one
``xcls gear slow`` process reads the Redis Stream of ready mean gradients through the consumer
group, owns the backbone optimizer, and publishes the weights (a versioned Redis key, see
:class:`bridge.WeightStore`) every ``gear.publish_every`` backbone steps; the trainers
reload the newest every ``gear.sync_every`` steps. A slow process started later in the same
group takes over the entries of one that died (after ``--min-idle-ms``) and starts from the last
published weights.

Several slow processes share the backbone work under torchrun (``torchrun --nproc-per-node N -m
xcls gear slow CONFIG``): each rank reads its own means, every round the ranks vote (items read,
stop, still busy) in one all-reduce, and when anything was read all of them step together with
the parameter gradients summed over the ranks (:class:`workers.gear.SlowGearGroup`); rank 0
publishes. Started separately instead, they would train diverging copies of the backbone.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from workers.settings import ExperimentConfig
from xcls.cli_help import DefaultsHelpFormatter
from xcls.config import ConfigError, load_config
from xcls.metrics_http import add_metrics_args, serve_metrics_from_args
from xcls.run import build_slow_worker, worker_placement

if TYPE_CHECKING:  # the command line imports torch only when a command runs
    import torch

log = logging.getLogger("xcls.gear")


def add_parser(sub: argparse._SubParsersAction) -> None:
    gear = sub.add_parser("gear", help="gear mode workers (slow gear)",
                          description="Gear mode commands. See 'xcls gear slow --help'.")
    cmds = gear.add_subparsers(dest="gear_command", metavar="COMMAND")
    p = cmds.add_parser(
        "slow", help="slow-gear worker: apply mean feature gradients to the backbone",
        description="Read ready mean gradients of CONFIG's job from the Redis Stream (consumer "
        "group 'slow_gear'), reload those samples' images from data.train, run the backbone "
        "forward with grad and backward with the mean gradient, step the backbone, and publish "
        "the weights every gear.publish_every steps for the trainers (gear.slow=external, "
        "gear.backend=redis). Stops on SIGTERM/SIGINT after publishing. Under torchrun "
        "(torchrun --nproc-per-node N -m xcls gear slow CONFIG) the N processes train one "
        "backbone data-parallel, their gradients summed every step; rank 0 publishes.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("config", type=Path, help="the experiment TOML file the trainers use")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set gear.prefix=job7 (repeatable)")
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop after this many backbone steps (0: run until stopped)")
    p.add_argument("--idle-exit", type=float, default=0.0,
                   help="stop after this many seconds without a gradient (0: never)")
    p.add_argument("--consumer", default=None,
                   help="this worker's name in the consumer group, '-RANK' appended under torchrun "
                   "(default: host-pid)")
    p.add_argument("--min-idle-ms", type=int, default=60_000,
                   help="take over entries another consumer left unacked this long")
    p.add_argument("--block-ms", type=int, default=500,
                   help="how long one read waits for new gradients")
    add_metrics_args(p, per_rank=True)
    p.set_defaults(func=run_slow)
    gear.set_defaults(func=lambda args: gear.print_help() or 2)


def _check_slow_args(args: argparse.Namespace) -> None:
    """Refuse flags no slow gear can run with, before the config is read or Redis is asked:
    a negative wait is an error from Redis (--block-ms) or a claim every read fails with
    (--min-idle-ms), and a negative limit would stop the worker before its first step."""
    for flag, value in (("--max-steps", args.max_steps), ("--min-idle-ms", args.min_idle_ms),
                        ("--block-ms", args.block_ms)):
        if value < 0:
            raise SystemExit(f"error: {flag} {value} must be >= 0")
    if not 0 <= args.idle_exit < math.inf:
        raise SystemExit(f"error: --idle-exit {args.idle_exit} must be >= 0 and finite")


def run_slow(args: argparse.Namespace) -> int:
    from workers.distributed import process_group

    _check_slow_args(args)
    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.gear.backend != "redis":
            raise ConfigError("gear.backend: the slow-gear worker reads the Redis stream; set "
                              "gear.backend=redis")
        rank, world, device = worker_placement(cfg)
        from workers import metrics

        serve_metrics_from_args(args, metrics.REGISTRY, per_rank=True)
        with process_group(world, device):
            return _slow_loop(cfg, args, (rank, world, device))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _slow_loop(cfg: ExperimentConfig, args: argparse.Namespace,
               placement: tuple[int, int, torch.device]) -> int:
    from bridge import weights_digest
    from workers.gear import run_slow_worker
    from workers.metrics import CountedWeightChannel, watch_slow_gear
    from workers.schedule import lr_at

    rank, world, _ = placement
    worker = build_slow_worker(cfg, placement, consumer=args.consumer,
                               min_idle_ms=args.min_idle_ms)
    log.info("slow_gear_started prefix=%s version=%d consumer=%s rank=%d world=%d",
             cfg.gear.prefix, worker.slow.version, worker.consumer.consumer, rank, world)
    watch_slow_gear(worker.slow, worker.consumer)
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    steps = run_slow_worker(
        worker.slow, worker.consumer, CountedWeightChannel(worker.weights), worker.group,
        start=worker.start,
        # No cosine decay: this worker does not know how long the trainers will run.
        lr_at_step=lambda step: lr_at(step, cfg.optim.lr, cfg.optim.warmup_steps, 0,
                                      "constant"),
        publish_every=cfg.gear.publish_every, should_stop=lambda: stop,
        max_steps=args.max_steps, idle_exit_s=args.idle_exit, block_ms=args.block_ms)
    slow, c = worker.slow, worker.slow.counts
    # One write with its newline: the ranks share one pipe, and print's separate write of
    # the "\n" let two ranks' lines run together.
    sys.stdout.write(f"slow gear rank {rank}/{world}: {steps} backbone steps, "
                     f"{c.slow_forwards} means applied, {c.rejected} rejected, "
                     f"{worker.consumer.metrics.corrupt} malformed, {c.resets} resets "
                     f"followed, version {slow.version}, "
                     f"weights {weights_digest(slow.backbone)}\n")
    sys.stdout.flush()
    return 0

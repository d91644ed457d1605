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
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from xcls.config import ConfigError, ExperimentConfig, load_config
from xcls.run import build_backbone_and_optimizer, redis_client, worker_placement

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
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    p.set_defaults(func=run_slow)
    gear.set_defaults(func=lambda args: gear.print_help() or 2)


def run_slow(args: argparse.Namespace) -> int:
    from workers.distributed import process_group

    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.gear.backend != "redis":
            raise ConfigError("gear.backend: the slow-gear worker reads the Redis stream; set "
                              "gear.backend=redis")
        rank, world, device = worker_placement(cfg)
        with process_group(world, device):
            return _slow_loop(cfg, args, device, rank, world)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _slow_loop(cfg: ExperimentConfig, args: argparse.Namespace, device: torch.device,
               rank: int, world: int) -> int:
    import torch

    from bridge import RedisGradientConsumer, WeightChannel, WeightStore, weights_digest
    from workers.data.errors import DatasetError
    from workers.data.lmdb_dataset import LmdbImageDataset
    from workers.gear import SlowGear, SlowGearGroup
    from workers.schedule import lr_at

    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    try:
        train_set = LmdbImageDataset(cfg.data.train)
    except DatasetError as e:
        raise ConfigError(f"data.train: {e}") from None
    # The trainers' initial backbone, should none be published yet.
    backbone, optimizer = build_backbone_and_optimizer(cfg, train_set.metadata, device)
    backbone.train()
    client = redis_client(cfg.gear.redis_url)
    weights: WeightChannel = WeightStore(client, cfg.gear.prefix)
    group = SlowGearGroup(rank, world)
    # Take over where a previous slow worker stopped (its optimizer momentum is not kept);
    # rank 0's copy is everyone's, should the ranks have read different publications.
    start = weights.load_into(backbone, -1)
    version = group.from_rank0(start if start is not None else 0)
    group.broadcast_state(backbone)
    name = f"{args.consumer}-{rank}" if args.consumer and world > 1 else args.consumer
    consumer = RedisGradientConsumer(client, cfg.model.dim, cfg.gear.prefix, consumer=name,
                                     min_idle_ms=args.min_idle_ms)
    slow = SlowGear(backbone, optimizer, train_set, device, cfg.gear.slow_batch, version,
                    group if world > 1 else None)
    log.info("slow_gear_started prefix=%s version=%d consumer=%s rank=%d world=%d",
             cfg.gear.prefix, version, consumer.consumer, rank, world)

    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    steps, published, last_work = 0, version, time.monotonic()
    while not (args.max_steps and steps >= args.max_steps):
        # No cosine decay: this worker does not know how long the trainers will run.
        lr = lr_at(steps, cfg.optim.lr, cfg.optim.warmup_steps, 0, "constant")
        batch = consumer.read(slow.max_items, args.block_ms)
        if len(batch):
            last_work = time.monotonic()
        busy = not args.idle_exit or time.monotonic() - last_work <= args.idle_exit
        # One vote per round keeps the ranks in step: all apply, all stop, or none.
        total, stopping, anyone_busy = group.agree(len(batch), stop, busy)
        before = slow.version
        if total:
            slow.apply(batch, lr)  # alone, a batch of only rejected ids takes no step
            if len(batch):
                # Rejected ids are acked too: re-delivering them would only reject them again.
                consumer.ack(batch)
        if slow.version != before:
            steps += 1
            if rank == 0 and steps % cfg.gear.publish_every == 0 and \
                    weights.publish(backbone, slow.version):
                published = slow.version
        if stopping or not anyone_busy:
            break
    if rank == 0 and slow.version != published:
        weights.publish(backbone, slow.version)
    c = slow.counts
    # One write with its newline: the ranks share one pipe, and print's separate write of
    # the "\n" let two ranks' lines run together.
    sys.stdout.write(f"slow gear rank {rank}/{world}: {steps} backbone steps, "
                     f"{c.slow_forwards} means applied, {c.rejected} rejected, "
                     f"{consumer.metrics.corrupt} malformed, version {slow.version}, "
                     f"weights {weights_digest(backbone)}\n")
    sys.stdout.flush()
    return 0

"""``xcls cluster up``: a whole cluster (shards, then training workers) as processes on this host.

Shards bind 127.0.0.1 only; workers run under ``torchrun --standalone``. Every child runs in a
session of its own, so a Ctrl-C in the terminal reaches this process alone and the stop order
stays ours: workers first (their last pushes land on live shards), then the slow-gear group
(its last publication sees every gradient the workers sent), then shards.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from contextlib import AbstractContextManager
from pathlib import Path

from workers.settings import ExperimentConfig
from xcls.config import ConfigError, load_config
from xcls.secret_files import read_token
from xcls.shards import (
    Child,
    ShardProcess,
    ShardStartError,
    ShardStartTimeout,
    ShardSupervisor,
    StartCancelled,
    TooManyRestarts,
    shard_processes,
    spawn,
    stop,
)
from xcls.stop_request import StopRequest

log = logging.getLogger("xcls.cluster")

POLL_S = 0.2


def add_parser(sub: argparse._SubParsersAction) -> None:
    cluster = sub.add_parser("cluster", help="run shards and workers as local processes",
                             description="Local multi-process cluster. See 'xcls cluster up "
                             "--help'.")
    cmds = cluster.add_subparsers(dest="cluster_command", metavar="COMMAND")
    p = cmds.add_parser(
        "up", help="start shards, train with torchrun workers, stop everything",
        description="Start S model-server shards on 127.0.0.1, wait until every one answers "
        "its health check, then train CONFIG with W data-parallel workers (torchrun "
        "--standalone; ams.addresses is filled in for them). When training ends, or on "
        "Ctrl-C/SIGTERM, the workers are stopped first, then the slow-gear group (with "
        "--slow-workers), then the shards, each with SIGTERM, and their exit codes are "
        "reported. A shard that exits, or hangs past --hang-timeout (it is killed), is "
        "started again on its port; the workers, under torchrun --max-restarts, then roll "
        "back together to their newest checkpoint and every shard to its snapshot. Exit "
        "code: the workers' (0 when training finished), 128+signal when interrupted, 1 when "
        "a shard fails to start or fails more than --max-restarts times. With --shards-only the "
        "shards stay up in the foreground until Ctrl-C, for running 'xcls train' by hand.")
    p.add_argument("config", type=Path, nargs="?",
                   help="experiment TOML file (see configs/); optional with --shards-only "
                        "when --data-dir is given")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field for the workers, e.g. --set "
                        "train.max_steps=100 (repeatable; ams.addresses is set for you)")
    p.add_argument("--shards", type=int, default=2, metavar="S",
                   help="number of shard processes; class c lives on shard c mod S "
                        "(default: %(default)s)")
    p.add_argument("--workers", type=int, default=1, metavar="W",
                   help="number of training processes (ranks); each trains data.batch_size "
                        "samples per step (default: %(default)s)")
    p.add_argument("--slow-workers", type=int, default=0, metavar="G",
                   help="also run G slow-gear processes ('xcls gear slow' under torchrun, one "
                        "backbone data-parallel) for gear.slow=external with the redis backend; "
                        "they start before the workers and stop after them (default: %(default)s)")
    p.add_argument("--data-dir", type=Path,
                   help="the shards' snapshot directory (default: TRAIN_OUT_DIR/ams, next to "
                        "the checkpoints, which is what resuming a run needs)")
    p.add_argument("--base-port", type=int, metavar="P",
                   help="shard i listens on port P+i (default: free ports below the OS's "
                        "ephemeral range, which a restarted shard gets back)")
    p.add_argument("--metrics-port", type=int, default=0, metavar="M",
                   help="serve Prometheus metrics on 127.0.0.1: shard i on M+i, worker rank r "
                        "on M+S+r, slow-gear rank g on M+S+W+g (default: 0, off)")
    p.add_argument("--shards-only", action="store_true",
                   help="start the shards (restoring their newest snapshot), print the "
                        "addresses to put in a config, and serve until Ctrl-C/SIGTERM")
    p.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="shard restarts allowed in all, and worker-group restarts (torchrun "
                        "--max-restarts); one more failure stops the cluster (default: "
                        "%(default)s)")
    p.add_argument("--hang-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a shard that answers no health check for this long is killed and "
                        "restarted (default: %(default)s)")
    p.add_argument("--start-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="how long the shards may take to start serving (default: %(default)s)")
    p.add_argument("--stop-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long each role may take to exit after SIGTERM before SIGKILL "
                        "(default: %(default)s)")
    p.set_defaults(func=run_up)
    cluster.set_defaults(func=lambda args: cluster.print_help() or 2)


# Processes one ``cluster up`` starts on its host at most: a typo such as --workers 100000
# would otherwise fork until the host runs out of memory.
MAX_PROCESSES = 256


def _child_flags(args: argparse.Namespace) -> list[str]:
    """The global verbosity flags, passed on so every role logs as loudly as this one."""
    return ["-q"] if args.quiet else ["-v"] * args.verbose


def _check_args(args: argparse.Namespace) -> ExperimentConfig | None:
    """Validate the options and load the config before any process starts."""
    if args.shards < 1:
        raise SystemExit(f"error: --shards {args.shards} must be >= 1")
    if args.workers < 1:
        raise SystemExit(f"error: --workers {args.workers} must be >= 1")
    if args.slow_workers < 0:
        raise SystemExit(f"error: --slow-workers {args.slow_workers} must be >= 0")
    processes = args.shards + args.workers + args.slow_workers
    if processes > MAX_PROCESSES:
        raise SystemExit(f"error: --shards, --workers and --slow-workers start {processes} "
                         f"processes on this host; at most {MAX_PROCESSES}")
    if args.base_port is not None and not 1 <= args.base_port <= 65536 - args.shards:
        raise SystemExit(f"error: --base-port {args.base_port}: ports {args.base_port}.."
                         f"{args.base_port + args.shards - 1} must lie in 1..65535")
    last_metrics_port = args.metrics_port + args.shards + args.workers + args.slow_workers - 1
    if args.metrics_port and not (0 < args.metrics_port and last_metrics_port <= 65535):
        raise SystemExit(f"error: --metrics-port {args.metrics_port}: ports "
                         f"{args.metrics_port}..{last_metrics_port} must lie in 1..65535")
    if args.metrics_port and args.base_port is not None \
            and args.metrics_port <= args.base_port + args.shards - 1 \
            and args.base_port <= last_metrics_port:
        raise SystemExit(f"error: --metrics-port {args.metrics_port}: its ports "
                         f"{args.metrics_port}..{last_metrics_port} overlap the shards' "
                         f"{args.base_port}..{args.base_port + args.shards - 1} "
                         "(--base-port)")
    for flag, seconds in (("--start-timeout", args.start_timeout),
                          ("--stop-timeout", args.stop_timeout),
                          ("--hang-timeout", args.hang_timeout)):
        if not 0 < seconds < math.inf:
            raise SystemExit(f"error: {flag} {seconds:g} must be > 0 and finite")
    if args.max_restarts < 0:
        raise SystemExit(f"error: --max-restarts {args.max_restarts} must be >= 0")
    if args.data_dir is not None and args.data_dir.exists() and not args.data_dir.is_dir():
        raise SystemExit(f"error: --data-dir {args.data_dir} is not a directory")
    if args.config is None:
        if not args.shards_only:
            raise SystemExit("error: CONFIG is required to train (or use --shards-only)")
        if args.data_dir is None:
            raise SystemExit("error: --shards-only without CONFIG needs --data-dir (where the "
                             "shards keep their snapshots)")
        if args.overrides:
            raise SystemExit("error: --set needs CONFIG")
        return None
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    if args.slow_workers and not (cfg.gear.enabled and cfg.gear.slow == "external"
                                  and cfg.gear.backend == "redis"):
        raise SystemExit("error: --slow-workers needs gear.enabled=true, gear.slow=external and "
                         "gear.backend=redis in the config (the slow gear reads the Redis "
                         "stream the trainers write)")
    if cfg.head.placement == "collective":
        raise SystemExit("error: head.placement = 'collective' keeps the rows in the workers and "
                         "needs no shards: run 'torchrun --nproc-per-node W -m xcls train "
                         "CONFIG' (or scripts/launch_worker.sh)")
    if cfg.ams.addresses:
        log.warning("config_addresses_replaced was=%s", ",".join(cfg.ams.addresses))
    if cfg.ams.token_file:  # the shards' and the workers' token: refused here, once
        read_token(cfg.ams.token_file, "ams.token_file")
    return cfg


class Cluster:
    """The roles of one ``cluster up``; ``stop_requested`` is set by SIGINT/SIGTERM (its
    handlers go in with the cluster, before the first child starts)."""

    def __init__(self, args: argparse.Namespace, cfg: ExperimentConfig | None) -> None:
        self.args, self.cfg = args, cfg
        self.data_dir: Path = args.data_dir or Path(cfg.train.out_dir) / "ams"
        self.token_file = cfg.ams.token_file if cfg else ""
        self.shards: list[ShardProcess] = []
        self.supervisor: ShardSupervisor | None = None
        self.workers: Child | None = None
        self.slow: Child | None = None
        self.stop_requested = StopRequest()

    # ---- shards -------------------------------------------------------------------------

    def shard_processes(self) -> AbstractContextManager[list[ShardProcess]]:
        """The shards, serving on 127.0.0.1 until the block ends."""
        args = self.args
        ports = range(args.base_port, args.base_port + args.shards) \
            if args.base_port is not None else None
        # In training mode the workers restore the exact step of their checkpoint; by hand,
        # the newest snapshot is the natural state to come back to.
        # A shard restarted during training comes back empty: the workers' rollback restores
        # the step it needs.
        extra = ["--restore", "latest"] if args.shards_only else []
        if self.cfg is not None:
            # every checkpoint a rollback may pick keeps the snapshot of its step
            extra += ["--keep-snapshots", str(self.cfg.train.snapshots_to_keep),
                      "--storage", str(self.cfg.ams.storage)]
        return shard_processes(args.shards, data_dir=self.data_dir, ports=ports,
                               token_file=self.token_file, extra_args=extra,
                               xcls_flags=_child_flags(args), ready_timeout=args.start_timeout,
                               stop_timeout=args.stop_timeout, cancel=self.stop_requested,
                               metrics_ports=self.metrics_ports(0, args.shards))

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.shards]

    def supervise(self, shards: list[ShardProcess]) -> None:
        """Keep ``shards`` serving from now on (``watch_shards``)."""
        self.shards = shards
        self.supervisor = ShardSupervisor(shards, max_restarts=self.args.max_restarts,
                                          hang_timeout=self.args.hang_timeout,
                                          ready_timeout=self.args.start_timeout,
                                          cancel=self.stop_requested)

    def watch_shards(self) -> None:
        """Restart a shard that died or hung; ClusterError once restarts run out."""
        try:
            self.supervisor.check()
        except TooManyRestarts as e:
            raise ClusterError(str(e)) from None

    def dead_shard(self) -> int | None:
        return next((s.shard_id for s in self.shards if s.proc.poll() is not None), None)

    def report_shard_stats(self) -> None:
        """Print each shard's traffic for the run (pushes count every worker's pushes)."""
        import ams
        from ams.errors import AmsError

        token = read_token(self.token_file, "ams.token_file") if self.token_file else None
        try:
            with ams.connect(self.addresses, token=token, timeout=10, ready_timeout=5) as c:
                stats = c.stats()
        except AmsError as e:
            log.warning("shard_stats_unavailable error=%s", e)
            return
        for s in stats:
            for table, t in s["tables"].items():
                print(f"shard {s['shard_id']} table {table}: {t['pushes']} pushes, "
                      f"{t['rows_pushed']} rows pushed, {t['pulls']} pulls, graph version "
                      f"{t['graph_version']}", flush=True)

    # ---- workers ------------------------------------------------------------------------

    def _torchrun(self, processes: int, *xcls_args: str, max_restarts: int = 0) -> list[str]:
        overrides = [x for item in self.args.overrides for x in ("--set", item)]
        # torchrun with a restartable store, refusals not restarted and a quiet stop
        return [sys.executable, "-m", "xcls.torchrun", "--standalone",
                "--nproc-per-node", str(processes), "--max-restarts", str(max_restarts),
                "-m", "xcls", *_child_flags(self.args),
                *xcls_args, str(self.args.config), *overrides]

    def metrics_ports(self, offset: int, count: int) -> range | None:
        """The metrics ports of a role: ``count`` of them from ``--metrics-port`` + ``offset``
        (None when metrics are off)."""
        base = self.args.metrics_port
        return range(base + offset, base + offset + count) if base else None

    def _metrics_flag(self, offset: int) -> list[str]:
        """``--metrics-port`` for a torchrun role whose rank 0 serves on base + ``offset``
        (each rank adds its own)."""
        ports = self.metrics_ports(offset, 1)
        return ["--metrics-port", str(ports[0])] if ports else []

    def worker_command(self) -> list[str]:
        metrics = self._metrics_flag(self.args.shards)
        # a worker that meets a restarted shard exits (train_cmd.ROLLBACK_EXIT_CODE); torchrun
        # then restarts the group, which resumes from the newest checkpoint
        return [*self._torchrun(self.args.workers, "train", *metrics,
                                max_restarts=self.args.max_restarts),
                "--set", f"ams.addresses={json.dumps(self.addresses)}"]

    def start_slow_gear(self) -> None:
        """The slow-gear group, if --slow-workers: it runs until stopped (SIGTERM), then
        publishes the backbone a last time."""
        if self.args.slow_workers:
            metrics = self._metrics_flag(self.args.shards + self.args.workers)
            self.slow = spawn("slow-gear", self._torchrun(self.args.slow_workers, "gear",
                                                          "slow", *metrics), prefix="[slow-gear] ")

    def run_workers(self) -> int | None:
        """Train until the workers exit (their exit code) or a stop is requested (None),
        restarting shards that die or hang meanwhile."""
        self.start_slow_gear()
        self.workers = spawn("workers", self.worker_command())
        while self.workers.proc.poll() is None:
            if self.stop_requested.wait(POLL_S):
                return None
            self.watch_shards()
        return self.workers.proc.returncode

    def stop_workers(self) -> None:
        """Workers first (their last pushes land on live shards), then the slow-gear group
        (its last publication sees every gradient the workers sent); the shards stop after."""
        if self.workers is not None:
            stop([self.workers], self.args.stop_timeout)
        if self.slow is not None:
            # The slow gear only ever stops on a signal; its ranks publish and exit 0. Signal
            # them, not torchrun, which reports its own SIGTERM as a failure with a traceback
            # but exits 0 when its workers stop cleanly on theirs.
            stop([self.slow], self.args.stop_timeout, signal_children=True)


class ClusterError(RuntimeError):
    """A role failed to start or died; the message says which."""


def run_up(args: argparse.Namespace) -> int:
    cfg = _check_args(args)
    cluster = Cluster(args, cfg)
    # The stop's handlers went in with the cluster, before the first child starts: a signal at
    # any point must still lead to the ordered stop below, never to orphans.
    code = 1
    try:
        with cluster.shard_processes() as shards:
            cluster.supervise(shards)
            try:
                code = _serve_or_train(cluster)
            finally:
                cluster.stop_workers()
    except StartCancelled:
        pass
    except ShardStartTimeout as e:
        print(f"error: {e} (--start-timeout)", file=sys.stderr)
    except (ShardStartError, ClusterError) as e:
        print(f"error: {e}", file=sys.stderr)
    signum = cluster.stop_requested.signum
    return 128 + signum if signum else code


def _serve_or_train(cluster: Cluster) -> int:
    listed = json.dumps(cluster.addresses)
    if cluster.args.shards_only:
        print(f"shards serving; put this in the [ams] section of your config:\n"
              f"addresses = {listed}\n"
              f"or pass: --set 'ams.addresses={listed}'\n"
              f"Ctrl-C stops them.", flush=True)
        while not cluster.stop_requested.wait(POLL_S):
            cluster.watch_shards()
        return 0
    code = cluster.run_workers()
    if code is None:
        return 1  # a stop was requested: run_up turns this into 128 + the signal number
    log.info("workers_finished exit_code=%d shard_restarts=%d", code,
             cluster.supervisor.restarts)
    if cluster.dead_shard() is None:
        cluster.report_shard_stats()
    return code

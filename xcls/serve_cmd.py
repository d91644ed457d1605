"""``xcls serve shard``: run one AMS shard process."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import os
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from ams.limits import RPC_THREADS
from workers.settings import MAX_THREADS
from xcls.cli_help import DefaultsHelpFormatter
from xcls.metrics_http import add_metrics_args, serve_metrics_from_args
from xcls.secret_files import read_secret, read_token
from xcls.stop_request import StopRequest

if TYPE_CHECKING:
    from ams.cluster.scheduler import LeaseKeeper
    from ams.shard.store import ShardStore

log = logging.getLogger("xcls.serve")


def add_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run a server role (a model-server shard, the "
                           "scheduler)", description="Run a server role. See 'xcls serve shard "
                           "--help' and 'xcls serve scheduler --help'.")
    roles = serve.add_subparsers(dest="role", metavar="ROLE")
    p = roles.add_parser(
        "shard", help="serve one shard of the class-weight tables over gRPC",
        description="Serve shard I of S of the class-weight tables (rows + momentum) over gRPC. "
        "Class id c lives on shard c mod S. Stops cleanly on SIGTERM/SIGINT: health turns "
        "NOT_SERVING, in-flight pushes finish, mmap tables are written out and kept "
        "(--storage), exit code 0.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("--shard-id", type=int, required=True, help="this shard's index I, 0-based")
    p.add_argument("--num-shards", type=int, required=True, help="how many shards S in all")
    _add_listen_args(p, "anything but loopback needs --auth-token-file or TLS")
    p.add_argument("--data-port", type=int, default=0,
                   help="TCP port of the data plane, where pulls and pushes travel as binary "
                        "frames beside the gRPC port (proto/ams/api/frames.md); 0 picks a free "
                        "one, which clients learn from the shard. Fix it where a firewall or "
                        "a published container port must name it")
    p.add_argument("--data-dir", type=_directory_arg,
                   help="snapshot directory, shared by all shards of the cluster")
    p.add_argument("--storage", default="memory", metavar="memory|mmap",
                   help="where the tables' rows, optimizer state and decay clocks live: "
                        "'memory' (RAM), or 'mmap': files under DATA_DIR/tables mapped into "
                        "memory and paged by the OS, for tables larger than RAM (needs "
                        "--data-dir and the disk space). A clean stop keeps mmap tables and "
                        "the next start reopens them (not their neighbor graphs: build them "
                        "again or restore a snapshot); "
                        "after a crash they are discarded: restore a snapshot. A storage "
                        "error at start is one line on stderr and exit code 2")
    p.add_argument("--restore", metavar="latest|STEP",
                   help="load a snapshot before serving: 'latest' = newest complete one "
                        "(starts empty if there is none yet)")
    p.add_argument("--auth-token-file", type=Path,
                   help="file holding a shared secret; clients must send it")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate chain (enables TLS)")
    p.add_argument("--tls-key", type=Path, help="PEM private key for --tls-cert")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback bind with neither token nor TLS")
    p.add_argument("--require-auth", action="store_true",
                   help="refuse to start without --auth-token-file or TLS, even on loopback")
    p.add_argument("--keep-snapshots", type=int, default=3, metavar="K",
                   help="after each snapshot keep the K newest complete steps of this shard's "
                        "pieces and remove older ones; 0 keeps all")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds to let in-flight calls finish on shutdown")
    p.add_argument("--rpc-threads", type=int, default=RPC_THREADS, help="gRPC handler threads")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads per request; requests already run in parallel "
                        "handler threads, and parallel kernels stall each other on busy cores")
    add_metrics_args(p)
    _add_lease_args(p)
    p.set_defaults(func=run_shard)
    _add_scheduler_parser(roles)
    serve.set_defaults(func=lambda args: serve.print_help() or 2)


def _directory_arg(text: str) -> Path:
    """--data-dir's type: a path, not the empty string (which would mean the current
    directory, where a mistyped variable in a launch script would put the tables)."""
    if not text:
        raise argparse.ArgumentTypeError("must name a directory, not ''")
    return Path(text)


def _add_listen_args(p: argparse.ArgumentParser, bind_rule: str) -> None:
    p.add_argument("--port", type=int, default=0, help="TCP port; 0 picks a free one")
    p.add_argument("--host", default="127.0.0.1", help=f"address to bind; {bind_rule}")
    p.add_argument("--port-file", type=Path,
                   help="write the bound port here once serving (useful with --port 0)")


# ---- the scheduler role, and a shard's lease with it ---------------------------------------

# A shard exits with this code when the scheduler declared it dead (it hung past its lease):
# the cluster already gave up on its rows, so it must not serve; its supervisor starts a new
# incarnation.
EXIT_LEASE_LOST = 3


def _add_lease_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scheduler", metavar="HOST:PORT",
                   help="register with this 'xcls serve scheduler' and keep a lease; exit with "
                        f"code {EXIT_LEASE_LOST} once the scheduler declares this shard dead "
                        "(the auth token, if any, is sent to it too)")
    p.add_argument("--advertise", metavar="HOST",
                   help="host the scheduler hands to workers (default: --host, or this "
                        "machine's name when --host is a wildcard)")


def _add_scheduler_parser(roles: argparse._SubParsersAction) -> None:
    p = roles.add_parser(
        "scheduler", help="coordinate a multi-host job: shard discovery and leases",
        description="Shards ('xcls serve shard --scheduler') and workers (ams.scheduler) "
        "register here and renew a lease every TTL/3; workers find the shards here. A lease "
        "not renewed within the TTL (a dead or hung member) moves the generation on, which "
        "makes the workers roll back to their newest checkpoint. State lives in memory: after "
        "a restart the members register again.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("--num-shards", type=int, required=True, help="how many shards S the job has")
    _add_listen_args(p, "anything but loopback needs --auth-token-file")
    p.add_argument("--lease-ttl", type=float, default=10.0,
                   help="seconds a lease lasts without renewal; at least 1, since members "
                        "renew every TTL/3")
    p.add_argument("--auth-token-file", type=Path,
                   help="file holding the cluster's shared secret; members must send it")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback bind without a token")
    p.add_argument("--require-auth", action="store_true",
                   help="refuse to start without --auth-token-file, even on loopback: "
                        "without a token anyone who reaches the port can register for a "
                        "shard's slot and so fence the real shard (docs/reliability.md)")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds to let in-flight calls finish on shutdown")
    add_metrics_args(p)
    p.set_defaults(func=run_scheduler)


def run_scheduler(args: argparse.Namespace) -> int:
    _check_num_shards(args)
    _check_server_args(args)
    from ams.cluster.scheduler import check_lease_ttl, create_scheduler_server
    from ams.errors import InvalidArgument

    try:
        check_lease_ttl(args.lease_ttl)
    except InvalidArgument as e:
        raise SystemExit(f"error: --lease-ttl: {e}") from None
    token = read_token(args.auth_token_file, "--auth-token-file") \
        if args.auth_token_file else None
    if not _is_loopback(args.host) and not token and not args.insecure:
        raise SystemExit(f"error: refusing to serve on {args.host} without --auth-token-file; "
                         "add --insecure if this network is trusted")
    if args.require_auth and not token:
        raise SystemExit("error: --require-auth: give --auth-token-file")
    from ams.cluster import metrics

    serve_metrics_from_args(args, metrics.REGISTRY)
    stop = StopRequest()  # before serving: a caller that sees it up may stop it at once
    try:
        running = create_scheduler_server(args.num_shards, lease_ttl=args.lease_ttl,
                                          host=args.host, port=args.port, token=token)
    except OSError as e:
        raise SystemExit(f"error: {e}") from None
    _write_port_file(args.port_file, running.port)
    log.info("listening scheduler host=%s port=%d num_shards=%d lease_ttl_s=%g auth=%s",
             args.host, running.port, args.num_shards, args.lease_ttl, bool(token))
    stop.wait()
    _remove_port_file(args.port_file)
    running.stop(args.grace)
    log.info("stopped")
    return 0


def _check_num_shards(args: argparse.Namespace) -> None:
    """Refuse a --num-shards no scheduler lists (``ams.cluster.lease.MAX_SHARD_SLOTS``)."""
    from ams.cluster.lease import MAX_SHARD_SLOTS

    if not 1 <= args.num_shards <= MAX_SHARD_SLOTS:
        raise SystemExit(f"error: --num-shards {args.num_shards} must be in "
                         f"1..{MAX_SHARD_SLOTS}")


def _check_server_args(args: argparse.Namespace) -> None:
    """Refuse a --port, --port-file or --grace no server could use, before anything starts
    (the port file is written once serving, too late for a one-line error)."""
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"error: --port {args.port} must be in 0..65535")
    if args.port_file is not None and not args.port_file.parent.is_dir():
        raise SystemExit(f"error: --port-file {args.port_file}: {args.port_file.parent} is not "
                         "a directory")
    if args.port_file is not None and args.port_file.is_dir():
        raise SystemExit(f"error: --port-file {args.port_file} is a directory; name a file")
    if not 0 <= args.grace < math.inf:
        raise SystemExit(f"error: --grace {args.grace} must be >= 0 and finite")


def _write_port_file(path: Path | None, port: int) -> None:
    """Write ``port`` to ``path`` atomically (a reader never sees a partial number)."""
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


def _remove_port_file(path: Path | None) -> None:
    """Take the port file away as the server stops: a watcher must not dial a port that
    nothing serves (or that another process took since)."""
    if path is not None:
        path.unlink(missing_ok=True)


def _check_lease_args(args: argparse.Namespace) -> None:
    """Refuse a malformed --scheduler, or --advertise without it, before anything starts."""
    from ams.addresses import parse_address
    from ams.errors import InvalidArgument

    if args.scheduler is None:
        if args.advertise is not None:
            raise SystemExit("error: --advertise needs --scheduler")
        return
    try:
        parse_address(args.scheduler)
    except InvalidArgument as e:
        raise SystemExit(f"error: --scheduler: {e}") from None


def _advertised_address(args: argparse.Namespace, port: int) -> str:
    """host:port the scheduler hands to workers for this shard."""
    import socket

    host = args.advertise or args.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _keep_shard_lease(args: argparse.Namespace, incarnation: str, port: int, token: str | None,
                      stop: StopRequest) -> LeaseKeeper | None:
    """Register this serving shard with the scheduler and keep its lease; a lost lease sets
    ``stop`` (the caller then exits with EXIT_LEASE_LOST). SystemExit when registering fails;
    None when a stop is asked for first (registering retries a scheduler it cannot reach for
    a minute, which a SIGTERM must not wait out)."""
    from ams.cluster.lease import Role
    from ams.cluster.scheduler import SchedulerClient
    from ams.errors import AmsError

    scheduler = SchedulerClient(args.scheduler, token=token)
    address = _advertised_address(args, port)
    outcome: list[LeaseKeeper | BaseException] = []

    def register() -> None:
        try:
            outcome.append(scheduler.keep_lease(Role.SHARD, args.shard_id, address, incarnation,
                                                on_lost=lambda reason: stop.set()))
        except BaseException as e:  # handed to the main thread
            outcome.append(e)

    registering = threading.Thread(target=register, name="lease-register", daemon=True)
    registering.start()
    while registering.is_alive():
        if stop.wait(0.2):
            log.info("registration_abandoned scheduler=%s reason=stop", args.scheduler)
            return None
    (result,) = outcome
    if isinstance(result, AmsError):
        scheduler.close()
        raise SystemExit(f"error: registering with the scheduler: {result}") from None
    if isinstance(result, BaseException):
        raise result
    log.info("registered scheduler=%s address=%s incarnation=%s", args.scheduler, address,
             incarnation)
    return result


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_shard(args: argparse.Namespace) -> int:
    _check_num_shards(args)
    if not 0 <= args.shard_id < args.num_shards:
        raise SystemExit(f"error: --shard-id {args.shard_id} must be in [0, --num-shards "
                         f"{args.num_shards})")
    _check_server_args(args)
    if not 0 <= args.data_port <= 65535:
        raise SystemExit(f"error: --data-port {args.data_port} must be in 0..65535")
    if args.data_port and args.data_port == args.port:
        raise SystemExit(f"error: --data-port {args.data_port} is --port too; give each its "
                         "own")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise SystemExit("error: --tls-cert and --tls-key go together")
    token = read_token(args.auth_token_file, "--auth-token-file") \
        if args.auth_token_file else None
    tls = args.tls_cert is not None
    if not _is_loopback(args.host) and not (token or tls) and not args.insecure:
        raise SystemExit(f"error: refusing to serve on {args.host} without --auth-token-file or "
                         "TLS; add --insecure if this network is trusted")
    if args.require_auth and not (token or tls):
        raise SystemExit("error: --require-auth: give --auth-token-file or --tls-cert/--tls-key")
    if args.keep_snapshots < 0:
        raise SystemExit(f"error: --keep-snapshots {args.keep_snapshots} must be >= 0")
    if args.restore is not None and args.data_dir is None:
        raise SystemExit("error: --restore needs --data-dir")
    for flag, threads in (("--rpc-threads", args.rpc_threads),
                          ("--torch-threads", args.torch_threads)):
        if not 1 <= threads <= MAX_THREADS:  # a process has a limit on its threads
            raise SystemExit(f"error: {flag} {threads} must be in 1..{MAX_THREADS}")
    _check_lease_args(args)
    if args.data_dir is not None:
        try:
            args.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SystemExit(f"error: --data-dir {args.data_dir}: {e.strerror or e}") from None
    import torch

    torch.set_num_threads(args.torch_threads)
    store = _open_store(args)
    try:
        from ams.shard import metrics

        serve_metrics_from_args(args, metrics.REGISTRY)
        return _serve(args, store, token, tls)
    finally:
        _close_store(store)


def _open_store(args: argparse.Namespace) -> ShardStore:
    """The shard's store on ``--storage`` (mmap: reopening the tables a clean stop kept); a
    storage error is one line on stderr and exit code 2."""
    from ams.errors import AmsError
    from ams.shard.store import ShardStore

    if args.storage == "mmap" and args.data_dir is None:
        error = "--storage mmap needs --data-dir (its tables go in DATA_DIR/tables)"
    else:
        try:
            return ShardStore(args.shard_id, args.num_shards, storage=args.storage,
                              storage_dir=args.data_dir / "tables" if args.data_dir else None)
        except AmsError as e:
            error = f"--storage {args.storage}: {e}"
    print(f"error: {error}", file=sys.stderr)
    raise SystemExit(2)


def _close_store(store: ShardStore) -> None:
    """Close the store, keeping mmap tables for the next start; a table that cannot be kept
    is logged (the next start discards it)."""
    from ams.errors import AmsError

    try:
        store.close()
    except AmsError as e:
        log.error("store_close_failed error=%s", e)


def _restore_at_start(args: argparse.Namespace, store: ShardStore) -> int:
    """``--restore``: load a snapshot into ``store`` before serving; the step loaded (-1:
    none)."""
    from ams.errors import SnapshotError
    from ams.shard.metrics import record_restore
    from ams.shard.restore import restore_into
    from ams.shard.snapshot import list_steps

    restored = -1
    if args.restore is not None:
        if args.restore == "latest":
            step = None
        else:
            try:
                step = int(args.restore)
            except ValueError:
                raise SystemExit(f"error: --restore {args.restore!r}: 'latest' or a step "
                                 "number") from None
        if step is None and not list_steps(args.data_dir):
            log.info("restore_skipped reason=no_snapshots data_dir=%s", args.data_dir)
        else:
            try:
                restored, path = restore_into(store, args.data_dir, step)
            except SnapshotError as e:
                raise SystemExit(f"error: {e}") from None
            newest = list_steps(args.data_dir)[0]
            if step is None and restored != newest:  # the skipped steps are logged above
                log.warning("restore_fell_back newest=%d restored=%d", newest, restored)
            log.info("restored step=%d path=%s", restored, path)
            record_restore()
    return restored


def _serve(args: argparse.Namespace, store: ShardStore, token: str | None, tls: bool) -> int:
    """Bind, restore ``--restore`` (health NOT_SERVING meanwhile), then serve ``store`` until
    SIGTERM/SIGINT (exit code 0) or a lost lease."""
    from ams.server.service import create_server

    try:
        running = create_server(
            store, host=args.host, port=args.port, data_dir=args.data_dir, token=token,
            tls_cert=read_secret(args.tls_cert, "--tls-cert") if tls else None,
            tls_key=read_secret(args.tls_key, "--tls-key") if tls else None,
            max_workers=args.rpc_threads, keep_snapshots=args.keep_snapshots, ready=False,
            data_port=args.data_port)
    except OSError as e:
        raise SystemExit(f"error: {e}") from None
    log.info("listening shard=%d/%d host=%s port=%d data_port=%d tls=%s auth=%s", args.shard_id,
             args.num_shards, args.host, running.port, running.data_plane.port, tls, bool(token))
    try:
        restored = _restore_at_start(args, store)
    except BaseException:
        running.stop(0)
        raise
    # Handlers before SERVING: a caller that sees it serving may stop it at once. Not before
    # the restore, which SIGTERM still ends at once (nothing is served yet).
    stop = StopRequest()
    running.mark_ready(restored)
    _write_port_file(args.port_file, running.port)  # once serving, as its --help says
    log.info("serving shard=%d/%d restored_step=%d", args.shard_id, args.num_shards, restored)

    lease = None
    if args.scheduler is not None:
        try:
            lease = _keep_shard_lease(args, running.incarnation, running.port, token, stop)
        except SystemExit:
            _remove_port_file(args.port_file)
            running.stop(0)
            raise
    stop.wait()
    _remove_port_file(args.port_file)
    if lease is not None and lease.lost.is_set():
        # Fenced: the workers already roll back without this shard; refuse in-flight calls.
        log.error("fenced reason=%s exit_code=%d", lease.reason, EXIT_LEASE_LOST)
        running.stop(0)
        return EXIT_LEASE_LOST
    log.info("stopping grace_s=%.0f", args.grace)
    if lease is not None:
        lease.stop()  # leaving, it releases: the workers learn it now, not a TTL later
    running.stop(args.grace)
    log.info("stopped")
    return 0

"""``xcls serve shard``: run one AMS shard process."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import signal
import threading
from pathlib import Path

log = logging.getLogger("xcls.serve")


def add_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run a server role (a model-server shard)",
                           description="Run a server role. See 'xcls serve shard --help'.")
    roles = serve.add_subparsers(dest="role", metavar="ROLE")
    p = roles.add_parser(
        "shard", help="serve one shard of the class-weight tables over gRPC",
        description="Serve shard I of S of the class-weight tables (rows + momentum) over gRPC. "
        "Class id c lives on shard c mod S. Stops cleanly on SIGTERM/SIGINT: health turns "
        "NOT_SERVING, in-flight pushes finish, exit code 0.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shard-id", type=int, required=True, help="this shard's index I, 0-based")
    p.add_argument("--num-shards", type=int, required=True, help="how many shards S in all")
    p.add_argument("--port", type=int, default=0, help="TCP port; 0 picks a free one")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; anything but loopback needs --auth-token-file or TLS")
    p.add_argument("--port-file", type=Path,
                   help="write the bound port here once serving (useful with --port 0)")
    p.add_argument("--data-dir", type=Path,
                   help="snapshot directory, shared by all shards of the cluster")
    p.add_argument("--restore", metavar="latest|STEP",
                   help="load a snapshot before serving: 'latest' = newest complete one "
                        "(starts empty if there is none yet)")
    p.add_argument("--auth-token-file", type=Path,
                   help="file holding a shared secret; clients must send it")
    p.add_argument("--tls-cert", type=Path, help="PEM certificate chain (enables TLS)")
    p.add_argument("--tls-key", type=Path, help="PEM private key for --tls-cert")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback bind with neither token nor TLS")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds to let in-flight calls finish on shutdown")
    p.add_argument("--workers", type=int, default=16, help="gRPC handler threads")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads per request; requests already run in parallel "
                        "handler threads, and parallel kernels stall each other on busy cores")
    p.set_defaults(func=run_shard)
    serve.set_defaults(func=lambda args: serve.print_help() or 2)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _read_secret(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SystemExit(f"error: cannot read {what} {path}: {e.strerror}") from None
    if not data.strip():
        raise SystemExit(f"error: {what} {path} is empty")
    return data


def run_shard(args: argparse.Namespace) -> int:
    from ams.errors import SnapshotError
    from ams.server import create_server
    from ams.snapshot import list_steps, restore_into
    from ams.store import ShardStore

    if args.num_shards < 1 or not 0 <= args.shard_id < args.num_shards:
        raise SystemExit(f"error: --shard-id {args.shard_id} must be in [0, --num-shards "
                         f"{args.num_shards})")
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"error: --port {args.port} must be in 0..65535")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise SystemExit("error: --tls-cert and --tls-key go together")
    token = _read_secret(args.auth_token_file, "auth token file").decode().strip() \
        if args.auth_token_file else None
    tls = args.tls_cert is not None
    if not _is_loopback(args.host) and not (token or tls) and not args.insecure:
        raise SystemExit(f"error: refusing to serve on {args.host} without --auth-token-file or "
                         "TLS; add --insecure if this network is trusted")
    if args.restore is not None and args.data_dir is None:
        raise SystemExit("error: --restore needs --data-dir")

    if args.torch_threads < 1:
        raise SystemExit(f"error: --torch-threads {args.torch_threads} must be >= 1")
    import torch

    torch.set_num_threads(args.torch_threads)
    store = ShardStore(args.shard_id, args.num_shards)
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
                got, path = restore_into(store, args.data_dir, step)
            except SnapshotError as e:
                raise SystemExit(f"error: {e}") from None
            log.info("restored step=%d path=%s", got, path)
    if args.data_dir is not None:
        args.data_dir.mkdir(parents=True, exist_ok=True)

    running = create_server(
        store, host=args.host, port=args.port, data_dir=args.data_dir, token=token,
        tls_cert=_read_secret(args.tls_cert, "TLS certificate") if tls else None,
        tls_key=_read_secret(args.tls_key, "TLS key") if tls else None,
        max_workers=args.workers)
    if args.port_file:
        tmp = args.port_file.with_name(args.port_file.name + ".tmp")
        tmp.write_text(f"{running.port}\n")
        os.replace(tmp, args.port_file)
    log.info("listening shard=%d/%d host=%s port=%d tls=%s auth=%s", args.shard_id,
             args.num_shards, args.host, running.port, tls, bool(token))

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("stopping grace_s=%.0f", args.grace)
    running.stop(args.grace)
    log.info("stopped")
    return 0

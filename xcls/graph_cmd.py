"""``xcls graph build``: build a table's exact KNN graph on running shards."""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
from pathlib import Path

log = logging.getLogger("xcls.graph")


def add_parser(sub: argparse._SubParsersAction) -> None:
    graph = sub.add_parser("graph", help="neighbor graph of a table (KNN softmax)",
                           description="Neighbor graph commands. See 'xcls graph build --help'.")
    cmds = graph.add_subparsers(dest="graph_command", metavar="COMMAND")
    p = cmds.add_parser(
        "build", help="build the exact k-NN table over a table's normalized rows",
        description="Build the exact k-NN lists of every class of TABLE (inner product over "
        "L2-normalized rows, the class itself first) by streaming every shard's rows past each "
        "shard's rows, and store each class's list with the shard that owns it. A table of at "
        "most 1 GiB of fp32 rows, built on the CPU by one builder without --resume-dir, is "
        "gathered here instead and each pair of row blocks scored once (twice as fast).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ams", required=True, metavar="ADDR[,ADDR...]",
                   help="the shards' host:port, in shard order")
    p.add_argument("--table", required=True, help="table name, e.g. fc")
    p.add_argument("--k", type=int, default=32, help="neighbors per class (itself included)")
    p.add_argument("--builders", type=int, default=1,
                   help="split the shards between this many builder processes")
    p.add_argument("--builder-index", type=int,
                   help="run only this builder (one per host/GPU; give all the same --version)")
    p.add_argument("--version", type=int, help="graph version to write (default: current + 1)")
    p.add_argument("--step", type=int, default=0, help="training step the rows come from")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--resume-dir", type=Path,
                   help="keep finished query blocks here so an interrupted build resumes")
    p.add_argument("--auth-token-file", type=Path, help="shared secret of the shards")
    p.add_argument("--connect-timeout", type=float, default=30.0,
                   help="seconds to wait for every shard to answer")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_build)
    graph.set_defaults(func=lambda args: graph.print_help() or 2)


def run_build(args: argparse.Namespace) -> int:
    import ams
    from ams.errors import AmsError
    from ams.graph import resolve_device
    from ams.graph_build import build_graph, current_graph_version

    try:
        resolve_device(args.device)
    except ValueError as e:
        raise SystemExit(f"error: --device {e}") from None
    if args.k < 1:
        raise SystemExit(f"error: --k {args.k} must be >= 1")
    if args.builders < 1:
        raise SystemExit(f"error: --builders {args.builders} must be >= 1")
    token = args.auth_token_file.read_text().strip() if args.auth_token_file else None
    try:
        client = ams.connect(args.ams, token=token, ready_timeout=args.connect_timeout)
    except AmsError as e:
        raise SystemExit(f"error: {e}") from None
    with client:
        try:
            client.spec(args.table)
            version = args.version or current_graph_version(client, args.table) + 1
            if args.builders > 1 and args.builder_index is None:
                return _spawn_builders(args, version)
            got = build_graph(client, args.table, args.k, step=args.step,
                              builders=args.builders, builder_index=args.builder_index,
                              version=version, device=args.device, resume_dir=args.resume_dir,
                              progress=not args.no_progress and sys.stderr.isatty())
        except AmsError as e:
            raise SystemExit(f"error: {e}") from None
    print(f"graph version {got} of table {args.table!r} built with k={args.k}")
    return 0


def _spawn_builders(args: argparse.Namespace, version: int) -> int:
    """One builder process per index on this host, all writing the same version."""
    base = [sys.executable, "-m", "xcls", "graph", "build", "--ams", args.ams, "--table",
            args.table, "--k", str(args.k), "--builders", str(args.builders), "--version",
            str(version), "--step", str(args.step), "--no-progress"]
    for flag, value in (("--device", args.device), ("--resume-dir", args.resume_dir),
                        ("--auth-token-file", args.auth_token_file)):
        if value is not None:
            base += [flag, str(value)]
    procs = [subprocess.Popen([*base, "--builder-index", str(i)])
             for i in range(args.builders)]
    codes = [p.wait() for p in procs]
    if any(codes):
        log.error("builders_failed exit_codes=%s", codes)
        return 1
    print(f"graph version {version} of table {args.table!r} built with k={args.k} "
          f"by {args.builders} builders")
    return 0

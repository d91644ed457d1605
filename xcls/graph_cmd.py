"""``xcls graph build``: build a table's KNN graph (exact or IVF) on running shards."""

from __future__ import annotations

import argparse
import logging
import math
import subprocess
import sys
from pathlib import Path

from workers.settings import GraphConfig
from xcls.cli_help import DefaultsHelpFormatter
from xcls.secret_files import read_secret, read_token

log = logging.getLogger("xcls.graph")


def add_parser(sub: argparse._SubParsersAction) -> None:
    graph = sub.add_parser("graph", help="neighbor graph of a table (KNN softmax)",
                           description="Neighbor graph commands. See 'xcls graph build --help'.")
    cmds = graph.add_subparsers(dest="graph_command", metavar="COMMAND")
    p = cmds.add_parser(
        "build", help="build the k-NN table over a table's normalized rows",
        description="Build the k-NN lists of every class of TABLE (inner product over "
        "L2-normalized rows, the class itself first) and store each class's list with the "
        "shard that owns it. --method exact streams every shard's rows past each shard's rows; "
        "a table of at most 1 GiB of fp32 rows, built on the CPU by one builder without "
        "--resume-dir, is gathered here instead and each pair of row blocks scored once "
        "(twice as fast). --method ivf puts every row in a faiss inverted-file index of "
        "--nlist lists (float16 rows) and searches --nprobe lists per class; it logs the "
        "recall of a sample of the lists against an exact search.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("--ams", required=True, metavar="ADDR[,ADDR...]",
                   help="the shards' host:port, in shard order")
    p.add_argument("--table", required=True, help="table name, e.g. fc")
    p.add_argument("--k", type=int, default=32, help="neighbors per class (itself included)")
    p.add_argument("--method", default="exact", help="exact | ivf")
    p.add_argument("--nlist", type=int, default=0,
                   help="ivf: lists of the index (0: about 4 sqrt(N))")
    p.add_argument("--nprobe", type=int, default=GraphConfig.nprobe,
                   help="ivf: lists each class scans (default: %(default)s, as graph.nprobe)")
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
    p.add_argument("--tls-ca", type=Path,
                   help="PEM certificate of the authority that signed the shards' TLS "
                        "certificates (shards started with --tls-cert)")
    p.add_argument("--connect-timeout", type=float, default=30.0,
                   help="seconds to wait for every shard to answer")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_build)
    graph.set_defaults(func=lambda args: graph.print_help() or 2)


def _check_build_args(args: argparse.Namespace) -> None:
    """Refuse flags no build can use, before torch is imported or a shard is asked."""
    if args.k < 1:
        raise SystemExit(f"error: --k {args.k} must be >= 1")
    if args.builders < 1:
        raise SystemExit(f"error: --builders {args.builders} must be >= 1")
    if args.builder_index is not None and not 0 <= args.builder_index < args.builders:
        raise SystemExit(f"error: --builder-index {args.builder_index} must be in "
                         f"[0, --builders {args.builders})")
    if args.nlist < 0:
        raise SystemExit(f"error: --nlist {args.nlist} must be >= 0")
    if args.nprobe < 1:
        raise SystemExit(f"error: --nprobe {args.nprobe} must be >= 1")
    for flag, value in (("--version", args.version), ("--step", args.step)):
        if value is not None and value < 0:
            raise SystemExit(f"error: {flag} {value} must be >= 0")
    if not 0 < args.connect_timeout < math.inf:
        raise SystemExit(f"error: --connect-timeout {args.connect_timeout} must be > 0 and "
                         "finite")
    if not args.table:
        raise SystemExit("error: --table: a table name is required")
    if args.resume_dir is not None and args.resume_dir.exists() and not args.resume_dir.is_dir():
        raise SystemExit(f"error: --resume-dir {args.resume_dir} is not a directory")


def run_build(args: argparse.Namespace) -> int:
    _check_build_args(args)
    import ams
    from ams.errors import AmsError
    from ams.graph import resolve_device
    from ams.graph.build import GraphMethod, build_graph, current_graph_version
    from ams.graph.ivf import load_faiss

    if args.method not in list(GraphMethod):
        print(f"error: --method {args.method!r} is not one of "
              f"{', '.join(repr(str(m)) for m in GraphMethod)}", file=sys.stderr)
        return 2
    try:
        resolve_device(args.device)
    except ValueError as e:
        raise SystemExit(f"error: --device {e}") from None
    if args.method == GraphMethod.IVF:
        try:
            load_faiss()
        except ImportError as e:
            raise SystemExit(f"error: --method ivf: {e}") from None
    token = read_token(args.auth_token_file, "--auth-token-file") \
        if args.auth_token_file else None
    tls_ca = read_secret(args.tls_ca, "--tls-ca") if args.tls_ca else None
    try:
        client = ams.connect(args.ams, token=token, tls_ca=tls_ca,
                             ready_timeout=args.connect_timeout)
    except AmsError as e:
        raise SystemExit(f"error: {e}") from None
    with client:
        try:
            client.spec(args.table)
            version = args.version or current_graph_version(client, args.table) + 1
            if args.builders > 1 and args.builder_index is None:
                return _spawn_builders(args, version)
            report = build_graph(client, args.table, args.k, step=args.step,
                                 method=args.method, nlist=args.nlist, nprobe=args.nprobe,
                                 builders=args.builders, builder_index=args.builder_index,
                                 version=version, device=args.device,
                                 resume_dir=args.resume_dir,
                                 progress=not args.no_progress and sys.stderr.isatty())
        except AmsError as e:
            raise SystemExit(f"error: {e}") from None
    recall = "" if report.recall is None else \
        f", recall@{args.k} {report.recall:.4f} on {report.sampled} sampled classes"
    print(f"graph version {report.version} of table {args.table!r} built with k={args.k} "
          f"({report.method}{recall})")
    return 0


def _spawn_builders(args: argparse.Namespace, version: int) -> int:
    """One builder process per index on this host, all writing the same version."""
    base = [sys.executable, "-m", "xcls", "graph", "build", "--ams", args.ams, "--table",
            args.table, "--k", str(args.k), "--method", args.method, "--nlist", str(args.nlist),
            "--nprobe", str(args.nprobe), "--builders", str(args.builders), "--version",
            str(version), "--step", str(args.step), "--no-progress"]
    for flag, value in (("--device", args.device),
                        ("--resume-dir", args.resume_dir),
                        ("--auth-token-file", args.auth_token_file),
                        ("--tls-ca", args.tls_ca)):
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

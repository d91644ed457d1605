"""The ``xcls`` command. Each subcommand lives in its own module exposing ``add_parser``."""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

from xcls.config import ConfigError
from xcls.logs import setup_logging
from xcls.parent import exit_with_parent

# Exit codes, the same in every command: 0 done; 2 refused before starting (bad arguments,
# config, files or data, a port in use, a service unreachable), one line on stderr, as
# argparse does; 1 a failure while running, in the log. Workers also use 75 (train.py: ask
# torchrun for a restart) and 143 (stopped by SIGTERM after a checkpoint), shards 3 (a lost
# lease).
EXIT_BAD_INPUT = 2

# Module paths of subcommand groups; each defines add_parser(subparsers) and sets
# ``func`` (taking the parsed args, returning an exit code) on the parsers it adds.
COMMAND_MODULES = [
    "xcls.serve_cmd",
    "xcls.data_cmd",
    "xcls.graph_cmd",
    "xcls.train_cmd",
    "xcls.cluster_cmd",
    "xcls.gear_cmd",
    "xcls.plan_cmd",
    "xcls.predict_cmd",
]


def installed_version() -> str:
    """xcls's version as installed; a source tree run from ``PYTHONPATH`` has no metadata,
    and must still run."""
    try:
        return version("xcls")
    except PackageNotFoundError:
        return "(not installed: a source tree)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xcls",
        description="Train classifiers with millions of classes: model server (AMS), KNN "
        "softmax, gear bridge. Run 'xcls COMMAND --help' for each command.",
    )
    parser.add_argument("--version", action="version", version=f"xcls {installed_version()}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logging (-vv: debug)")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    setup_logging(-1 if args.quiet else args.verbose)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:  # a flag, a config key or a file they name
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except SystemExit as e:
        if isinstance(e.code, str):  # a command refusing its input, in one line
            print(e.code, file=sys.stderr)
            return EXIT_BAD_INPUT
        raise


# Young objects the cyclic collector lets pile up before a pass (Python's default: 700). A
# process's start is mostly imports, whose objects (torch's above all) live as long as the
# process; at the default, the collector walks them again and again while they pile up, a
# share of the start of every shard and worker. Cycles made later wait a little longer.
COLLECT_EVERY = 50_000


def run() -> int:
    """The ``xcls`` process: ``main`` on ``sys.argv`` with the collector's passes further
    apart (``COLLECT_EVERY``), then the collector frozen, so that the interpreter's exit skips
    its final collection over every object torch and grpc made (most of a torch process's exit
    time, paid by every shard, worker and command as it ends). Library callers use ``main``,
    which leaves the collector alone."""
    exit_with_parent()
    gc.set_threshold(COLLECT_EVERY)
    try:
        return main()
    finally:
        gc.freeze()

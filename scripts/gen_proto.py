"""Regenerate the gRPC stubs in ams/api/ from proto/ams/api/*.proto (every one there: the
shard's ``shard.proto`` and the scheduler's ``scheduler.proto``).

The only writer of ams/api/*_pb2*.py and *.pyi. Usage: python scripts/gen_proto.py [--out DIR]
(--out lets the staleness test generate into a temporary folder and compare).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out_root: Path) -> list[Path]:
    """Run protoc on every proto under proto/ams/api; return the files written."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT))
                    for p in (PROTO_ROOT / "ams" / "api").glob("*.proto"))
    if not protos:
        raise SystemExit("no .proto files under proto/ams/api")
    (out_root / "ams" / "api").mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_root / "ams" / "api").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT,
                        help="root to write ams/api/ under (default: the repo)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

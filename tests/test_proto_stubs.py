"""The committed stubs in ams/api/ are exactly what scripts/gen_proto.py makes now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_committed_stubs_are_fresh(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out",
                    str(tmp_path)], check=True, capture_output=True)
    fresh = sorted(p.name for p in (tmp_path / "ams" / "api").glob("*_pb2*"))
    for service in ("shard", "scheduler"):  # every service's stubs are generated and compared
        assert {f"{service}_pb2.py", f"{service}_pb2.pyi", f"{service}_pb2_grpc.py"} <= set(fresh)
    committed = sorted(p.name for p in (ROOT / "ams" / "api").glob("*_pb2*"))
    assert fresh == committed, "stub files differ: run python scripts/gen_proto.py"
    for name in fresh:
        a = (tmp_path / "ams" / "api" / name).read_bytes()
        b = (ROOT / "ams" / "api" / name).read_bytes()
        assert a == b, f"ams/api/{name} is stale: run python scripts/gen_proto.py and commit"


def test_wire_codes_are_the_proto_dtype_enum():
    """Frames carry dtypes by the same numbers as shard.proto's DType enum."""
    import torch

    from ams.api import shard_pb2 as pb
    from ams.dtypes import WIRE_CODES

    names = {torch.float32: "FLOAT32", torch.float16: "FLOAT16", torch.bfloat16: "BFLOAT16",
             torch.int64: "INT64", torch.int32: "INT32"}
    assert {names[d]: code for d, code in WIRE_CODES.items()} == \
        {name: pb.DType.Value(name) for name in pb.DType.keys() if name != "DTYPE_UNSPECIFIED"}

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

"""Pure modules (store, optimizer, routing, graph, losses) must not pull in grpc or the stubs."""

from __future__ import annotations

import subprocess
import sys

import pytest

PURE = ["ams.store", "ams.storage", "ams.slots", "ams.optim", "ams.sharding", "ams.rowinit",
        "ams.snapshot", "ams.frames",
        "ams.graph", "ams.lease", "ams.plan", "workers.losses", "workers.comm"]


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_no_grpc(module):
    code = (f"import sys, {module}\n"
            "bad = sorted(m for m in sys.modules if m == 'grpc' or m.startswith('grpc.')"
            " or m.startswith('ams.api'))\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} imports {out.stdout.strip()}"

"""Pure modules (store, optimizer, routing, graph, losses) must not pull in grpc or the stubs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PURE = ["ams.store", "ams.storage", "ams.slots", "ams.optim", "ams.sharding", "ams.rowinit",
        "ams.snapshot", "ams.frames",
        "ams.graph", "ams.lease", "ams.plan", "workers.losses", "workers.comm"]

# Each module is imported in a forked child of one interpreter that has loaded torch and numpy
# but none of the project and no grpc: one interpreter start for all modules, and a child
# sees exactly what its one import loaded.
_IMPORT_EACH = """
import importlib, json, os, sys
import numpy, torch
assert not any(m == "grpc" or m.startswith(("grpc.", "ams", "workers")) for m in sys.modules)
found = {}
for name in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        importlib.import_module(name)
        bad = sorted(m for m in sys.modules
                     if m == "grpc" or m.startswith(("grpc.", "ams.api")))
        os.write(write, json.dumps(bad).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = pipe.read()
    code = os.waitpid(pid, 0)[1]
    found[name] = json.loads(answer) if code == 0 and answer else f"import failed ({code})"
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def loaded_by() -> dict[str, list[str] | str]:
    """Module -> the grpc and stub modules its import loaded (or why it failed)."""
    out = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *PURE], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_no_grpc(module, loaded_by):
    assert loaded_by[module] == [], f"{module} imports {loaded_by[module]}"

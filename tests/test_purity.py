"""Pure modules (the shard, routing, the graph algorithms, losses, selection) must not pull in
grpc or the stubs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _modules_under(folder: str, *, leave_out: tuple[str, ...] = ()) -> list[str]:
    """Every module of the package ``folder`` (a path under the repository), as dotted names."""
    names = []
    for path in sorted((ROOT / folder).glob("*.py")):
        name = folder.replace("/", ".") + ("" if path.stem == "__init__" else f".{path.stem}")
        if name not in leave_out:
            names.append(name)
    return names


# The shard's store and everything under it, the graph algorithms (not the build job, which
# drives the client), the frame format, the scheduler's rules, the capacity arithmetic.
PURE = [*_modules_under("ams/shard"), *_modules_under("ams/graph", leave_out=("ams.graph.build",)),
        "ams.sharding", "ams.wire.frames", "ams.cluster.lease", "ams.cluster.plan",
        "workers.losses", "workers.selection", "workers.comm"]

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

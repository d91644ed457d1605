"""The package layering, read from the source with ``ast``: no import cycles, no upward imports.

Layers, lowest first: ``ams`` (model server) and ``bridge`` (feature cache) stand alone,
``workers`` (training) builds on both, ``xcls`` (the command line and run assembly) on all.
Inside ``ams``, each room (a folder by concept) imports only the rooms below it: the shared
vocabulary at the bottom, then the shard's state, the wire, the data plane, the shard server
and the client, the cluster; the graph's algorithms stand beside the shard, and the graph build
is a job over the client (``AMS_ROOMS``).
Every import counts, at module level, inside functions and under ``TYPE_CHECKING`` alike: a
lazy import still ties the modules together, only later. No ``xcls/*_cmd.py`` imports another
one; what two commands share lives in a library module they both import.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ams", "bridge", "workers", "xcls")
# What each package may import of the project (itself included).
ALLOWED = {
    "ams": {"ams"},
    "bridge": {"bridge"},
    "workers": {"ams", "bridge", "workers"},
    "xcls": {"ams", "bridge", "workers", "xcls"},
}
COMMAND_MODULE = re.compile(r"^xcls\.\w+_cmd$")
# The rooms of ``ams`` and what each may import (itself included). A module's room is the
# longest of these prefixes it has; the top-level modules of ``ams`` are its vocabulary
# ("base"), and ``ams`` itself (the package, which names the public API) may import any room.
AMS_ROOMS = {
    "ams.api": {"ams.api"},  # generated stubs
    "base": {"base"},  # errors, dtypes, sharding, limits, addresses, alloc, jsontext
    "ams.shard": {"base", "ams.shard"},
    "ams.graph": {"base", "ams.graph"},
    "ams.wire": {"base", "ams.api", "ams.shard", "ams.wire"},
    "ams.dataplane": {"base", "ams.shard", "ams.wire", "ams.dataplane"},
    "ams.server": {"base", "ams.api", "ams.shard", "ams.wire", "ams.dataplane", "ams.server"},
    "ams.client": {"base", "ams.api", "ams.shard", "ams.wire", "ams.dataplane", "ams.client"},
    "ams.cluster": {"base", "ams.api", "ams.shard", "ams.graph", "ams.wire", "ams.server",
                    "ams.cluster"},
    "ams.graph.build": {"base", "ams.shard", "ams.graph", "ams.client", "ams.graph.build"},
}


@dataclass(frozen=True)
class Import:
    """``module`` imports project module ``target`` at ``path``:``line``."""

    module: str
    target: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path.relative_to(self.path.parents[1])}:{self.line}: " \
               f"{self.module} imports {self.target}"


def module_names(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted name -> file of every ``.py`` under ``root/<package>``."""
    names = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names[".".join(parts)] = path
    return names


def compiled_modules(root: Path) -> set[str]:
    """The C extensions pyproject.toml builds."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {ext["name"] for ext in setuptools.get("ext-modules", [])}


COMPILED = compiled_modules(ROOT)


def _project_module(name: str, modules: dict[str, Path]) -> str | None:
    """The project module ``name`` loads: itself, or the longest known prefix of it (None for
    anything outside the project)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def project_imports(modules: dict[str, Path]) -> list[Import]:
    """Every import of a project module by a project module, wherever in the file it is."""
    found: dict[tuple[str, str, int], Import] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join([*base_parts, *([node.module] if node.module else [])])
                else:
                    base = node.module
                # ``from pkg import name``: the submodule pkg.name if there is one, else pkg.
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in node.names]
            else:
                continue
            for name in names:
                if name in COMPILED:  # no source here to resolve it to; it imports nothing
                    continue
                target = _project_module(name, modules)
                if target is not None and target != module:
                    found.setdefault((module, target, node.lineno),
                                     Import(module, target, path, node.lineno))
    return list(found.values())


def find_cycles(imports: list[Import]) -> list[list[Import]]:
    """One cycle, as the imports that close it, per strongly connected group of modules."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:
        edges.setdefault(imp.module, {}).setdefault(imp.target, imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(imports) + 100))
    try:
        for v in sorted(edges):
            if v not in index:
                connect(v)
    finally:
        sys.setrecursionlimit(limit)

    cycles = []
    for group in groups:
        start = min(group)
        # Shortest way back to ``start`` inside the group (breadth first).
        previous: dict[str, Import] = {}
        frontier = [start]
        while frontier and start not in previous:
            following = []
            for v in frontier:
                for w, imp in sorted(edges.get(v, {}).items()):
                    if w in group and w not in previous:
                        previous[w] = imp
                        following.append(w)
            frontier = following
        cycle, v = [], start
        while True:
            cycle.append(previous[v])
            v = previous[v].module
            if v == start:
                break
        cycles.append(cycle[::-1])
    return cycles


def ams_room(module: str) -> str | None:
    """The room of an ``ams`` module (``AMS_ROOMS``); None for the package itself and for
    modules outside ``ams``."""
    if module == "ams" or not module.startswith("ams."):
        return None
    rooms = [room for room in AMS_ROOMS if module == room or module.startswith(room + ".")]
    return max(rooms, key=len) if rooms else "base"


def layering_violations(imports: list[Import]) -> list[str]:
    """Imports against the layering: upward across packages or across the rooms of ``ams``,
    or between command modules."""
    bad = []
    for imp in imports:
        room, target_room = ams_room(imp.module), ams_room(imp.target)
        if room is not None and target_room is not None \
                and target_room not in AMS_ROOMS[room]:
            bad.append(f"{imp}: {room} may import only "
                       f"{', '.join(sorted(AMS_ROOMS[room]))} of ams")
            continue
        layer, target_layer = imp.module.split(".")[0], imp.target.split(".")[0]
        if target_layer not in ALLOWED[layer]:
            bad.append(f"{imp}: {layer} may import only "
                       f"{', '.join(sorted(ALLOWED[layer]))} of the project")
        elif COMMAND_MODULE.match(imp.module) and COMMAND_MODULE.match(imp.target):
            bad.append(f"{imp}: a command module imports another; move what they share into a "
                       "library module")
    return bad


def _describe(cycle: list[Import]) -> str:
    return " -> ".join([cycle[0].module, *(imp.target for imp in cycle)]) + "\n    " + \
        "\n    ".join(str(imp) for imp in cycle)


def test_no_import_cycles():
    cycles = find_cycles(project_imports(module_names(ROOT, PACKAGES)))
    assert not cycles, "import cycles:\n  " + "\n  ".join(_describe(c) for c in cycles)


def test_imports_follow_the_layering():
    bad = layering_violations(project_imports(module_names(ROOT, PACKAGES)))
    assert not bad, "imports against the layering:\n  " + "\n  ".join(bad)


def test_checks_catch_a_cycle_and_an_upward_import(tmp_path):
    """The checks themselves, on a small tree with one cycle (via a lazy, relative import)
    and one upward import."""
    (tmp_path / "ams").mkdir()
    (tmp_path / "ams" / "__init__.py").write_text("")
    (tmp_path / "ams" / "a.py").write_text("import ams.b\n")
    (tmp_path / "ams" / "b.py").write_text("def f():\n    from . import a\n")
    (tmp_path / "ams" / "c.py").write_text("from typing import TYPE_CHECKING\n"
                                           "if TYPE_CHECKING:\n    from xcls.run import Run\n")
    (tmp_path / "xcls").mkdir()
    (tmp_path / "xcls" / "__init__.py").write_text("")
    (tmp_path / "xcls" / "run.py").write_text("import ams.c\nimport torch\n")
    (tmp_path / "xcls" / "a_cmd.py").write_text("from xcls import b_cmd\n")
    (tmp_path / "xcls" / "b_cmd.py").write_text("")
    (tmp_path / "ams" / "shard").mkdir()
    (tmp_path / "ams" / "shard" / "__init__.py").write_text("")
    (tmp_path / "ams" / "shard" / "store.py").write_text("import ams.client.remote\n")
    (tmp_path / "ams" / "client").mkdir()
    (tmp_path / "ams" / "client" / "__init__.py").write_text("")
    (tmp_path / "ams" / "client" / "remote.py").write_text("import ams.shard\n")
    imports = project_imports(module_names(tmp_path, ("ams", "xcls")))
    cycles = find_cycles(imports)
    assert [[(i.module, i.target) for i in c] for c in cycles] == [
        [("ams.a", "ams.b"), ("ams.b", "ams.a")], [("ams.c", "xcls.run"), ("xcls.run", "ams.c")]]
    bad = sorted(layering_violations(imports))
    assert len(bad) == 3
    assert "ams/c.py:3: ams.c imports xcls.run" in bad[0]
    assert "shard/store.py:1: ams.shard.store imports ams.client.remote" in bad[1]
    assert "xcls/a_cmd.py:1: xcls.a_cmd imports xcls.b_cmd" in bad[2]


# Each module is imported in a forked child of one process that has loaded only the heavy
# third-party libraries: every import starts with none of the project loaded (an order
# dependence cannot hide), at the cost of one interpreter start in all.
_IMPORT_EACH = """
import contextlib, importlib, os, sys, traceback
import numpy, torch
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if name.endswith("__main__"):  # the entry point runs the command: ask for --help
                sys.argv = [name, "--help"]
                with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
                    try:
                        importlib.import_module(name)
                    except SystemExit as e:
                        code = e.code or 0
            else:
                importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if os.waitpid(pid, 0)[1]:
        failed.append(name)
print("failed:", " ".join(failed))
"""


def test_every_module_imports_on_its_own():
    names = sorted(module_names(ROOT, PACKAGES))
    out = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *names], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "failed:", out.stdout + out.stderr

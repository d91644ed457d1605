"""What a user installing the wheel gets: its files, its requirements, and the version."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from xcls.cli import COLLECT_EVERY
from xcls.config import example_configs, load_config

ROOT = Path(__file__).resolve().parent.parent


def _runtime_requirements() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def _lower_bound(requirements: list[str], name: str) -> tuple[int, ...]:
    spec = next(r for r in requirements if re.fullmatch(rf"{re.escape(name)}>=[\d.]+", r))
    return tuple(int(p) for p in spec.split(">=")[1].split("."))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src / name)
    for package in ("ams", "workers", "bridge", "xcls"):
        shutil.copytree(ROOT / package, src / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(src)], check=True, capture_output=True)
    return zipfile.ZipFile(next(out.glob("xcls-*.whl")))


def test_wheel_ships_the_example_configs_and_the_stubs(wheel):
    names = set(wheel.namelist())
    shipped = {f"xcls/configs/{p.name}" for p in example_configs()}
    assert shipped and shipped <= names
    assert {"ams/api/shard_pb2.py", "ams/api/shard_pb2_grpc.py",
            "ams/cluster/plan_rates.json"} <= names
    if shutil.which("cc") or shutil.which("gcc"):  # the optional compiled row update
        assert [n for n in names
                if n.startswith("ams/shard/_kernels.") and n.endswith(".so")], names


def test_wheel_requirements_have_no_pins_and_no_code_generator(wheel):
    metadata = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    requires = [line.split(":", 1)[1].strip() for line in
                wheel.read(metadata).decode().splitlines() if line.startswith("Requires-Dist:")]
    runtime = [r for r in requires if "extra ==" not in r]
    assert not [r for r in runtime if "==" in r], "exact pins break users' environments"
    assert not [r for r in runtime if r.startswith("grpcio-tools")]  # code generation only
    assert [r for r in runtime if r.startswith("tensorboard")]


def test_lower_bounds_match_what_the_stubs_check_at_import():
    stub = (ROOT / "ams" / "api" / "shard_pb2.py").read_text()
    major, minor, patch = (int(x) for x in re.search(
        r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", stub).groups())
    grpc_stub = (ROOT / "ams" / "api" / "shard_pb2_grpc.py").read_text()
    grpc_version = tuple(int(x) for x in re.search(
        r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_stub).group(1).split("."))
    requirements = _runtime_requirements()
    assert _lower_bound(requirements, "protobuf") == (major, minor, patch)
    assert _lower_bound(requirements, "grpcio") == grpc_version
    assert _lower_bound(requirements, "grpcio-health-checking") == grpc_version


def test_version_and_examples_from_the_command_line():
    version = subprocess.run([sys.executable, "-m", "xcls", "--version"], check=True,
                             capture_output=True, text=True).stdout.split()
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version == ["xcls", meta]
    listed = subprocess.run([sys.executable, "-m", "xcls", "config", "examples"], check=True,
                            capture_output=True, text=True).stdout.split()
    assert listed and [Path(p) for p in listed] == example_configs()
    for path in listed:
        load_config(path)  # every shipped example is a valid config


def test_a_source_tree_that_is_not_installed_runs(tmp_path):
    """``PYTHONPATH=checkout python -m xcls``: no package metadata, and still every command
    (the parser is built first, --version included)."""
    for package in ("ams", "workers", "bridge", "xcls"):  # no xcls.egg-info beside them
        (tmp_path / package).symlink_to(ROOT / package)
    probe = (f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\nfrom xcls.cli import main\n"
             "sys.exit(main(sys.argv[1:]))")
    for argv, expected in ((["--version"], "xcls (not installed: a source tree)"),
                           (["--help"], "usage: xcls")):
        # -S: no site-packages, so no installed xcls (the commands asked need only the stdlib)
        done = subprocess.run([sys.executable, "-S", "-c", probe, *argv], capture_output=True,
                              text=True, timeout=60, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(expected), done.stdout


@pytest.mark.parametrize("argv", [["--help"], ["data", "glyphs", "--help"], ["train", "--help"],
                                  ["plan", "--help"]])
def test_help_does_not_load_torch(argv):
    """``--help`` answers before torch is imported (that takes seconds)."""
    probe = ("import sys\nfrom xcls.cli import main\n"
             "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
             "print('torch' in sys.modules, code, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True,
                          timeout=60)
    assert done.stderr.split()[-2:] == ["False", "0"], done.stderr
    assert "usage: xcls" in done.stdout


def test_the_process_entry_points_tune_the_collector():
    """The ``xcls`` script and ``python -m xcls`` collect less often while they run and end
    with the collector frozen (the exit then skips a final collection over torch's objects);
    ``main`` called in a process of the caller's leaves the collector as it was."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["xcls"] == "xcls.cli:run"
    probe = ("import atexit, gc, runpy, sys\n"
             "atexit.register(lambda: print('frozen', gc.get_freeze_count(), file=sys.stderr))\n"
             "atexit.register(lambda: print('threshold', gc.get_threshold()[0], "
             "file=sys.stderr))\n"
             "from xcls.cli import main\n"
             "main(['config', 'print'])\n"
             "print('after-main', gc.get_freeze_count(), file=sys.stderr)\n"
             "print('after-main-threshold', gc.get_threshold()[0], file=sys.stderr)\n"
             "sys.argv = ['xcls', 'config', 'print']\n"
             "runpy.run_module('xcls', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    counts = dict(line.split() for line in done.stderr.splitlines())
    assert counts["after-main"] == "0" and counts["after-main-threshold"] == "700"
    assert int(counts["frozen"]) > 0 and counts["threshold"] == str(COLLECT_EVERY)

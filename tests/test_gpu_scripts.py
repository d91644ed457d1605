"""scripts/gpu_checks.sh and scripts/gpu_wheels.sh on a host without a GPU: they parse, say what
to carry, and their dry runs list the steps and commands a GPU host would run, with flags the
benchmarks have."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.conftest import SMALL_FONTS

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ROOT / "scripts" / "gpu_checks.sh"
WHEELS = ROOT / "scripts" / "gpu_wheels.sh"
STEPS = ["setup", "tests", "step-1m", "step-10m-ams", "step-10m-collective", "heads",
         "step-100m", "graph-10m"]


def run(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.mark.parametrize("script", [CHECKS, WHEELS])
def test_the_scripts_parse_and_say_what_to_carry(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    out = run(script, "--help")
    assert out.returncode == 0, out.stderr
    assert ".whl" in out.stdout and "--dry-run" in out.stdout
    assert out.stdout.rstrip().splitlines()[-1].startswith("Usage: bash scripts/")  # no code
    assert run(script, "--no-such-option").returncode == 2


def dry_steps(*args: str) -> list[tuple[str, int, list[str]]]:
    out = run(CHECKS, "--dry-run", *args)
    assert out.returncode == 0, out.stderr
    steps = []
    for line in out.stdout.splitlines():
        name, limit, command = re.fullmatch(r"(\S+) (\d+)s: (.*)", line).groups()
        steps.append((name, int(limit), shlex.split(command)))
    return steps


def test_the_checks_run_in_order_in_calls_of_eight_minutes_and_can_be_picked():
    steps = dry_steps()
    assert [name for name, _, _ in steps] == STEPS
    # each step's own limit is at most the budget; the budget ends within 8 minutes
    assert all(limit <= 480 for _, limit, _ in steps)
    assert re.search(r"GPU_CHECKS_SECONDS:-480", CHECKS.read_text())
    assert [name for name, _, _ in dry_steps("--only", "heads,tests")] == ["tests", "heads"]
    out = run(CHECKS, "--only", "nothing")
    assert out.returncode == 2 and "no step nothing" in out.stderr


def test_the_benchmark_commands_use_flags_the_benchmarks_have():
    for name, _, command in dry_steps():
        if len(command) > 1 and command[1].startswith("benchmarks/"):
            source = (ROOT / command[1]).read_text()
            for flag in (a for a in command[2:] if a.startswith("--")):
                assert f'"{flag}"' in source, (name, flag)
    tests = dict((name, command) for name, _, command in dry_steps())["tests"]
    assert tests[-3:] == ["-k", "cuda", "tests"]


def test_the_wheelhouse_is_this_environments_versions_for_python_312():
    out = run(WHEELS, "--dry-run", "/tmp/wheelhouse")
    assert out.returncode == 0, out.stderr
    download, pack = (shlex.split(line) for line in out.stdout.splitlines())
    assert download[download.index("--python-version") + 1] == "3.12"
    assert download[download.index("-d") + 1] == "/tmp/wheelhouse"
    wanted = {f"{name}=={importlib.metadata.version(name)}"
              for name in ("grpcio", "grpcio-health-checking", "protobuf", "lmdb", "redis")}
    assert wanted <= set(download)
    assert pack[:3] == ["tar", "-cJf", "/tmp/wheelhouse/xcls-test-fonts.tar.xz"]
    assert sorted(Path(p).name for p in pack[4:]) == sorted(SMALL_FONTS)

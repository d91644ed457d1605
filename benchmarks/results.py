"""Benchmark results as data: each run appends its figures to ``benchmarks/results/NAME.jsonl``.

One line is one row of one of the benchmark's tables::

    {"date": "2026-11-25T14:03:07Z", "commit": "9ced081", "device": "2-core CPU VM (AMD EPYC,
     AVX-512)", "command": "python benchmarks/bench_heads.py", "table": "head alone",
     "figures": {"N": 1000000, "head": "knn", "ms/step": 36.6, ...}}

The rows one process records share its ``date`` (the moment this module was imported), so a run
is the records with the same date, commit, device and command. ``render_results.py`` renders the
pages people read from these files; nothing else writes them. A benchmark calls::

    from results import record
    record("bench_topk", rows, device=describe_device(device))

``XCLS_RESULTS_DIR`` sends the records elsewhere (the tests point it at a temporary directory, so
that a smoke run never touches the tracked files). ``XCLS_RESULTS_COMMIT`` names the commit where
the tree has no git history to tell it (a copy sent to a GPU host: ``scripts/gpu_checks.sh``).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
RESULTS_DIR_ENV = "XCLS_RESULTS_DIR"
COMMIT_ENV = "XCLS_RESULTS_COMMIT"
DIRTY = "-dirty"  # what current_commit appends when the tree differs from the commit

# One stamp per process: every table a run records carries the same date.
RUN_DATE = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

Figure = int | float | str | None


@dataclass(frozen=True)
class Record:
    """One table row of one run."""

    date: str
    commit: str
    device: str
    command: str
    table: str
    figures: dict[str, Figure]

    @property
    def run(self) -> tuple[str, str, str, str]:
        """What identifies the run that measured this row."""
        return (self.date, self.commit, self.device, self.command)


def results_dir() -> Path:
    """Where records go: ``$XCLS_RESULTS_DIR`` if set, else the tracked ``benchmarks/results``."""
    return Path(os.environ.get(RESULTS_DIR_ENV) or RESULTS_DIR)


def current_commit() -> str:
    """The short hash of the code measured, with ``-dirty`` when tracked files differ from it
    (the records themselves excepted), so a figure of uncommitted code never passes as the
    commit's. ``$XCLS_RESULTS_COMMIT``, when set, is taken as named: a tree copied to a GPU
    host may sit beside a stale .git there. Without either: "unknown"."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short=7", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                      ":(exclude)benchmarks/results")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{commit}{DIRTY}" if changed else commit


def describe_device(device: object = "cpu") -> str:
    """The machine in a few words: "NVIDIA H100 80GB HBM3 (16 CPU cores)" for a CUDA device,
    "2-core CPU VM (AMD EPYC, AVX-512)" otherwise (AVX-512 moves CPU figures by up to 2x)."""
    cores = os.cpu_count() or 1
    if str(device).startswith("cuda"):
        import torch

        return f"{torch.cuda.get_device_name(device)} ({cores} CPU cores)"
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{cores}-core CPU"
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    flags = set(flags.group(1).split()) if flags else set()
    vm = " VM" if "hypervisor" in flags else ""
    avx = "AVX-512" if "avx512f" in flags else "no AVX-512"
    return f"{cores}-core CPU{vm} ({model.group(1).strip() if model else 'unknown'}, {avx})"


def machine_of(device: str) -> str:
    """The machine a ``describe_device`` string names, without the details in its parentheses
    (the CPU's model, the host's cores): "2-core CPU VM", "NVIDIA H100 80GB HBM3"."""
    return device.split(" (", 1)[0]


def command_line() -> str:
    """This process's command as a user types it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(shown), *sys.argv[1:]])


def record(name: str, rows: Iterable[Mapping[str, Figure]], *, table: str = "",
           command: str | None = None, device: str | None = None) -> Path:
    """Append ``rows`` (column name -> figure) as the records of table ``table`` of benchmark
    ``name``, stamped with this run's date, the commit, ``device`` (default: this CPU) and
    ``command`` (default: this process's). Returns the file written."""
    path = results_dir() / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": RUN_DATE, "commit": current_commit(),
            "device": device or describe_device(), "command": command or command_line(),
            "table": table}
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps({**meta, "figures": dict(row)}, ensure_ascii=False) + "\n")
    return path


def load(path: Path) -> list[Record]:
    """The records of one results file, in the order they were appended."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            records.append(Record(data["date"], data["commit"], data["device"],
                                  data["command"], data.get("table", ""), data["figures"]))
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}:{number}: not a results record ({err})") from err
    return records


_NUMBER = re.compile(r"-?(\d{1,3}(,\d{3})+|\d+)(\.\d+)?")


def parse_figure(cell: str) -> Figure:
    """A table cell as data: "1,114" -> 1114, "36.6" -> 36.6, "—" or "" -> None, else the text
    (a cell such as "447.2x" or "0.24 + 0.16" stays as printed)."""
    text = cell.strip().replace("**", "")
    if text in ("", "-", "—"):
        return None
    if _NUMBER.fullmatch(text):
        plain = text.replace(",", "")
        return float(plain) if "." in plain else int(plain)
    return text


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table_row(header: str, line: str) -> dict[str, Figure]:
    """One printed table row as column -> figure, named by the printed header (either as
    ``| a | b |`` or as ``a | b``)."""
    return dict(zip(_cells(header), map(parse_figure, _cells(line)), strict=True))


def markdown_rows(lines: Iterable[str]) -> list[dict[str, Figure]]:
    """The rows of a markdown table (its header line, separator and rows) as column -> figure."""
    table = [line.strip() for text in lines for line in text.splitlines()
             if line.strip().startswith("|")]
    return [table_row(table[0], line) for line in table[2:]]

"""The plan against real ``xcls serve shard`` processes: its resident memory of a shard, and
the script that measures the rates it scales."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ams
from ams.cluster import plan
from ams.cluster.plan import Job, load_rates, shard_memory

ROOT = Path(__file__).resolve().parents[2]
N, D = 1_000_000, 128


def vm_rss(pid: int) -> int:
    """Resident bytes of process ``pid``, from /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def test_resident_at_rest_matches_a_real_shard(shard_cluster):
    (proc,) = shard_cluster(1)
    with ams.connect([proc.address]) as client:
        client.create_table("fc", num_rows=N, dim=D, dtype="float16", momentum=0.0)
        measured = vm_rss(proc.proc.pid)
    # a table just created has taken no traffic yet: the plan's resident figure at rest
    job = Job(num_classes=N, dim=D, dtype="float16", momentum=0.0, shards=1, head="partial")
    planned = shard_memory(job, load_rates()).at_rest
    table = N * (D * 2 + 8)  # float16 rows and float64 clocks
    assert abs(planned - measured) <= 0.1 * measured, (planned, measured, table)


def test_rates_script_measures_what_the_planner_reads(tmp_path, monkeypatch):
    """benchmarks/plan_rates.py at toy sizes: its entries, with the shipped GPU ones, load."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plan_rates.py"), "--rows", "600",
         "--ivf-rows", "4000", "--shard-rows", "20000", "--streams", "1", "--active", "2000",
         "--repeats", "1", "--threads", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads(done.stdout)
    shipped = json.loads((ROOT / "ams" / "cluster" / plan.RATES_FILE).read_text())
    rates_file = tmp_path / "rates.json"
    rates_file.write_text(json.dumps({**shipped, **measured}))
    monkeypatch.setattr(plan, "RATES_FILE", str(rates_file))
    rates = load_rates()
    assert rates.cpu_exact == measured["cpu_exact"]["flops_per_s"] > 0
    assert rates.baseline == measured["shard"]["baseline_bytes"] > 0
    for entry in measured.values():
        assert entry["command"].startswith("python benchmarks/plan_rates.py --rows 600")

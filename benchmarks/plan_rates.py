"""Measure what ``xcls plan`` needs of this machine and print it as ``ams/cluster/plan_rates.json``
entries: the graph build's compute rates and a shard process's memory.

* ``cpu_exact``: FLOP/s of the exact in-memory build (``ams.graph.knn``, symmetric: N^2 d
  multiply-adds counted as 2 FLOPs each, half the pairs).
* ``cpu_ring``: FLOP/s of the exact ring build (``ams.graph.build_shard_neighbors``, 2 N^2 d).
* ``cpu_ivf``: FLOP/s of an IVF build (``ams.graph.ivf.ivf_knn``: train, add, search every
  row) counted with ``ams.cluster.plan.ivf_flops``: an effective rate for that formula, not the
  hardware's peak.
* ``shard``: a real ``xcls serve shard`` process's baseline VmRSS, the message buffers it
  keeps per client stream, and a snapshot piece's bytes beyond its tensors (``shard_memory``).

Each rate is the best of ``--repeats`` runs (the machine may be shared). Copy the printed JSON
into ``ams/cluster/plan_rates.json`` (or pass ``--write``), keeping its nominal GPU entry.

    python benchmarks/plan_rates.py --rows 20000 --dim 128 --k 32 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import ams
from ams.cluster import plan
from ams.graph import build_shard_neighbors, knn, resolve_nlist
from ams.graph.ivf import DEFAULT_NPROBE, ivf_knn
from xcls.shards import shard_processes

ROOT = Path(__file__).resolve().parent.parent


def machine() -> str:
    """CPU model, CPUs, torch threads and the load when measured (a shared machine measures
    slower), as a planner's reader needs them."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{model}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads (torch "
            f"{torch.__version__}), load average {os.getloadavg()[0]:.1f} when measured")


def best_of(repeats: int, run: Callable[[], object]) -> float:
    """Shortest wall time of ``repeats`` calls of ``run``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def exact_rates(n: int, dim: int, k: int, repeats: int) -> dict[str, float]:
    """FLOP/s of the symmetric in-memory build and of the ring build on n random rows."""
    rows = torch.randn(n, dim, generator=torch.Generator().manual_seed(0))
    sym = best_of(repeats, lambda: knn(rows, k, device="cpu"))
    ids = torch.arange(n)
    ring = best_of(repeats, lambda: build_shard_neighbors(
        0, 1, lambda shard: iter([(ids, rows)]), k, device="cpu"))
    return {"cpu_exact": n * n * dim / sym, "cpu_ring": 2 * n * n * dim / ring}


def ivf_rate(n: int, dim: int, k: int, nprobe: int, repeats: int) -> float:
    """FLOP/s of ``ams.graph.ivf.ivf_knn`` (the IVF build's train, add and search, auto nlist)
    on n clustered unit rows, counted with ``plan.ivf_flops``."""
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((max(1, n // 100), dim), dtype=np.float32)
    rows = centres[rng.integers(len(centres), size=n)]
    rows += 0.5 * rng.standard_normal((n, dim), dtype=np.float32)
    rows = torch.from_numpy(rows)
    seconds = best_of(repeats, lambda: ivf_knn(rows, k, nprobe=nprobe))
    return plan.ivf_flops(n, dim, resolve_nlist(0, n), nprobe) / seconds


def _vm_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def shard_memory(rows: int, streams: int, active: int) -> dict[str, float]:
    """A serving shard's memory, measured on a real ``xcls serve shard`` process:

    * baseline: its VmRSS holding a one-row table (the process, and what serving a first
      request loads, without the bytes of a table);
    * snapshot overhead: a snapshot piece's bytes beyond its tensors, over its tensors, for a
      float16 table of ``rows`` x 128 without momentum;
    * buffers per stream: how far its VmRSS grows while ``streams`` client threads each pull
      and push ``active`` random rows of that table 8 times, per thread.
    """
    with tempfile.TemporaryDirectory() as tmp, \
            shard_processes(1, data_dir=Path(tmp), log_dir=Path(tmp)) as procs:
        pid = procs[0].proc.pid
        with ams.connect([procs[0].address]) as client:
            client.create_table("one", num_rows=1, dim=128, dtype="float16", momentum=0.0)
            baseline = _vm_rss(pid)
            client.create_table("fc", num_rows=rows, dim=128, dtype="float16", momentum=0.0)
            (piece,) = client.snapshot(1)
            at_rest = _vm_rss(pid)

            def stream(seed: int) -> None:
                g = torch.Generator().manual_seed(seed)
                for _ in range(8):
                    ids = torch.randperm(rows, generator=g)[:active]
                    client.pull("fc", ids)
                    client.push("fc", ids, torch.randn(active, 128, generator=g), lr=0.01)

            threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            serving = _vm_rss(pid)
        tensors = rows * (128 * 2 + 8)
        on_disk = sum(f.stat().st_size for f in Path(piece).iterdir())
    return {"baseline_bytes": baseline,
            "buffers_per_stream_bytes": max(0, serving - at_rest) // streams,
            "snapshot_overhead_fraction": float(f"{(on_disk - tensors) / tensors:.4g}")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=20000, help="rows of the exact builds")
    p.add_argument("--ivf-rows", type=int, default=200000, help="rows of the IVF build")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--k", type=int, default=32)
    p.add_argument("--nprobe", type=int, default=DEFAULT_NPROBE)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shard-rows", type=int, default=2000000,
                   help="rows of the shard's table (float16 x 128, no momentum)")
    p.add_argument("--streams", type=int, default=4,
                   help="client threads pulling and pushing at once")
    p.add_argument("--active", type=int, default=100000,
                   help="rows each pull and push of a stream names")
    p.add_argument("--write", action="store_true",
                   help="update the measured entries of ams/cluster/plan_rates.json in place")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    command = "python benchmarks/plan_rates.py " + shlex.join(sys.argv[1:])
    where = machine()
    measured = {}
    for name, rate in exact_rates(args.rows, args.dim, args.k, args.repeats).items():
        measured[name] = {"flops_per_s": float(f"{rate:.4g}"), "measured": True,
                          "machine": where, "command": command}
    rate = ivf_rate(args.ivf_rows, args.dim, args.k, args.nprobe, args.repeats)
    measured["cpu_ivf"] = {"flops_per_s": float(f"{rate:.4g}"), "measured": True,
                           "machine": where, "command": command}
    measured["shard"] = {**shard_memory(args.shard_rows, args.streams, args.active),
                         "machine": where, "command": command}
    text = json.dumps(measured, indent=2)
    print(text)
    if args.write:
        path = ROOT / "ams" / "cluster" / plan.RATES_FILE
        current = json.loads(path.read_text()) if path.exists() else {}
        current.update(measured)
        path.write_text(json.dumps(current, indent=2) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    for name, entry in measured.items():
        if "flops_per_s" in entry:
            print(f"{name}: {entry['flops_per_s'] / 1e9:.1f} GFLOP/s", file=sys.stderr)


if __name__ == "__main__":
    main()

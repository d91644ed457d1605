"""Gear bridge cache throughput vs recomputing the backbone.

For each backend (memory, LMDB, Redis on its own loopback redis-server), dim and batch size:
features/s of ``put`` and of ``get`` (all hits), beside features/s of a small ResNet-ish backbone
forward (32x32 grayscale, torch CPU) on the same batch. ``get/fwd`` > 1 means a cache hit is that
many times cheaper than recomputing the feature.

    python benchmarks/bench_bridge.py
    python benchmarks/bench_bridge.py --batches 256 --dims 128 --repeats 3
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from results import record, table_row
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bridge import LmdbFeatureCache, MemoryFeatureCache, RedisFeatureCache  # noqa: E402
from bridge.cache import FEATURE_DTYPE  # noqa: E402
from bridge.redis_util import make_client  # noqa: E402


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.skip = (nn.Identity() if stride == 1 and cin == cout else
                     nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                   nn.BatchNorm2d(cout)))

    def forward(self, x):
        return torch.relu(self.body(x) + self.skip(x))


def backbone(dim: int) -> nn.Module:
    """ResNet-ish, ~0.37 M parameters: stem 32ch, blocks 32 -> 64 (/2) -> 128 (/2), pool, linear."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, 1, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        Block(32, 32, 1), Block(32, 64, 2), Block(64, 128, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, dim)).eval()


def best_rate(fn, n: int, repeats: int) -> float:
    """Items/s of the fastest of ``repeats`` calls of ``fn`` (one warm-up call first)."""
    fn(0)
    best = float("inf")
    for r in range(1, repeats + 1):
        t0 = time.perf_counter()
        fn(r)
        best = min(best, time.perf_counter() - t0)
    return n / best


def measure_cache(cache, feats: np.ndarray, repeats: int) -> tuple[float, float]:
    """(put, get) features/s. Each put writes fresh ids (inserts, as the fast gear does on
    misses); gets read the last batch written (all hits)."""
    batch = feats.shape[0]
    put = best_rate(lambda r: cache.put(np.arange(r * batch, (r + 1) * batch), feats, 1),
                    batch, repeats)
    ids = np.arange(repeats * batch, (repeats + 1) * batch)
    get = best_rate(lambda _r: cache.get(ids), batch, repeats)
    if not bool(cache.get(ids)[1].all()):
        raise SystemExit(f"{type(cache).__name__}: benchmark reads missed")
    return put, get


def measure_backbone(net: nn.Module, batch: int, repeats: int) -> float:
    """Features/s of a no-grad forward on ``batch`` random 32x32 grayscale images."""
    images = torch.randn(batch, 1, 32, 32)
    with torch.inference_mode():
        return best_rate(lambda _r: net(images), batch, repeats)


def start_redis(binary: str, workdir: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = make_client(port=port)
    for _ in range(500):
        try:
            client.ping()
            return proc, port
        except Exception:
            time.sleep(0.02)
    proc.kill()
    raise SystemExit(f"redis-server on port {port} did not answer PING")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--dims", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per figure (best kept)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads for the backbone")
    ap.add_argument("--backends", nargs="+", default=["memory", "lmdb", "redis"],
                    choices=["memory", "lmdb", "redis"])
    ap.add_argument("--redis-server", default=shutil.which("redis-server") or
                    "/usr/bin/redis-server")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    tmp = tempfile.mkdtemp(prefix="bench_bridge_")
    redis_proc = port = None
    if "redis" in args.backends:
        redis_proc, port = start_redis(args.redis_server, tmp)
    rows = []
    try:
        for dim in args.dims:
            net = backbone(dim)
            for batch in args.batches:
                fwd = measure_backbone(net, batch, max(1, args.repeats // 2))
                feats = np.random.default_rng(0).standard_normal((batch, dim)).astype(np.float32)
                for kind in args.backends:
                    budget = 2 * (args.repeats + 1) * batch * (dim * 4 + 64) + (16 << 20)
                    if kind == "memory":
                        cache = MemoryFeatureCache(dim, budget, ttl_s=3600)
                    elif kind == "lmdb":
                        cache = LmdbFeatureCache(Path(tmp) / f"lmdb_{dim}_{batch}", dim, budget,
                                                 ttl_s=3600)
                    else:
                        cache = RedisFeatureCache(make_client(port=port), dim, f"b{dim}x{batch}",
                                                  3600)
                    put, get = measure_cache(cache, feats, args.repeats)
                    if isinstance(cache, LmdbFeatureCache):
                        cache.close()
                    rows.append((kind, dim, batch, put, get, fwd))
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"dtype={FEATURE_DTYPE} torch_threads={args.threads} repeats={args.repeats} "
          f"(features/s, best of repeats; get = all hits)")
    header = "| backend | dim | batch | put feat/s | get feat/s | backbone fwd feat/s | get/fwd |"
    print(f"{header}\n|---|---:|---:|---:|---:|---:|---:|")
    lines = [f"| {kind} | {dim} | {batch} | {put:,.0f} | {get:,.0f} | {fwd:,.0f} | "
             f"{get / fwd:,.1f}x |" for kind, dim, batch, put, get, fwd in rows]
    print("\n".join(lines))
    record("bench_bridge", [table_row(header, line) for line in lines])


if __name__ == "__main__":
    main()

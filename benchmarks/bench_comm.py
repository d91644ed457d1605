"""Data-parallel gradient exchange: DDP's dense all-reduce against layer-wise top-k
compression (``workers.comm.TopkCompressor``), on gloo ranks of this host.

Each rank trains the backbone alone (no class head: the head's rows go through the AMS, not
through DDP) on random images with a random linear target, so the gradients have the
backbone's real shapes. Per setting: bytes each rank hands to collectives per step (the
compressor's counter; dense: 4 bytes per gradient entry), the ratio to dense, and the median
step time (forward, backward with the exchange, SGD step). Each setting runs with small DDP
buckets, whose exchanges start while the backward pass goes on (overlap), and with one bucket
as large as the model, whose exchange starts only when the backward pass has ended.

    python benchmarks/bench_comm.py                         # 2 and 4 ranks, resnet_small
    python benchmarks/bench_comm.py --ranks 2 --densities 0.01 --steps 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from results import record, table_row
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workers.backbones import build_backbone
from workers.comm import TopkCompressor


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace, density: float,
             bucket_mb: float, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = build_backbone(args.backbone, args.dim, 1, args.image_size)
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        compressor = None
        if density < 1.0:
            compressor = TopkCompressor(model, density=density, momentum=0.9,
                                        dense_below=args.dense_below)
            ddp.register_comm_hook(None, compressor.hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01,
                                    momentum=0.0 if compressor else 0.9)
        g = torch.Generator().manual_seed(rank)
        target = nn.Linear(args.dim, args.dim)
        times = []
        for step in range(args.warmup + args.steps):
            images = torch.randn(args.batch, 1, args.image_size, args.image_size, generator=g)
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad()
            features = ddp(images)
            loss = (features - target(features.detach())).pow(2).mean()
            loss.backward()
            optimizer.step()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        entries = sum(p.numel() for p in model.parameters())
        if compressor is None:
            sent = entries * 4
        else:
            sent = compressor.counters.bytes_sent / compressor.counters.steps
        out[rank] = {"ms": statistics.median(times) * 1000, "bytes": sent,
                     "dense": entries * 4}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="comma separated gloo world sizes")
    parser.add_argument("--densities", default="1,0.01,0.001",
                        help="comma separated; 1 is DDP's own dense all-reduce")
    parser.add_argument("--backbone", default="resnet_small")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64, help="images per rank and step")
    parser.add_argument("--dense-below", type=int, default=128,
                        help="layers with fewer entries go dense (comm.dense_below)")
    parser.add_argument("--bucket-mb", default="0.25,1000",
                        help="comma separated DDP bucket sizes (MB): small ones overlap the "
                             "exchange with the backward pass, one above the model's size "
                             "does not")
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    print(f"{args.backbone} d={args.dim} {args.image_size}x{args.image_size} batch "
          f"{args.batch}/rank, gloo on {os.cpu_count()} cores, {args.threads} thread(s)/rank")
    header = (f"{'ranks':>5} | {'exchange':>14} | {'buckets':>10} | {'bytes/step/rank':>15} | "
              f"{'fewer bytes':>11} | {'step ms':>8} | {'vs dense':>8} | "
              f"{'vs one bucket':>13}")
    print(header)
    print("-" * len(header), flush=True)
    sizes = [float(b) for b in args.bucket_mb.split(",")]
    timings: dict[tuple[int, float, float], float] = {}
    rows = []
    for world in (int(w) for w in args.ranks.split(",")):
        for density in (float(d) for d in args.densities.split(",")):
            for bucket_mb in sorted(sizes, reverse=True):
                out = mp.Manager().dict()
                mp.spawn(run_rank, args=(world, free_port(), args, density, bucket_mb, out),
                         nprocs=world, join=True)
                ms = statistics.median(r["ms"] for r in out.values())
                sent, dense = out[0]["bytes"], out[0]["dense"]
                timings[(world, density, bucket_mb)] = ms
                dense_ms = timings.get((world, 1.0, bucket_mb))
                one_ms = timings.get((world, density, max(sizes)))
                name = "dense" if density >= 1.0 else f"topk {density:.1%}"
                line = (f"{world:>5} | {name:>14} | {f'{bucket_mb:g} MB':>10} | "
                        f"{sent:>15,.0f} | {dense / sent:>10.1f}x | {ms:>8.1f} | "
                        f"{f'{dense_ms / ms:.2f}x' if dense_ms else '-':>8} | "
                        f"{f'{one_ms / ms:.2f}x' if one_ms else '-':>13}")
                print(line, flush=True)
                rows.append(table_row(header, line))
    record("bench_comm", rows)


if __name__ == "__main__":
    main()

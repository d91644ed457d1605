"""Top-k selection for gradient sparsification: ``workers.comm.topk`` against ``torch.topk``.

For each size, dtype and density, the median time of ``torch.topk(x, k)`` beside the two
methods of ``workers.comm.topk`` ("sample": a threshold from a strided sample, "chunks": divide
and conquer), on Gaussian entries (a gradient's magnitudes are taken with ``abs``, as the
compression hook does). "same set" checks that each method picked what torch.topk picked, up
to ties: the same values, each at an index holding it (float16 magnitudes have
many ties at the k-th value, where torch.topk's pick is arbitrary and ours takes the lowest
indices).

    python benchmarks/bench_topk.py                      # 25M float32 and float16, CPU
    python benchmarks/bench_topk.py --device cuda        # GPU host
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from results import describe_device, record, table_row

from workers.comm import TopkMethod, topk


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of fn() in ms, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="25000000", help="comma separated n")
    parser.add_argument("--densities", default="0.001,0.01", help="comma separated k / n")
    parser.add_argument("--dtypes", default="float32,float16", help="comma separated")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (CPU)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per figure")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is available")
    torch.set_num_threads(args.threads)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    print(f"device={describe_device(device)} threads={args.threads} repeats={args.repeats}")
    header = (f"{'n':>11} | {'dtype':>8} | {'density':>7} | {'k':>7} | {'torch.topk ms':>13} | "
              f"{'sample ms':>9} | {'chunks ms':>9} | {'sample x':>8} | {'chunks x':>8} | "
              f"{'same set':>8}")
    print(header)
    print("-" * len(header), flush=True)
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            x = torch.randn(n, generator=generator, device=device).abs().to(dtype)
            for density in (float(s) for s in args.densities.split(",")):
                k = max(1, round(n * density))
                reference = torch.topk(x, k).values.sort().values
                base = timed(lambda: torch.topk(x, k), args.repeats, device)  # noqa: B023
                cells = []
                same = True
                for method in TopkMethod:
                    ms = timed(lambda: topk(x, k, method), args.repeats, device)  # noqa: B023
                    values, indices = topk(x, k, method)
                    same &= (torch.equal(values.sort().values, reference)
                             and torch.equal(x[indices], values))
                    cells.append(ms)
                line = (f"{n:>11,} | {dtype_name:>8} | {density:>7.2%} | {k:>7,} | "
                        f"{base:>13.2f} | {cells[0]:>9.2f} | {cells[1]:>9.2f} | "
                        f"{base / cells[0]:>7.1f}x | {base / cells[1]:>7.1f}x | "
                        f"{'yes' if same else 'NO':>8}")
                print(line, flush=True)
                rows.append(table_row(header, line))
    record("bench_topk", rows, device=describe_device(device))


if __name__ == "__main__":
    main()

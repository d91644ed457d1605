"""KNN graph build: exact (ams.graph.knn) against faiss IndexFlatIP, or IVF (ams.graph.ivf,
``--method ivf``) against faiss IndexIVFFlat and the exact build.

Every row is searched against all rows (k neighbors, the row itself included) on clustered
Gaussian data. Recall@k of both is measured against a float64 numpy brute force on a sample of
query rows; a returned neighbor counts as correct when its float64 score reaches the k-th
best float64 score (less 1e-6), so exact ties at the cut are not counted as misses.
"cpu s" is process CPU time (all threads): a check on wall times taken on a busy machine.
"xcls +MB" / "ivf +MB" is how far the build raised the process's peak resident memory above
what it held before (input rows included in the baseline). The exact build's N x k result is
part of its figure; the IVF build hands its lists on block by block, as ams.graph.build
writes them to the shards, so its figure is the index and a block.

    python benchmarks/bench_graph.py --sizes 100000 --dim 128 --k 32 --threads 2 --device cpu
    python benchmarks/bench_graph.py --sizes 1000000,10000000 --device cuda --no-faiss  # GPU host
    python benchmarks/bench_graph.py --method ivf --sizes 1000000 --threads 2 --device cpu

``--no-faiss`` skips the faiss-cpu build (hours at 10M; with --method ivf the IndexIVFFlat
beside the float16 index) and leaves its columns empty; recall is still checked against the
float64 brute force. With --method ivf the exact build runs up to ``--exact-max`` rows.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable

import numpy as np
import torch
from results import describe_device, record, table_row

from ams.graph import (
    IvfIndex,
    knn,
    resolve_block_rows,
    resolve_device,
    resolve_nlist,
    sample_ids,
)
from ams.graph.ivf import DEFAULT_NPROBE, TRAIN_ROWS_PER_LIST

try:
    import faiss
except ImportError:  # the baseline only: --no-faiss runs without it (GPU hosts lack it)
    faiss = None


def clustered(n: int, dim: int, seed: int) -> np.ndarray:
    """Unit rows around n/100 random centres; within-cluster cosine ~0.8, so each row has
    many close competitors (harder than i.i.d. Gaussians, where all scores are ~0)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(1, n // 100), dim), dtype=np.float32)
    rows = centres[rng.integers(len(centres), size=n)]
    rows += 0.5 * rng.standard_normal((n, dim), dtype=np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    return rows


def exact_kth(rows: np.ndarray, queries: np.ndarray, k: int, chunk: int = 65536) -> np.ndarray:
    """float64 k-th best score of each query over all rows, (q,)."""
    q64 = rows[queries].astype(np.float64)
    best = np.full((len(queries), k), -np.inf)
    for start in range(0, len(rows), chunk):
        scores = q64 @ rows[start : start + chunk].astype(np.float64).T
        merged = np.concatenate([best, scores], axis=1)
        best = -np.partition(-merged, k - 1, axis=1)[:, :k]
    return best.min(axis=1)


def recall(rows: np.ndarray, queries: np.ndarray, lists: np.ndarray, kth: np.ndarray) -> float:
    """Share of the queries' lists (q, k) reaching the k-th float64 score ``kth`` (q,)."""
    k = lists.shape[1]
    hits = 0
    for q, row_ids, cut in zip(queries, lists, kth, strict=True):
        distinct = np.unique(row_ids[row_ids >= 0])
        scores = rows[distinct].astype(np.float64) @ rows[q].astype(np.float64)
        hits += min(k, int((scores >= cut - 1e-6).sum()))
    return hits / (k * len(queries))


def resident_mb() -> float:
    """Current resident set size of this process in MB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100000,1000000", help="comma separated N")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--no-faiss", action="store_true",
                        help="skip the faiss-cpu baseline (its columns print as -)")
    parser.add_argument("--block-size", type=int, default=0,
                        help="xcls query/key block rows (0: the device's default, "
                             "ams.graph.resolve_block_rows)")
    parser.add_argument("--recall-queries", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--method", choices=("exact", "ivf"), default="exact")
    parser.add_argument("--nlist", type=int, default=0, help="ivf lists (0: auto)")
    parser.add_argument("--nprobe", type=int, default=DEFAULT_NPROBE, help="ivf lists scanned")
    parser.add_argument("--exact-max", type=int, default=200000,
                        help="--method ivf: run the exact build beside it up to this N")
    args = parser.parse_args()

    if not args.no_faiss:
        if faiss is None:
            parser.error("the faiss baseline needs faiss-cpu (pip install faiss-cpu); "
                         "--no-faiss runs without it")
        faiss.omp_set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    try:
        device = resolve_device(args.device)
    except ValueError as err:
        parser.error(f"--device {err}")
    try:
        args.block_size = resolve_block_rows(args.block_size or None, device)
    except ValueError as err:
        parser.error(f"--block-size: {err}")
    if args.method == "ivf":
        bench_ivf(args)
        return
    header = f"{'N':>9} | {'xcls s':>8} | {'faiss s':>8} | {'xcls/faiss':>10} | " \
             f"{'xcls cpu s':>10} | {'faiss cpu s':>11} | {'recall xcls':>11} | " \
             f"{'recall faiss':>12} | {'xcls +MB':>8}"
    print(f"dim={args.dim} k={args.k} threads={args.threads} device={args.device} "
          f"block={args.block_size}", flush=True)
    print(header)
    print("-" * len(header), flush=True)
    figures = []
    for n in (int(s) for s in args.sizes.split(",")):
        rows = clustered(n, args.dim, args.seed)

        before_mb = resident_mb()
        start, cpu = time.perf_counter(), time.process_time()
        ids, _ = knn(torch.from_numpy(rows), args.k, block_size=args.block_size,
                     device=args.device)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        xcls_s, xcls_cpu = time.perf_counter() - start, time.process_time() - cpu
        # ru_maxrss is the process's peak so far (KB): with --sizes ascending, this build's
        # peak is the process's peak (a larger N peaks higher than every earlier build).
        xcls_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before_mb

        rng = np.random.default_rng(args.seed + 1)
        queries = rng.choice(n, size=min(n, args.recall_queries), replace=False)
        kth = exact_kth(rows, queries, args.k)
        xcls_recall = recall(rows, queries, ids.numpy()[queries], kth)

        faiss_cells = ("-", "-", "-", "-")
        if not args.no_faiss:
            start, cpu = time.perf_counter(), time.process_time()
            index = faiss.IndexFlatIP(args.dim)
            index.add(rows)
            _, faiss_ids = index.search(rows, args.k)
            faiss_s, faiss_cpu = time.perf_counter() - start, time.process_time() - cpu
            faiss_cells = (f"{faiss_s:.2f}", f"{xcls_s / faiss_s:.2f}", f"{faiss_cpu:.2f}",
                           f"{recall(rows, queries, faiss_ids[queries], kth):.4f}")
        faiss_s_cell, ratio_cell, faiss_cpu_cell, faiss_recall_cell = faiss_cells
        line = (f"{n:>9} | {xcls_s:>8.2f} | {faiss_s_cell:>8} | {ratio_cell:>10} | "
                f"{xcls_cpu:>10.2f} | {faiss_cpu_cell:>11} | {xcls_recall:>11.4f} | "
                f"{faiss_recall_cell:>12} | {xcls_mb:>8.0f}")
        print(line, flush=True)
        figures.append(table_row(header, line))
    record("bench_graph", figures, table="exact", device=describe_device(args.device))


def timed(device: str, build: Callable[..., np.ndarray], /, *args: object, **kwargs: object
          ) -> tuple[np.ndarray, float, float, float]:
    """(ids, wall s, process cpu s, peak MB above the start) of ``build(*args, **kwargs)``
    run on ``device``."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident memory (VmHWM) starts again from the current
    before_mb = resident_mb()
    start, cpu = time.perf_counter(), time.process_time()
    ids = build(*args, **kwargs)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    with open("/proc/self/status") as f:
        peak_mb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
    return ids, seconds, cpu, peak_mb - before_mb


def ivf_lists(rows: np.ndarray, k: int, queries: np.ndarray, nlist: int, nprobe: int,
              seed: int, device: str, block: int = 65536) -> np.ndarray:
    """IVF lists of every row, computed block by block as ams.graph.build does (memory: the
    index and a block, the lists written out and dropped); returns those of ``queries``."""
    x, n = torch.from_numpy(rows), len(rows)
    index = IvfIndex(rows.shape[1], nlist, nprobe, device=device)
    index.train(x[sample_ids(n, TRAIN_ROWS_PER_LIST * nlist, seed)], seed)
    ids = torch.arange(n)
    for start in range(0, n, block):
        index.add(ids[start:start + block], x[start:start + block])
    kept = np.empty((len(queries), k), dtype=np.int64)
    for start in range(0, n, block):
        found = index.search(ids[start:start + block], x[start:start + block], k)[0].numpy()
        mine = (queries >= start) & (queries < start + block)
        kept[mine] = found[queries[mine] - start]
    return kept


def exact_lists(rows: np.ndarray, k: int, queries: np.ndarray, **kwargs: object) -> np.ndarray:
    return knn(torch.from_numpy(rows), k, **kwargs)[0].numpy()[queries]


def faiss_ivf_flat(rows: np.ndarray, k: int, nlist: int, nprobe: int, seed: int) -> np.ndarray:
    """faiss IndexIVFFlat (float32 lists), trained on the sample ams.graph.ivf trains on."""
    index = faiss.IndexIVFFlat(faiss.IndexFlatIP(rows.shape[1]), rows.shape[1], nlist,
                               faiss.METRIC_INNER_PRODUCT)
    index.cp.seed = seed
    index.train(rows[sample_ids(len(rows), TRAIN_ROWS_PER_LIST * nlist, seed).numpy()])
    index.add(rows)
    index.nprobe = nprobe
    return index.search(rows, k)[1]


def bench_ivf(args: argparse.Namespace) -> None:
    """One row per N: the float16 IVF build (ams.graph.IvfIndex, streamed as
    ams.graph.build streams shards), faiss IndexIVFFlat with the same lists, and the exact
    build where N <= --exact-max."""
    header = f"{'N':>9} | {'nlist':>6} | {'nprobe':>6} | {'ivf s':>8} | {'ivf cpu s':>9} | " \
             f"{'recall ivf':>10} | {'ivf +MB':>7} | {'flat s':>8} | {'recall flat':>11} | " \
             f"{'exact s':>8} | {'recall exact':>12}"
    print(f"dim={args.dim} k={args.k} threads={args.threads} device={args.device} "
          f"rows: clustered, N/100 centres", flush=True)
    print(header)
    print("-" * len(header), flush=True)
    figures = []
    for n in (int(s) for s in args.sizes.split(",")):
        rows = clustered(n, args.dim, args.seed)
        nlist = resolve_nlist(args.nlist, n)
        rng = np.random.default_rng(args.seed + 1)
        queries = rng.choice(n, size=min(n, args.recall_queries), replace=False)
        kth = exact_kth(rows, queries, args.k)
        lists, ivf_s, ivf_cpu, ivf_mb = timed(args.device, ivf_lists, rows, args.k, queries,
                                              nlist, args.nprobe, args.seed, args.device)
        cells = [f"{ivf_s:.2f}", f"{ivf_cpu:.2f}", f"{recall(rows, queries, lists, kth):.4f}",
                 f"{ivf_mb:.0f}"]
        print(f"# N={n} ivf: {' | '.join(cells)}", flush=True)
        if args.no_faiss:
            cells += ["-", "-"]
        else:
            flat, flat_s, _, _ = timed("cpu", faiss_ivf_flat, rows, args.k, nlist, args.nprobe,
                                       args.seed)
            cells += [f"{flat_s:.2f}", f"{recall(rows, queries, flat[queries], kth):.4f}"]
        if n <= args.exact_max:
            exact, exact_s, _, _ = timed(args.device, exact_lists, rows, args.k, queries,
                                         block_size=args.block_size, device=args.device)
            cells += [f"{exact_s:.2f}", f"{recall(rows, queries, exact, kth):.4f}"]
        else:
            cells += ["-", "-"]
        widths = (8, 9, 10, 7, 8, 11, 8, 12)
        line = (f"{n:>9} | {nlist:>6} | {min(args.nprobe, nlist):>6} | "
                + " | ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
        print(line, flush=True)
        figures.append(table_row(header, line))
    record("bench_graph", figures, table="ivf", device=describe_device(args.device))


if __name__ == "__main__":
    main()

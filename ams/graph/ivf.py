"""Approximate k-nearest-neighbor lists with faiss's inverted-file index (IVF), for tables the
exact search cannot reach: it scores all N^2 pairs, this about N^1.5.

k-means on a seeded sample of rows gives ``nlist`` centroids; every row is stored in the list
of its nearest centroid; a query scores the rows of the ``nprobe`` lists whose centroids are
nearest to it. A query thus scores ``nlist + nprobe * N / nlist`` rows instead of N, and
``nlist`` about ``4 * sqrt(N)`` balances the two terms. The lists hold the rows in float16
(faiss ``IndexIVFScalarQuantizer`` with ``QT_fp16``, no residual): half the memory of
``IndexIVFFlat`` (N * d * 2 bytes), no slower to scan (the scan is bound by memory traffic),
and a recall lower only where float16 rounding (about 2**-10 on a unit-row score) reorders
near-ties at the k-th score (``benchmarks/bench_graph.py --method ivf`` measures both).

Same contract as ``ams.graph.knn``: inner products of L2-normalized rows (cosine), int64 lists
in rank order, the class itself first (even where faiss ranks a duplicate row above it), padded
with -1 when fewer than k rows were found. Rows arrive in blocks (a shard's Scan stream), so the
memory is the index plus a block.

faiss is imported when an index is made, not with ``ams.graph``. It runs on the CPU with
torch's thread count, and on the GPU when the device is CUDA and faiss was built with GPU
support (otherwise on the CPU, with a warning).
"""

from __future__ import annotations

import logging
import math
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from ams.graph.topk import normalize_rows, resolve_device

log = logging.getLogger(__name__)

# Lists each query scans: build time grows with it, and so does recall
# (benchmarks/bench_graph.py --method ivf measures both).
DEFAULT_NPROBE = 8
# nlist = NLIST_PER_SQRT_N * sqrt(N) when not given, at most MAX_NLIST.
NLIST_PER_SQRT_N = 4
MAX_NLIST = 1 << 16
# k-means trains on this many sampled rows per list: faiss's clustering warns below 39 and
# subsamples above 256, and its time grows with sample x nlist. The auto nlist also keeps
# lists at least this long, so that nprobe lists hold many more rows than k.
TRAIN_ROWS_PER_LIST = 40
# Rows handed to faiss at a time (by IvfIndex when the caller's blocks are larger, and by
# ivf_knn): bounds the float32 copy.
_FAISS_BLOCK_ROWS = 1 << 16


def load_faiss() -> ModuleType:
    """The faiss module; ImportError with what to install when it is missing."""
    try:
        import faiss
    except ImportError:
        raise ImportError("the ivf graph method needs faiss: pip install faiss-cpu (or a faiss "
                          "build with GPU support)") from None
    return faiss


def resolve_nlist(nlist: int, num_rows: int) -> int:
    """The number of lists for a table of ``num_rows``: ``nlist`` if > 0, else about
    ``NLIST_PER_SQRT_N * sqrt(num_rows)``, at most ``MAX_NLIST`` and num_rows /
    ``TRAIN_ROWS_PER_LIST``, at least 1. ValueError for a negative nlist or one above
    num_rows."""
    if num_rows < 1:
        raise ValueError(f"num_rows={num_rows} must be >= 1")
    if nlist < 0 or nlist > num_rows:
        raise ValueError(f"nlist={nlist} must be in [0, num_rows={num_rows}] (0: auto)")
    if nlist:
        return nlist
    return max(1, min(MAX_NLIST, num_rows // TRAIN_ROWS_PER_LIST,
                      round(NLIST_PER_SQRT_N * math.sqrt(num_rows))))


def sample_ids(num_rows: int, count: int, seed: int) -> Tensor:
    """``min(count, num_rows)`` distinct ids of 0..num_rows-1, drawn uniformly with ``seed``,
    ascending; int64 (m,). Memory O(count), not O(num_rows), for count << num_rows."""
    if num_rows < 1 or count < 0:
        raise ValueError(f"need num_rows >= 1 and count >= 0, got {num_rows}, {count}")
    gen = torch.Generator().manual_seed(seed)
    if 4 * count >= num_rows:
        return torch.randperm(num_rows, generator=gen)[:count].sort().values
    found = torch.empty(0, dtype=torch.int64)
    while found.numel() < count:  # collisions are rare at count <= num_rows / 4
        drawn = torch.randint(num_rows, (count - found.numel(),), generator=gen)
        found = torch.unique(torch.cat([found, drawn]))
    return found


def list_recall(found: Tensor, exact: Tensor) -> float:
    """Mean share of each exact list that the found list holds (the class itself included):
    found, exact int64 (m, k), -1 pads; 1.0 for m = 0. Ties at the k-th score count as misses
    (rare for real rows)."""
    if found.shape[0] != exact.shape[0]:
        raise ValueError(f"found {tuple(found.shape)} and exact {tuple(exact.shape)}: the "
                         "row counts differ")
    valid = exact >= 0
    if not bool(valid.any()):
        return 1.0
    hit = (exact[:, :, None] == found[:, None, :]).any(dim=2) & valid
    return float(hit.sum()) / float(valid.sum())


class IvfIndex:
    """An IVF index over float16 rows: ``train`` on a sample, ``add`` every block of the table,
    then ``search`` blocks of query rows.

    Args:
        dim: row width d.
        nlist: number of lists (``resolve_nlist``).
        nprobe: lists each query scans (at most nlist are).
        device: CUDA uses faiss's GPU index when faiss has GPU support; None picks CUDA when
            torch sees one.

    Memory: the stored rows (N * d * 2 bytes, with their int64 ids N * 8) and the centroids.
    """

    def __init__(self, dim: int, nlist: int, nprobe: int = DEFAULT_NPROBE, *,
                 device: str | torch.device | None = None) -> None:
        if dim < 1 or nlist < 1 or nprobe < 1:
            raise ValueError(f"need dim, nlist and nprobe >= 1, got {dim}, {nlist}, {nprobe}")
        faiss = load_faiss()
        faiss.omp_set_num_threads(torch.get_num_threads())
        self.dim, self.nlist, self.nprobe = dim, nlist, min(nprobe, nlist)
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFScalarQuantizer(
            quantizer, dim, nlist, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT,
            False)  # no residual: fp16 keeps a unit row to 2**-11 without it
        index.nprobe = self.nprobe
        self._quantizer = quantizer  # the index refers to it; keep it alive
        self._gpu = None
        dev = resolve_device(device)
        if dev.type == "cuda":
            if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
                self._gpu = faiss.StandardGpuResources()
                index = faiss.index_cpu_to_gpu(self._gpu, dev.index or 0, index)
            else:
                log.warning("ivf_on_cpu reason=this faiss has no GPU support")
        self._index = index
        self.device = "cuda" if self._gpu is not None else "cpu"

    @property
    def trained(self) -> bool:
        """Whether ``train`` ran: rows can be added."""
        return bool(self._index.is_trained)

    @property
    def size(self) -> int:
        """Rows added so far."""
        return int(self._index.ntotal)

    def train(self, rows: Tensor, seed: int = 0) -> None:
        """k-means of ``rows`` (t, d) any float dtype, t >= nlist, normalized here; ``seed``
        seeds the clustering."""
        if rows.dim() != 2 or rows.shape[1] != self.dim or rows.shape[0] < self.nlist:
            raise ValueError(f"training rows {tuple(rows.shape)}: need (t >= nlist={self.nlist}, "
                             f"{self.dim})")
        self._index.cp.seed = seed
        self._index.train(_to_numpy(rows))

    def add(self, ids: Tensor, rows: Tensor) -> None:
        """Store ``rows`` (b, d) any float dtype, normalized here, under ``ids`` int64 (b,)."""
        self._check(ids, rows)
        if not self.trained:
            raise ValueError("train the index before adding rows")
        for start in range(0, ids.shape[0], _FAISS_BLOCK_ROWS):
            stop = start + _FAISS_BLOCK_ROWS
            self._index.add_with_ids(_to_numpy(rows[start:stop]),
                                     np.ascontiguousarray(ids[start:stop].numpy()))

    def search(self, ids: Tensor, rows: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Top-k lists of query ``rows`` (q, d) any float dtype with ids int64 (q,).

        Returns (neighbors int64 (q, k), scores float32 (q, k)): each list starts with the
        query's own id (score: its exact unit-row self product) and goes on with the index's
        best other rows, best first (scores of the float16-stored rows); -1 / -inf pad a list
        when fewer rows were found.
        """
        self._check(ids, rows)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        out_ids, out_scores = [], []
        for start in range(0, ids.shape[0], _FAISS_BLOCK_ROWS):
            block_ids = ids[start:start + _FAISS_BLOCK_ROWS]
            unit = normalize_rows(rows[start:start + _FAISS_BLOCK_ROWS], torch.device("cpu"))
            scores, found = self._index.search(unit.numpy(), k)
            ids_k, scores_k = _self_first(block_ids, torch.from_numpy(found),
                                          torch.from_numpy(scores), (unit * unit).sum(dim=1))
            out_ids.append(ids_k)
            out_scores.append(scores_k)
        if not out_ids:
            return torch.empty(0, k, dtype=torch.int64), torch.empty(0, k)
        return torch.cat(out_ids), torch.cat(out_scores)

    def _check(self, ids: Tensor, rows: Tensor) -> None:
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise TypeError(f"ids must be int64 of shape (n,), got {ids.dtype} {tuple(ids.shape)}")
        if rows.dim() != 2 or tuple(rows.shape) != (ids.shape[0], self.dim) \
                or not rows.is_floating_point():
            raise ValueError(f"rows {rows.dtype} {tuple(rows.shape)} do not match "
                             f"({ids.shape[0]}, {self.dim}) float")


def ivf_knn(rows: Tensor, k: int, *, nlist: int = 0, nprobe: int = DEFAULT_NPROBE,
            ids: Tensor | None = None, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Approximate k nearest neighbors of every row among all rows, held in memory (the
    counterpart of ``ams.graph.knn``; ``ams.graph.build`` streams shards instead).

    Args:
        rows: (N, d) float (any float dtype).
        k: neighbors per row, the row itself first.
        nlist, nprobe: see ``IvfIndex`` (nlist 0: ``resolve_nlist``).
        ids: (N,) int64 global ids (default 0..N-1).
        seed: seeds the training sample and the clustering.

    Rows are added and searched ``_FAISS_BLOCK_ROWS`` at a time, on the device ``IvfIndex``
    picks when given none.

    Returns (ids (N, k) int64, scores (N, k) float32), as ``IvfIndex.search``.
    """
    n = rows.shape[0]
    ids = torch.arange(n, dtype=torch.int64) if ids is None else ids
    lists = resolve_nlist(nlist, n)
    index = IvfIndex(rows.shape[1], lists, nprobe)
    index.train(rows[sample_ids(n, TRAIN_ROWS_PER_LIST * lists, seed)], seed)
    block = _FAISS_BLOCK_ROWS
    for start in range(0, n, block):
        index.add(ids[start:start + block], rows[start:start + block])
    out_ids, out_scores = torch.empty(n, k, dtype=torch.int64), torch.empty(n, k)
    for start in range(0, n, block):
        stop = start + block
        out_ids[start:stop], out_scores[start:stop] = index.search(ids[start:stop],
                                                                   rows[start:stop], k)
    return out_ids, out_scores


def _to_numpy(rows: Tensor) -> np.ndarray:
    """(n, d) any float dtype -> contiguous float32 unit rows for faiss."""
    return np.ascontiguousarray(normalize_rows(rows, torch.device("cpu")).numpy())


def _self_first(ids: Tensor, found: Tensor, scores: Tensor, self_scores: Tensor
                ) -> tuple[Tensor, Tensor]:
    """Put each query's own id first: ids (q,), found / scores (q, k) from faiss (-1 pads),
    self_scores (q,) -> (q, k) lists whose other entries keep faiss's order."""
    k = found.shape[1]
    is_self = found == ids[:, None]
    # stable sort on the flag: the other entries first, in order, then the query's own
    order = is_self.to(torch.uint8).sort(dim=1, stable=True).indices[:, :k - 1]
    rest_ids = found.gather(1, order)
    rest_scores = scores.gather(1, order).masked_fill(rest_ids < 0, -torch.inf)
    return (torch.cat([ids[:, None], rest_ids], dim=1),
            torch.cat([self_scores[:, None], rest_scores], dim=1))

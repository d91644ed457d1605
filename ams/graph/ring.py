"""Distributed graph build: ring schedule over shards, resumable per query block.

Each builder owns some home shards (``assign_shards``). For a home shard it takes that shard's
rows as queries, cut into query blocks, and streams every shard's rows past them in ring order
starting at its own shard (``ring_order``), so concurrent builders read different shards at
any moment and W is never gathered in one place (KNN softmax's ring schedule, docs/references.md).

Every query row needs every key, so the cost of a build is dominated by how often the shards
are streamed: one full pass over all shards per pass. A pass therefore carries as many query
blocks as fit in ``PASS_MEMORY_BYTES`` (each key block is read and normalized once, then
scored against all of them); with its 1 GiB at d=128 that is ~1.5M query rows per pass. Query
and key blocks are the device's block rows (``ams.graph.resolve_block_rows``); the score block
memory (block rows x block rows) is shared by the pass.

Resume: when a pass ends, each of its query blocks' lists is written atomically (tmp file +
os.replace) under ``resume_dir``; a rerun loads finished blocks and computes only the rest.
Blocks are computed independently of how they were grouped into passes, so the rerun's result
is identical. Use a fresh ``resume_dir`` per graph version: a stored block is trusted as long
as its query ids and k match.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from ams.graph.knn import concat_results, search_pass, split_blocks
from ams.graph.topk import resolve_block_rows, resolve_device, resolve_low_precision

log = logging.getLogger(__name__)

# Memory for the query blocks that ride on one pass over the shards: every pass streams every
# shard once, so fuller passes read less; 1 GiB holds ~1.5M query rows at d=128, so a home
# shard of up to that many rows takes a single pass.
PASS_MEMORY_BYTES = 1 << 30

Scan = Callable[[int], Iterable[tuple[Tensor, Tensor]]]


def assign_shards(num_shards: int, num_builders: int) -> list[list[int]]:
    """Home shards of each builder: builder b gets shards b, b + B, b + 2B, ... (round
    robin, so loads differ by at most one shard)."""
    if num_shards < 1 or num_builders < 1:
        raise ValueError(f"need num_shards >= 1 and num_builders >= 1, "
                         f"got {num_shards}, {num_builders}")
    return [list(range(b, num_shards, num_builders)) for b in range(num_builders)]


def ring_order(home_shard: int, num_shards: int) -> list[int]:
    """Shards in the order a builder streams them: home, home + 1, ... (mod num_shards).
    Builders with different homes start on different shards and stay apart."""
    if not 0 <= home_shard < num_shards:
        raise ValueError(f"home_shard {home_shard} not in 0..{num_shards - 1}")
    return [(home_shard + i) % num_shards for i in range(num_shards)]


def build_shard_neighbors(
    home_shard: int,
    num_shards: int,
    scan: Scan,
    k: int,
    *,
    device: str | torch.device | None = None,
    resume_dir: Path | None = None,
    progress: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Exact k-NN lists of the home shard's rows against the rows of all shards.

    Args:
        home_shard: the shard whose rows are the queries.
        num_shards: shards in the ring.
        scan: ``scan(shard)`` yields (ids (b,) int64, rows (b, d) float) blocks of that
            shard's rows (rows may be fp16/bf16; they are cast to fp32 and normalized on
            arrival). Called once for the home shard (its rows then stay in memory) and once
            per pass for every other shard.
        k: list length, the class itself first.
        device: see ``knn``; it sets the block rows (a query block is the unit of resume, a
            key block the width of a score block) and the precision of the search.
        resume_dir: where finished query blocks are kept (None: no resume).
        progress: show a tqdm bar over query blocks.

    Returns:
        ids (n,) int64 of the home shard's rows in scan order, neighbors (n, k) int64,
        scores (n, k) float32 (padding -1 / -inf when fewer than k rows exist).
    """
    dev = resolve_device(device)
    low = resolve_low_precision(dev)
    block_rows = resolve_block_rows(None, dev)
    home_ids, home_rows = _collect(scan(home_shard))
    n, dim = home_rows.shape
    starts = list(range(0, n, block_rows))
    store = _BlockStore(resume_dir, home_shard, k) if resume_dir is not None else None
    results: dict[int, tuple[Tensor, Tensor]] = {}
    if store is not None:
        for i, start in enumerate(starts):
            found = store.load(i, home_ids[start : start + block_rows])
            if found is not None:
                results[i] = found
    pending = [i for i in range(len(starts)) if i not in results]

    per_block = block_rows * _query_row_bytes(dim, k, low)
    blocks_per_pass = max(1, PASS_MEMORY_BYTES // per_block)
    bar = tqdm(total=len(starts), initial=len(results), unit="block", disable=not progress,
               desc=f"graph shard {home_shard}")
    for p in range(0, len(pending), blocks_per_pass):
        group = pending[p : p + blocks_per_pass]
        query_blocks = [
            (home_ids[starts[i] : starts[i] + block_rows],
             home_rows[starts[i] : starts[i] + block_rows])
            for i in group
        ]

        def key_stream() -> Iterator[tuple[Tensor, Tensor]]:
            for shard in ring_order(home_shard, num_shards):
                bar.set_postfix(shard=shard)
                if shard == home_shard:
                    yield from split_blocks(home_ids, home_rows, block_rows)
                else:
                    yield from scan(shard)

        found = search_pass(query_blocks, key_stream(), k, device=dev, low_precision=low,
                            key_block_rows=block_rows)
        for i, (ids, _), block in zip(group, query_blocks, found, strict=True):
            if store is not None:
                store.save(i, ids, *block)
            results[i] = block
        bar.update(len(group))
    bar.close()
    neighbors, scores = concat_results([results[i] for i in range(len(starts))], k)
    return home_ids, neighbors, scores


def refresh_neighbors(
    query_ids: Tensor,
    query_rows: Tensor,
    scan_all: Iterable[tuple[Tensor, Tensor]],
    k: int,
    *,
    device: str | torch.device | None = None,
) -> tuple[Tensor, Tensor]:
    """Fresh lists for some classes only (partial refresh), in one pass over all rows.

    Args:
        query_ids: (m,) int64 ids of the classes to refresh.
        query_rows: (m, d) float their current rows.
        scan_all: (ids (b,) int64, rows (b, d)) blocks of all rows, read once; all m query
            blocks ride on this one pass, so memory grows with m (meant for m << N).
        k, device: see ``build_shard_neighbors``.

    Returns neighbors (m, k) int64 and scores (m, k) float32, equal to those rows of a full
    build.
    """
    dev = resolve_device(device)
    block_rows = resolve_block_rows(None, dev)
    found = search_pass(list(split_blocks(query_ids, query_rows, block_rows)), scan_all, k,
                        device=dev, low_precision=resolve_low_precision(dev),
                        key_block_rows=block_rows)
    return concat_results(found, k)


def _collect(blocks: Iterable[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Concatenate a shard's (ids, rows) blocks, keeping the stored row dtype."""
    pairs = list(blocks)
    if not pairs:
        raise ValueError("the home shard has no rows")
    return torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])


def _query_row_bytes(dim: int, k: int, low_precision: bool) -> int:
    """Memory one query row holds during a pass: its fp32 (and fp16) copy and running list."""
    return dim * 4 + (dim * 2 if low_precision else 0) + (k - 1) * (8 + 4)


def _tensor_of(value: object, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    return isinstance(value, Tensor) and value.dtype == dtype and tuple(value.shape) == tuple(shape)


class _BlockStore:
    """Finished query blocks of one home shard, one file each, written atomically."""

    def __init__(self, root: Path, home_shard: int, k: int) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.home_shard = home_shard
        self.k = k

    def _path(self, block: int) -> Path:
        return self.root / f"shard{self.home_shard:05d}-block{block:07d}.pt"

    def load(self, block: int, query_ids: Tensor) -> tuple[Tensor, Tensor] | None:
        """The stored (neighbors int64 (q, k), scores float32 (q, k)) of ``block`` for
        ``query_ids`` int64 (q,), or None when there is none that matches: a file that cannot
        be read (truncated, not a block's) or holds other ids, k or shapes is computed again."""
        path = self._path(block)
        if not path.exists():
            return None
        try:
            saved = torch.load(path, weights_only=True)
        except Exception as e:  # torch.load raises many types for a damaged file
            log.warning("graph_block_unreadable path=%s error=%s", path, type(e).__name__)
            return None
        expected = (query_ids.numel(), self.k)
        if (not isinstance(saved, dict) or saved.get("k") != self.k
                or not _tensor_of(saved.get("query_ids"), torch.int64, query_ids.shape)
                or not torch.equal(saved["query_ids"], query_ids)
                or not _tensor_of(saved.get("neighbors"), torch.int64, expected)
                or not _tensor_of(saved.get("scores"), torch.float32, expected)):
            return None
        return saved["neighbors"], saved["scores"]

    def save(self, block: int, query_ids: Tensor, neighbors: Tensor, scores: Tensor) -> None:
        path = self._path(block)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        payload = {"k": self.k, "query_ids": query_ids, "neighbors": neighbors, "scores": scores}
        with open(tmp, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

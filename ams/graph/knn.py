"""Exact k-nearest-neighbor search over L2-normalized class-weight rows, blocked and streamed.

``knn`` searches rows all against all (each pair of row blocks scored once, ``symmetric_search``,
or streamed past query blocks in low precision, ``search_pass``); the ring schedule over shards
(``ams.graph.ring``) feeds ``search_pass`` from every shard in turn. Both rest on
``ams.graph.topk.TopKAccumulator``, whose docstring says how a key block is consumed and why the
result is exact. Ids are int64 end to end.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor
from tqdm import tqdm

from ams.graph.topk import (
    KeyBlock,
    ScoreBuffer,
    TopKAccumulator,
    check_rows,
    resolve_block_rows,
    resolve_device,
    resolve_low_precision,
)


def split_blocks(ids: Tensor, rows: Tensor, block_rows: int) -> Iterator[tuple[Tensor, Tensor]]:
    """(ids (n,), rows (n, d)) -> consecutive blocks of at most ``block_rows`` (views)."""
    for start in range(0, ids.shape[0], block_rows):
        yield ids[start : start + block_rows], rows[start : start + block_rows]


def search_pass(
    query_blocks: Sequence[tuple[Tensor, Tensor]],
    key_stream: Iterable[tuple[Tensor, Tensor]],
    k: int,
    *,
    device: torch.device,
    low_precision: bool,
    key_block_rows: int,
) -> list[tuple[Tensor, Tensor]]:
    """One pass of a key stream past several query blocks: each key block is prepared once
    and scored against every query block, so the stream is read once per pass however many
    query blocks ride on it.

    Args:
        query_blocks: [(ids (q,) int64, rows (q, d) float)] query blocks.
        key_stream: (ids (b,) int64, rows (b, d) float) key blocks; ids unique over the stream.
        device, low_precision, key_block_rows: see ``TopKAccumulator`` (the callers resolve
            them: ``resolve_device``, ``resolve_low_precision``, ``resolve_block_rows``).

    Returns [(ids (q, k) int64, scores (q, k) float32)] per query block, on CPU.
    """
    buffer = ScoreBuffer()
    accumulators = [
        TopKAccumulator(
            ids, rows, k, device=device, low_precision=low_precision,
            key_block_rows=key_block_rows, score_buffer=buffer,
        )
        for ids, rows in query_blocks
    ]
    for key_ids, key_rows in key_stream:
        keys = KeyBlock.prepare(key_ids, key_rows, device, low_precision)
        for acc in accumulators:
            acc.update_block(keys)
    return [tuple(t.cpu() for t in acc.result()) for acc in accumulators]


def symmetric_search(
    ids: Tensor, rows: Tensor, k: int, block_size: int, device: torch.device,
    progress: bool = False,
) -> list[tuple[Tensor, Tensor]]:
    """fp32 all-against-all search that scores each pair of row blocks once: block i's scores
    against block j are block j's against block i, transposed, so the (i, j) block goes to
    both accumulators (i <= j) and the matmul work halves. Where the matmul dominates (CPU)
    that is most of the build time.

    Args: ids (N,) int64 unique; rows (N, d) any float dtype; block_size: rows per block;
    progress: a tqdm bar over the blocks (their pairs take less time as the build goes on).
    Returns [(ids (q, k) int64, scores (q, k) float32)] per block of rows, on CPU.
    """
    buffer = ScoreBuffer()
    accumulators = [
        TopKAccumulator(block_ids, block_rows, k, device=device, low_precision=False,
                        key_block_rows=block_size, score_buffer=buffer)
        for block_ids, block_rows in split_blocks(ids, rows, block_size)
    ]
    # Each accumulator normalized its rows once; the same rows serve as the key blocks.
    blocks = [KeyBlock(acc.query_ids, acc.query_rows, None) for acc in accumulators]
    # A second buffer for the shared block: the accumulators' own scratch is reused inside
    # update_block (the diagonal block) and must not overwrite a pair still being consumed.
    pair_buffer = ScoreBuffer()
    results: list[tuple[Tensor, Tensor]] = []
    bar = tqdm(total=len(blocks), unit="block", desc="graph", disable=not progress)
    for i, acc in enumerate(accumulators):
        acc.update_block(blocks[i])
        for j in range(i + 1, len(blocks)):
            scores = pair_buffer.get(len(blocks[i]), len(blocks[j]), torch.float32, device)
            torch.mm(blocks[i].rows, blocks[j].rows.T, out=scores)
            acc.update_scores(scores, blocks[j])
            accumulators[j].update_scores(scores.T, blocks[i])
        # Block i has now met every block (j < i gave theirs earlier, transposed).
        results.append(tuple(t.cpu() for t in acc.result()))
        accumulators[i] = None  # its lists are in the results; free them as we go
        bar.update(1)
    bar.close()
    return results


def knn(
    rows: Tensor,
    k: int,
    *,
    block_size: int | None = None,
    device: str | torch.device | None = None,
    ids: Tensor | None = None,
    progress: bool = False,
) -> tuple[Tensor, Tensor]:
    """Exact k nearest neighbors of every row among all rows, by cosine similarity.

    Args:
        rows: (N, d) float (any float dtype).
        k: neighbors per row, the row itself first (k >= 1).
        block_size: query and key block rows (None: ``resolve_block_rows``); work memory is
            O(block_size**2) scores plus the running lists, never O(N**2).
        device: where to search; None picks CUDA when available. The search scores in fp16
            and re-scores in fp32 (same result as fp32) where ``resolve_low_precision`` says
            so (CUDA), else in fp32, each pair of row blocks once (``symmetric_search``).
        ids: (N,) int64 global ids of the rows (default 0..N-1); returned ids are these.
        progress: show a tqdm bar (fp32 search only).

    Returns:
        (ids (N, k) int64, scores (N, k) float32) on CPU, scores descending after the row
        itself; if N < k the lists are padded with -1 / -inf.
    """
    if ids is None:
        ids = torch.arange(rows.shape[0], dtype=torch.int64)
    check_rows(ids, rows)
    dev = resolve_device(device)
    block_size = resolve_block_rows(block_size, dev)
    if not resolve_low_precision(dev):
        return concat_results(symmetric_search(ids, rows, k, block_size, dev, progress), k)
    # All rows go in as one key block: it is normalized (and moved to the device) once, then
    # scored block_size columns at a time.
    results = search_pass(
        list(split_blocks(ids, rows, block_size)),
        [(ids, rows)],
        k,
        device=dev,
        low_precision=True,
        key_block_rows=block_size,
    )
    return concat_results(results, k)


def concat_results(results: Sequence[tuple[Tensor, Tensor]], k: int) -> tuple[Tensor, Tensor]:
    """Stack per-block (ids (q, k), scores (q, k)) results into (n, k), (n, k)."""
    if not results:
        return torch.empty(0, k, dtype=torch.int64), torch.empty(0, k)
    return torch.cat([r[0] for r in results]), torch.cat([r[1] for r in results])

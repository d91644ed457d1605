# ruff: noqa: ANN001  (Triton kernel arguments are typed by the launcher, not by hints)
"""Fused score-and-filter for the exact search on CUDA (Triton).

Once every running list of a query block is full, a key block can only contribute the keys
that reach a query's threshold: a handful per row. The unfused path writes the whole (q, b)
fp16 score block to memory, reads it back to compare, and syncs on ``nonzero`` and the id
match; on a GPU those passes cost several times the matmul. Here one kernel computes each
(BLOCK_Q, BLOCK_K) tile of scores in registers (fp16 inputs, fp32 accumulation, the precision
the module's error bound assumes), compares it with the per-query thresholds, skips the
query's own id, and appends only the passing (query row, key column) pairs to a candidate
buffer. The score block never exists in memory.

Available when Triton and a CUDA device are (``available(device)``); everything else uses the
unfused path, which gives the same lists.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the unfused path serves
    triton = None

BLOCK_Q = 128
BLOCK_K = 64
NUM_WARPS = 8
NUM_STAGES = 3
# Programs per launch to aim for: a few waves over an H100's 132 SMs.
_PROGRAMS = 2048


def available(device: torch.device) -> bool:
    """Whether the fused filter runs on ``device``: CUDA, with Triton installed."""
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _score_filter_kernel(
        query_ptr, key_ptr, query_id_ptr, key_id_ptr, threshold_ptr,
        out_rows_ptr, out_cols_ptr, counter_ptr,
        q, b, d, keys_per_program, capacity, stride_query, stride_key,
        BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # One program: a tile of queries, held in registers, against a range of keys, tile by
        # tile (the flash-attention layout: each query tile is loaded once).
        rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        row_in = rows < q
        dims = tl.arange(0, BLOCK_D)
        dim_in = dims < d
        queries = tl.load(query_ptr + rows[:, None] * stride_query + dims[None, :],
                          mask=row_in[:, None] & dim_in[None, :], other=0.0)
        threshold = tl.load(threshold_ptr + rows, mask=row_in, other=float("inf"))
        query_ids = tl.load(query_id_ptr + rows, mask=row_in, other=-1)
        key_start = tl.program_id(1) * keys_per_program
        key_stop = tl.minimum(key_start + keys_per_program, b)
        for tile in range(key_start, key_stop, BLOCK_K):
            cols = tile + tl.arange(0, BLOCK_K)
            col_in = cols < key_stop
            keys = tl.load(key_ptr + cols[:, None] * stride_key + dims[None, :],
                           mask=col_in[:, None] & dim_in[None, :], other=0.0)
            scores = tl.dot(queries, tl.trans(keys))
            keep = (scores >= threshold[:, None]) & col_in[None, :]
            if tl.max(tl.max(keep.to(tl.int32), axis=1), axis=0) > 0:  # rare after the start
                key_ids = tl.load(key_id_ptr + cols, mask=col_in, other=-1)
                keep = keep & (query_ids[:, None] != key_ids[None, :])
                zeros = tl.zeros((BLOCK_Q, BLOCK_K), dtype=tl.int32)
                # Few pairs pass a tile once the lists are full; per-pair slots cost less than
                # a prefix sum over the tile (measured: benchmarks/bench_graph.py).
                slot = tl.atomic_add(counter_ptr + zeros, 1, mask=keep)
                store = keep & (slot < capacity)
                tl.store(out_rows_ptr + slot, rows[:, None] + zeros, mask=store)
                tl.store(out_cols_ptr + slot, cols[None, :] + zeros, mask=store)


class FusedFilter:
    """Candidate buffers for :func:`FusedFilter.candidates`, grow-only and reused.

    ``capacity`` bounds the candidates one call may return; a call with more returns ``None``
    and the caller takes the unfused path for that block.
    """

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.device = device
        self._rows = torch.empty(capacity, dtype=torch.int32, device=device)
        self._cols = torch.empty(capacity, dtype=torch.int32, device=device)
        self._counter = torch.zeros(1, dtype=torch.int32, device=device)

    def candidates(
        self, queries: Tensor, keys: Tensor, query_ids: Tensor, key_ids: Tensor, threshold: Tensor
    ) -> tuple[Tensor, Tensor] | None:
        """(rows (c,), cols (c,)) int64 of the pairs with ``queries[r] . keys[c] >= threshold[r]``
        and ``query_ids[r] != key_ids[c]``, in no particular order; ``None`` if more than
        ``capacity`` pass.

        queries (q, d) and keys (b, d): float16, rows contiguous; query_ids (q,), key_ids (b,)
        int64; threshold (q,) float32. Scores are fp32 sums of the fp16 products.
        """
        q, d = queries.shape
        b = keys.shape[0]
        if q == 0 or b == 0:
            empty = torch.empty(0, dtype=torch.int64, device=queries.device)
            return empty, empty
        self._counter.zero_()
        query_tiles = triton.cdiv(q, BLOCK_Q)
        # Enough key ranges for every SM to hold a few programs, each range whole tiles.
        ranges = max(1, min(triton.cdiv(b, BLOCK_K), _PROGRAMS // query_tiles))
        keys_per_program = triton.cdiv(triton.cdiv(b, ranges), BLOCK_K) * BLOCK_K
        grid = (query_tiles, triton.cdiv(b, keys_per_program))
        _score_filter_kernel[grid](
            queries, keys, query_ids, key_ids, threshold,
            self._rows, self._cols, self._counter,
            q, b, d, keys_per_program, self.capacity, queries.stride(0), keys.stride(0),
            BLOCK_Q=BLOCK_Q, BLOCK_K=BLOCK_K, BLOCK_D=max(16, triton.next_power_of_2(d)),
            num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )
        n = int(self._counter)
        if n > self.capacity:
            return None
        return self._rows[:n].long(), self._cols[:n].long()

"""The streaming core of the exact k-nearest-neighbor search (``ams.graph.knn``):
:class:`TopKAccumulator`, a block of query rows
with a running top-k that consumes key blocks from any source (local memory, a shard Scan
stream, the ring over all shards). Scores are inner products of L2-normalized rows (cosine
similarity), so "nearest" means "largest score".

How a key block is consumed (see ``TopKAccumulator.update``):

* The query x key score block is one matmul into a reused buffer (memory ``q * b``, never N).
* Until a query's running list is full, the block's top candidates are taken densely (topk).
* Once it is full, only keys scoring at least ``threshold - margin`` can still enter, where
  ``threshold`` is the query's current k-th best exact score. After the first few blocks that
  is a handful of keys per row, so a filter replaces the full-width topk per block (which on
  CPU costs about twice the matmul): the max of each group of 8 columns is compared to the
  threshold and only passing groups are opened. Passing keys are queued and merged into the
  running lists in batches (one padded topk per ~q*k candidates, not per block).
* On CUDA with Triton, once every list of a query block is full the score block is not written
  at all: ``ams.graph.fused_filter`` scores tiles in registers and emits only the passing keys.
* Low precision (fp16, TensorCore on CUDA): the score block is computed in fp16, candidates are
  re-scored exactly in fp32 before they enter the running list. The margin ``2**-8`` bounds the
  fp16 score error of unit rows (inputs rounded to 11-bit mantissa: |err| <= 2 * 2**-11 * sum|q_j
  k_j| <= 2**-10, output rounding <= 2**-11), so every key whose fp32 score reaches the
  threshold passes the filter: the low-precision pass loses no neighbor and the result equals
  the fp32 search. This replaces the KNN softmax paper's heuristic "recall k' > k, re-rank,
  hope" with a bound, so there is no recall_k knob: the recall is exact by construction.

Each query's own row is forced first in its list (even against exact duplicates) with its true
score; keys with the query's id are skipped in the stream. Lists shorter than k (fewer than k
distinct rows streamed) are padded with id -1 and score -inf. Ids are int64 end to end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ams.graph import fused_filter

LOW_PRECISION_DTYPE = torch.float16
# Bound on |fp16 score - fp32 score| for unit-norm rows, with room to spare; see module docstring.
LOW_PRECISION_MARGIN = 2.0**-8
# Candidates re-scored in fp32 at a time: bounds the gathered (c, d) row copies.
_RESCORE_CHUNK = 1 << 16
# Columns per group in the threshold filter (see _entries_at_least).
_GROUP = 8


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to search on: ``device`` if given, else CUDA when available, else CPU.
    Raises ValueError for a string that names no device, a CUDA device on a host without
    CUDA, or one past its device count, before any rows move."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except RuntimeError:  # torch lists every device type it knows
        raise ValueError(f"{device!r}: not a device (cpu, cuda or cuda:N)") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{device}: no CUDA device is available")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"{device}: this host has {torch.cuda.device_count()} CUDA "
                             "device(s)")
        if resolved.index is None:
            # Tensors report cuda:N; a bare "cuda" would never compare equal to their device,
            # and the reused work buffers would be re-allocated (and lose the queue) each call.
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


# Rows per query block and per key block on each device (resolve_block_rows says why these
# sizes); read at each call, so a test can make them small to run the many-block paths.
CPU_BLOCK_ROWS = 4096
CUDA_BLOCK_ROWS = 32768
# Device types whose searches score in fp16 and re-score candidates in fp32 (the same lists as
# fp32): CUDA has fast TensorCore fp16 matmul; on CPU fp16/bf16 matmul is far slower than fp32.
LOW_PRECISION_DEVICE_TYPES = frozenset({"cuda"})


def resolve_block_rows(block_rows: int | None, device: torch.device) -> int:
    """Rows per query or key block; ``None`` picks the device's default (``CPU_BLOCK_ROWS``,
    ``CUDA_BLOCK_ROWS``). On CPU 4096 keeps a score block near the caches. On CUDA every block
    pair costs a few kernel launches and host syncs, so the blocks must be large for the
    matmul to dominate: a 32768 x 32768 fp16 score block (2 GiB) scores about ten times faster
    per pair than 4096 rows do."""
    if block_rows is None:
        return CUDA_BLOCK_ROWS if device.type == "cuda" else CPU_BLOCK_ROWS
    if block_rows < 1:
        raise ValueError(f"block rows must be >= 1, got {block_rows}")
    return block_rows


def resolve_low_precision(device: torch.device) -> bool:
    """Whether a search on ``device`` scores in fp16 (``LOW_PRECISION_DEVICE_TYPES``): on CUDA
    (fast TensorCore matmul), not elsewhere."""
    return device.type in LOW_PRECISION_DEVICE_TYPES


def normalize_rows(rows: Tensor, device: torch.device) -> Tensor:
    """(n, d) any float dtype -> (n, d) float32 L2-normalized rows on ``device``."""
    return F.normalize(rows.to(device=device, dtype=torch.float32), dim=1)


class ScoreBuffer:
    """Work memory shared by the accumulators of one pass, which run one at a time: the score
    block and the queue of filtered candidates. Both are grow-only and reused, so the matmul
    writes into memory that is already mapped (a fresh buffer per block costs more than
    the matmul), and a long build does not interleave short-lived and kept allocations, which
    fragment glibc's heap to several times the live memory."""

    def __init__(self) -> None:
        self._flat: Tensor | None = None
        self._queue: tuple[Tensor, Tensor, Tensor] | None = None
        self._fused: fused_filter.FusedFilter | None = None

    def get(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A contiguous (rows, cols) view of the score buffer; contents undefined."""
        numel = rows * cols
        flat = self._flat
        if flat is None or flat.dtype != dtype or flat.device != device or flat.numel() < numel:
            flat = torch.empty(numel, dtype=dtype, device=device)
            self._flat = flat
        return flat[:numel].view(rows, cols)

    def queue(self, capacity: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        """Candidate queue of at least ``capacity`` entries: (query rows int64, key ids int64,
        exact scores float32), each (>= capacity,); contents undefined."""
        queue = self._queue
        if queue is None or queue[0].device != device or queue[0].numel() < capacity:
            queue = (torch.empty(capacity, dtype=torch.int64, device=device),
                     torch.empty(capacity, dtype=torch.int64, device=device),
                     torch.empty(capacity, device=device))
            self._queue = queue
        return queue

    def fused(self, capacity: int, device: torch.device) -> fused_filter.FusedFilter:
        """The fused filter's candidate buffers, for at least ``capacity`` candidates."""
        fused = self._fused
        if fused is None or fused.device != device or fused.capacity < capacity:
            fused = fused_filter.FusedFilter(capacity, device)
            self._fused = fused
        return fused


class KeyBlock:
    """A block of key rows prepared for scoring: global ids (b,) int64, fp32 unit rows (b, d),
    and their fp16 copy (b, d) when searching in low precision (else None)."""

    def __init__(self, ids: Tensor, rows: Tensor, low: Tensor | None) -> None:
        self.ids = ids
        self.rows = rows
        self.low = low

    @classmethod
    def prepare(
        cls, ids: Tensor, rows: Tensor, device: torch.device, low_precision: bool
    ) -> KeyBlock:
        """Cast rows (b, d) of any float dtype (shards may store fp16/bf16) to fp32 on
        ``device``, normalize, and make the fp16 copy if ``low_precision``."""
        check_rows(ids, rows)
        unit = normalize_rows(rows, device)
        low = unit.to(LOW_PRECISION_DTYPE) if low_precision else None
        return cls(ids.to(device), unit, low)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def slice(self, start: int, stop: int) -> KeyBlock:
        """Rows ``start:stop`` (views, no copy)."""
        low = None if self.low is None else self.low[start:stop]
        return KeyBlock(self.ids[start:stop], self.rows[start:stop], low)


class TopKAccumulator:
    """A block of query rows and their running top-k over every key block passed to ``update``.

    Args:
        query_ids: (q,) int64 global ids of the query rows.
        query_rows: (q, d) float rows (any float dtype; normalized here).
        k: list length, the query itself included (k >= 1).
        device: where to search; None picks CUDA when available.
        low_precision: fp16 scoring + exact fp32 re-score (``resolve_low_precision``).
        key_block_rows: key blocks are scored at most this many rows at a time, which bounds
            the score block to (q, key_block_rows) whatever size the source delivers.
        score_buffer: scratch shared with other accumulators of the same pass.

    Memory: the query rows (fp32, plus fp16 when low precision), the running list (q, k-1),
    and one (q, key_block_rows) score block.
    """

    def __init__(
        self,
        query_ids: Tensor,
        query_rows: Tensor,
        k: int,
        *,
        device: str | torch.device | None = None,
        low_precision: bool,
        key_block_rows: int,
        score_buffer: ScoreBuffer | None = None,
    ) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if key_block_rows < 1:
            raise ValueError(f"key_block_rows must be >= 1, got {key_block_rows}")
        self.device = resolve_device(device)
        self.low_precision = low_precision
        self.k = k
        self.key_block_rows = key_block_rows
        queries = KeyBlock.prepare(query_ids, query_rows, self.device, self.low_precision)
        self._query_ids = queries.ids
        self._query_rows = queries.rows
        self._query_low = queries.low
        self._buffer = score_buffer if score_buffer is not None else ScoreBuffer()
        q = self._query_ids.shape[0]
        # The running list holds the k-1 best keys other than the query itself; its minimum
        # per row is the filter threshold (-inf while the list is not full).
        self._ids = torch.full((q, k - 1), -1, dtype=torch.int64, device=self.device)
        self._scores = torch.full((q, k - 1), -torch.inf, device=self.device)
        self._threshold = torch.full((q, 1), -torch.inf, device=self.device)
        self._full = False
        # Filtered candidates (rows, ids, exact scores) wait in the shared queue and are
        # merged in batches of up to q*(k-1): one merge per key chunk would cost more than the
        # filtering. The threshold they were filtered with is stale but still a lower bound of
        # the final k-th score, so no key that belongs in the result is lost. The queue is
        # empty whenever update_block returns, so the accumulators of a pass can share it.
        self._queued = 0

    @property
    def query_ids(self) -> Tensor:
        """(q,) int64 global ids of the query rows, on the search device."""
        return self._query_ids

    @property
    def query_rows(self) -> Tensor:
        """(q, d) float32 L2-normalized query rows, on the search device."""
        return self._query_rows

    def update(self, key_ids: Tensor, key_rows: Tensor) -> None:
        """Consume a key block: ids (b,) int64 global, rows (b, d) any float dtype."""
        self.update_block(KeyBlock.prepare(key_ids, key_rows, self.device, self.low_precision))

    def update_block(self, keys: KeyBlock) -> None:
        """Consume an already prepared key block (lets one pass prepare each block once for
        all of its accumulators)."""
        if self.k == 1:
            return
        for start in range(0, len(keys), self.key_block_rows):
            self._update_chunk(keys.slice(start, start + self.key_block_rows))
        self._merge_queue()

    def result(self) -> tuple[Tensor, Tensor]:
        """(ids (q, k) int64, scores (q, k) float32): the query itself first with its true
        score, then the neighbors by descending exact fp32 score; -1 / -inf padding."""
        self_scores = (self._query_rows * self._query_rows).sum(dim=1, keepdim=True)
        scores, order = self._scores.sort(dim=1, descending=True)
        ids = self._ids.gather(1, order)
        return (
            torch.cat([self._query_ids[:, None], ids], dim=1),
            torch.cat([self_scores, scores], dim=1),
        )

    def _update_chunk(self, keys: KeyBlock) -> None:
        q, b = self._query_ids.shape[0], len(keys)
        if q == 0 or b == 0:
            return
        low = self.low_precision
        if low and self._full and fused_filter.available(self.device):
            fused = self._buffer.fused(self._ids.numel(), self.device)
            found = fused.candidates(self._query_low, keys.low, self._query_ids, keys.ids,
                                     (self._threshold - LOW_PRECISION_MARGIN).view(-1))
            if found is not None:  # else more passed than a queue holds: score unfused
                rows, cols = found
                if rows.numel():
                    self._queue_candidates(rows, keys.ids[cols],
                                           self._exact_scores(rows, keys.rows, cols))
                return
        query_mat = self._query_low if low else self._query_rows
        key_mat = keys.low if low else keys.rows
        scores = self._buffer.get(q, b, query_mat.dtype, self.device)
        if low and self.device.type == "cuda":
            # The error bound above assumes fp32 accumulation; cuBLAS may otherwise reduce
            # fp16 products in fp16 (torch's default allows it), whose error grows with d.
            allowed = torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
            try:
                torch.mm(query_mat, key_mat.T, out=scores)
            finally:
                torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = allowed
        else:
            torch.mm(query_mat, key_mat.T, out=scores)
        self_rows, self_cols = _matching_positions(self._query_ids, keys.ids)
        if self_rows.numel():
            scores[self_rows, self_cols] = -torch.inf
        self._consume(scores, keys)

    def update_scores(self, scores: Tensor, keys: KeyBlock) -> None:
        """Consume fp32 scores (q, b) of these queries against ``keys`` computed elsewhere:
        the symmetric search scores a block pair once and feeds it to both blocks, the second
        one as a transposed view. ``scores`` is only read; it must not pair a query with
        itself. Not for low-precision accumulators (their scores need the re-score)."""
        if self.low_precision:
            raise ValueError("update_scores takes exact fp32 scores; this accumulator scores "
                             "in low precision")
        if self.k > 1 and scores.numel():
            self._consume(scores, keys)
            self._merge_queue()

    def _consume(self, scores: Tensor, keys: KeyBlock) -> None:
        """Take what can enter the lists from a score block (self pairs already masked)."""
        low = self.low_precision
        if not self._full:
            taken = self._merge_dense(scores, keys)
            if not low:
                return  # the block's exact top-(k-1) went in; nothing else of it can enter
            # The fp16 top-(k-1) may rank a key below one whose fp32 score is higher: check
            # the rest of the block against the thresholds now known. A row still short has
            # taken every valid key of the block, so it needs nothing more.
            scores.scatter_(1, taken, -torch.inf)
        self._filter(scores, keys)

    def _filter(self, scores: Tensor, keys: KeyBlock) -> None:
        """Queue the keys scoring at least the threshold (less the low-precision margin):
        after the first blocks a few per row, so no full-width topk is needed."""
        low = self.low_precision
        threshold = self._threshold.masked_fill(torch.isneginf(self._threshold), torch.inf)
        if low:
            threshold = threshold - LOW_PRECISION_MARGIN
        rows, cols, values = _entries_at_least(scores, threshold)
        if rows.numel() == 0:
            return
        exact = self._exact_scores(rows, keys.rows, cols) if low else values
        self._queue_candidates(rows, keys.ids[cols], exact)

    def _queue_candidates(self, rows: Tensor, cand_ids: Tensor, exact: Tensor) -> None:
        """Queue (query row, key id, exact score) candidates, each (c,), for the next merge."""
        n, capacity = rows.numel(), self._ids.numel()
        if self._queued + n > capacity:
            self._merge_queue()
        if n > capacity:  # more than a queue's worth at once (early blocks): merge directly
            self._merge_candidates(rows, cand_ids, exact)
            return
        queue_rows, queue_ids, queue_scores = self._buffer.queue(capacity, self.device)
        end = self._queued + n
        queue_rows[self._queued:end] = rows
        queue_ids[self._queued:end] = cand_ids
        queue_scores[self._queued:end] = exact
        self._queued = end

    def _merge_dense(self, scores: Tensor, keys: KeyBlock) -> Tensor:
        """Merge the block's best min(k-1, b) keys per query (used while lists are not full);
        returns their columns (q, min(k-1, b))."""
        width = min(self.k - 1, scores.shape[1])
        block_scores, cols = scores.topk(width, dim=1)
        valid = ~torch.isneginf(block_scores)  # the query's own column, masked above
        if self.low_precision:
            rows = torch.arange(cols.shape[0], device=self.device)[:, None].expand_as(cols)
            exact = self._exact_scores(rows.reshape(-1), keys.rows, cols.reshape(-1))
            block_scores = exact.view_as(cols)
        block_scores = block_scores.float().masked_fill(~valid, -torch.inf)
        block_ids = keys.ids[cols].masked_fill(~valid, -1)
        self._set_lists(*merge_top_lists(self._ids, self._scores, block_ids, block_scores))
        return cols

    def _merge_queue(self) -> None:
        """Merge the queued candidates and empty the queue."""
        if not self._queued:
            return
        n, self._queued = self._queued, 0
        queue_rows, queue_ids, queue_scores = self._buffer.queue(n, self.device)
        self._merge_candidates(queue_rows[:n], queue_ids[:n], queue_scores[:n])

    def _merge_candidates(self, rows: Tensor, cand_ids: Tensor, cand_scores: Tensor) -> None:
        """Merge (query row, key id, exact score) candidates, each (c,): pad them per row, then
        one topk."""
        q = self._ids.shape[0]
        counts = torch.bincount(rows, minlength=q)
        width = int(counts.max())
        order = rows.argsort(stable=True)
        rows, cand_ids, cand_scores = rows[order], cand_ids[order], cand_scores[order]
        slot = torch.arange(rows.numel(), device=self.device) - (counts.cumsum(0) - counts)[rows]
        pad_ids = torch.full((q, width), -1, dtype=torch.int64, device=self.device)
        pad_scores = torch.full((q, width), -torch.inf, device=self.device)
        pad_ids[rows, slot] = cand_ids
        pad_scores[rows, slot] = cand_scores.float()
        self._set_lists(*merge_top_lists(self._ids, self._scores, pad_ids, pad_scores))

    def _set_lists(self, ids: Tensor, scores: Tensor) -> None:
        self._ids, self._scores = ids, scores
        self._threshold = scores.amin(dim=1, keepdim=True)
        self._full = not bool(torch.isneginf(self._threshold).any())

    def _exact_scores(self, rows: Tensor, key_rows: Tensor, cols: Tensor) -> Tensor:
        """fp32 scores of (query rows[i], key cols[i]) pairs, (c,) float32."""
        out = torch.empty(rows.numel(), device=self.device)
        for start in range(0, rows.numel(), _RESCORE_CHUNK):
            r = rows[start : start + _RESCORE_CHUNK]
            c = cols[start : start + _RESCORE_CHUNK]
            out[start : start + r.numel()] = (self._query_rows[r] * key_rows[c]).sum(dim=1)
        return out


def merge_top_lists(
    ids: Tensor, scores: Tensor, new_ids: Tensor, new_scores: Tensor
) -> tuple[Tensor, Tensor]:
    """Top-(width of ``ids``) of two lists side by side, by score: ids (r, w) int64 and
    scores (r, w) float32 with new_ids / new_scores (r, *) -> (ids, scores), each (r, w),
    best first."""
    all_scores = torch.cat([scores, new_scores], dim=1)
    best, pos = all_scores.topk(scores.shape[1], dim=1)
    best_ids = torch.cat([ids, new_ids], dim=1).gather(1, pos)
    return best_ids, best


def _entries_at_least(scores: Tensor, threshold: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(rows, cols, values) of the entries of scores (q, b) >= threshold (q, 1).

    A compare + nonzero over all q*b entries costs about half the matmul on CPU. Instead the
    max of each group of _GROUP columns is compared (one cheap pass, nonzero over b/_GROUP
    columns), and only groups whose max passes are opened. ``scores`` may also be the
    transpose of a contiguous block (the symmetric search); then rows are grouped instead.
    """
    q, b = scores.shape
    if not scores.is_contiguous() and scores.T.is_contiguous() and q % _GROUP == 0:
        return _entries_at_least_transposed(scores.T, threshold)
    if b % _GROUP or not scores.is_contiguous():
        rows, cols = torch.nonzero(scores >= threshold, as_tuple=True)
        return rows, cols, scores[rows, cols]
    width = b // _GROUP
    # Group j holds columns j, j + width, j + 2*width, ...: the max is an elementwise max of
    # contiguous slabs, which vectorizes well.
    group_max = scores.view(q, _GROUP, width).amax(dim=1)
    rows, groups = torch.nonzero(group_max >= threshold, as_tuple=True)
    if rows.numel() == 0:
        return rows, groups, scores.new_empty(0)
    # Flat (1-d) indexing: much cheaper than 2-d advanced indexing.
    offsets = torch.arange(0, b, width, device=scores.device)
    flat = (rows * b + groups)[:, None] + offsets  # (opened groups, _GROUP)
    values = scores.view(-1)[flat]
    keep = values >= threshold.view(-1)[rows][:, None]
    flat, values = flat[keep], values[keep]
    return flat // b, flat % b, values


def _entries_at_least_transposed(
    keys_by_queries: Tensor, threshold: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """``_entries_at_least`` of ``keys_by_queries.T`` for a contiguous (b, q) block, without
    copying it: the max over groups of _GROUP key rows is compared to each query's threshold."""
    b, q = keys_by_queries.shape
    width = b // _GROUP
    group_max = keys_by_queries.view(_GROUP, width, q).amax(dim=0)  # (width, q)
    groups, rows = torch.nonzero(group_max >= threshold.view(1, q), as_tuple=True)
    if rows.numel() == 0:
        return rows, groups, keys_by_queries.new_empty(0)
    offsets = torch.arange(0, b, width, device=keys_by_queries.device) * q
    flat = (groups * q + rows)[:, None] + offsets  # (opened groups, _GROUP)
    values = keys_by_queries.view(-1)[flat]
    keep = values >= threshold.view(-1)[rows][:, None]
    flat, values = flat[keep], values[keep]
    return flat % q, flat // q, values


def _matching_positions(query_ids: Tensor, key_ids: Tensor) -> tuple[Tensor, Tensor]:
    """(query positions, key positions) of the pairs with equal ids; ids unique per side."""
    if int(query_ids.max()) < int(key_ids.min()) or int(query_ids.min()) > int(key_ids.max()):
        empty = torch.empty(0, dtype=torch.int64, device=query_ids.device)
        return empty, empty  # disjoint id ranges: the common case of blocks from elsewhere
    sorted_keys, order = key_ids.sort()
    pos = torch.searchsorted(sorted_keys, query_ids).clamp_max(key_ids.numel() - 1)
    hit = sorted_keys[pos] == query_ids
    return hit.nonzero(as_tuple=True)[0], order[pos[hit]]


def check_rows(ids: Tensor, rows: Tensor) -> None:
    """ids int64 (n,) and rows (n, d) of a float dtype, else TypeError or ValueError."""
    if ids.dtype != torch.int64:
        raise TypeError(f"ids must be int64, got {ids.dtype}")
    if rows.dim() != 2 or ids.shape != (rows.shape[0],):
        raise ValueError(f"ids {tuple(ids.shape)} do not match rows {tuple(rows.shape)}")
    if not rows.is_floating_point():
        raise TypeError(f"rows must be floating point, got {rows.dtype}")

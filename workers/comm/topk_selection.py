"""Exact top-k of a large 1-D tensor, fast enough to run on every layer's gradient each step.

``torch.topk`` over tens of millions of entries is a full selection; for gradient
sparsification k is a small fraction of n (0.1 % to 1 %), so almost every entry can be ruled
out by one comparison. Both methods here first find a threshold t that at least k entries
reach but few more do, then collect the entries >= t in one memory-bound pass, then select
exactly among those few:

* ``"sample"``: t is read off a strided sample at a rank a few standard deviations above
  k's expected share, so that with near certainty at least k entries reach it; when fewer do
  (an unlucky or adversarial input) the rank is raised and the collection repeated, ending at
  the full tensor, so the result is always exact.
* ``"chunks"`` (divide and conquer, as in the KNN-softmax paper): the tensor is cut into
  chunks and the top-k' of every chunk is taken in one batched ``topk``, with k' about twice
  each chunk's share of k. The k-th largest of those chunk winners is reached by at least k
  entries (the winners above it), so it is a valid threshold and no retry is ever needed; it
  sits at the exact k-th value when k' >= k.

Ties at the k-th value go to the lowest indices, so the result does not depend on the method,
the device or the thread count. NaN is refused: it has no place in a magnitude ranking.
"""

from __future__ import annotations

import math
from enum import StrEnum

import torch
from torch import Tensor

# Entries whose maximum one comparison stands for when collecting the entries above t: the
# slab-wise max is one vectorized pass, and the nonzero that follows runs over n / _GROUP.
_GROUP = 16
# Below this many entries (or where k is a large share of n) the selection is torch's own
# sort: the sampled and chunked paths only pay off where most entries can be ruled out.
_SMALL = 1 << 16
# Sample size of the "sample" method; its top-r costs next to nothing against one pass.
_SAMPLE = 1 << 16
# Chunks of the "chunks" method: enough for the batched topk to use every core, few enough
# that chunks * k candidates stay far below n at the densities sparsification uses.
_CHUNKS = 64


class TopkMethod(StrEnum):
    """How the threshold of ``topk`` is found."""

    SAMPLE = "sample"  # estimated from a strided sample; retried lower when too few reach it
    CHUNKS = "chunks"  # the k-th largest of the chunks' own top-k'; never retried


def topk(x: Tensor, k: int, method: TopkMethod | str = TopkMethod.SAMPLE) -> tuple[Tensor, Tensor]:
    """The k largest entries of ``x`` and their positions: the same set ``torch.topk`` picks.

    Args:
        x: (n,) floating tensor (float32, float16, bfloat16 or float64), CPU or CUDA.
        k: 0 <= k <= n.
        method: ``TopkMethod`` (see the module docstring); both give the same result.

    Returns:
        values (k,) of x's dtype, descending; indices (k,) int64 into x. Equal values are
        ordered by index, and at the k-th value the lowest indices are taken.

    Raises:
        ValueError: x is not 1-D or not floating, k is out of range, x holds NaN, or the
            method is unknown.
    """
    if x.dim() != 1:
        raise ValueError(f"topk takes a 1-D tensor, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"topk takes a floating tensor, got {x.dtype}")
    n = x.numel()
    if not 0 <= k <= n:
        raise ValueError(f"k={k} must be in [0, {n}]")
    try:
        method = TopkMethod(method)
    except ValueError:
        raise ValueError(f"method={method!r} is not one of "
                         f"{', '.join(repr(str(m)) for m in TopkMethod)}") from None
    if k == 0:
        return x.new_empty(0), torch.empty(0, dtype=torch.int64, device=x.device)
    if n <= _SMALL or k * 64 > n:
        threshold = x.topk(k).values[-1]  # most entries pass: no shortcut to the threshold
    elif method is TopkMethod.CHUNKS:
        threshold = _chunked_threshold(x, k)
    else:
        return _sampled(x, k)
    return _select(*_at_least(x, threshold), k)


def _sampled(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
    n = x.numel()
    stride = max(1, n // _SAMPLE)
    sample = x[::stride]
    s = sample.numel()
    # Entries of the sample expected above the true k-th value, then 4 standard deviations
    # (binomial) more: fewer than k entries reach the threshold about once in 30,000 calls.
    expected = k * s / n
    rank = min(s, math.ceil(expected + 4 * math.sqrt(expected) + 4))
    while True:
        threshold = sample.topk(rank).values[-1]
        if torch.isnan(threshold):
            raise _nan_error()
        values, indices = _at_least(x, threshold)
        if values.numel() >= k:
            return _select(values, indices, k)
        if rank == s:  # even the sample's minimum is above the k-th value
            return _select(*_at_least(x, x.topk(k).values[-1]), k)
        rank = min(s, rank * 4)


def _chunked_threshold(x: Tensor, k: int) -> Tensor:
    """A value (0-d) that at least k entries of x reach, at or just below x's k-th largest:
    the k-th largest of the chunks' top-k' (k' * chunks >= k)."""
    n = x.numel()
    width = n // _CHUNKS
    main = x[: width * _CHUNKS].view(_CHUNKS, width)
    per_chunk = min(width, 2 * math.ceil(k / _CHUNKS))
    candidates = main.topk(per_chunk, dim=1).values.reshape(-1)  # NaN sorts first
    tail = x[width * _CHUNKS :]
    candidates = torch.cat([candidates, tail])
    if torch.isnan(candidates).any():
        raise _nan_error()
    return candidates.topk(k).values[-1]


def _at_least(x: Tensor, threshold: Tensor) -> tuple[Tensor, Tensor]:
    """(values, indices) of the entries of x that are >= threshold, in no set order; raises
    on NaN among the entries it opens (every NaN is opened: a group's max is NaN)."""
    n = x.numel()
    width = n // _GROUP
    main = x[: width * _GROUP].view(_GROUP, width)
    # Group j is the column j, j + width, ...: its max is an elementwise max of contiguous
    # slabs. "not below" instead of ">=" opens the groups whose max is NaN.
    group_max = main.amax(dim=0)
    cols = torch.nonzero(~(group_max < threshold)).view(-1)
    offsets = torch.arange(_GROUP, device=x.device) * width
    flat = (cols[:, None] + offsets).view(-1)
    tail = torch.arange(_GROUP * width, n, device=x.device)
    flat = torch.cat([flat, tail])
    values = x[flat]
    if torch.isnan(values).any():
        raise _nan_error()
    keep = values >= threshold
    return values[keep], flat[keep]


def _select(values: Tensor, indices: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest of the candidates (values (m,), their indices (m,), m >= k), equal
    values by ascending index, taking the lowest indices at the k-th value."""
    by_index = indices.argsort()
    values, indices = values[by_index], indices[by_index]
    # A stable descending sort keeps equal values in index order.
    order = values.sort(descending=True, stable=True).indices[:k]
    return values[order], indices[order]


def _nan_error() -> ValueError:
    return ValueError("topk: the tensor holds NaN; a gradient with NaN cannot be ranked "
                      "(check the loss scale or the learning rate)")

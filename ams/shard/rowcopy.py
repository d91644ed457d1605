"""Whole-row gathers and scatters done by numpy, single-threaded.

Moving rows is a memory-bound copy that one core does at memory speed. torch runs the same
ops as intra-op parallel kernels, and when the cores are busy (a trainer computing while its
prefetch thread pulls, shard handler threads, client and shard on one box) each parallel
region waits for a time slice, and a copy that numpy does in well under a millisecond takes
torch many times longer (benchmarks/RESULTS.md).
Rows are viewed as bytes, so every row dtype (bfloat16 included, which numpy lacks) works.
The range check of an index (``bounds``) is numpy's too.
"""

from __future__ import annotations

import numpy as np
import torch


def _as_array(rows: torch.Tensor) -> np.ndarray:
    """A contiguous tensor as a numpy array over the same memory, bfloat16 (which numpy lacks)
    as int16: the same bytes, and rows move as bytes here."""
    rows = rows.contiguous()
    if rows.dtype == torch.bfloat16:
        rows = rows.view(torch.int16)
    return rows.numpy()


def _as_bytes(rows: torch.Tensor) -> np.ndarray:
    """(n, dim) contiguous tensor -> (n, dim * itemsize) uint8 array over the same memory."""
    return _as_array(rows).view(np.uint8)


def _as_records(rows: torch.Tensor) -> np.ndarray:
    """(n, dim) contiguous tensor -> (n,) array of one opaque record per row, same memory:
    numpy moves a record with one memcpy, where a uint8 row is a loop over its bytes."""
    raw = _as_bytes(rows)
    return raw.view(np.dtype((np.void, raw.shape[1]))).reshape(-1)


def bounds(index: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty int64 (m,) CPU tensor. numpy's reductions, two passes over
    the index: torch's one-pass aminmax costs several times as much per call, and requests of
    a few rows are most of a shard's calls."""
    values = index.numpy()
    if values.size <= 16:  # Python's min and max of a few ints cost less than two reductions
        few = values.tolist()
        return min(few), max(few)
    return int(values.min()), int(values.max())


def gather(rows: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """``rows[index]``: rows (n, dim); index: int64 (m,) in [0, n) -> (m, dim), a new tensor,
    or ``out`` (contiguous (m, dim) of ``rows``' dtype) written in place and returned."""
    if out is not None and (not out.is_contiguous() or out.dtype != rows.dtype):
        raise ValueError(f"rowcopy.gather needs a contiguous destination of {rows.dtype}")
    if index.numel() == 0:  # numpy gives empty results zero strides, which torch cannot view
        return out if out is not None else rows.new_empty((0, rows.shape[1]))
    if out is not None:
        # "clip" writes straight into out (the indices are in range); numpy's default,
        # "raise", takes the whole result into a buffer first
        _as_array(rows).take(index.numpy(), axis=0, out=_as_array(out), mode="clip")
        return out
    taken = torch.from_numpy(_as_array(rows).take(index.numpy(), axis=0))
    return taken.view(torch.bfloat16) if rows.dtype == torch.bfloat16 else taken


def scatter(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``out[index] = rows`` in place. out: contiguous (n, dim); index: int64 (m,) in [0, n);
    rows: (m, dim) of ``out``'s dtype."""
    if not out.is_contiguous():  # a contiguous copy would take the writes and be dropped
        raise ValueError("rowcopy.scatter needs a contiguous destination")
    if index.numel() == 0 or out.shape[1] == 0:
        return
    np.put(_as_records(out), index.numpy(), _as_records(rows))


def copy(out: torch.Tensor, rows: torch.Tensor) -> None:
    """``out[:] = rows`` for contiguous tensors of one shape and dtype: one memcpy."""
    if not out.is_contiguous():
        raise ValueError("rowcopy.copy needs a contiguous destination")
    if out.shape != rows.shape or out.dtype != rows.dtype:
        raise ValueError(f"rowcopy.copy: {tuple(rows.shape)} {rows.dtype} into "
                         f"{tuple(out.shape)} {out.dtype}")
    if out.numel():
        np.copyto(_as_bytes(out), _as_bytes(rows))

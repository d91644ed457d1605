"""Whole-row gathers, scatters and sums done by numpy, single-threaded.

Moving rows is a memory-bound copy that one core does at memory speed. torch runs the same ops as
intra-op parallel kernels, and when the cores are busy (a trainer computing while its prefetch
thread pulls, shard handler threads, client and shard on one box) each parallel region waits for a
time slice, and a copy that numpy does in well under a millisecond takes torch many times longer
(docs/decisions.md, "Row gathers and scatters run in numpy"). Rows are viewed as bytes, so every row
dtype (bfloat16 included, which numpy lacks) works. The range check of an index (``bounds``) is
numpy's too, and so is the sort that puts one shard's part of a push in ascending order with
repeated ids summed (``ascending_unique``), which the client and the store share.
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


def ascending_unique(ids: torch.Tensor, grads: torch.Tensor, positions: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One shard's part of a push as ``PushPieces`` takes it: (keys, values, source).

    ids: int64 (n,), any order, repeats allowed; grads: float32 (n, dim); positions: int64
    (m,), the rows of ``ids`` the shard owns (None: all of them). keys: those ids ascending,
    each once; values: ``grads``, or float32 (len(keys), dim) where repeated ids' gradients
    are summed; source: int64 (len(keys),), the row of ``values`` holding each key's
    gradient, or None for row i.

    Ids already ascending and unique, as a trainer's active classes are, pass with no sort;
    the client runs this once per shard, on the shards' threads, so the shards' sorts
    overlap. The ids are numpy's to index, compare and sort: torch's kernels for them run
    on an intra-op thread pool that the fan-out threads, each with its own, oversubscribe."""
    keys = ids.numpy()
    source = None if positions is None else positions.numpy()
    if source is not None:
        keys = keys[source]
    if keys.size > 1 and not (keys[1:] > keys[:-1]).all():
        order = np.argsort(keys)  # introsort: several times torch's sort of int64 on one core
        ascending = keys[order]
        first = np.empty(keys.size, dtype=bool)
        first[0], first[1:] = True, ascending[1:] != ascending[:-1]
        repeats = not first.all()
        if repeats:
            # sorted again, stably, so that each id's gradients are summed in request order,
            # the same sums however the ids are split among shards
            order = np.argsort(keys, kind="stable")
        keys = ascending
        source = order if source is None else source[order]
        if repeats:  # their gradients summed, in one row per id
            inverse = torch.from_numpy(np.cumsum(first) - 1)
            values = torch.zeros((int(inverse[-1]) + 1, grads.shape[1]), dtype=torch.float32)
            values.index_add_(0, inverse, grads.index_select(0, torch.from_numpy(source)))
            return torch.from_numpy(keys[first]), values, None
    if positions is None and source is None:
        return ids, grads, None
    return torch.from_numpy(keys), grads, torch.from_numpy(source)

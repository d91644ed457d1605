"""A push cut into pieces: the requests one shard's part of a push travels in.

Pure torch. Each piece's gradients are gathered when it is sent, straight into the buffer that
carries them when the caller has one (a region of the client's shared buffer): one copy per piece on
the client, none of them into a temporary first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from ams import rowcopy


class PushPiece(NamedTuple):
    """One push request: ids int64 (n,) owned by the shard, ascending and unique; grads
    float32 (n, dim); its (client id, sequence) sequence, which makes a retry apply once."""

    ids: torch.Tensor
    grads: torch.Tensor
    sequence: int


def piece_sizes(rows: int, most: int) -> list[int]:
    """``rows`` cut into as few pieces of at most ``most`` rows as they take (one of 0 rows
    for none), their sizes differing by one at most: no short last piece, which would wait on
    the wire alone and fall below the shared buffer's minimum (``ams.shm.MIN_SHARED_BYTES``)."""
    count = max(1, -(-rows // max(1, most)))
    base, longer = divmod(rows, count)
    return [base + 1] * longer + [base] * (count - longer)


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
    overlap."""
    keys = ids if positions is None else ids.index_select(0, positions)
    source = positions
    if keys.numel() > 1 and not bool((keys[1:] > keys[:-1]).all()):
        # numpy's introsort: several times torch's sort of int64 on one core
        order = torch.from_numpy(np.argsort(keys.numpy()))
        keys = keys.index_select(0, order)
        source = order if source is None else source.index_select(0, order)
        if bool((keys[1:] == keys[:-1]).any()):
            keys, inverse = torch.unique_consecutive(keys, return_inverse=True)
            values = torch.zeros((keys.numel(), grads.shape[1]), dtype=torch.float32)
            values.index_add_(0, inverse, grads.index_select(0, source))
            return keys, values, None
    return keys, grads, source


class PushPieces(Sequence[PushPiece]):
    """One shard's part of a push, cut into pieces, each gathered when it is asked for: the
    first piece goes on the wire while the next is gathered, and a resend after a lost
    connection gathers again (the same rows and sequences).

    keys: int64 ids, ascending and unique; values: float32 (., dim) gradients; source: int64
    (len(keys),), the row of ``values`` that holds each key's gradient, or None for row i;
    chunks: positions into ``keys``, one tensor per piece; first_sequence: the first piece's
    sequence (the others follow it)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, source: torch.Tensor | None,
                 chunks: Sequence[torch.Tensor], first_sequence: int) -> None:
        self.keys, self.values, self.source = keys, values, source
        self.chunks, self.first_sequence = chunks, first_sequence

    @classmethod
    def one(cls, ids: torch.Tensor, grads: torch.Tensor, sequence: int) -> PushPieces:
        """A single piece: ids int64 (n,) ascending and unique, grads float32 (n, dim)."""
        return cls(ids, grads, None, [torch.arange(ids.numel())], sequence)

    @property
    def dim(self) -> int:
        return self.values.shape[1]

    def __len__(self) -> int:
        return len(self.chunks)

    def rows_of(self, i: int) -> int:
        """How many rows piece ``i`` carries."""
        return self.chunks[i].numel()

    def __getitem__(self, i: int) -> PushPiece:  # type: ignore[override]
        return self.gather(i)

    def gather(self, i: int, out: torch.Tensor | None = None) -> PushPiece:
        """Piece ``i``, its gradients written into ``out`` when given (contiguous float32
        (``rows_of(i)``, ``dim``)), else into a new tensor."""
        chunk = self.chunks[i]
        rows = chunk if self.source is None else self.source.index_select(0, chunk)
        return PushPiece(self.keys.index_select(0, chunk),
                         rowcopy.gather(self.values, rows, out=out), self.first_sequence + i)

"""A push cut into pieces: the requests one shard's part of a push travels in.

No sockets, so it is tested alone. A piece is a run of consecutive keys. Its gradients are
gathered when it is sent, straight into the buffer that carries them when the caller has one
(a region of the client's shared buffer): one copy per piece on the client, none of them into
a temporary first, and none at all for a piece sent from the caller's own gradients as they
lie.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ams.shard import rowcopy


class PushPiece(NamedTuple):
    """One push request: ids int64 (n,) owned by the shard, ascending and unique; grads
    float32 (n, dim); its (client id, sequence) sequence, which makes a retry apply once."""

    ids: torch.Tensor
    grads: torch.Tensor
    sequence: int


def piece_sizes(rows: int, most: int) -> list[int]:
    """``rows`` cut into as few pieces of at most ``most`` rows as they take (one of 0 rows
    for none), their sizes differing by one at most: no short last piece, which would wait on
    the wire alone and fall below the shared buffer's minimum
    (``ams.dataplane.shm.MIN_SHARED_BYTES``)."""
    count = max(1, -(-rows // max(1, most)))
    base, longer = divmod(rows, count)
    return [base + 1] * longer + [base] * (count - longer)


class PushPieces(Sequence[PushPiece]):
    """One shard's part of a push, cut into pieces, each gathered when it is asked for: the
    first piece goes on the wire while the next is gathered, and a resend after a lost
    connection gathers again (the same rows and sequences).

    keys: int64 ids, ascending and unique; values: float32 (., dim) gradients; source: int64
    (len(keys),), the row of ``values`` that holds each key's gradient, or None for row i;
    sizes: the pieces' lengths, in order, covering ``keys``; first_sequence: the first
    piece's sequence (the others follow it)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, source: torch.Tensor | None,
                 sizes: Sequence[int], first_sequence: int) -> None:
        self.keys, self.values, self.source = keys, values, source
        self.starts = [0]
        for size in sizes:
            self.starts.append(self.starts[-1] + size)
        self.first_sequence = first_sequence

    @classmethod
    def one(cls, ids: torch.Tensor, grads: torch.Tensor, sequence: int) -> PushPieces:
        """A single piece: ids int64 (n,) ascending and unique, grads float32 (n, dim)."""
        return cls(ids, grads, None, [ids.numel()], sequence)

    @property
    def dim(self) -> int:
        return self.values.shape[1]

    def __len__(self) -> int:
        return len(self.starts) - 1

    def rows_of(self, i: int) -> int:
        """How many rows piece ``i`` carries."""
        return self.starts[i + 1] - self.starts[i]

    def __getitem__(self, i: int) -> PushPiece:  # type: ignore[override]
        return self.gather(i)

    def gather(self, i: int, out: torch.Tensor | None = None) -> PushPiece:
        """Piece ``i``, its gradients written into ``out`` when given (contiguous float32
        (``rows_of(i)``, ``dim``)), else a new tensor, or a view of ``values`` where its rows
        lie together there."""
        if not 0 <= i < len(self):
            raise IndexError(f"piece {i} of {len(self)}")
        start, end = self.starts[i], self.starts[i + 1]
        if self.source is not None:
            grads = rowcopy.gather(self.values, self.source[start:end], out=out)
        elif out is not None:
            rowcopy.copy(out, self.values[start:end])
            grads = out
        else:
            grads = self.values[start:end]
        return PushPiece(self.keys[start:end], grads, self.first_sequence + i)

"""Where the rows of one pull request land, on the client's end of a data connection.

A pull asks a shard for the rows of a few pieces of ids; each piece is one PULL frame, and its
rows land in one of four ways, each a small class with the same three calls (``place``:
what the PULL says about the rows' place; ``rows_out``: where rows that come in the answer's
frame are received; ``take``: what is done with them once the answer is in):

* ``InFrame``: the rows come in the answer's frame, received straight into their slice of the
  result, or into a tensor of their own and scattered to their positions from there;
* ``Staged``: the shard writes them to a region of the shared buffer of their own, and they are
  copied or scattered from there before the region is given back (a result outside the buffer);
* ``InPlace``: the shard writes them to their slice of the result, which lies in the buffer;
* ``ScatteredInPlace``: the shard writes row j to row ``positions[j]`` of the result, which lies
  in the buffer.

``PullTarget.landing`` picks one for each piece as it is sent (a staged region is taken then,
and given back once its answer is read).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ams.dataplane.shm import MIN_SHARED_BYTES, SharedArena
from ams.dataplane.sockets import Frame
from ams.shard import rowcopy
from ams.wire.frames import FrameError, Header


@dataclass
class RowsPlace:
    """What a PULL frame says about where its answer's rows go: ``meta`` beyond the table (the
    shared region's offset and bytes), ``positions`` (int64, a scattered pull's) and ``region``,
    the shared region the shard writes (None: the rows come in the answer), given back once the
    answer is read where ``release``."""

    meta: dict = field(default_factory=dict)
    positions: torch.Tensor | None = None
    region: int | None = None
    release: bool = False


class Landing:
    """Where one piece's rows land: rows ``start:end`` of the pull, in ``out`` (m, dim) in
    order, or at ``positions[start:end]`` of it (``positions`` None: in order)."""

    def __init__(self, out: torch.Tensor, positions: torch.Tensor | None, start: int,
                 end: int) -> None:
        self.out, self.positions, self.start, self.end = out, positions, start, end

    @property
    def count(self) -> int:
        return self.end - self.start

    @property
    def wanted(self) -> torch.Tensor | None:
        """This piece's positions in ``out`` (None: its rows go to ``out[start:end]``)."""
        return None if self.positions is None else self.positions[self.start:self.end]

    def place(self) -> RowsPlace:
        raise NotImplementedError

    def rows_out(self, header: Header) -> torch.Tensor | None:
        """Where the answer's rows are received, when they come in its frame."""
        return None

    def take(self, answer: Frame) -> None:
        """The answer is in: its rows to their places."""

    def check(self, header: Header) -> None:
        """The answer announces this piece's count of rows, and ``out``'s width and dtype."""
        want = (self.count, self.out.shape[1], self.out.dtype)
        if (header.num_rows, header.dim, header.dtype) != want:
            raise FrameError(f"frame: {header.num_rows} rows of {header.dim} x {header.dtype} "
                             f"where {want[0]} of {want[1]} x {want[2]} was due")


class InFrame(Landing):
    """Rows in the answer's frame: received into their slice of ``out``, or scattered."""

    def place(self) -> RowsPlace:
        return RowsPlace()

    def rows_out(self, header: Header) -> torch.Tensor:
        self.check(header)
        if self.positions is not None:
            return torch.empty((header.num_rows, header.dim), dtype=header.dtype)
        return self.out[self.start:self.end]

    def take(self, answer: Frame) -> None:
        if answer.header.shared:
            raise FrameError("frame: rows in a shared buffer where none was asked for")
        if self.positions is not None:
            rowcopy.scatter(self.out, self.wanted, answer.rows)


class Staged(Landing):
    """Rows the shard writes to ``region`` of ``shared``, copied or scattered from there."""

    def __init__(self, out: torch.Tensor, positions: torch.Tensor | None, start: int, end: int,
                 shared: SharedArena, region: int) -> None:
        super().__init__(out, positions, start, end)
        self.shared, self.region = shared, region

    def place(self) -> RowsPlace:
        nbytes = self.count * self.out.shape[1] * self.out.element_size()
        return RowsPlace({"offset": self.region, "bytes": nbytes}, region=self.region,
                           release=True)

    def take(self, answer: Frame) -> None:
        if not answer.header.shared:
            raise FrameError("frame: rows in the frame where the shared buffer was asked for")
        self.check(answer.header)
        got = self.shared.rows(self.region, self.out.dtype, self.count, self.out.shape[1])
        if self.positions is None:
            rowcopy.copy(self.out[self.start:self.end], got)
        else:
            rowcopy.scatter(self.out, self.wanted, got)


class InPlace(Landing):
    """Rows the shard writes to their slice of ``out``, which lies at ``base`` of the shared
    buffer."""

    def __init__(self, out: torch.Tensor, start: int, end: int, base: int) -> None:
        super().__init__(out, None, start, end)
        self.base = base

    def place(self) -> RowsPlace:
        row_bytes = self.out.shape[1] * self.out.element_size()
        offset = self.base + self.start * row_bytes
        return RowsPlace({"offset": offset, "bytes": self.count * row_bytes}, region=offset)

    def take(self, answer: Frame) -> None:
        if not answer.header.shared:
            raise FrameError("frame: rows in the frame where the shared buffer was asked for")
        self.check(answer.header)


class ScatteredInPlace(Landing):
    """Rows the shard writes to their positions in ``out``, which lies at ``base`` of the
    shared buffer."""

    def __init__(self, out: torch.Tensor, positions: torch.Tensor, start: int, end: int,
                 base: int) -> None:
        super().__init__(out, positions, start, end)
        self.base = base

    def place(self) -> RowsPlace:
        nbytes = self.out.shape[0] * self.out.shape[1] * self.out.element_size()
        return RowsPlace({"offset": self.base, "bytes": nbytes}, positions=self.wanted,
                           region=self.base)

    take = InPlace.take


class PullTarget:
    """A pull's result: ``out`` (m, dim), contiguous, of the table's row dtype; ``positions``
    None (the pieces' rows fill ``out`` in order) or int64 (n,) (row j of the pieces goes to
    ``out[positions[j]]``); ``shared``: the connection's shared buffer, or None."""

    def __init__(self, out: torch.Tensor, positions: torch.Tensor | None,
                 shared: SharedArena | None) -> None:
        self.out, self.positions, self.shared = out, positions, shared
        self.base = shared.offset_of(out) if shared is not None else None

    def landing(self, start: int, end: int) -> Landing:
        """Where the rows ``start:end`` of the pull land: in place where ``out`` lies in the
        shared buffer; else staged in a region of their own when they fill at least
        ``MIN_SHARED_BYTES`` and a region is free; else in the answer's frame."""
        if self.base is not None:
            if self.positions is None:
                return InPlace(self.out, start, end, self.base)
            return ScatteredInPlace(self.out, self.positions, start, end, self.base)
        nbytes = (end - start) * self.out.shape[1] * self.out.element_size()
        if self.shared is not None and nbytes >= MIN_SHARED_BYTES:
            region = self.shared.allocate(nbytes)
            if region is not None:
                return Staged(self.out, self.positions, start, end, self.shared, region)
        return InFrame(self.out, self.positions, start, end)

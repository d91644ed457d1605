"""Compact neighbor lists of the rows one shard owns (the graph compression of KNN softmax,
docs/references.md).

A shard keeps only its own rows' lists, indexed by local position 0..n-1, in one of two
layouts:

* fixed width: ``offsets`` is None and ``neighbors`` is (n, k), list i is ``neighbors[i]``.
  Every list of a full build has exactly k entries, so this is the normal case: no offsets.
* CSR, for ragged lists (short lists, partial refreshes that change lengths): ``offsets``
  (n + 1,) int64, list i is ``neighbors[offsets[i]:offsets[i + 1]]``.

Ids are int32 when the table has fewer than 2**31 classes, int64 otherwise (``id_dtype``), so
a full graph takes 4 bytes a neighbor and nothing per row. The same pair ``(offsets or None,
neighbors)`` describes lists wherever they go (lookups, updates, the wire, snapshots). All
operations are vectorised over rows.

The table never mutates its tensors in place: ``update`` builds new ones, so a snapshot that
holds the old ``offsets`` / ``neighbors`` stays consistent while training refreshes the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate

import torch
from torch import Tensor

# Class counts from here on need int64 ids.
INT32_CLASSES = 2**31


def id_dtype(num_classes: int) -> torch.dtype:
    """The dtype a table of ``num_classes`` classes keeps neighbor ids in: int32 below 2**31
    classes, int64 from there."""
    return torch.int32 if num_classes < INT32_CLASSES else torch.int64


def check_lists(offsets: Tensor | None, neighbors: Tensor, count: int | None = None) -> None:
    """ValueError unless (offsets, neighbors) are neighbor lists in one of the two layouts:
    fixed width (offsets None, neighbors (count, k)) or CSR (offsets (count + 1,) int64,
    non-decreasing from 0 to len(neighbors), neighbors 1-D); ids int32 or int64 (their range
    is the caller's to check). ``count`` None: any number of lists."""
    if not isinstance(neighbors, Tensor) or neighbors.dtype not in (torch.int32, torch.int64):
        got = f"{neighbors.dtype}" if isinstance(neighbors, Tensor) else type(neighbors).__name__
        raise ValueError(f"neighbors: need int32 or int64 ids, got {got}")
    if offsets is None:
        if neighbors.dim() != 2 or (count is not None and neighbors.shape[0] != count):
            want = "(n, k)" if count is None else f"({count}, k)"
            raise ValueError(f"neighbors: fixed-width lists (no offsets) need shape {want}, "
                             f"got {tuple(neighbors.shape)}")
        return
    if neighbors.dim() != 1:
        raise ValueError(f"neighbors: CSR lists (offsets given) need a 1-d tensor, got shape "
                         f"{tuple(neighbors.shape)}; send fixed-width lists without offsets")
    if not isinstance(offsets, Tensor) or offsets.dtype != torch.int64 or offsets.dim() != 1:
        got = f"{offsets.dtype} {tuple(offsets.shape)}" if isinstance(offsets, Tensor) \
            else type(offsets).__name__
        raise ValueError(f"offsets: need a 1-d int64 tensor, got {got}")
    if count is not None and offsets.numel() != count + 1:
        raise ValueError(f"offsets: need {count + 1} values for {count} lists, "
                         f"got {offsets.numel()}")
    if offsets.numel() == 0 or int(offsets[0]) != 0 or int(offsets[-1]) != neighbors.numel():
        raise ValueError(f"offsets: need offsets[0] == 0 and offsets[-1] == len(neighbors) "
                         f"= {neighbors.numel()}")
    if bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError("offsets: must be non-decreasing")


def list_lengths(offsets: Tensor | None, neighbors: Tensor) -> Tensor:
    """(m,) int64 length of every list of (offsets or None, neighbors), either layout."""
    if offsets is None:
        return torch.full((neighbors.shape[0],), neighbors.shape[1], dtype=torch.int64)
    return offsets[1:] - offsets[:-1]


def as_csr(offsets: Tensor | None, neighbors: Tensor) -> tuple[Tensor, Tensor]:
    """The same lists as CSR: offsets (m + 1,) int64, neighbors 1-D (fixed-width ``neighbors``
    (m, k) flattened, a view when contiguous)."""
    if offsets is not None:
        return offsets, neighbors
    m, k = neighbors.shape
    return torch.arange(m + 1, dtype=torch.int64) * k, neighbors.reshape(-1)


def gather_segments(starts: Tensor, lengths: Tensor, source: Tensor) -> tuple[Tensor, Tensor]:
    """Concatenate the segments ``source[starts[i] : starts[i] + lengths[i]]``.

    Args: starts (m,) int64, lengths (m,) int64, source (s,) int32 or int64.
    Returns: offsets (m + 1,) int64 and values (offsets[-1],) of source's dtype, in segment
    order.
    """
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    total = int(offsets[-1])
    # Each output slot j of segment i reads source[starts[i] + (j - offsets[i])].
    shift = torch.repeat_interleave(starts - offsets[:-1], lengths, output_size=total)
    index = torch.arange(total, dtype=torch.int64, device=lengths.device) + shift
    return offsets, source[index]


def lists_to_dense(offsets: Tensor | None, neighbors: Tensor, width: int) -> Tensor:
    """Lists of either layout -> (m, width) int64, each truncated to ``width`` and padded
    with -1.

    Args: offsets (m + 1,) int64 and neighbors (offsets[-1],) (CSR), or offsets None and
    neighbors (m, k) (fixed width); ids int32 or int64.
    """
    if offsets is None:
        m, k = neighbors.shape
        dense = torch.full((m, width), -1, dtype=torch.int64)
        dense[:, :min(k, width)] = neighbors[:, :width]
        return dense
    lengths = offsets[1:] - offsets[:-1]
    m, total = lengths.numel(), neighbors.numel()
    row = torch.repeat_interleave(torch.arange(m), lengths, output_size=total)
    col = torch.arange(total) - torch.repeat_interleave(offsets[:-1], lengths, output_size=total)
    keep = col < width
    dense = torch.full((m, width), -1, dtype=torch.int64)
    dense[row[keep], col[keep]] = neighbors[keep].to(torch.int64)
    return dense


class NeighborTable:
    """Neighbor lists of one shard's rows, fixed width or CSR (see the module docstring).

    The layout follows from the lists: fixed width exactly when every list has ``k`` entries.
    The constructor, the factories and ``update`` all pick it, so a full build is fixed width,
    a refresh that keeps every list at k stays so, one that shortens a list makes the table
    CSR, and it returns to fixed width once every list has k entries again.

    Attributes:
        offsets: None (fixed width), or (n + 1,) int64, offsets[0] == 0, non-decreasing (CSR).
        neighbors: (n, k) (fixed width) or (offsets[-1],) (CSR) global class ids in
            0..num_classes-1, dtype ``id_dtype(num_classes)``, each list in rank order (the
            class itself first when the list came from ``knn``).
        num_classes: the table's class count N (ids 0..N-1); it picks the id dtype.
        k: the list length the graph was built for (at least the longest list).
        version: graph version (one per full build).
        step: training step of the weights the graph was built from.
    """

    def __init__(
        self,
        offsets: Tensor | None,
        neighbors: Tensor,
        *,
        num_classes: int,
        k: int | None = None,
        version: int = 0,
        step: int = 0,
    ) -> None:
        """Lists of either layout (``check_lists``), ids int32 or int64 in 0..num_classes-1
        (kept as ``id_dtype(num_classes)``); ``k`` None: the longest list. ValueError for
        anything else."""
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes={num_classes!r} must be an integer >= 1")
        check_lists(offsets, neighbors)
        self.num_classes = num_classes
        self.version = version
        self.step = step
        self._set_lists(offsets, _checked_ids(neighbors, num_classes), k or 0)

    @classmethod
    def from_dense(cls, neighbors: Tensor, *, num_classes: int, version: int = 0, step: int = 0
                   ) -> NeighborTable:
        """From (n, k) int32 or int64 lists in rank order; entries < 0 are padding and dropped
        (none: the table is fixed width as given)."""
        check_lists(None, neighbors)
        valid = neighbors >= 0
        if bool(valid.all()):
            return cls(None, neighbors, num_classes=num_classes, k=neighbors.shape[1],
                       version=version, step=step)
        offsets = torch.zeros(neighbors.shape[0] + 1, dtype=torch.int64)
        torch.cumsum(valid.sum(dim=1), 0, out=offsets[1:])
        return cls(offsets, neighbors[valid], num_classes=num_classes, k=neighbors.shape[1],
                   version=version, step=step)

    @classmethod
    def from_csr(cls, positions: Tensor, offsets: Tensor | None, neighbors: Tensor,
                 num_rows: int, *, num_classes: int, k: int | None = None) -> NeighborTable:
        """From lists given for ``positions`` (m,) int64 in any order, which must be each of
        0..num_rows-1 exactly once: CSR offsets (m + 1,) and neighbors (offsets[-1],), or
        offsets None and fixed-width neighbors (m, w)."""
        return cls.from_parts([(positions, offsets, neighbors)], num_rows,
                              num_classes=num_classes, k=k)

    @classmethod
    def from_parts(cls, parts: list[tuple[Tensor, Tensor | None, Tensor]], num_rows: int, *,
                   num_classes: int, k: int | None = None) -> NeighborTable:
        """From one or more parts ``(positions (m,) int64, offsets or None, neighbors)``, lists
        of either layout for disjoint sets of positions that together cover 0..num_rows-1
        (e.g. lists that arrived in pieces). Parts all fixed width of one width are placed
        straight into one (num_rows, w) tensor; any other mix goes through CSR."""
        which = _order(torch.cat([p for p, _, _ in parts]), num_rows)
        checked = []
        for positions, offsets, neighbors in parts:
            check_lists(offsets, neighbors, positions.numel())
            checked.append((positions, offsets, _checked_ids(neighbors, num_classes)))
        widths = {nb.shape[1] if offsets is None else -1 for _, offsets, nb in checked}
        if len(widths) == 1 and -1 not in widths:
            out = torch.empty((num_rows, checked[0][2].shape[1]), dtype=id_dtype(num_classes))
            for positions, _, neighbors in checked:
                out[positions] = neighbors
            return cls(None, out, num_classes=num_classes, k=k)
        csr = [as_csr(offsets, nb) for _, offsets, nb in checked]
        bases = accumulate((nb.numel() for _, nb in csr), initial=0)
        starts = torch.cat([o[:-1] + base for (o, _), base in zip(csr, bases, strict=False)])
        lengths = torch.cat([o[1:] - o[:-1] for o, _ in csr])
        offsets, neighbors = gather_segments(starts[which], lengths[which],
                                             torch.cat([nb for _, nb in csr]))
        return cls(offsets, neighbors, num_classes=num_classes, k=k)

    @property
    def fixed(self) -> bool:
        """True for the fixed-width layout (no offsets)."""
        return self.offsets is None

    @property
    def num_rows(self) -> int:
        return self.neighbors.shape[0] if self.offsets is None else self.offsets.numel() - 1

    def lengths(self) -> Tensor:
        """(n,) int64 list length of every row."""
        return list_lengths(self.offsets, self.neighbors)

    def nbytes(self) -> int:
        """Bytes the lists take: k * 4 a row fixed width with int32 ids."""
        return self.neighbors.nbytes + (0 if self.offsets is None else self.offsets.nbytes)

    def lookup(self, positions: Tensor) -> tuple[Tensor | None, Tensor]:
        """Lists of rows ``positions`` (m,) int64 (repeats allowed), in request order, in the
        table's layout and id dtype.

        Returns (None, neighbors (m, k)) fixed width, or (offsets (m + 1,) int64, neighbors
        (offsets[-1],)) CSR.
        """
        _check_positions(positions, self.num_rows)
        if self.offsets is None:
            return None, self.neighbors.index_select(0, positions)
        return gather_segments(self.offsets[positions], self.lengths()[positions], self.neighbors)

    def lookup_nbytes(self, positions: Tensor) -> int:
        """Bytes of the tensors ``lookup(positions)`` returns, found without building them."""
        _check_positions(positions, self.num_rows)
        itemsize = self.neighbors.element_size()
        if self.offsets is None:
            return positions.numel() * self.k * itemsize
        listed = int(self.lengths().index_select(0, positions).sum())
        return 8 * (positions.numel() + 1) + listed * itemsize

    def update(self, positions: Tensor, offsets: Tensor | None, neighbors: Tensor,
               allocate: Callable[[tuple[int, ...], torch.dtype], Tensor] | None = None
               ) -> None:
        """Replace the lists of ``positions`` (m,) int64, distinct, with lists of either
        layout: offsets None and neighbors (m, w), or CSR offsets (m + 1,) and neighbors
        (offsets[-1],); ids int32 or int64 in 0..num_classes-1. Lengths may change, and the
        layout follows them (see the class docstring).

        Builds new tensors instead of writing into the old ones: a copy of the (n, k) table
        when fixed-width lists of width k replace fixed-width ones, else O(total lists) once.
        ``allocate(shape, dtype)`` gives that copy's tensor (None: in RAM).
        """
        _check_positions(positions, self.num_rows)
        check_lists(offsets, neighbors, positions.numel())
        if positions.unique().numel() != positions.numel():
            raise ValueError("positions: repeats are ambiguous in an update")
        new = _checked_ids(neighbors, self.num_classes)
        if self.offsets is None and offsets is None and new.shape[1] == self.k:
            table = (allocate(tuple(self.neighbors.shape), self.neighbors.dtype)
                     if allocate is not None else torch.empty_like(self.neighbors))
            table.copy_(self.neighbors)
            table.index_copy_(0, positions, new)
            self.neighbors = table
            return
        old_offsets, old_flat = as_csr(self.offsets, self.neighbors)
        new_offsets, new_flat = as_csr(offsets, new)
        starts = old_offsets[:-1].clone()
        lengths = old_offsets[1:] - old_offsets[:-1]
        # Old and new lists side by side in one source; replaced rows read the new part.
        starts[positions] = new_offsets[:-1] + old_flat.numel()
        lengths[positions] = new_offsets[1:] - new_offsets[:-1]
        merged = gather_segments(starts, lengths, torch.cat([old_flat, new_flat]))
        self._set_lists(*merged, self.k)

    def to_dense(self, width: int | None = None) -> Tensor:
        """(n, width) int64 lists padded with -1 (width defaults to ``k``)."""
        return lists_to_dense(self.offsets, self.neighbors, self.k if width is None else width)

    def _set_lists(self, offsets: Tensor | None, neighbors: Tensor, k: int) -> None:
        """Hold checked lists of the table's id dtype, with ``k`` raised to the longest list,
        fixed width exactly when every list has k entries."""
        if offsets is None:
            self.k = max(k, neighbors.shape[1])
            if neighbors.shape[1] != self.k:  # every list shorter than k
                offsets, neighbors = as_csr(None, neighbors)
        else:
            lengths = offsets[1:] - offsets[:-1]
            self.k = max(k, int(lengths.max()) if lengths.numel() else 0)
            if bool((lengths == self.k).all()):
                offsets, neighbors = None, neighbors.reshape(lengths.numel(), self.k)
        self.offsets, self.neighbors = offsets, neighbors


def _checked_ids(neighbors: Tensor, num_classes: int) -> Tensor:
    """``neighbors`` (int32 or int64) as ``id_dtype(num_classes)``; ValueError for an id
    outside 0..num_classes-1, found before narrowing (which would wrap it into range)."""
    if neighbors.numel() and (int(neighbors.min()) < 0 or int(neighbors.max()) >= num_classes):
        raise ValueError(f"neighbors: ids must lie in 0..{num_classes - 1}, got "
                         f"{int(neighbors.min())}..{int(neighbors.max())}")
    return neighbors.to(id_dtype(num_classes))


def _order(positions: Tensor, num_rows: int) -> Tensor:
    """(num_rows,) int64: row i's index in ``positions`` (m,) int64, which must hold each of
    0..num_rows-1 exactly once; ValueError otherwise."""
    _check_positions(positions, num_rows)
    which = torch.full((num_rows,), -1, dtype=torch.int64)
    which[positions] = torch.arange(positions.numel())
    if positions.numel() != num_rows or bool((which < 0).any()):
        raise ValueError(f"positions: need each of 0..{num_rows - 1} once, got "
                         f"{positions.numel()} positions (with repeats or gaps)")
    return which


def _check_positions(positions: Tensor, num_rows: int) -> None:
    if positions.dtype != torch.int64 or positions.dim() != 1:
        raise ValueError(f"positions: need (m,) int64, got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= num_rows):
        raise IndexError(f"positions: must lie in 0..{num_rows - 1}")


class StagedGraph:
    """The parts of a full graph of ``version`` that have arrived for a shard's ``owned`` rows
    (a graph may come in several calls, messages being size-limited); ``add`` returns the
    finished graph once every row has its list, exactly once.

    Fixed-width parts of one width are written straight into the (owned, k) table of the
    graph's id dtype as they arrive, so staging a graph sent in int64 blocks costs the finished
    table and no copy of the parts; any other mix is kept as parts and assembled at the end."""

    def __init__(self, version: int, step: int, owned: int, num_classes: int) -> None:
        self.version, self.step, self.num_classes = version, step, num_classes
        self.parts: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        self.lists: torch.Tensor | None = None
        self.covered = torch.zeros(owned, dtype=torch.bool)

    def add(self, positions: torch.Tensor, offsets: torch.Tensor | None,
            neighbors: torch.Tensor,
            new_lists: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
            ) -> NeighborTable | None:
        """Stage the lists of local ``positions`` (int64 (n,); offsets and neighbors as
        ``NeighborTable.update`` takes them); ``new_lists(shape, dtype)`` makes the fixed-width
        table. Returns the graph (version and step set) once complete, else None.
        ``ValueError`` when some rows already have a list in this version (a retried delivery of
        a part already staged is ignored)."""
        seen = self.covered[positions]
        if positions.numel() and bool(seen.all()):
            return None  # a retried delivery of a part already staged
        if bool(seen.any()):
            raise ValueError(f"ids: some rows already have a list in graph version "
                             f"{self.version}; each row is sent once per version")
        if offsets is None and not self.parts and (
                self.lists is None or self.lists.shape[1] == neighbors.shape[1]):
            if self.lists is None:
                self.lists = new_lists((self.covered.numel(), neighbors.shape[1]),
                                       id_dtype(self.num_classes))
            self.lists[positions] = neighbors.to(self.lists.dtype)
        else:
            if self.lists is not None:  # another layout or width after all: keep it as a part
                before = self.covered.nonzero().squeeze(1)
                self.parts.append((before, None, self.lists[before]))
                self.lists = None
            self.parts.append((positions, offsets, neighbors))
        self.covered[positions] = True
        if not bool(self.covered.all()):
            return None
        if self.lists is not None:
            graph = NeighborTable(None, self.lists, num_classes=self.num_classes)
        else:
            graph = NeighborTable.from_parts(self.parts, self.covered.numel(),
                                             num_classes=self.num_classes)
        graph.version, graph.step = self.version, self.step
        return graph

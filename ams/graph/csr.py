"""Compressed neighbor lists of the rows one shard owns (the graph compression of KNN
softmax, docs/references.md).

A shard keeps only its own rows' lists, indexed by local position 0..n-1. Lists may differ in
length (short lists, partial refreshes), so they are stored CSR: list i is
``neighbors[offsets[i]:offsets[i + 1]]``. All operations are vectorised over rows.

The table never mutates its tensors in place: ``update`` builds new ones, so a snapshot that
holds the old ``offsets`` / ``neighbors`` stays consistent while training refreshes the graph.
"""

from __future__ import annotations

import torch
from torch import Tensor


def gather_segments(starts: Tensor, lengths: Tensor, source: Tensor) -> tuple[Tensor, Tensor]:
    """Concatenate the segments ``source[starts[i] : starts[i] + lengths[i]]``.

    Args: starts (m,) int64, lengths (m,) int64, source (s,) int64.
    Returns: offsets (m + 1,) int64 and values (offsets[-1],) int64, in segment order.
    """
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    total = int(offsets[-1])
    # Each output slot j of segment i reads source[starts[i] + (j - offsets[i])].
    shift = torch.repeat_interleave(starts - offsets[:-1], lengths, output_size=total)
    index = torch.arange(total, dtype=torch.int64, device=lengths.device) + shift
    return offsets, source[index]


def csr_to_dense(offsets: Tensor, neighbors: Tensor, width: int) -> Tensor:
    """CSR lists -> (m, width) int64, each list truncated to ``width`` and padded with -1.

    Args: offsets (m + 1,) int64, neighbors (offsets[-1],) int64.
    """
    lengths = offsets[1:] - offsets[:-1]
    m, total = lengths.numel(), neighbors.numel()
    row = torch.repeat_interleave(torch.arange(m), lengths, output_size=total)
    col = torch.arange(total) - torch.repeat_interleave(offsets[:-1], lengths, output_size=total)
    keep = col < width
    dense = torch.full((m, width), -1, dtype=torch.int64)
    dense[row[keep], col[keep]] = neighbors[keep]
    return dense


class NeighborTable:
    """CSR neighbor lists of one shard's rows.

    Attributes:
        offsets: (n + 1,) int64, offsets[0] == 0, non-decreasing.
        neighbors: (offsets[-1],) int64 global class ids, each list in rank order (the class
            itself first when the list came from ``knn``).
        k: the list length the graph was built for (longest list when not given).
        version: graph version (one per full build).
        step: training step of the weights the graph was built from.
    """

    def __init__(
        self,
        offsets: Tensor,
        neighbors: Tensor,
        *,
        k: int | None = None,
        version: int = 0,
        step: int = 0,
    ) -> None:
        _check_csr(offsets, neighbors)
        self.offsets = offsets
        self.neighbors = neighbors
        self.k = int(self.lengths().max()) if k is None and offsets.numel() > 1 else (k or 0)
        self.version = version
        self.step = step

    @classmethod
    def from_dense(cls, neighbors: Tensor, *, version: int = 0, step: int = 0) -> NeighborTable:
        """From (n, k) int64 lists in rank order; entries < 0 are padding and dropped."""
        if neighbors.dtype != torch.int64 or neighbors.dim() != 2:
            raise ValueError(f"neighbors: need (n, k) int64, got {neighbors.dtype} "
                             f"{tuple(neighbors.shape)}")
        valid = neighbors >= 0
        offsets = torch.zeros(neighbors.shape[0] + 1, dtype=torch.int64)
        torch.cumsum(valid.sum(dim=1), 0, out=offsets[1:])
        return cls(offsets, neighbors[valid], k=neighbors.shape[1], version=version, step=step)

    @classmethod
    def from_csr(
        cls, positions: Tensor, offsets: Tensor, neighbors: Tensor, num_rows: int
    ) -> NeighborTable:
        """From lists given for ``positions`` (m,) int64 in any order, which must be each of
        0..num_rows-1 exactly once; offsets (m + 1,), neighbors (offsets[-1],) int64."""
        _check_csr(offsets, neighbors)
        if positions.numel() != num_rows or positions.numel() + 1 != offsets.numel():
            raise ValueError(f"positions: need each of 0..{num_rows - 1} once, "
                             f"got {positions.numel()} positions for {offsets.numel() - 1} lists")
        _check_positions(positions, num_rows)
        which = torch.full((num_rows,), -1, dtype=torch.int64)
        which[positions] = torch.arange(num_rows)
        if bool((which < 0).any()):
            raise ValueError(f"positions: need each of 0..{num_rows - 1} once (repeats found)")
        starts = offsets[:-1][which]
        lengths = (offsets[1:] - offsets[:-1])[which]
        new_offsets, new_neighbors = gather_segments(starts, lengths, neighbors)
        return cls(new_offsets, new_neighbors)

    @classmethod
    def from_parts(cls, parts: list[tuple[Tensor, Tensor, Tensor]], num_rows: int
                   ) -> NeighborTable:
        """From CSR parts ``(positions (m,), offsets (m + 1,), neighbors)`` for disjoint sets
        of positions that together cover 0..num_rows-1 (e.g. lists that arrived in pieces)."""
        lengths = torch.cat([o[1:] - o[:-1] for _, o, _ in parts])
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return cls.from_csr(torch.cat([p for p, _, _ in parts]), offsets,
                            torch.cat([nb for _, _, nb in parts]), num_rows)

    @property
    def num_rows(self) -> int:
        return self.offsets.numel() - 1

    def lengths(self) -> Tensor:
        """(n,) int64 list length of every row."""
        return self.offsets[1:] - self.offsets[:-1]

    def nbytes(self) -> int:
        return self.offsets.nbytes + self.neighbors.nbytes

    def lookup(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Lists of rows ``positions`` (m,) int64 (repeats allowed), in request order.

        Returns offsets (m + 1,) int64 and neighbors (offsets[-1],) int64.
        """
        _check_positions(positions, self.num_rows)
        return gather_segments(self.offsets[positions], self.lengths()[positions], self.neighbors)

    def update(self, positions: Tensor, offsets: Tensor, neighbors: Tensor) -> None:
        """Replace the lists of ``positions`` (m,) int64, distinct, with the CSR lists
        offsets (m + 1,), neighbors (offsets[-1],) int64; lengths may change.

        Builds new tensors (O(total lists) once) instead of writing into the old ones.
        """
        _check_csr(offsets, neighbors)
        _check_positions(positions, self.num_rows)
        if positions.numel() + 1 != offsets.numel():
            raise ValueError(f"{positions.numel()} positions but {offsets.numel() - 1} lists")
        if positions.unique().numel() != positions.numel():
            raise ValueError("positions: repeats are ambiguous in an update")
        new_lengths = offsets[1:] - offsets[:-1]
        starts = self.offsets[:-1].clone()
        lengths = self.lengths()  # a fresh tensor: safe to write into
        # Old and new lists side by side in one source; replaced rows read the new part.
        starts[positions] = offsets[:-1] + self.neighbors.numel()
        lengths[positions] = new_lengths
        source = torch.cat([self.neighbors, neighbors])
        self.offsets, self.neighbors = gather_segments(starts, lengths, source)
        if new_lengths.numel():
            self.k = max(self.k, int(new_lengths.max()))

    def to_dense(self, width: int | None = None) -> Tensor:
        """(n, width) int64 lists padded with -1 (width defaults to ``k``)."""
        return csr_to_dense(self.offsets, self.neighbors, self.k if width is None else width)


def _check_csr(offsets: Tensor, neighbors: Tensor) -> None:
    for what, t in (("offsets", offsets), ("neighbors", neighbors)):
        if t.dtype != torch.int64 or t.dim() != 1:
            raise ValueError(f"{what}: need a 1-d int64 tensor, got {t.dtype} {tuple(t.shape)}")
    if offsets.numel() == 0 or int(offsets[0]) != 0 or int(offsets[-1]) != neighbors.numel():
        raise ValueError(f"offsets: need offsets[0] == 0 and offsets[-1] == len(neighbors) "
                         f"= {neighbors.numel()}")
    if bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError("offsets: must be non-decreasing")


def _check_positions(positions: Tensor, num_rows: int) -> None:
    if positions.dtype != torch.int64 or positions.dim() != 1:
        raise ValueError(f"positions: need (m,) int64, got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= num_rows):
        raise IndexError(f"positions: must lie in 0..{num_rows - 1}")

"""How far a neighbor graph has gone stale: the share of each class's neighbors that a
rebuild replaced.

Rows keep moving between rebuilds, and while the learning rate is high they move fast
(docs/accuracy.md shows how fast on the glyph data). Measured at each rebuild (the trainer
writes it to OUT/graph.csv), it says how stale the neighbors were that the knn head took
since the last one. Pure torch.
"""

from __future__ import annotations

import torch
from torch import Tensor


def neighbor_turnover(old: Tensor, new: Tensor) -> Tensor:
    """Per class, the fraction of ``new``'s neighbors that ``old`` did not list.

    old, new: int64 (n, k) neighbor lists of the same n classes, nearest first, column 0
    being the class itself (it is left out), -1 padding short lists. Returns float32 (n,)
    in [0, 1]; a class with no neighbors in ``new`` counts 0.
    """
    if old.shape != new.shape or old.dim() != 2:
        raise ValueError(f"old and new must be (n, k) of one shape, got {tuple(old.shape)} "
                         f"and {tuple(new.shape)}")
    old_sorted = old[:, 1:].sort(dim=1).values
    candidates = new[:, 1:].contiguous()
    if old_sorted.shape[1] == 0:
        return torch.zeros(new.shape[0])
    # membership of each new neighbor in its row's old list, by binary search: O(n k log k)
    # where a pairwise comparison would take n k^2 (k runs to the thousands at 100M classes)
    at = torch.searchsorted(old_sorted, candidates).clamp(max=old_sorted.shape[1] - 1)
    kept = old_sorted.gather(1, at) == candidates
    listed = candidates >= 0
    replaced = (listed & ~kept).sum(dim=1).float()
    return replaced / listed.sum(dim=1).clamp(min=1).float()

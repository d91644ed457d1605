"""Active-class selection for one training step (KNN softmax's selection algorithm;
PartialFC's sampling; docs/references.md).

``select_weighted(labels, neighbors, budget, generator, num_classes)`` picks them for both
heads (PartialFC's passes no neighbors) and returns a :class:`Selection`:

* ``active``: (A,) int64 class ids, sorted ascending, unique; the rows the step pulls.
* ``target``: (B,) int64 with ``active[target] == labels``: the target column of each sample
  in the (B, A) logits.

Neighbor lists come dense: (B, k) int64 in rank order, -1 padding a short list (a table lookup
result becomes this with ``ams.shard.neighbor_lists.lists_to_dense``).

Selection runs on CPU (the prefetch thread), on CPU tensors. The sorts inside go through numpy:
torch's multi-threaded CPU sort of a few 100k int64 is many times slower than numpy's whenever
the cores are shared, and B=256 x k=1200 is 300k ids per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ams.sharding import owned_count


@dataclass(frozen=True)
class Selection:
    """One step's active classes with how each got there.

    active: (A,) int64 class ids, sorted ascending, unique.
    target: (B,) int64 with ``active[target] == labels``.
    log_weight: (A,) float32, log of 1 / (probability that the class was drawn): 0 for the
        labels and neighbors (taken for sure), ``log(pool / drawn)`` for the classes drawn
        uniformly from the ``pool`` classes left over. Added to the logits, it turns the
        softmax over the active classes into an unbiased estimate of the full softmax's
        partition function (the "logQ" correction of sampled softmax).
    """

    active: Tensor
    target: Tensor
    log_weight: Tensor


def select_weighted(
    labels: Tensor,
    neighbors: Tensor | None,
    budget: int,
    generator: torch.Generator,
    num_classes: int,
    random_share: float = 0.0,
) -> Selection:
    """KNN-softmax active classes: labels, then neighbors by rank, then uniform random fill.

    Priority order: every label; then rank-1 neighbors of all labels, then rank-2, ...
    (column by column of ``neighbors``); duplicates count once, at their first place. A is
    ``budget`` (capped at ``num_classes``), but never fewer than the distinct labels, which
    are all kept. Of the A - labels negative slots, ``random_share`` (rounded) go to uniformly
    random classes and the rest to the order's next classes; distinct uniformly random
    classes also fill any slot the order cannot. Deterministic given the generator's state.

    Args:
        labels: (B,) int64 in 0..num_classes-1.
        neighbors: (B, k) int64 rank-ordered lists of the labels' classes, -1 padding, or
            None (labels + random fill only: PartialFC's sampling).
        budget: target number of active classes A.
        generator: source of the random fill (CPU generator).
        Tensors are CPU tensors.
        num_classes: N.
        random_share: fraction in [0, 1] of the negative slots given to random classes.

    Returns the :class:`Selection`: the active classes, each label's column, and each
    class's sampling weight.
    """
    _check_ids("labels", labels, 1, num_classes)
    if neighbors is None:
        order = labels
    else:
        _check_ids("neighbors", neighbors, 2, num_classes, allow_padding=True)
        if neighbors.shape[0] != labels.shape[0]:
            raise ValueError(f"neighbors has {neighbors.shape[0]} lists for "
                             f"{labels.shape[0]} labels")
        ranked = neighbors.T.reshape(-1)  # rank 0 of all lists, then rank 1, ...
        order = torch.cat([labels, ranked[ranked >= 0]])
    active, log_weight = _choose(order.numpy(), np.unique(labels.numpy()).size, budget,
                                 generator, num_classes, random_share)
    return Selection(active=active, target=torch.searchsorted(active, labels),
                     log_weight=log_weight)


def select_in_slice(
    labels: Tensor,
    neighbors: Tensor | None,
    budget: int,
    generator: torch.Generator,
    num_classes: int,
    rank: int,
    world: int,
    random_share: float = 0.0,
) -> Selection:
    """``select_weighted`` within slice ``rank`` of ``world``: the classes ``c`` with
    ``c % world == rank`` (the layout of ``ams.sharding``), as collective mode's ranks select.

    The priority order is the global one (labels, then neighbors by rank) with the classes of
    other slices left out; ``budget`` and the uniform fill count within the slice, so
    ``world == 1`` draws exactly what ``select_weighted`` draws. ``labels`` (B,) and
    ``neighbors`` (B, k) are the whole global batch's. Returns the slice's active classes
    (global ids, sorted), ``target`` (B,) with -1 for the labels of other slices, and the
    logQ weights with ``pool`` counted within the slice.
    """
    _check_ids("labels", labels, 1, num_classes)
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} must lie in [0, world={world})")
    size = owned_count(num_classes, rank, world)
    if size == 0:
        raise ValueError(f"slice {rank} of {world} holds no class of {num_classes}")
    own = labels % world == rank
    order = labels[own] // world
    num_labels = np.unique(order.numpy()).size
    if neighbors is not None:
        _check_ids("neighbors", neighbors, 2, num_classes, allow_padding=True)
        if neighbors.shape[0] != labels.shape[0]:
            raise ValueError(f"neighbors has {neighbors.shape[0]} lists for "
                             f"{labels.shape[0]} labels")
        ranked = neighbors.T.reshape(-1)
        ranked = ranked[(ranked >= 0) & (ranked % world == rank)]
        order = torch.cat([order, ranked // world])
    local, log_weight = _choose(order.numpy(), num_labels, budget, generator, size,
                                random_share)
    active = local * world + rank
    target = torch.full_like(labels, -1)
    target[own] = torch.searchsorted(local, labels[own] // world)
    return Selection(active=active, target=target, log_weight=log_weight)


def _choose(order: np.ndarray, num_labels: int, budget: int, generator: torch.Generator,
            num_classes: int, random_share: float) -> tuple[Tensor, Tensor]:
    """The core of ``select_weighted``: from ``order`` (n,) int64, the priority order whose
    first distinct ``num_labels`` values are the labels, the active classes (A,) sorted and
    their logQ weights (A,) float32."""
    if not 0.0 <= random_share <= 1.0:
        raise ValueError(f"random_share must lie in [0, 1], got {random_share}")
    ranked_unique = _unique_in_order(order)
    total = max(min(budget, num_classes), num_labels)
    negatives = total - num_labels
    chosen = ranked_unique[:total - round(random_share * negatives)]
    fill = _sample_excluding(chosen, total - chosen.size, num_classes, generator)
    active = torch.from_numpy(np.sort(np.concatenate([chosen, fill])))
    log_weight = torch.zeros(active.numel(), dtype=torch.float32)
    if fill.size:
        pool = num_classes - chosen.size
        log_weight[torch.searchsorted(active, torch.from_numpy(fill))] = \
            float(np.log(pool / fill.size))
    return active, log_weight


def _unique_in_order(values: np.ndarray) -> np.ndarray:
    """Distinct values of (n,) int64 in order of first occurrence."""
    # one stable sort finds each value's first place; sorting those places restores the order
    # (np.unique(return_index=True) then an argsort of its indices costs two sorts and more)
    order = np.argsort(values, kind="stable")
    return values[np.sort(order[_run_starts(values[order])])]


def _run_starts(ordered: np.ndarray) -> np.ndarray:
    """(n,) bool: where each run of equal values of the sorted (n,) ``ordered`` begins."""
    starts = np.ones(ordered.size, dtype=bool)
    starts[1:] = ordered[1:] != ordered[:-1]
    return starts


def _sample_excluding(
    excluded: np.ndarray, count: int, num_classes: int, generator: torch.Generator
) -> np.ndarray:
    """``count`` distinct uniform classes of 0..num_classes-1 not in ``excluded`` (n,) int64:
    ascending from the rejection sampling, in no particular order from the permutation.

    Rejection sampling (cheap while the fill is small next to N): i.i.d. draws until enough
    distinct ones are left after dropping the excluded, then ``count`` of those at random.
    Nothing in it favours one class over another, so that is a uniform random subset; when the
    fill is most of what is left, a permutation of all classes is cheaper.
    """
    if count <= 0:
        return np.empty(0, dtype=np.int64)
    free = num_classes - excluded.size
    if 2 * count >= free:
        perm = torch.randperm(num_classes, generator=generator).numpy()
        return perm[~np.isin(perm, excluded)][:count]
    distinct = np.empty(0, dtype=np.int64)
    while distinct.size < count:
        draws = torch.randint(num_classes, (_draws_for(count - distinct.size, num_classes),),
                              generator=generator)
        merged = np.sort(np.concatenate([distinct, draws.numpy()]))
        distinct = merged[_run_starts(merged)]
        distinct = distinct[~np.isin(distinct, excluded)]
    if distinct.size == count:
        return distinct
    keep = np.zeros(distinct.size, dtype=bool)  # a mask, so the subset stays ascending
    keep[torch.randperm(distinct.size, generator=generator)[:count].numpy()] = True
    return distinct[keep]


def _draws_for(missing: int, num_classes: int) -> int:
    """Uniform draws from ``num_classes`` classes that give about 5 % more than ``missing``
    distinct classes: d draws give N (1 - exp(-d / N)) distinct ones on average."""
    share = min(0.999, (1.05 * missing + 64) / num_classes)
    return int(-num_classes * math.log1p(-share)) + 16


def _check_ids(
    what: str, ids: Tensor, ndim: int, num_classes: int, allow_padding: bool = False
) -> None:
    if ids.dtype != torch.int64 or ids.dim() != ndim:
        raise ValueError(f"{what}: need a {ndim}-d int64 tensor, got {ids.dtype} "
                         f"{tuple(ids.shape)}")
    if ids.numel() == 0:
        return
    low = -1 if allow_padding else 0
    if int(ids.min()) < low or int(ids.max()) >= num_classes:
        raise ValueError(f"{what}: ids must lie in 0..{num_classes - 1}")

"""neighbor_turnover against a set computation, one class at a time."""

from __future__ import annotations

import pytest
import torch

from ams.graph.churn import neighbor_turnover


def reference_turnover(old: torch.Tensor, new: torch.Tensor) -> list[float]:
    out = []
    for o, n in zip(old.tolist(), new.tolist(), strict=True):
        listed = [c for c in n[1:] if c >= 0]
        previous = {c for c in o[1:] if c >= 0}
        out.append(sum(c not in previous for c in listed) / len(listed) if listed else 0.0)
    return out


def random_lists(generator: torch.Generator, n: int, k: int, classes: int) -> torch.Tensor:
    lists = torch.stack([torch.randperm(classes, generator=generator)[:k] for _ in range(n)])
    lists[:, 0] = torch.arange(n)  # the class itself ranks first
    short = torch.rand(n, generator=generator) < 0.3
    cut = torch.randint(1, max(k, 2), (n,), generator=generator)
    columns = torch.arange(k)[None, :]
    return torch.where(short[:, None] & (columns >= cut[:, None]), -1, lists)


@pytest.mark.parametrize("k", [1, 2, 9, 33])
def test_turnover_matches_a_set_computation(k):
    g = torch.Generator().manual_seed(k)
    old = random_lists(g, 200, k, 60)
    new = random_lists(g, 200, k, 60)
    new[:50] = old[:50]  # unchanged lists turn nothing over
    got = neighbor_turnover(old, new)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(reference_turnover(old, new)))
    assert bool((got[:50] == 0).all())


def test_reordered_lists_turn_nothing_over_and_disjoint_ones_everything():
    old = torch.tensor([[0, 5, 6, 7], [1, 8, 9, -1]])
    assert neighbor_turnover(old, torch.tensor([[0, 7, 5, 6], [1, 9, 8, -1]])).tolist() == [0, 0]
    assert neighbor_turnover(old, torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]])).tolist() == [1, 1]


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="one shape"):
        neighbor_turnover(torch.zeros(3, 4, dtype=torch.int64),
                           torch.zeros(3, 5, dtype=torch.int64))

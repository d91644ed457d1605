"""workers.selection against a plain-Python model of KNN softmax's selection algorithm."""

from __future__ import annotations

import collections
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ams.cluster.plan import budget_for_sample_rate
from workers.selection import select_in_slice, select_weighted

BIG = 5_000_000_000


def priority_order(labels: list[int], neighbors: list[list[int]]) -> list[int]:
    """Labels, then rank 1 of every list, rank 2, ... ; first occurrence wins; -1 skipped."""
    seen: dict[int, None] = dict.fromkeys(labels)
    width = max((len(r) for r in neighbors), default=0)
    for rank in range(width):
        for row in neighbors:
            if rank < len(row) and row[rank] >= 0:
                seen.setdefault(row[rank])
    return list(seen)


@st.composite
def batches(draw):
    num_classes = draw(st.integers(1, 3000))
    b = draw(st.integers(1, 40))
    k = draw(st.integers(0, 12))
    labels = draw(st.lists(st.integers(0, num_classes - 1), min_size=b, max_size=b))
    neighbors = []
    for label in labels:
        length = draw(st.integers(0, k))
        rest = draw(st.lists(st.integers(0, num_classes - 1), min_size=length, max_size=length))
        row = ([label] + rest)[: max(length, 1)] if k else []
        neighbors.append(row + [-1] * (k - len(row)))
    budget = draw(st.integers(0, num_classes + 10))
    seed = draw(st.integers(0, 2**31))
    return num_classes, labels, neighbors, budget, seed


def run(labels, neighbors, budget, seed, num_classes, random_share=0.0):
    g = torch.Generator().manual_seed(seed)
    lab = torch.tensor(labels, dtype=torch.int64)
    nb = None if neighbors is None else torch.tensor(neighbors, dtype=torch.int64).reshape(
        len(labels), -1)
    return select_weighted(lab, nb, budget, g, num_classes, random_share)


@settings(max_examples=150, deadline=None)
@given(batch=batches())
def test_selection_properties(batch):
    num_classes, labels, neighbors, budget, seed = batch
    selection = run(labels, neighbors, budget, seed, num_classes)
    active, remapped = selection.active, selection.target
    assert active.dtype == remapped.dtype == torch.int64
    a = active.tolist()
    assert a == sorted(set(a)) and all(0 <= x < num_classes for x in a)
    assert [a[i] for i in remapped.tolist()] == labels
    distinct_labels = len(set(labels))
    keep = max(min(budget, num_classes), distinct_labels)
    assert len(a) == keep
    order = priority_order(labels, neighbors)
    if len(order) >= keep:
        assert a == sorted(order[:keep])  # cut by rank, never dropping a label
    else:
        assert set(order) <= set(a)  # the rest is random fill
    again = run(labels, neighbors, budget, seed, num_classes)
    assert torch.equal(again.active, active) and torch.equal(again.target, remapped)
    assert torch.equal(again.log_weight, selection.log_weight)


@settings(max_examples=150, deadline=None)
@given(batch=batches(), share=st.floats(0.0, 1.0))
def test_random_share_keeps_random_slots(batch, share):
    num_classes, labels, neighbors, budget, seed = batch
    selection = run(labels, neighbors, budget, seed, num_classes, share)
    active, remapped = selection.active, selection.target
    a = active.tolist()
    assert a == sorted(set(a)) and [a[i] for i in remapped.tolist()] == labels
    distinct_labels = len(set(labels))
    total = max(min(budget, num_classes), distinct_labels)
    assert len(a) == total
    # labels, then the priority order for all but the random share of the negative slots
    ranked = priority_order(labels, neighbors)[:total - round(share * (total - distinct_labels))]
    assert set(ranked) <= set(a)


def test_random_share_draws_uniform_classes():
    # one label whose 40 neighbors would fill a budget of 41; with half the 40 negative slots
    # random, the 20 nearest stay and over many draws every other class shows up about equally
    # often among the rest
    num_classes, labels = 200, torch.tensor([0])
    neighbors = torch.arange(1, 41)[None, :]
    g = torch.Generator().manual_seed(0)
    counts = collections.Counter()
    for _ in range(2000):
        active = select_weighted(labels, neighbors, 41, g, num_classes, random_share=0.5).active
        a = set(active.tolist())
        assert len(a) == 41 and set(range(21)) <= a  # label + its 20 nearest
        counts.update(a - set(range(21)))
    assert sum(counts.values()) == 2000 * 20
    expected = 2000 * 20 / (num_classes - 21)
    assert set(counts) <= set(range(21, num_classes))
    assert max(counts.values()) < 1.5 * expected and min(counts.values()) > 0.5 * expected
    with pytest.raises(ValueError, match="random_share"):
        select_weighted(labels, neighbors, 41, g, num_classes, random_share=1.5)


@settings(max_examples=100, deadline=None)
@given(batch=batches(), share=st.floats(0.0, 1.0))
def test_only_random_classes_carry_a_log_weight(batch, share):
    # The documented rule (Selection.log_weight): the classes taken for sure, the labels and
    # then the priority order's next classes in the negative slots not given to random
    # classes, weigh exactly 0; every other active class was drawn uniformly from the pool of
    # classes left over once the sure ones are out, and weighs log(pool / drawn).
    num_classes, labels, neighbors, budget, seed = batch
    weighted = run(labels, neighbors, budget, seed, num_classes, share)
    assert weighted.log_weight.dtype == torch.float32
    assert weighted.log_weight.shape == weighted.active.shape
    distinct_labels = len(set(labels))
    total = max(min(budget, num_classes), distinct_labels)
    random_slots = round(share * (total - distinct_labels))
    sure = set(priority_order(labels, neighbors)[:total - random_slots])
    active = weighted.active.tolist()
    assert sure <= set(active)
    drawn = [c for c in active if c not in sure]
    pool = num_classes - len(sure)
    for c, w in zip(active, weighted.log_weight.tolist(), strict=True):
        if c in sure:
            assert w == 0.0, f"class {c} was taken for sure but weighs {w}"
        else:
            # the weights are float32: allow for its rounding
            assert w == pytest.approx(math.log(pool / len(drawn)), rel=1e-6, abs=1e-7), c


def test_a_slice_draws_uniformly_from_its_own_classes():
    # Collective mode's slice r of W holds the classes c % W == r: its labels are taken for
    # sure, the rest of its budget is drawn uniformly from its other classes only, each drawn
    # class weighing log(pool / drawn) with the pool counted within the slice; the labels of
    # other slices have no column here (target -1).
    num_classes, world, rank = 23, 3, 1  # slice 1: 1, 4, 7, ..., 22 (8 classes)
    labels = torch.tensor([4, 0, 2, 4, 22])  # 4 and 22 fall in slice 1
    others = {1, 7, 10, 13, 16, 19}  # the pool: slice 1 less its labels
    g = torch.Generator().manual_seed(4)
    counts: collections.Counter[int] = collections.Counter()
    draws = 3000
    for _ in range(draws):
        selection = select_in_slice(labels, None, 4, g, num_classes, rank, world)
        active = selection.active.tolist()
        assert len(active) == 4 and active == sorted(active) and {4, 22} <= set(active)
        assert [active[t] if t >= 0 else None for t in selection.target.tolist()] == \
            [4, None, None, 4, 22]
        drawn = set(active) - {4, 22}
        assert drawn <= others
        weights = dict(zip(active, selection.log_weight.tolist(), strict=True))
        assert weights[4] == weights[22] == 0.0
        assert all(weights[c] == pytest.approx(math.log(6 / 2)) for c in drawn)
        counts.update(drawn)
    assert set(counts) == others
    expected = draws * 2 / 6  # 1000 each; binomial sd about 26
    assert all(abs(c - expected) < 150 for c in counts.values()), counts


def test_log_weights_make_the_partition_estimate_unbiased():
    # Full softmax partition sum_j exp(z_j) in float64 against the mean over many selections
    # of sum_{j active} exp(z_j + log_weight_j): labels and neighbors count once, the uniform
    # draws stand for the classes left over. Without the weights the estimate falls short.
    num_classes, budget = 60, 14
    labels = torch.tensor([3, 7, 7])
    neighbors = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10], [7, 8, 9, 10]])
    z = torch.randn(num_classes, generator=torch.Generator().manual_seed(5),
                    dtype=torch.float64) * 2
    full = z.exp().sum().item()
    g = torch.Generator().manual_seed(6)
    weighted, plain = [], []
    for _ in range(3000):
        s = select_weighted(labels, neighbors, budget, g, num_classes, random_share=0.5)
        terms = z[s.active].exp()
        weighted.append((terms * s.log_weight.double().exp()).sum().item())
        plain.append(terms.sum().item())
    estimate = torch.tensor(weighted, dtype=torch.float64)
    stderr = estimate.std().item() / len(weighted) ** 0.5
    assert abs(estimate.mean().item() - full) < 4 * stderr
    assert sum(plain) / len(plain) < full - 20 * stderr


@settings(max_examples=100, deadline=None)
@given(batch=batches())
def test_without_neighbors_labels_and_random_classes_fill_the_budget(batch):
    # PartialFC's sampling (workers.heads.SampledClasses)
    num_classes, labels, _, budget, seed = batch
    selection = run(labels, None, budget, seed, num_classes)
    active, remapped = selection.active, selection.target
    a = active.tolist()
    assert a == sorted(set(a)) and set(labels) <= set(a)
    assert [a[i] for i in remapped.tolist()] == labels
    assert len(a) == max(min(budget, num_classes), len(set(labels)))


def test_neighbors_fill_before_random_and_by_rank():
    labels = torch.tensor([10, 20])
    neighbors = torch.tensor([[10, 11, 12, 13], [20, 21, 22, -1]])
    g = torch.Generator().manual_seed(0)
    selection = select_weighted(labels, neighbors, 5, g, 100)
    active, remapped = selection.active, selection.target
    assert active.tolist() == [10, 11, 12, 20, 21]  # rank 1 of both, then rank 2 of the first
    assert active[remapped].tolist() == [10, 20]
    active = select_weighted(labels, neighbors, 9, g, 100).active
    assert {10, 11, 12, 13, 20, 21, 22} <= set(active.tolist()) and active.numel() == 9


def test_labels_over_budget_are_all_kept():
    labels = torch.tensor([5, 3, 9, 3, 1])
    neighbors = torch.tensor([[5, 6], [3, 4], [9, 8], [3, 4], [1, 2]])
    selection = select_weighted(labels, neighbors, 2, torch.Generator(), 10)
    active, remapped = selection.active, selection.target
    assert active.tolist() == [1, 3, 5, 9]
    assert active[remapped].tolist() == labels.tolist()


def test_random_fill_is_uniform_and_excludes_active():
    counts: collections.Counter[int] = collections.Counter()
    g = torch.Generator().manual_seed(1)
    for _ in range(3000):
        active = select_weighted(torch.tensor([0]), None, 3, g, 21).active
        assert active[0] == 0
        counts.update(active[1:].tolist())
    assert set(counts) == set(range(1, 21))
    assert all(200 < c < 400 for c in counts.values())  # expected 300 each


def test_random_fill_draws_every_subset_equally_often():
    # pairs, not single classes: a fill that favoured some combinations (the smallest of the
    # distinct draws, say) can still show each class equally often on its own
    g = torch.Generator().manual_seed(3)
    pairs: collections.Counter[tuple[int, ...]] = collections.Counter()
    draws = 6000
    for _ in range(draws):
        active = select_weighted(torch.tensor([0]), None, 3, g, 21).active
        pairs[tuple(active[1:].tolist())] += 1
    assert len(pairs) == 190  # every pair of the 20 other classes
    expected = draws / 190
    chi2 = sum((c - expected) ** 2 / expected for c in pairs.values())
    assert chi2 < 189 + 5 * (2 * 189) ** 0.5  # 189 degrees of freedom: mean 189, sd 19.4


def test_large_ids_and_big_batches():
    n = 2 * BIG
    g = torch.Generator().manual_seed(2)
    labels = torch.randint(n, (256,), generator=g)
    neighbors = torch.cat([labels[:, None], torch.randint(n, (256, 1199), generator=g)], 1)
    selection = select_weighted(labels, neighbors, 100_000, g, n)
    active, remapped = selection.active, selection.target
    assert active.numel() == 100_000 and torch.equal(active[remapped], labels)
    selection = select_weighted(labels, neighbors, 400_000, g, n)
    active, remapped = selection.active, selection.target
    assert active.numel() == 400_000 and torch.equal(active[remapped], labels)
    assert bool((active[1:] > active[:-1]).all()) and int(active.max()) < n


def test_budget_for_sample_rate():
    assert budget_for_sample_rate(0.1, 1000) == 100
    assert budget_for_sample_rate(1e-9, 1000) == 1
    with pytest.raises(ValueError):
        budget_for_sample_rate(0.0, 10)


def test_rejects_ids_out_of_range():
    with pytest.raises(ValueError):
        select_weighted(torch.tensor([10]), None, 3, torch.Generator(), 10)
    with pytest.raises(ValueError):
        select_weighted(torch.tensor([1]), torch.tensor([[1, -2]]), 3, torch.Generator(), 10)

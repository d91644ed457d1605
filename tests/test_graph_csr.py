"""ams.graph.csr against plain Python lists of lists."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ams.graph import NeighborTable, csr_to_dense

BIG = 5_000_000_000


def as_lists(offsets: torch.Tensor, neighbors: torch.Tensor) -> list[list[int]]:
    o = offsets.tolist()
    nb = neighbors.tolist()
    return [nb[o[i] : o[i + 1]] for i in range(len(o) - 1)]


def to_csr(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = [0]
    for row in lists:
        offsets.append(offsets[-1] + len(row))
    flat = [x for row in lists for x in row]
    return torch.tensor(offsets, dtype=torch.int64), torch.tensor(flat, dtype=torch.int64)


def test_from_dense_drops_padding_and_looks_up():
    dense = torch.tensor([[BIG, 7, 9], [3, -1, -1], [4, 5, -1], [-1, -1, -1]])
    table = NeighborTable.from_dense(dense, version=3, step=42)
    assert (table.version, table.step, table.k, table.num_rows) == (3, 42, 3, 4)
    assert as_lists(table.offsets, table.neighbors) == [[BIG, 7, 9], [3], [4, 5], []]
    offsets, nbrs = table.lookup(torch.tensor([2, 0, 2, 3]))
    assert as_lists(offsets, nbrs) == [[4, 5], [BIG, 7, 9], [4, 5], []]
    offsets, nbrs = table.lookup(torch.empty(0, dtype=torch.int64))
    assert offsets.tolist() == [0] and nbrs.numel() == 0
    assert torch.equal(table.to_dense(), dense)


def test_lookup_rejects_bad_positions():
    table = NeighborTable.from_dense(torch.tensor([[0, 1], [1, 0]]))
    with pytest.raises(IndexError):
        table.lookup(torch.tensor([2]))
    with pytest.raises(IndexError):
        table.lookup(torch.tensor([-1]))
    with pytest.raises(ValueError):
        table.lookup(torch.tensor([0], dtype=torch.int32))


def test_constructor_rejects_bad_csr():
    with pytest.raises(ValueError):
        NeighborTable(torch.tensor([0, 2, 1]), torch.tensor([1]))
    with pytest.raises(ValueError):
        NeighborTable(torch.tensor([0, 3]), torch.tensor([1, 2]))


def test_from_csr_reorders_by_position():
    lists = [[10, 11], [], [12], [13, 14, 15]]
    offsets, nbrs = to_csr(lists)
    table = NeighborTable.from_csr(torch.tensor([2, 0, 3, 1]), offsets, nbrs, 4)
    assert as_lists(table.offsets, table.neighbors) == [[], [13, 14, 15], [10, 11], [12]]
    with pytest.raises(ValueError):
        NeighborTable.from_csr(torch.tensor([2, 2, 3, 1]), offsets, nbrs, 4)


def test_update_builds_new_tensors_and_keeps_old_snapshot():
    table = NeighborTable.from_dense(torch.tensor([[0, 1, 2], [1, 0, 2], [2, 1, 0]]))
    old_offsets, old_nbrs = table.offsets, table.neighbors
    snapshot = (old_offsets.clone(), old_nbrs.clone())
    offsets, nbrs = to_csr([[2, BIG, 7, 8, 9], [0]])
    table.update(torch.tensor([2, 0]), offsets, nbrs)
    assert as_lists(table.offsets, table.neighbors) == [[0], [1, 0, 2], [2, BIG, 7, 8, 9]]
    assert table.k == 5
    assert torch.equal(old_offsets, snapshot[0]) and torch.equal(old_nbrs, snapshot[1])
    with pytest.raises(ValueError):
        table.update(torch.tensor([1, 1]), *to_csr([[1], [1]]))


def test_csr_to_dense_truncates_and_pads():
    offsets, nbrs = to_csr([[1, 2, 3], [], [4]])
    assert csr_to_dense(offsets, nbrs, 2).tolist() == [[1, 2], [-1, -1], [4, -1]]


lists_st = st.lists(st.lists(st.integers(0, 2**40), max_size=6), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(lists=lists_st, data=st.data())
def test_updates_and_lookups_match_a_list_model(lists, data):
    model = [list(r) for r in lists]
    table = NeighborTable.from_csr(torch.arange(len(model)), *to_csr(model), len(model))
    for _ in range(data.draw(st.integers(1, 4))):
        positions = data.draw(st.lists(st.integers(0, len(model) - 1), unique=True,
                                       max_size=len(model)))
        new = data.draw(st.lists(st.lists(st.integers(0, 2**40), max_size=8),
                                 min_size=len(positions), max_size=len(positions)))
        table.update(torch.tensor(positions, dtype=torch.int64), *to_csr(new))
        for p, row in zip(positions, new, strict=True):
            model[p] = row
        ask = data.draw(st.lists(st.integers(0, len(model) - 1), max_size=40))
        got = table.lookup(torch.tensor(ask, dtype=torch.int64))
        assert as_lists(*got) == [model[p] for p in ask]
    assert as_lists(table.offsets, table.neighbors) == model

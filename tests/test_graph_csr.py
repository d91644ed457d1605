"""ams.shard.neighbor_lists against plain Python lists of lists, in both layouts (fixed
width, CSR) and both id dtypes (int32 below 2**31 classes, int64 from there)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ams.shard.neighbor_lists import NeighborTable, check_lists, id_dtype, lists_to_dense

BIG = 5_000_000_000


def as_lists(offsets: torch.Tensor | None, neighbors: torch.Tensor) -> list[list[int]]:
    if offsets is None:
        return neighbors.tolist()
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
    table = NeighborTable.from_dense(dense, num_classes=BIG + 1, version=3, step=42)
    assert (table.version, table.step, table.k, table.num_rows) == (3, 42, 3, 4)
    assert not table.fixed and table.neighbors.dtype == torch.int64
    assert as_lists(table.offsets, table.neighbors) == [[BIG, 7, 9], [3], [4, 5], []]
    offsets, nbrs = table.lookup(torch.tensor([2, 0, 2, 3]))
    assert as_lists(offsets, nbrs) == [[4, 5], [BIG, 7, 9], [4, 5], []]
    offsets, nbrs = table.lookup(torch.empty(0, dtype=torch.int64))
    assert offsets.tolist() == [0] and nbrs.numel() == 0
    assert torch.equal(table.to_dense(), dense)


def test_lookup_rejects_bad_positions():
    table = NeighborTable.from_dense(torch.tensor([[0, 1], [1, 0]]), num_classes=2)
    with pytest.raises(IndexError):
        table.lookup(torch.tensor([2]))
    with pytest.raises(IndexError):
        table.lookup(torch.tensor([-1]))
    with pytest.raises(ValueError):
        table.lookup(torch.tensor([0], dtype=torch.int32))


def test_constructor_rejects_bad_csr():
    with pytest.raises(ValueError):
        NeighborTable(torch.tensor([0, 2, 1]), torch.tensor([1]), num_classes=10)
    with pytest.raises(ValueError):
        NeighborTable(torch.tensor([0, 3]), torch.tensor([1, 2]), num_classes=10)


def test_from_csr_reorders_by_position():
    lists = [[10, 11], [], [12], [13, 14, 15]]
    offsets, nbrs = to_csr(lists)
    table = NeighborTable.from_csr(torch.tensor([2, 0, 3, 1]), offsets, nbrs, 4, num_classes=16)
    assert as_lists(table.offsets, table.neighbors) == [[], [13, 14, 15], [10, 11], [12]]
    with pytest.raises(ValueError):
        NeighborTable.from_csr(torch.tensor([2, 2, 3, 1]), offsets, nbrs, 4, num_classes=16)
    fixed = NeighborTable.from_csr(torch.tensor([1, 0]), None, torch.tensor([[5, 6], [7, 8]]),
                                   2, num_classes=16)
    assert fixed.fixed and fixed.neighbors.tolist() == [[7, 8], [5, 6]]


def test_update_builds_new_tensors_and_keeps_old_snapshot():
    table = NeighborTable.from_dense(torch.tensor([[0, 1, 2], [1, 0, 2], [2, 1, 0]]),
                                     num_classes=BIG + 1)
    old_nbrs = table.neighbors
    snapshot = old_nbrs.clone()
    table.update(torch.tensor([1]), None, torch.tensor([[1, 2, 0]]))  # stays fixed width
    assert table.fixed and table.neighbors.tolist() == [[0, 1, 2], [1, 2, 0], [2, 1, 0]]
    assert torch.equal(old_nbrs, snapshot)
    old_nbrs = table.neighbors
    snapshot = old_nbrs.clone()
    offsets, nbrs = to_csr([[2, BIG, 7, 8, 9], [0]])
    table.update(torch.tensor([2, 0]), offsets, nbrs)
    assert as_lists(table.offsets, table.neighbors) == [[0], [1, 2, 0], [2, BIG, 7, 8, 9]]
    assert table.k == 5 and not table.fixed
    assert torch.equal(old_nbrs, snapshot)
    with pytest.raises(ValueError):
        table.update(torch.tensor([1, 1]), *to_csr([[1], [1]]))


def test_lists_to_dense_truncates_and_pads_both_layouts():
    offsets, nbrs = to_csr([[1, 2, 3], [], [4]])
    assert lists_to_dense(offsets, nbrs, 2).tolist() == [[1, 2], [-1, -1], [4, -1]]
    assert lists_to_dense(offsets, nbrs.int(), 4).tolist() == [[1, 2, 3, -1], [-1] * 4,
                                                              [4, -1, -1, -1]]
    fixed = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.int32)
    assert lists_to_dense(None, fixed, 2).tolist() == [[1, 2], [4, 5]]
    out = lists_to_dense(None, fixed, 4)
    assert out.dtype == torch.int64 and out.tolist() == [[1, 2, 3, -1], [4, 5, 6, -1]]


def test_nbytes_fixed_int32_against_int64_csr():
    lists = torch.arange(1000 * 12).reshape(1000, 12) % 1000
    table = NeighborTable.from_dense(lists, num_classes=100_000_000)
    assert table.fixed and table.offsets is None and table.neighbors.dtype == torch.int32
    assert table.nbytes() == 1000 * 12 * 4 == 48_000
    wide = NeighborTable.from_dense(lists, num_classes=2**31)  # int64 ids from 2**31 classes
    assert wide.fixed and wide.neighbors.dtype == torch.int64 and wide.nbytes() == 96_000
    lists[5, 11] = -1  # one short list: CSR, offsets 8 bytes a row plus one
    ragged = NeighborTable.from_dense(lists, num_classes=100_000_000)
    assert not ragged.fixed and ragged.nbytes() == 8 * 1001 + 4 * (12_000 - 1)


def test_id_dtype_follows_the_class_count():
    assert id_dtype(2**31 - 1) == torch.int32 and id_dtype(2**31) == torch.int64
    top = 2**31 - 1  # the largest id an int32 table holds
    small = NeighborTable(None, torch.tensor([[top - 1, 0]]), num_classes=top)
    assert small.neighbors.dtype == torch.int32 and small.neighbors.tolist() == [[top - 1, 0]]
    big = NeighborTable(None, torch.tensor([[7, 3]], dtype=torch.int32), num_classes=2**31 + 9)
    assert big.neighbors.dtype == torch.int64
    big.update(torch.tensor([0]), None, torch.tensor([[2**31 + 8, 1]]))
    assert big.neighbors.tolist() == [[2**31 + 8, 1]]


def test_ids_out_of_range_are_refused_before_narrowing():
    table = NeighborTable(None, torch.tensor([[0, 1], [1, 0]]), num_classes=100)
    before = table.neighbors
    for bad in ([[2**32 + 5, 1]], [[-1, 1]], [[100, 1]]):  # 2**32 + 5 would wrap to 5
        with pytest.raises(ValueError, match="ids must lie in 0..99"):
            table.update(torch.tensor([0]), None, torch.tensor(bad))
        with pytest.raises(ValueError, match="ids must lie in 0..99"):
            NeighborTable(None, torch.tensor(bad), num_classes=100)
    assert table.neighbors is before and table.neighbors.tolist() == [[0, 1], [1, 0]]


@pytest.mark.parametrize("offsets,neighbors,count,needle", [
    (torch.tensor([0, 2]), torch.tensor([[1, 2]]), 1, "need a 1-d tensor"),
    (None, torch.tensor([1, 2]), 1, "need shape"),
    (None, torch.tensor([[1, 2]]), 2, r"need shape \(2, k\)"),
    (torch.tensor([0, 1, 2]), torch.tensor([1, 2]), 1, "need 2 values for 1 lists"),
    (torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 2]), 1, "1-d int64"),
    (None, torch.tensor([[1.0, 2.0]]), 1, "int32 or int64"),
    (torch.tensor([0, 3]), torch.tensor([1, 2]), 1, "offsets\\[-1\\]"),
])
def test_check_lists_refuses_malformed_lists(offsets, neighbors, count, needle):
    with pytest.raises(ValueError, match=needle):
        check_lists(offsets, neighbors, count)
    table = NeighborTable(None, torch.tensor([[0, 1], [1, 0]]), num_classes=10)
    with pytest.raises(ValueError, match=needle):
        table.update(torch.arange(count), offsets, neighbors)
    assert table.fixed and table.neighbors.tolist() == [[0, 1], [1, 0]]


def test_from_parts_places_fixed_parts_and_merges_mixed_ones():
    fixed_a = (torch.tensor([3, 0]), None, torch.tensor([[30, 31], [0, 1]]))
    fixed_b = (torch.tensor([1, 2]), None, torch.tensor([[10, 11], [20, 21]], dtype=torch.int32))
    table = NeighborTable.from_parts([fixed_a, fixed_b], 4, num_classes=40)
    assert table.fixed and table.neighbors.dtype == torch.int32
    assert table.neighbors.tolist() == [[0, 1], [10, 11], [20, 21], [30, 31]]
    csr_b = (torch.tensor([1, 2]), *to_csr([[10], [20, 21]]))
    table = NeighborTable.from_parts([fixed_a, csr_b], 4, num_classes=40)
    assert not table.fixed and table.k == 2
    assert as_lists(table.offsets, table.neighbors) == [[0, 1], [10], [20, 21], [30, 31]]
    wide_b = (torch.tensor([1, 2]), None, torch.tensor([[10, 11, 12], [20, 21, 22]]))
    table = NeighborTable.from_parts([fixed_a, wide_b], 4, num_classes=40)
    assert not table.fixed and table.k == 3
    assert table.to_dense().tolist() == [[0, 1, -1], [10, 11, 12], [20, 21, 22], [30, 31, -1]]
    with pytest.raises(ValueError, match="each of 0..4 once"):
        NeighborTable.from_parts([fixed_a, fixed_b], 5, num_classes=40)
    with pytest.raises(ValueError, match="once"):
        NeighborTable.from_parts([fixed_a, fixed_a], 4, num_classes=40)


def test_layout_returns_to_fixed_width_when_every_list_has_k_entries():
    table = NeighborTable(None, torch.tensor([[0, 1], [1, 2], [2, 0]]), num_classes=3)
    table.update(torch.tensor([1]), *to_csr([[1]]))
    assert not table.fixed and as_lists(table.offsets, table.neighbors) == [[0, 1], [1], [2, 0]]
    offsets, got = table.lookup(torch.tensor([2, 1]))
    assert as_lists(offsets, got) == [[2, 0], [1]]
    table.update(torch.tensor([1]), None, torch.tensor([[1, 0]]))
    assert table.fixed and table.neighbors.tolist() == [[0, 1], [1, 0], [2, 0]]
    offsets, got = table.lookup(torch.tensor([2, 2]))
    assert offsets is None and got.tolist() == [[2, 0], [2, 0]]


def dense_bytes(lists: list[list[int]], fixed: bool, itemsize: int) -> int:
    """Bytes of lists held fixed width (ids only) or CSR (int64 offsets and ids)."""
    ids = sum(len(r) for r in lists) * itemsize
    return ids if fixed else ids + 8 * (len(lists) + 1)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_updates_and_lookups_match_a_list_model(data):
    """Both layouts and both id dtypes against Python lists: every lookup equals the model,
    and the table is fixed width exactly when every list has k entries."""
    num_classes = data.draw(st.sampled_from([1000, 2**40]), label="num_classes")
    ids = st.integers(0, num_classes - 1)
    itemsize = 4 if num_classes < 2**31 else 8
    n = data.draw(st.integers(1, 30), label="n")
    if data.draw(st.booleans(), label="full build"):
        k = data.draw(st.integers(0, 6), label="k")
        model = data.draw(st.lists(st.lists(ids, min_size=k, max_size=k), min_size=n,
                                   max_size=n))
        table = NeighborTable.from_csr(torch.arange(n), None,
                                       torch.tensor(model, dtype=torch.int64).reshape(n, k), n,
                                       num_classes=num_classes)
    else:
        model = data.draw(st.lists(st.lists(ids, max_size=6), min_size=n, max_size=n))
        k = max(len(r) for r in model)
        table = NeighborTable.from_csr(torch.arange(n), *to_csr(model), n,
                                       num_classes=num_classes)
    assert table.neighbors.dtype == (torch.int32 if itemsize == 4 else torch.int64)
    for _ in range(data.draw(st.integers(1, 4))):
        positions = data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
        m = len(positions)
        if data.draw(st.booleans(), label="fixed-width update"):
            w = data.draw(st.sampled_from([k, k, max(k - 1, 0), k + 1]), label="width")
            new = data.draw(st.lists(st.lists(ids, min_size=w, max_size=w), min_size=m,
                                     max_size=m))
            table.update(torch.tensor(positions, dtype=torch.int64), None,
                         torch.tensor(new, dtype=torch.int64).reshape(m, w))
        else:
            new = data.draw(st.lists(st.lists(ids, max_size=8), min_size=m, max_size=m))
            table.update(torch.tensor(positions, dtype=torch.int64), *to_csr(new))
        for p, row in zip(positions, new, strict=True):
            model[p] = row
        k = max([k] + [len(r) for r in new])
        fixed = all(len(r) == k for r in model)
        assert (table.k, table.fixed) == (k, fixed)
        assert table.nbytes() == dense_bytes(model, fixed, itemsize)
        ask = torch.tensor(data.draw(st.lists(st.integers(0, n - 1), max_size=40)),
                           dtype=torch.int64)
        got = table.lookup(ask)
        assert (got[0] is None) == fixed
        asked = [model[p] for p in ask.tolist()]
        assert as_lists(*got) == asked
        assert table.lookup_nbytes(ask) == dense_bytes(asked, fixed, itemsize)
    assert as_lists(table.offsets, table.neighbors) == model
    assert table.to_dense().tolist() == [r + [-1] * (k - len(r)) for r in model]

"""ams.shard.rowcopy: numpy row gathers and scatters, against torch's own indexing."""

from __future__ import annotations

import pytest
import torch

from ams.shard import rowcopy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_gather_and_scatter_equal_torch_indexing(dtype):
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(50, 7, generator=g).to(dtype)
    index = torch.randint(0, 50, (20,), generator=g)
    assert torch.equal(rowcopy.gather(rows, index), rows[index])
    out = torch.full((20, 7), -1.0, dtype=dtype)
    assert rowcopy.gather(rows, index, out=out) is out
    assert torch.equal(out, rows[index])
    target, expected = rows.clone(), rows.clone()
    unique = torch.randperm(50, generator=g)[:10]
    values = torch.randn(10, 7, generator=g).to(dtype)
    rowcopy.scatter(target, unique, values)
    expected[unique] = values
    assert torch.equal(target, expected)


def test_empty_index_and_strided_destinations():
    rows = torch.arange(12.0).view(4, 3)
    assert rowcopy.gather(rows, torch.empty(0, dtype=torch.int64)).shape == (0, 3)
    strided = torch.zeros(3, 6)[:, ::2]
    with pytest.raises(ValueError, match="contiguous destination"):
        rowcopy.gather(rows, torch.tensor([0, 1, 2]), out=strided)
    with pytest.raises(ValueError, match="destination of torch.float32"):  # no silent cast
        rowcopy.gather(rows, torch.tensor([0, 1, 2]), out=torch.zeros(3, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous destination"):
        rowcopy.scatter(strided, torch.tensor([0]), rows[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_equals_torch_copy_and_refuses_what_it_cannot_write(dtype):
    rows = torch.randn(9, 5, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = torch.zeros(9, 5, dtype=dtype)
    rowcopy.copy(out, rows)
    assert torch.equal(out, rows)
    with pytest.raises(ValueError, match="contiguous"):
        rowcopy.copy(torch.zeros(5, 9, dtype=dtype).t(), rows)
    with pytest.raises(ValueError, match=r"\(9, 5\)"):
        rowcopy.copy(torch.zeros(9, 4, dtype=dtype), rows)


def test_bounds_are_the_smallest_and_largest_index():
    gen = torch.Generator().manual_seed(1)
    index = torch.randint(-50, 10**12, (1000,), generator=gen)
    for view in (index, index[::7], index[:10], index[:1]):
        assert rowcopy.bounds(view) == (min(view.tolist()), max(view.tolist()))

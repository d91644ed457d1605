"""workers.comm.topk against an independent reference: numpy's lexicographic sort by
(value descending, index ascending), which also states the tie rule."""

import numpy as np
import pytest
import torch

from tests.conftest import DEVICES
from workers.comm import TopkMethod, topk

METHODS = [m.value for m in TopkMethod]


def reference(x: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(values float64, indices) of the k largest, equal values by ascending index."""
    values = x.double().cpu().numpy()
    order = np.lexsort((np.arange(values.size), -values))[:k]
    return values[order], order


def check(x: torch.Tensor, k: int, method: str) -> None:
    values, indices = topk(x, k, method)
    assert values.dtype == x.dtype and indices.dtype == torch.int64
    assert values.device == x.device and indices.device == x.device
    expected_values, expected_indices = reference(x, k)
    np.testing.assert_array_equal(indices.cpu().numpy(), expected_indices)
    np.testing.assert_array_equal(values.double().cpu().numpy(), expected_values)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", [(200_003, 200), (200_003, 2_000), (1 << 20, 1),
                                 (1 << 20, 10_000), (1000, 10)])
def test_random_entries_match_the_reference(device, method, dtype, n, k):
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(n, generator=g).to(dtype).to(device)
    check(x, k, method)
    check(x.abs(), k, method)  # magnitudes, as the compression hook ranks them


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
def test_ties_go_to_the_lowest_indices(device, method):
    g = torch.Generator().manual_seed(1)
    few_values = torch.randint(0, 7, (300_001,), generator=g).float().to(device)
    for k in (1, 5_000, 60_000):
        check(few_values, k, method)
    all_equal = torch.full((200_000,), 0.25, device=device)
    for k in (1, 777, 200_000):
        values, indices = topk(all_equal, k, method)
        assert torch.equal(indices.cpu(), torch.arange(k))
        assert bool((values == 0.25).all())


@pytest.mark.parametrize("method", METHODS)
def test_k_at_the_ends_and_negative_entries(method):
    g = torch.Generator().manual_seed(2)
    x = -torch.rand(150_000, generator=g) - 1.0  # every entry negative
    for k in (0, 1, 149_999, 150_000):
        check(x, k, method)
    x[[5, 70_000, 149_999]] = torch.tensor([float("inf"), -float("inf"), 3.0])
    check(x, 2, method)
    check(x, 150_000, method)


def test_a_sample_that_overestimates_the_threshold_is_retried_until_exact():
    # Every 16th entry (the strided sample's positions at this n) is large, the others small:
    # the sample puts the threshold among the large entries, so far fewer than k reach it.
    n = 1 << 20
    g = torch.Generator().manual_seed(3)
    x = torch.rand(n, generator=g)
    x[::16] += 100.0
    for k in (1_000, 65_536, 100_000):
        check(x, k, "sample")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("where", [0, 1234, 199_999])
def test_nan_is_refused_wherever_it_is(device, method, where):
    x = torch.rand(200_000, device=device)
    x[where] = float("nan")
    for k in (1, 100, 150_000):
        with pytest.raises(ValueError, match="NaN"):
            topk(x, k, method)


@pytest.mark.parametrize("bad, match", [
    (lambda: topk(torch.rand(4, 4), 2), "1-D"),
    (lambda: topk(torch.arange(10), 2), "floating"),
    (lambda: topk(torch.rand(10), 11), r"k=11 must be in \[0, 10\]"),
    (lambda: topk(torch.rand(10), -1), r"k=-1"),
    (lambda: topk(torch.rand(10), 2, "bisect"), "'bisect' is not one of 'sample', 'chunks'"),
])
def test_bad_input_is_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()

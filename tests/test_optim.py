"""ams.shard.optim's row update, compiled (ams/shard/_kernels.c) and in torch, against a
float64 reference in every pair of row and state dtypes; the compiled path's refusal of bad
arguments."""

from __future__ import annotations

import shutil

import pytest
import torch

import ams.shard.optim as optim
from ams.shard.optim import SparseMomentumSGD
from tests.conftest import reference_sgd_step

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The rounding of one stored value, relative: float32 leaves only float32 arithmetic
TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def test_the_kernel_is_built():
    """An editable install on a host with a C compiler builds the kernel: without it every
    push takes the slower torch update, and the compiled tests here skip."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this host")
    import ams.shard._kernels  # noqa: F401  (an ImportError fails the test)


def reference(rows, state, positions, grads, lr, momentum, wd, catch_up):
    """torch.optim.SGD in float64 on the gathered rows (after their decay catch-up)."""
    w = rows[positions].double()
    if catch_up is not None:
        w = w * catch_up.to(torch.float32).double()[:, None]
    v = state[positions].double()
    reference_sgd_step(w, v, torch.arange(positions.numel()), grads, lr, momentum, wd)
    return w, v


def rounded_as(got: torch.Tensor, want: torch.Tensor) -> float:
    """The share of ``got``'s values that equal float64 ``want`` rounded to ``got``'s dtype
    (to nearest even). float32 arithmetic is far finer than a float16 or bfloat16 step, so a
    low-precision value differs only where ``want`` lies within float32 error of a tie; a
    truncating conversion misses about half of them."""
    if got.dtype == torch.float32:
        return 1.0
    return float((got == want.to(got.dtype)).double().mean())


@pytest.mark.parametrize("rows_dtype", DTYPES)
@pytest.mark.parametrize("state_dtype", DTYPES)
@pytest.mark.parametrize("momentum,wd", [(0.9, 5e-4), (0.0, 0.01), (0.5, 0.0), (0.0, 0.0)])
@pytest.mark.parametrize("with_catch_up", [False, True])
def test_update_equals_float64_sgd(update_path, rows_dtype, state_dtype, momentum, wd,
                                   with_catch_up):
    g = torch.Generator().manual_seed(7)
    n, dim = 40, 37  # a dim that is no multiple of a vector width
    rows = (torch.randn(n, dim, generator=g) * 0.1).to(rows_dtype)
    width = dim if momentum else 0
    state = (torch.randn(n, width, generator=g) * 0.01).to(state_dtype)
    positions = torch.tensor([0, 3, 4, 17, 39, 22])
    grads = torch.randn(positions.numel(), dim, generator=g)
    catch_up = torch.rand(positions.numel(), generator=g, dtype=torch.float64) \
        if with_catch_up else None
    rows_before, state_before = rows.clone(), state.clone()

    update = SparseMomentumSGD(momentum, wd).compute(rows, state, positions, grads, 0.05,
                                                     catch_up)
    assert torch.equal(rows, rows_before) and torch.equal(state, state_before)  # only read
    assert update.first_non_finite() is None
    want_rows, want_state = reference(rows, state, positions, grads, 0.05, momentum, wd,
                                      catch_up)
    assert update.rows.dtype == rows_dtype and update.rows.shape == (positions.numel(), dim)
    tol = TOL[rows_dtype]
    torch.testing.assert_close(update.rows.double(), want_rows, rtol=tol, atol=tol * 0.1)
    assert rounded_as(update.rows, want_rows) > 0.98
    if momentum:
        assert update.state.dtype == state_dtype
        tol = TOL[state_dtype]
        torch.testing.assert_close(update.state.double(), want_state, rtol=tol, atol=tol)
        assert rounded_as(update.state, want_state) > 0.98
    else:
        assert update.state is None

    SparseMomentumSGD.commit(rows, state, update)
    assert torch.equal(rows[positions], update.rows)
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[positions] = False
    assert torch.equal(rows[untouched], rows_before[untouched])


@pytest.mark.parametrize("dtype,value,what", [
    (torch.float16, 7e4, "rows"),  # float16 overflows at 65504
    (torch.bfloat16, 3e38, "rows"),
    (torch.float32, float("nan"), "rows"),
    (torch.float32, float("inf"), "rows"),
])
def test_the_first_row_stored_non_finite_is_named(update_path, dtype, value, what):
    rows = torch.zeros(10, 4, dtype=dtype)
    state = torch.zeros(10, 4, dtype=dtype)
    positions = torch.tensor([1, 5, 6, 8])
    grads = torch.full((4, 4), 0.01)
    grads[2, 3] = value  # position 6
    grads[3, 0] = value
    lr = 10.0 if dtype == torch.bfloat16 else 1.0
    # momentum 0: v is the gradient, so the row is the first value to overflow
    update = SparseMomentumSGD(0.0, 0.0).compute(rows, state[:, :0], positions, -grads, lr)
    assert update.first_non_finite() == (what, 2)


def test_state_that_overflows_is_named_when_the_rows_stay_finite(update_path):
    # The momentum grows past float16's range while lr 0 leaves the rows where they are
    rows = torch.zeros(6, 3, dtype=torch.float16)
    state = torch.full((6, 3), 6e4, dtype=torch.float16)
    update = SparseMomentumSGD(0.9, 0.0).compute(rows, state, torch.tensor([0, 2, 4]),
                                                 torch.tensor([[0.0] * 3, [2e4] * 3, [0.0] * 3]),
                                                 0.0)
    assert update.first_non_finite() == ("state", 1)


def test_compiled_update_refuses_what_it_cannot_read():
    """The kernel reads raw memory: the Python side refuses anything it would misread."""
    if optim._kernels is None:
        pytest.skip("ams.shard._kernels is not built here")
    opt = SparseMomentumSGD(0.9, 0.0)
    rows, state = torch.zeros(8, 4), torch.zeros(8, 4)
    grads = torch.zeros(2, 4)
    cases = [
        (rows, state, torch.tensor([0, 8]), grads, "out of range"),
        (rows, state, torch.tensor([-1, 2]), grads, "out of range"),
        (rows, state, torch.tensor([0, 1], dtype=torch.int32), grads, "int64"),
        (rows.t(), state, torch.tensor([0, 1]), grads, "contiguous"),
        (rows, torch.zeros(8, 3), torch.tensor([0, 1]), grads, "does not match"),
        (rows, state, torch.tensor([0, 1]), torch.zeros(3, 4), "grads"),
        (rows.double(), state, torch.tensor([0, 1]), grads, "float32, float16 or bfloat16"),
    ]
    for r, s, p, gr, match in cases:
        with pytest.raises(ValueError, match=match):
            opt.compute(r, s, p, gr, 0.1)
    with pytest.raises(ValueError, match="catch_up"):
        opt.compute(rows, state, torch.tensor([0, 1]), grads, 0.1,
                    torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("rows_dtype,state_dtype", [(torch.float32, torch.float32),
                                                    (torch.float16, torch.float16),
                                                    (torch.bfloat16, torch.float32)])
def test_step_updates_in_place_as_float64_sgd(update_path, rows_dtype, state_dtype):
    g = torch.Generator().manual_seed(3)
    rows = (torch.randn(30, 19, generator=g) * 0.1).to(rows_dtype)
    state = (torch.randn(30, 19, generator=g) * 0.01).to(state_dtype)
    positions = torch.tensor([2, 5, 6, 29])
    grads = torch.randn(4, 19, generator=g)
    catch_up = torch.tensor([1.0, 0.5, 0.999, 0.25], dtype=torch.float64)
    rows_before, state_before = rows.clone(), state.clone()
    want_rows, want_state = reference(rows, state, positions, grads, 0.05, 0.9, 1e-3, catch_up)

    assert SparseMomentumSGD(0.9, 1e-3).step(rows, state, positions, grads, 0.05,
                                             catch_up) is None
    tol = TOL[rows_dtype]
    torch.testing.assert_close(rows[positions].double(), want_rows, rtol=tol, atol=tol * 0.1)
    tol = TOL[state_dtype]
    torch.testing.assert_close(state[positions].double(), want_state, rtol=tol, atol=tol)
    untouched = torch.ones(30, dtype=torch.bool)
    untouched[positions] = False
    assert torch.equal(rows[untouched], rows_before[untouched])
    assert torch.equal(state[untouched], state_before[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_refused_step_changes_nothing(update_path, dtype):
    """The in-place update writes rows before it knows a later one overflows: it must put
    every one back, bit for bit. Widths whose rows are saved with vector stores (a multiple
    of 32 bytes) and others."""
    g = torch.Generator().manual_seed(4)
    for dim in (8, 16, 37):
        rows = (torch.randn(20, dim, generator=g) * 0.1).to(dtype)
        state = (torch.randn(20, dim, generator=g) * 0.01).to(dtype)
        rows_before, state_before = rows.clone(), state.clone()
        positions = torch.tensor([1, 4, 9, 16, 19])
        grads = torch.randn(5, dim, generator=g) * 0.01
        grads[3, 5] = float("inf") if dtype == torch.float32 else 3e38  # position 16
        found = SparseMomentumSGD(0.9, 5e-4).step(rows, state, positions, grads, 10.0)
        assert found is not None and found[1] == 3
        assert torch.equal(rows.view(torch.uint8), rows_before.view(torch.uint8))
        assert torch.equal(state.view(torch.uint8), state_before.view(torch.uint8))


@pytest.mark.parametrize("rows_dtype,state_dtype", [(torch.float32, torch.float32),
                                                    (torch.float16, torch.float16),
                                                    (torch.bfloat16, torch.float32),
                                                    (torch.bfloat16, torch.bfloat16)])
def test_step_writes_what_compute_returns_bit_for_bit(update_path, rows_dtype, state_dtype):
    """What the in-place update writes into the table is what ``compute`` returns, for widths
    with and without a vector tail."""
    g = torch.Generator().manual_seed(5)
    for dim in (128, 131):
        rows = torch.randn(400, dim, generator=g).to(rows_dtype)
        state = (torch.randn(400, dim, generator=g) * 0.1).to(state_dtype)
        positions = torch.randperm(400, generator=g)[:150].sort().values
        grads = torch.randn(150, dim, generator=g)
        catch_up = torch.rand(150, generator=g, dtype=torch.float64)
        opt = SparseMomentumSGD(0.9, 5e-4)
        update = opt.compute(rows, state, positions, grads, 0.3, catch_up)
        assert opt.step(rows, state, positions, grads, 0.3, catch_up) is None
        assert torch.equal(rows[positions].view(torch.uint8), update.rows.view(torch.uint8))
        assert torch.equal(state[positions].view(torch.uint8), update.state.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rounding_to_the_stored_dtype_is_torchs_bit_for_bit(update_path, dtype):
    """With zero momentum state, the new state is the gradient rounded to the state dtype:
    every rounding case (ties to even, subnormals, the edge of the range) against torch's."""
    g = torch.Generator().manual_seed(11)
    exponents = torch.randint(-40, 18 if dtype == torch.float16 else 120, (4000,), generator=g)
    values = (1 + torch.rand(4000, generator=g)) * torch.pow(2.0, exponents.float())
    ulp_1 = 2.0 ** (-10 if dtype == torch.float16 else -7)
    edges = torch.tensor([1 + ulp_1 / 2, 1 + 1.5 * ulp_1, 2 ** -24, 2 ** -25, 3 * 2 ** -26,
                          2 ** -14 - 2 ** -25, 65504.0, 65519.0, 65520.0, 0.0, 2 ** -133,
                          3.3895e38, 3.4e38])
    grads = torch.cat([values, -values, edges, -edges]).view(-1, 1)
    n = grads.shape[0]
    state = torch.zeros(n, 1, dtype=dtype)
    rows = torch.zeros(n, 1)
    update = SparseMomentumSGD(0.5, 0.0).compute(rows, state, torch.arange(n), grads, 0.0)
    want = (grads + 0.0).to(dtype)  # g + momentum * 0: a -0.0 gradient gives +0.0
    finite = torch.isfinite(want).view(-1)
    assert torch.equal(update.state.view(torch.int16)[finite], want.view(torch.int16)[finite])
    assert not torch.isfinite(update.state[~finite]).any()
    assert update.first_non_finite() == ("state", int((~finite).nonzero()[0, 0]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_finite_low_precision_value_reads_and_writes_back_unchanged(update_path, dtype):
    bits = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    rows = values[torch.isfinite(values)].view(-1, 1).contiguous()
    n = rows.shape[0]
    update = SparseMomentumSGD(0.0, 0.0).compute(rows, rows[:, :0], torch.arange(n),
                                                 torch.zeros(n, 1), 0.0)
    assert update.first_non_finite() is None
    assert torch.equal(update.rows.view(torch.int16), rows.view(torch.int16))

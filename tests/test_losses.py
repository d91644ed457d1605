"""CombinedMarginLoss against a float64 formula written with the math module."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.losses import MARGIN_PRESETS, CombinedMarginLoss

# (m1, m2, m3): the presets plus insightface's combined margin and a SphereFace-like m1 = 2,
# whose switch-over angle (pi - m2) / m1 lies well inside [0, pi].
MARGINS = [*MARGIN_PRESETS.values(), (1.0, 0.3, 0.2), (2.0, 0.0, 0.0), (1.35, 0.2, 0.1)]


def reference_target(c: float, m1: float, m2: float, m3: float) -> float:
    """Unscaled margin logit of one target cosine, in float64."""
    theta = math.acos(min(1.0, max(-1.0, c)))
    switch = (math.pi - m2) / m1
    if theta <= switch:
        return math.cos(m1 * theta + m2) - m3
    return c - (1.0 + math.cos(switch)) - m3


def reference_target_slope(c: float, m1: float, m2: float) -> float:
    """d(target logit)/d(cos theta) of the formula above, for |c| < 1."""
    if m1 == 1.0 and m2 == 0.0:
        return 1.0
    theta = math.acos(c)
    if theta <= (math.pi - m2) / m1:
        return m1 * math.sin(m1 * theta + m2) / math.sin(theta)
    return 1.0


def reference_logits(cosine: np.ndarray, target: np.ndarray, s: float, margin) -> np.ndarray:
    out = cosine.astype(np.float64).copy()
    for i, t in enumerate(target):
        if t >= 0:
            out[i, t] = reference_target(float(out[i, t]), *margin)
    return s * out


def random_cosines(b: int, a: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, a, generator=g) * 2 - 1


@pytest.mark.parametrize("margin", MARGINS)
def test_logits_match_float64_formula(margin):
    cosine = random_cosines(16, 9, seed=1)
    target = torch.randint(0, 9, (16,), generator=torch.Generator().manual_seed(2))
    target[3] = -1
    loss = CombinedMarginLoss(64.0, *margin)
    got = loss(cosine, target)
    assert got.dtype == torch.float32 and got.shape == (16, 9)
    want = reference_logits(cosine.numpy(), target.numpy(), 64.0, margin)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=64 * 2e-6)


def test_absent_label_gets_scale_only():
    cosine = random_cosines(4, 5, seed=3)
    target = torch.full((4,), -1, dtype=torch.int64)
    got = CombinedMarginLoss.from_preset("arcface", s=30.0)(cosine, target)
    torch.testing.assert_close(got, cosine * 30.0, rtol=0, atol=0)


@pytest.mark.parametrize("margin", MARGINS)
@pytest.mark.parametrize("theta", [1e-3, 1e-2, 0.7, math.pi / 2, math.pi - 1e-2, math.pi - 1e-3])
def test_edge_angles_value_and_gradient(margin, theta):
    c = math.cos(theta)
    cosine = torch.tensor([[c, 0.1]], dtype=torch.float32, requires_grad=True)
    target = torch.tensor([0])
    logits = CombinedMarginLoss(1.0, *margin)(cosine, target)
    (grad,) = torch.autograd.grad(logits[0, 0], cosine)
    c32 = float(cosine.detach()[0, 0])
    assert logits[0, 0].item() == pytest.approx(reference_target(c32, *margin), abs=2e-6)
    # acos is ill-conditioned near 0 and pi: allow the float32 rounding of theta there.
    slope = reference_target_slope(c32, *margin[:2])
    assert grad[0, 0].item() == pytest.approx(slope, rel=2e-3, abs=1e-5)
    assert grad[0, 1].item() == 0.0


@pytest.mark.parametrize("margin", MARGINS)
def test_switch_over_angle_is_continuous_and_monotone(margin):
    m1, m2, _ = margin
    loss = CombinedMarginLoss(1.0, *margin)
    thetas = torch.linspace(1e-3, math.pi - 1e-3, 2001, dtype=torch.float64)
    values = loss.target_logit(torch.cos(thetas).float()).double()
    assert bool((values[1:] <= values[:-1] + 1e-6).all()), "target logit must fall as theta grows"
    switch = (math.pi - m2) / m1
    if switch < math.pi:
        around = torch.cos(torch.tensor([switch - 1e-4, switch + 1e-4])).float()
        below, above = loss.target_logit(around).tolist()
        assert below == pytest.approx(-1.0 - margin[2], abs=1e-3)
        assert above == pytest.approx(-1.0 - margin[2], abs=1e-3)


@pytest.mark.parametrize("name", list(MARGIN_PRESETS))
def test_cosines_of_exactly_plus_minus_one_stay_finite(name):
    cosine = torch.tensor([[1.0, -1.0], [-1.0, 1.0]], requires_grad=True)
    target = torch.tensor([0, 0])
    loss = CombinedMarginLoss.from_preset(name)
    logits = loss(cosine, target)
    logits.sum().backward()
    assert torch.isfinite(logits).all() and torch.isfinite(cosine.grad).all()
    m1, m2, m3 = MARGIN_PRESETS[name]
    # theta = 0 is clamped to acos(1 - 2^-23) ~ 4.9e-4 rad: logit within s * 5e-4 of the formula.
    assert logits[0, 0].item() == pytest.approx(64 * reference_target(1.0, m1, m2, m3), abs=0.04)
    assert logits[1, 0].item() == pytest.approx(64 * reference_target(-1.0, m1, m2, m3), abs=1e-4)


@settings(max_examples=60, deadline=None)
@given(
    c=st.floats(-1.0, 1.0, width=32),
    m1=st.sampled_from([1.0, 1.35, 2.0]),
    m2=st.floats(0.0, 1.0),
    m3=st.floats(0.0, 0.5),
)
def test_any_cosine_matches_formula(c, m1, m2, m3):
    loss = CombinedMarginLoss(1.0, m1, m2, m3)
    got = loss(torch.tensor([[c]], dtype=torch.float32), torch.tensor([0]))[0, 0].item()
    # Within 2^-23 of +-1 the clamp moves theta by up to 5e-4 rad (slope <= m1 in theta).
    tol = 2e-6 if abs(c) < 1 - 2 ** -23 else 2e-3
    assert got == pytest.approx(reference_target(c, m1, m2, m3), abs=tol)


def test_float32_logits_under_autocast_from_bfloat16_cosines():
    cosine = random_cosines(8, 6, seed=4).bfloat16()
    target = torch.arange(6).repeat(2)[:8]
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        got = CombinedMarginLoss.from_preset("arcface")(cosine, target)
    assert got.dtype == torch.float32
    want = reference_logits(cosine.float().numpy(), target.numpy(), 64.0, MARGIN_PRESETS["arcface"])
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=64 * 2e-6)


def test_presets_by_name():
    loss = CombinedMarginLoss.from_preset("cosface", s=32.0)
    assert (loss.s, loss.m1, loss.m2, loss.m3) == (32.0, 1.0, 0.0, 0.35)
    with pytest.raises(ValueError, match="arcface"):
        CombinedMarginLoss.from_preset("sphereface")


@pytest.mark.parametrize(
    ("cosine", "target", "message"),
    [
        (torch.zeros(2, 3), torch.tensor([0, 3]), r"\[-1, 3\)"),
        (torch.zeros(2, 3), torch.tensor([0, -2]), r"\[-1, 3\)"),
        (torch.zeros(2, 3), torch.tensor([0, 1], dtype=torch.int32), "int64"),
        (torch.zeros(2, 3), torch.tensor([0]), r"\(B, A\)"),
        (torch.zeros(3), torch.tensor([0, 1, 2]), r"\(B, A\)"),
    ],
)
def test_bad_inputs_are_rejected(cosine, target, message):
    with pytest.raises(ValueError, match=message):
        CombinedMarginLoss(64.0, 1.0, 0.5, 0.0)(cosine, target)


def test_bad_margins_are_rejected():
    with pytest.raises(ValueError):
        CombinedMarginLoss(0.0)
    with pytest.raises(ValueError):
        CombinedMarginLoss(64.0, m2=math.pi)

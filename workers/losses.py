"""Combined angular margin (ArcFace / CosFace / SphereFace-style / plain normalized softmax).

Given cosines cos(theta) between L2-normalized features and class rows, the target column of
each sample becomes ``cos(m1*theta + m2) - m3`` and every column is scaled by ``s``; the caller
feeds the result to cross-entropy.

Past the angle where ``m1*theta + m2`` reaches pi, ``cos(m1*theta + m2)`` turns back up, so a
sample far from its class would be rewarded for moving further away. PLSC's
``margin_cross_entropy`` kernel applies the formula as is; insightface's ArcFace switches to
``cos(theta) - m2*sin(m2)`` beyond that angle (monotone, but with a jump). We switch to
``cos(theta) - (1 + cos(theta_t))`` beyond ``theta_t = (pi - m2) / m1``: monotone in theta and
continuous at theta_t (both sides equal -1 there), so the loss has no jump either.
"""

from __future__ import annotations

import math
from enum import StrEnum

import torch
from torch import nn


class Margin(StrEnum):
    """The named margins a config can pick."""

    ARCFACE = "arcface"  # additive angular margin: cos(theta + 0.5)
    COSFACE = "cosface"  # additive cosine margin: cos(theta) - 0.35
    SOFTMAX = "softmax"  # normalized softmax, no margin


# (m1, m2, m3) of each named margin; insightface trains all of them with s = 64.
MARGIN_PRESETS: dict[Margin, tuple[float, float, float]] = {
    Margin.ARCFACE: (1.0, 0.5, 0.0),
    Margin.COSFACE: (1.0, 0.0, 0.35),
    Margin.SOFTMAX: (1.0, 0.0, 0.0),
}

# acos'(c) = -1/sqrt(1 - c^2) is infinite at c = +-1; clamping to 1 - 2^-23 (the float32 value
# just below 1) bounds it by about 2,050 and moves theta by at most 5e-4 rad.
_ACOS_EPS = torch.finfo(torch.float32).eps


class CombinedMarginLoss(nn.Module):
    """Margin logits from cosines.

    forward(cosine, target):
        cosine: (B, A) float (any float dtype; computed in at least float32), cos(theta) of
            normalized features against normalized active rows.
        target: (B,) int64, position of each sample's label among the A columns, or -1 for a
            sample whose label is not among them (that row gets no margin, only the scale).
        returns: (B, A) logits in float32 (float64 for float64 cosines), ``s * cos(theta)``
            off target and ``s * (cos(m1*theta + m2) - m3)`` on target (with the monotone
            extension described in the module docstring). Differentiable w.r.t. ``cosine``.
    """

    def __init__(self, s: float, m1: float = 1.0, m2: float = 0.0, m3: float = 0.0) -> None:
        super().__init__()
        if s <= 0 or m1 <= 0 or not 0.0 <= m2 < math.pi:
            raise ValueError(f"need s > 0, m1 > 0 and 0 <= m2 < pi; got s={s}, m1={m1}, m2={m2}")
        self.s, self.m1, self.m2, self.m3 = float(s), float(m1), float(m2), float(m3)
        self.threshold_angle = (math.pi - self.m2) / self.m1

    @classmethod
    def from_preset(cls, name: Margin | str, s: float = 64.0) -> CombinedMarginLoss:
        """The margin called ``name`` (a :class:`Margin`) with scale ``s``."""
        if name not in MARGIN_PRESETS:
            raise ValueError(f"unknown margin preset {name!r}; known: {', '.join(MARGIN_PRESETS)}")
        return cls(s, *MARGIN_PRESETS[Margin(name)])

    def extra_repr(self) -> str:
        return f"s={self.s}, m1={self.m1}, m2={self.m2}, m3={self.m3}"

    def target_logit(self, cos_theta: torch.Tensor) -> torch.Tensor:
        """Unscaled margin logit for target cosines: float32 (n,) -> float32 (n,)."""
        if self.m1 == 1.0 and self.m2 == 0.0:
            # CosFace / plain: no acos, so the gradient is exact everywhere, +-1 included.
            return cos_theta - self.m3
        theta = torch.acos(cos_theta.clamp(-1.0 + _ACOS_EPS, 1.0 - _ACOS_EPS))
        margin_cos = torch.cos(self.m1 * theta + self.m2)
        if self.threshold_angle < math.pi:
            continued = cos_theta - (1.0 + math.cos(self.threshold_angle))
            margin_cos = torch.where(theta <= self.threshold_angle, margin_cos, continued)
        return margin_cos - self.m3

    def forward(self, cosine: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if cosine.dim() != 2 or target.shape != cosine.shape[:1]:
            raise ValueError(f"expected cosine (B, A) and target (B,), got "
                             f"{tuple(cosine.shape)} and {tuple(target.shape)}")
        if target.dtype != torch.int64:
            raise ValueError(f"target must be int64, got {target.dtype}")
        if target.numel() and (int(target.min()) < -1 or int(target.max()) >= cosine.shape[1]):
            raise ValueError(f"target positions must lie in [-1, {cosine.shape[1]}), got range "
                             f"[{int(target.min())}, {int(target.max())}]")
        with torch.autocast(device_type=cosine.device.type, enabled=False):
            logits = cosine.to(torch.promote_types(cosine.dtype, torch.float32))
            rows = torch.nonzero(target >= 0).squeeze(1)
            cols = target[rows]
            logits = logits.index_put((rows, cols), self.target_logit(logits[rows, cols]))
            return logits * self.s

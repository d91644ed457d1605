"""Learning-rate schedule: linear warmup, then cosine decay to zero or constant."""

from __future__ import annotations

import math
from collections.abc import Iterable

from ams.optim import step_decay


def lr_at(step: int, peak: float, warmup_steps: int, total_steps: int, kind: str) -> float:
    """Learning rate of (0-based) ``step``: ``peak * (step+1)/warmup`` during warmup, then
    ``cosine`` (half a cosine from ``peak`` to 0 at ``total_steps``) or ``constant``."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if kind == "constant":
        return peak
    if kind != "cosine":
        raise ValueError(f"unknown schedule {kind!r}: cosine | constant")
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def decay_clocks(lrs: Iterable[float], weight_decay: float) -> list[float]:
    """The AMS weight-decay clock (``ams.optim``) at the start of each step and after the
    last: ``out[t] = sum over s < t of -log(1 - lrs[s] * weight_decay)``; len(lrs) + 1 values.
    """
    out = [0.0]
    for lr in lrs:
        if lr * weight_decay >= 1:
            raise ValueError(f"learning rate {lr} x weight decay {weight_decay} must be below 1")
        out.append(out[-1] + step_decay(lr, weight_decay))
    return out

"""Learning-rate schedule: linear warmup, then cosine decay to zero or constant."""

from __future__ import annotations

import math
from enum import StrEnum


class Schedule(StrEnum):
    """What the learning rate does after warmup."""

    COSINE = "cosine"  # half a cosine from the peak to 0 at the last step
    CONSTANT = "constant"  # stays at the peak (a growing batch may stand in for decay)


def lr_at(step: int, peak: float, warmup_steps: int, total_steps: int,
          kind: Schedule | str) -> float:
    """Learning rate of (0-based) ``step``: ``peak * (step+1)/warmup`` during warmup, then
    ``cosine`` (half a cosine from ``peak`` to 0 at ``total_steps``) or ``constant``."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if kind == Schedule.CONSTANT:
        return peak
    if kind != Schedule.COSINE:
        raise ValueError(f"unknown schedule {kind!r}: {' | '.join(Schedule)}")
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))

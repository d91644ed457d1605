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


# The class rows' automatic warm-up lasts until each class has been a label this many times on
# average (docs/accuracy.md, "The start: the class rows' warm-up").
ROW_WARMUP_LABEL_VISITS = 3


def row_warmup_steps(configured: int, warmup_steps: int, num_classes: int,
                     global_batch: int) -> int:
    """Steps of the class rows' linear warm-up: ``configured`` when >= 0, else (-1, auto) the
    steps in which each of ``num_classes`` classes is, on average, ``ROW_WARMUP_LABEL_VISITS``
    times a label of a ``global_batch``-sample batch, and never fewer than the backbone's
    ``warmup_steps``.

    Why: a row that has not yet been a label only decays (weight decay, at the rows' lr), and
    a scale-invariant row's step grows as 1 / |w|^2, so its first label step replaces it with
    one image's feature and leaves it a norm inversely proportional to what decay left of it,
    too large for later steps to turn. A warm-up over the first label visits keeps both the
    decay and those steps small until every class has been seen."""
    if configured >= 0:
        return configured
    if configured != -1:
        raise ValueError(f"row warm-up must be >= 0 or -1 (auto), got {configured}")
    return max(warmup_steps, math.ceil(ROW_WARMUP_LABEL_VISITS * num_classes / global_batch))

"""Training-time image augmentation, decided by (seed, rank, step) so that a resumed run
augments exactly as the uninterrupted one would have."""

from __future__ import annotations

import torch


def flip_horizontally(images: torch.Tensor, *, seed: int, rank: int, step: int) -> torch.Tensor:
    """Each image of ``images`` (B, C, H, W), any dtype, mirrored left-right with probability
    1/2; a new tensor (the input is left as it is). The choice depends only on ``seed``,
    ``rank`` and ``step``."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + rank) * 1_000_003 + step)
    mirrored = torch.rand(images.shape[0], generator=generator) < 0.5
    return torch.where(mirrored[:, None, None, None], images.flip(-1), images)

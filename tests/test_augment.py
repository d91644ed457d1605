"""workers.augment against numpy's fliplr, image by image."""

from __future__ import annotations

import numpy as np
import torch

from workers.augment import flip_horizontally


def test_flip_mirrors_about_half_the_images_and_repeats_for_the_same_step():
    images = torch.randint(0, 256, (1000, 3, 5, 7), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    before = images.clone()
    out = flip_horizontally(images, seed=3, rank=1, step=40)
    assert torch.equal(images, before)  # the input is left alone
    mirrored = []
    for original, result in zip(images.numpy(), out.numpy(), strict=True):
        flipped = np.stack([np.fliplr(channel) for channel in original])
        assert (result == original).all() or (result == flipped).all()
        mirrored.append(bool((result == flipped).all()))
    assert 400 < sum(mirrored) < 600
    # a resumed run decides the same; another step, rank or seed decides anew
    assert torch.equal(flip_horizontally(images, seed=3, rank=1, step=40), out)
    for other in ({"seed": 4, "rank": 1, "step": 40}, {"seed": 3, "rank": 0, "step": 40},
                  {"seed": 3, "rank": 1, "step": 41}):
        assert not torch.equal(flip_horizontally(images, **other), out), other

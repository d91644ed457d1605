"""ams.shard.rowinit's initial rows against the documented hash, computed in Python
integers and float64."""

from __future__ import annotations

import math

import pytest
import torch

from ams.shard.rowinit import initial_rows


def python_initial_rows(ids: list[int], dim: int, seed: int, std: float) -> torch.Tensor:
    """float64 reference of ams.shard.rowinit's documented draw, in Python integers: splitmix64
    of the class id xor the hashed seed starts a Weyl sequence over the columns; one mixing
    round gives 64 bits, whose two 24-bit uniforms feed Box-Muller."""
    mask, golden = (1 << 64) - 1, 0x9E3779B97F4A7C15
    mix1, mix2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

    def splitmix64(x: int) -> int:
        z = (x + golden) & mask
        z = ((z ^ (z >> 30)) * mix1) & mask
        z = ((z ^ (z >> 27)) * mix2) & mask
        return z ^ (z >> 31)

    base = splitmix64(seed)
    rows = []
    for class_id in ids:
        start = splitmix64(class_id ^ base)
        row = []
        for column in range(1, dim + 1):
            z = (start + column * golden) & mask
            z = ((z ^ (z >> 33)) * mix1) & mask
            z ^= z >> 29
            u1, u2 = ((z >> 40) + 0.5) / 2**24, (((z >> 16) & 0xFFFFFF) + 0.5) / 2**24
            row.append(std * math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("threads", [1, 3])
def test_initial_rows_equal_the_documented_hash_on_any_thread_count(threads):
    ids = torch.randint(0, 1 << 40, (30000,), generator=torch.Generator().manual_seed(4))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # 330,000 values: three passes of 131,072, the last one short
        got = initial_rows(ids, 11, seed=6, std=0.5)
    finally:
        torch.set_num_threads(previous)
    want = python_initial_rows(ids.tolist(), 11, 6, 0.5)
    # float32 uniforms: where u1 rounds to 1 the draw is 0, not the reference's ~1e-4 * std
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=2e-4)

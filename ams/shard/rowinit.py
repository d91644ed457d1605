"""Initial class rows as a pure function of (seed, class id, column).

Every element is drawn from a counter-based hash (splitmix64) of its coordinates, so a row's
initial value does not depend on how many shards there are, which shard holds it, or in which
order rows were created: W is the same for 1 shard or 32.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import torch

# A bound on the unit normals drawn here: the smallest uniform fed to Box-Muller is 2**-25, so
# |normal| <= sqrt(-2 ln 2**-25) = 5.89; rows of std s stay within MAX_ABS_NORMAL * s.
MAX_ABS_NORMAL = 6.0

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
# Values hashed per pass. torch runs an op of this size on one thread, so threads share the
# passes instead of each op, and a pass's int64 temporaries (1 MiB each) stay in a core's
# cache (passes of 16,384 rows of 512 spilled it: 7x slower). Smaller passes starve the threads
# of the GIL instead: each of a pass's ~25 ops holds it ~3 us to dispatch, and at 32,768 values
# an op computes for only ~9 us, so the 16 threads of two embedded shards creating their parts
# at once asked for the GIL ~4x over and queued on it.
_CHUNK_VALUES = 1 << 17


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 value with the same bits (torch has no uint64 math)."""
    return c - (1 << 64) if c >= (1 << 63) else c


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic on negative values)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (wrapping arithmetic). int64 -> int64, same shape."""
    z = x + _signed(_GOLDEN)
    z = (z ^ _shr(z, 30)) * _signed(_MIX1)
    z = (z ^ _shr(z, 27)) * _signed(_MIX2)
    return z ^ _shr(z, 31)


def initial_rows(ids: torch.Tensor, dim: int, seed: int, std: float,
                 dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """Normal(0, std) rows for the given class ids, identical for any sharding.

    ids: int64 (n,) -> (n, dim) of ``dtype``. Each row's hash starts a Weyl sequence over its
    columns; one mixing round per element gives 64 bits, of which two 24-bit uniforms feed
    Box-Muller (float32 is plenty for an initial value and several times faster than float64).
    ``out``: a (n, dim) tensor of ``dtype`` to write the rows into and return (a file
    mapping, say), instead of a new one. Runs on ``torch.get_num_threads()`` threads.
    """
    if out is None:
        out = torch.empty((ids.numel(), dim), dtype=dtype)
    elif tuple(out.shape) != (ids.numel(), dim) or out.dtype != dtype:
        raise ValueError(f"out: {tuple(out.shape)} {out.dtype}, need ({ids.numel()}, {dim}) "
                         f"{dtype}")
    base = splitmix64(torch.tensor([seed], dtype=torch.int64))
    steps = torch.arange(1, dim + 1, dtype=torch.int64) * _signed(_GOLDEN)
    scale = 1.0 / (1 << 24)
    chunk = max(1, _CHUNK_VALUES // dim)

    def fill(start: int) -> None:
        row_hash = splitmix64(ids[start:start + chunk].to(torch.int64) ^ base)
        z = row_hash[:, None] + steps[None, :]
        z ^= _shr(z, 33)
        z *= _signed(_MIX1)
        z ^= _shr(z, 29)
        # in place: each temporary a pass does not make is 512 KiB less to stream through the
        # cache; scale is a power of two, so folding 2 pi into it rounds as before
        u1 = _shr(z, 40).to(torch.float32).add_(0.5).mul_(scale)
        u2 = (_shr(z, 16) & 0xFFFFFF).to(torch.float32).add_(0.5).mul_(scale * 2.0 * math.pi)
        out[start:start + chunk] = u1.log_().mul_(-2.0).sqrt_().mul_(u2.cos_()).mul_(std)

    starts = range(0, ids.numel(), chunk)
    threads = min(torch.get_num_threads(), len(starts))
    if threads > 1:
        with ThreadPoolExecutor(threads, thread_name_prefix="rowinit") as pool:
            list(pool.map(fill, starts))  # list(): a pass's error is raised here
    else:
        for start in starts:
            fill(start)
    return out

"""Class id -> shard routing: the one function both client and server use.

Ids are routed by ``id mod num_shards``. Modulo spreads consecutive (often equally popular) class
ids over all shards, and lets a shard keep its rows in one dense tensor addressed by
``id // num_shards``: no hash map, no per-row overhead, memory equal to the payload.
"""

from __future__ import annotations

import numpy as np
import torch

# The bound on a table's class count: ids and the slot arithmetic on them stay well inside int64.
MAX_ROWS = 2**62

# numpy's integer division and remainder below: a shard divides the ids of every request it
# serves, most name a few ids, and a torch call costs several times a numpy one at that size


def shard_of(ids: torch.Tensor, num_shards: int) -> torch.Tensor:
    """Owning shard of each id. ids: int64 (n,) >= 0 (CPU) -> int64 (n,) in
    [0, num_shards)."""
    return torch.from_numpy(np.remainder(ids.numpy(), num_shards))


def local_index(ids: torch.Tensor, num_shards: int) -> torch.Tensor:
    """Position of each (owned) id in its shard's dense row tensor. int64 (n,) (CPU) -> int64
    (n,) (``ids`` itself with one shard)."""
    if num_shards == 1:
        return ids
    return torch.from_numpy(np.floor_divide(ids.numpy(), num_shards))


def owned_count(num_rows: int, shard_id: int, num_shards: int) -> int:
    """How many of the ids 0..num_rows-1 shard ``shard_id`` owns."""
    if shard_id >= num_rows:
        return 0
    return (num_rows - 1 - shard_id) // num_shards + 1


def owned_ids(num_rows: int, shard_id: int, num_shards: int, start: int = 0,
              stop: int | None = None) -> torch.Tensor:
    """Global ids of local positions ``start:stop`` of a shard, ascending. -> int64 (m,)."""
    n = owned_count(num_rows, shard_id, num_shards)
    stop = n if stop is None else min(stop, n)
    return torch.arange(start, stop, dtype=torch.int64) * num_shards + shard_id


def piece_name(shard_id: int, num_shards: int) -> str:
    """The name of shard ``shard_id`` of ``num_shards``'s directory in a data dir shared by the
    shards (its snapshot pieces, its table files): ``shard-IIIII-of-SSSSS``."""
    return f"shard-{shard_id:05d}-of-{num_shards:05d}"


# Shard counts up to which split_by_shard makes a pass per shard rather than sorting.
FEW_SHARDS = 4


def split_by_shard(ids: torch.Tensor, num_shards: int) -> list[torch.Tensor]:
    """Positions into ``ids`` of the ids each shard owns, one int64 tensor per shard.

    A stable argsort keeps request order within a shard, so replies reassemble with one
    scatter per shard.
    """
    if num_shards == 1:
        return [torch.arange(ids.numel(), dtype=torch.int64)]
    # this runs on every pull and push of a client: up to FEW_SHARDS, one pass over the owners
    # per shard beats any sort; past them numpy sorts owners of 16 bits by radix, several times
    # faster than torch's stable merge sort on one core
    owner = np.remainder(ids.numpy(), num_shards)
    if num_shards <= FEW_SHARDS:
        return [torch.from_numpy(np.flatnonzero(owner == s)) for s in range(num_shards)]
    if num_shards <= 1 << 16:
        owner = owner.astype(np.uint16)
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=num_shards).tolist()
    return list(torch.from_numpy(order).split(counts))

"""Build or refresh a table's neighbors graph through the public client API (local or gRPC
shards); callers pass the client: ``build_graph(client, table, k)``.

The pure search is ``ams.graph``; this module only feeds it each shard's Scan stream and writes
each class's list back to the shard that owns it (SetNeighbors). A table whose fp32 rows fit in
``IN_MEMORY_BUILD_BYTES``, built by one fp32 builder without a resume directory (the embedded
trainer's rebuilds, ``xcls graph build`` on a small table), is gathered and searched
symmetrically in memory; everything else takes the ring.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ams.client import ShardedClient, check_ids
from ams.errors import InvalidArgument
from ams.graph import (
    assign_shards,
    build_shard_neighbors,
    knn,
    refresh_neighbors,
    resolve_device,
    resolve_low_precision,
)

log = logging.getLogger(__name__)

# Tables whose fp32 rows fit in this are built in one process's memory (see build_graph).
IN_MEMORY_BUILD_BYTES = 1 << 30


def current_graph_version(client: ShardedClient, table: str) -> int:
    """The highest graph version any shard holds for ``table`` (0: none yet)."""
    return max(s["tables"][table]["graph_version"] for s in client.stats())


def build_graph(client: ShardedClient, table: str, k: int, *, step: int = 0,
                builders: int = 1, builder_index: int | None = None, version: int | None = None,
                device: str | None = None, low_precision: bool | None = None,
                resume_dir: Path | None = None, query_block_rows: int = 4096,
                key_block_rows: int = 4096, progress: bool = False) -> int:
    """Exact top-k lists of every class of ``table``, stored with the owning shards.

    ``builders`` split the shards (``assign_shards``); this call runs builder ``builder_index``
    only, or all of them one after the other when None. ``version``: the graph version to write
    (default: one above the current); builders running in separate processes must be given the
    same one. Returns the version written.
    """
    spec = client.spec(table)
    if not 0 < k <= spec.num_rows:
        raise InvalidArgument(f"k={k} must be in [1, num_rows={spec.num_rows}]")
    if builders < 1 or (builder_index is not None and not 0 <= builder_index < builders):
        raise InvalidArgument(f"builder_index={builder_index} must be in [0, builders={builders})")
    version = current_graph_version(client, table) + 1 if version is None else version
    dev = resolve_device(device)
    if (builders == 1 and resume_dir is None and not resolve_low_precision(low_precision, dev)
            and spec.num_rows * spec.dim * 4 <= IN_MEMORY_BUILD_BYTES):
        # One process builds everything in fp32 and the rows fit: hold them all and score each
        # pair of row blocks once for both blocks (ams.graph.symmetric_search), half the matmul
        # work of the ring, which streams every shard past every home shard. Same lists.
        started = time.perf_counter()
        blocks = list(client.scan(table, key_block_rows))
        ids = torch.cat([b[0] for b in blocks])
        rows = torch.cat([b[1] for b in blocks])
        del blocks
        neighbors, _ = knn(rows, k, block_size=query_block_rows, device=dev, ids=ids,
                           progress=progress)
        client.set_neighbors(table, ids, neighbors, version=version, step=step,
                             replace_all=True)
        log.info("graph_built table=%s k=%d version=%d step=%d rows=%d in_memory=1 "
                 "seconds=%.2f", table, k, version, step, ids.numel(),
                 time.perf_counter() - started)
        return version
    plan = assign_shards(client.num_shards, builders)
    mine = plan if builder_index is None else [plan[builder_index]]
    started = time.perf_counter()
    for home_shards in mine:
        for home in home_shards:
            shard_resume = resume_dir / f"v{version}" if resume_dir is not None else None
            ids, neighbors, _ = build_shard_neighbors(
                home, client.num_shards, lambda s: client.scan_shard(table, s, key_block_rows),
                k, query_block_rows=query_block_rows, key_block_rows=key_block_rows,
                device=device, low_precision=low_precision, resume_dir=shard_resume,
                progress=progress)
            client.set_neighbors(table, ids, neighbors, version=version, step=step,
                                 replace_all=True)
    log.info("graph_built table=%s k=%d version=%d step=%d shards=%d seconds=%.2f", table, k,
             version, step, sum(len(h) for h in mine), time.perf_counter() - started)
    return version


def refresh_graph(client: ShardedClient, table: str, class_ids: torch.Tensor, *, step: int = 0,
                  device: str | None = None, low_precision: bool | None = None) -> int:
    """Recompute the lists of just ``class_ids`` (int64 (m,), m << N) against all rows, in
    place, keeping their current length k. Returns the graph version now in force."""
    version = current_graph_version(client, table)
    if version == 0:
        raise InvalidArgument(f"table {table!r} has no graph to refresh; build one first")
    ids = torch.unique(check_ids(class_ids))
    k = client.neighbors(table, ids[:1]).shape[1]
    neighbors, _ = refresh_neighbors(ids, client.pull(table, ids), client.scan(table), k,
                                     device=device, low_precision=low_precision)
    client.set_neighbors(table, ids, neighbors, version=version, step=step, replace_all=False)
    return version

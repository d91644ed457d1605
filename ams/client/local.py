"""The shard backend in process: the client API over ``ShardStore`` objects, no sockets.

This is the embedded default (``ams.connect(local_shards=N)``): the same ``ShardedClient`` code
path as the cluster, with each call going straight to the store.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from ams.errors import FailedPrecondition, InvalidArgument, shorten
from ams.limits import REQUEST_BYTES
from ams.shard import restore, rowcopy, snapshot
from ams.shard.spec import TableSpec
from ams.shard.store import ShardStore
from ams.wire.pieces import PushPieces

log = logging.getLogger(__name__)


class LocalShard:
    """Shard ``shard_id`` of ``num_shards`` held in this process. ``data_dir``: where its
    snapshots go; ``keep_snapshots``: after each snapshot, keep only this many newest
    complete steps of it (``ams.shard.snapshot.prune_snapshots``; 0 keeps all); ``storage``,
    ``storage_dir``: where its tables live (``ShardStore``)."""

    def __init__(self, shard_id: int, num_shards: int, data_dir: Path | None = None,
                 keep_snapshots: int = 3, storage: str = "memory",
                 storage_dir: str | Path | None = None) -> None:
        if isinstance(keep_snapshots, bool) or not isinstance(keep_snapshots, int) \
                or keep_snapshots < 0:
            raise InvalidArgument(
                f"keep_snapshots={shorten(keep_snapshots)} must be an integer >= 0")
        self.store = ShardStore(shard_id, num_shards, storage=storage, storage_dir=storage_dir)
        self.data_dir = data_dir
        self.keep_snapshots = keep_snapshots
        self.last_snapshot_step = -1

    def create_table(self, spec: TableSpec) -> bool:
        return self.store.create_table(spec)

    def table_specs(self) -> dict[str, TableSpec]:
        return {name: t.spec for name, t in self.store.tables.items()}

    # in process nothing is gained by cutting a request into pieces: one per request limit
    piece_bytes = REQUEST_BYTES

    def pull(self, table: str, pieces: Sequence[torch.Tensor],
             into: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        """Each piece's rows straight to their places (``RemoteShard.pull``)."""
        out, positions = into
        start = 0
        for ids in pieces:
            end = start + ids.numel()
            if positions is None:
                self.store.pull(table, ids, out[start:end])
            else:
                rowcopy.scatter(out, positions[start:end], self.store.pull(table, ids))
            start = end

    def push(self, table: str, pieces: PushPieces, lr: float, client_id: str,
             decay_clock: float | None) -> list[bool]:
        """Each piece in turn."""
        return [self.store.push(table, ids, grads, lr, client_id, sequence, decay_clock)
                for ids, grads, sequence in pieces]

    def scan(self, table: str, block_rows: int | None
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.store.scan(table, block_rows)

    def snapshot(self, step: int, timeout: float | None = None) -> str:
        """Write this shard's piece of snapshot ``step`` (``timeout``: the backend protocol's;
        nothing is waited for in process)."""
        path = snapshot.write_snapshot(self.store, self._data_dir(), step)
        self.last_snapshot_step = step
        snapshot.prune_after_snapshot(self.data_dir, self.store.shard_id, self.store.num_shards,
                                      self.keep_snapshots, step)
        return str(path)

    def restore(self, step: int | None, timeout: float | None = None) -> tuple[int, str]:
        """Load this shard's piece of snapshot ``step`` (None: the newest complete one)."""
        got, path = restore.restore_into(self.store, self._data_dir(), step)
        self.last_snapshot_step = got
        return got, str(path)

    def stats(self) -> dict:
        return {**self.store.stats(), "address": "local",
                "last_snapshot_step": self.last_snapshot_step}

    def neighbors(self, table: str, ids: torch.Tensor
                  ) -> tuple[torch.Tensor | None, torch.Tensor]:
        return self.store.neighbors(table, ids)

    def set_neighbors(self, table: str, ids: torch.Tensor, offsets: torch.Tensor | None,
                      neighbors: torch.Tensor, version: int, step: int,
                      replace_all: bool) -> int:
        return self.store.set_neighbors(table, ids, offsets, neighbors, version, step,
                                        replace_all)

    def take_touched(self, table: str, max_ids: int | None) -> torch.Tensor:
        return self.store.take_touched(table, max_ids)

    def learn_incarnation(self) -> str:
        """An in-process shard cannot restart on its own: it is the process it was."""
        return "local"

    def close(self) -> None:
        """Close the store (``ShardStore.close``): mmap tables are kept for the next client
        on the same storage dir."""
        self.store.close()

    def _data_dir(self) -> Path:
        if self.data_dir is None:
            raise FailedPrecondition("snapshots need a data dir: ams.connect(local_shards=N, "
                                     "data_dir=...)")
        return self.data_dir

"""One shard's part of a table as the store keeps it (``ShardTable``), the copy a snapshot
takes of it (``TableCopy``), and how a new one is made and filled with its initial rows."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from ams import sharding
from ams.shard.dedupe import PushDedupe
from ams.shard.neighbor_lists import NeighborTable, StagedGraph
from ams.shard.optim import SparseMomentumSGD, catch_up_factors
from ams.shard.rowinit import initial_rows
from ams.shard.slots import RowSlots
from ams.shard.spec import TableSpec
from ams.shard.storage import MappedFiles, TableTensors


@dataclass
class TableCounters:
    pulls: int = 0
    pushes: int = 0
    rows_pulled: int = 0
    rows_pushed: int = 0


@dataclass(frozen=True)
class TableCopy:
    """A consistent copy of one shard's table, taken at one instant (see
    ``ShardStore.copy_table``): tensors as in ``ShardTable``, the graph's lists (offsets or
    None, neighbors; see ``NeighborTable``) and (version, step, k) or None, and the push
    dedupe state (``PushDedupe.to_json``)."""

    spec: TableSpec
    rows: torch.Tensor
    state: torch.Tensor
    row_clock: torch.Tensor
    clock: float
    graph: tuple[torch.Tensor | None, torch.Tensor, int, int, int] | None
    dedupe: list


@dataclass
class ShardTable:
    """One shard's part of a table. rows/state: (slots, dim); row_clock: float64 (slots,), the
    decay clock each row was last brought up to, by slot (``slots`` None: slot = local
    position, as in memory storage); clock: the newest clock a push reached here;
    graph: neighbor lists or None; files: the files rows, state and row_clock are mapped from
    (None: in memory); closed: ``ShardStore.close`` kept the table, pushes are refused."""

    spec: TableSpec
    rows: torch.Tensor
    state: torch.Tensor
    row_clock: torch.Tensor
    optimizer: SparseMomentumSGD
    clock: float = 0.0
    graph: NeighborTable | None = None
    staged_graph: StagedGraph | None = None  # the next full graph's parts, set_neighbors
    counters: TableCounters = field(default_factory=TableCounters)
    dedupe: PushDedupe = field(default_factory=PushDedupe)
    lock: threading.Lock = field(default_factory=threading.Lock)
    files: MappedFiles | None = None
    closed: bool = False
    touched: torch.Tensor | None = None  # bool (owned,): pushed since take_touched
    slots: RowSlots | None = None  # each row's slot in rows/state/row_clock (None: row p in p)

    @property
    def tensors(self) -> TableTensors:
        return TableTensors(self.rows, self.state, self.row_clock, self.files, self.slots)

    @property
    def owned(self) -> int:
        """Rows of the table on this shard (the tensors may have more slots)."""
        return self.slots.owned if self.slots is not None else self.rows.shape[0]

    def with_decay_owed(self, rows: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """``rows`` (m, dim), a copy of the rows in slots ``at`` (int64 (m,)) that the caller
        owns, multiplied in place by the decay each owes up to the table's clock (in float32,
        rounded once to the row dtype), and returned. Call under the table's lock."""
        if self.clock == 0.0 or rows.shape[0] == 0:
            return rows
        factors = catch_up_factors(self.row_clock.index_select(0, at), self.clock)
        # in place: the product is taken in float32 and rounded into the row dtype, the same
        # values as widening a copy first, without a second reply-sized buffer
        return rows.mul_(factors.to(torch.float32)[:, None])



def new_table(spec: TableSpec, tensors: TableTensors, clock: float = 0.0,
               graph: NeighborTable | None = None, dedupe: PushDedupe | None = None
               ) -> ShardTable:
    return ShardTable(spec, tensors.rows, tensors.state, tensors.row_clock,
                      SparseMomentumSGD(spec.momentum, spec.weight_decay), clock, graph,
                      dedupe=dedupe if dedupe is not None else PushDedupe(),
                      files=tensors.files, slots=tensors.slots)


# Rows given their initial values at a time when a table is made: bounds the temporaries
# (ids, float32 values) whatever the table's size.
INIT_BLOCK_ROWS = 1 << 18


def fill_initial_rows(rows: torch.Tensor, spec: TableSpec, shard_id: int,
                       num_shards: int) -> None:
    """Write the initial rows (``ams.shard.rowinit``) of shard ``shard_id`` of ``num_shards``'s part
    of ``spec`` into ``rows`` (owned, dim) of the row dtype, block by block."""
    for start in range(0, rows.shape[0], INIT_BLOCK_ROWS):
        stop = min(start + INIT_BLOCK_ROWS, rows.shape[0])
        ids = sharding.owned_ids(spec.num_rows, shard_id, num_shards, start, stop)
        initial_rows(ids, spec.dim, spec.seed, spec.init_std, spec.dtype, out=rows[start:stop])

"""One shard's class rows and optimizer state, in torch tensors. Pure: no gRPC, no I/O.

A table is split over shards by ``ams.sharding`` (id mod S). The shard keeps its part as two
dense tensors, ``rows`` and ``state`` (momentum), of shape (owned, dim), addressed by
``id // S``, and each row's weight-decay clock (see ``ams.optim``). Every public method
validates its arguments completely before it changes anything, so a bad request leaves the
shard exactly as it was.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from ams import rowcopy, sharding
from ams.dtypes import DTYPE_NAMES, parse_row_dtype
from ams.errors import (
    FailedPrecondition,
    IdOutOfRange,
    InvalidArgument,
    RequestTooLarge,
    TableExists,
    TableNotFound,
)
from ams.graph.csr import NeighborTable
from ams.optim import SparseMomentumSGD, catch_up_factors, step_decay
from ams.rowinit import initial_rows

# Per-client memory of applied push sequences. A retry arrives within a deadline or two, so a
# window of recent sequences per client is enough to apply each push once.
PUSH_DEDUPE_WINDOW = 4096
MAX_TABLE_NAME = 128


@dataclass(frozen=True)
class TableSpec:
    """What a table is. ``num_rows`` is the global class count (ids 0..num_rows-1)."""

    name: str
    num_rows: int
    dim: int
    dtype: torch.dtype = torch.float32
    state_dtype: torch.dtype = torch.float32
    momentum: float = 0.9
    weight_decay: float = 5e-4
    seed: int = 0
    init_std: float = 0.01

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > MAX_TABLE_NAME \
                or not self.name.isprintable() or "/" in self.name:
            raise InvalidArgument(
                f"table name {self.name!r}: need 1..{MAX_TABLE_NAME} printable characters, no '/'")
        if not isinstance(self.num_rows, int) or not 0 < self.num_rows < 2**62:
            raise InvalidArgument(f"num_rows={self.num_rows!r} must be an integer in [1, 2**62)")
        if not isinstance(self.dim, int) or not 0 < self.dim <= 65536:
            raise InvalidArgument(f"dim={self.dim!r} must be an integer in [1, 65536]")
        object.__setattr__(self, "dtype", parse_row_dtype(self.dtype, "dtype"))
        object.__setattr__(self, "state_dtype", parse_row_dtype(self.state_dtype, "state_dtype"))
        for name in ("momentum", "weight_decay", "init_std"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise InvalidArgument(f"{name}={value!r} must be a finite number >= 0")
        if self.momentum >= 1:
            raise InvalidArgument(f"momentum={self.momentum} must be < 1")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise InvalidArgument(f"seed={self.seed!r} must be an integer in [0, 2**63)")

    @property
    def state_width(self) -> int:
        """Columns of the optimizer state: ``dim`` with momentum, 0 without (plain SGD keeps
        no state, which halves a float32 table's memory)."""
        return self.dim if self.momentum else 0

    def describe(self) -> dict:
        """JSON-able form (dtype names), used by snapshots and stats."""
        return {
            "name": self.name, "num_rows": self.num_rows, "dim": self.dim,
            "dtype": DTYPE_NAMES[self.dtype], "state_dtype": DTYPE_NAMES[self.state_dtype],
            "momentum": self.momentum, "weight_decay": self.weight_decay, "seed": self.seed,
            "init_std": self.init_std,
        }

    @classmethod
    def from_description(cls, d: dict) -> TableSpec:
        return cls(**d)


@dataclass
class TableCounters:
    pulls: int = 0
    pushes: int = 0
    rows_pulled: int = 0
    rows_pushed: int = 0


@dataclass
class ShardTable:
    """One shard's part of a table. rows/state: (owned, dim); row_clock: float64 (owned,), the
    decay clock each row was last brought up to; clock: the newest clock a push reached here;
    graph: neighbor lists or None."""

    spec: TableSpec
    rows: torch.Tensor
    state: torch.Tensor
    row_clock: torch.Tensor
    optimizer: SparseMomentumSGD
    clock: float = 0.0
    graph: NeighborTable | None = None
    staged_graph: dict | None = None  # parts of the next full graph, see set_neighbors
    counters: TableCounters = field(default_factory=TableCounters)
    lock: threading.Lock = field(default_factory=threading.Lock)


class ShardStore:
    """The tables of shard ``shard_id`` of ``num_shards``.

    Thread-safe: each request is applied atomically per table (a push never interleaves with
    another push or a pull of the same table).
    """

    def __init__(self, shard_id: int = 0, num_shards: int = 1,
                 max_rows_per_request: int = 1 << 20) -> None:
        if not 0 <= shard_id < num_shards:
            raise InvalidArgument(f"shard_id={shard_id} must be in [0, num_shards={num_shards})")
        self.shard_id = shard_id
        self.num_shards = num_shards
        self.max_rows_per_request = max_rows_per_request
        self.tables: dict[str, ShardTable] = {}
        self._tables_lock = threading.Lock()
        self._applied: dict[str, OrderedDict[int, None]] = {}
        self._applied_lock = threading.Lock()

    # ---- tables -------------------------------------------------------------------------

    def create_table(self, spec: TableSpec) -> bool:
        """Create the shard's part of a table with its initial rows and zero state.

        Returns False if an identical table exists; a different one with that name raises
        ``TableExists``.
        """
        with self._tables_lock:
            existing = self.tables.get(spec.name)
            if existing is not None:
                if existing.spec != spec:
                    raise TableExists(
                        f"table {spec.name!r} exists with {existing.spec.describe()}, "
                        f"not {spec.describe()}")
                return False
            ids = sharding.owned_ids(spec.num_rows, self.shard_id, self.num_shards)
            rows = initial_rows(ids, spec.dim, spec.seed, spec.init_std, spec.dtype)
            state = torch.zeros((ids.numel(), spec.state_width), dtype=spec.state_dtype)
            row_clock = torch.zeros(ids.numel(), dtype=torch.float64)
            self.tables[spec.name] = ShardTable(
                spec, rows, state, row_clock, SparseMomentumSGD(spec.momentum, spec.weight_decay))
            return True

    def table(self, name: str) -> ShardTable:
        try:
            return self.tables[name]
        except KeyError:
            known = ", ".join(sorted(self.tables)) or "none"
            raise TableNotFound(f"unknown table {name!r} (tables here: {known})") from None

    def install_table(self, spec: TableSpec, rows: torch.Tensor, state: torch.Tensor,
                      row_clock: torch.Tensor, clock: float,
                      graph: NeighborTable | None = None) -> None:
        """Put a whole restored table in place (replacing one of the same name)."""
        n = sharding.owned_count(spec.num_rows, self.shard_id, self.num_shards)
        for what, t, shape, dtype in (
                ("rows", rows, (n, spec.dim), spec.dtype),
                ("state", state, (n, spec.state_width), spec.state_dtype),
                ("row_clock", row_clock, (n,), torch.float64)):
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise InvalidArgument(
                    f"{what} of table {spec.name!r}: {tuple(t.shape)} {t.dtype}, "
                    f"need {shape} {dtype}")
        _check_clock(clock)
        with self._tables_lock:
            self.tables[spec.name] = ShardTable(
                spec, rows, state, row_clock,
                SparseMomentumSGD(spec.momentum, spec.weight_decay), clock, graph)

    # ---- validation ---------------------------------------------------------------------

    def _positions(self, table: ShardTable, ids: torch.Tensor, field_name: str = "ids"
                   ) -> torch.Tensor:
        """Validate ids (int64, 1-D, in range, owned here) -> local positions, int64 (n,)."""
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids)
            raise InvalidArgument(f"{field_name}: need an int64 tensor of shape (n,), got {got}")
        if ids.numel() > self.max_rows_per_request:
            raise RequestTooLarge(
                f"{field_name}: {ids.numel()} ids in one request, the limit is "
                f"{self.max_rows_per_request}; split the request")
        if ids.numel() == 0:
            return ids
        lo, hi = int(ids.min()), int(ids.max())
        num_rows = table.spec.num_rows
        if lo < 0 or hi >= num_rows:
            bad = lo if lo < 0 else hi
            raise IdOutOfRange(
                f"{field_name}: id {bad} is outside table {table.spec.name!r} "
                f"(num_rows={num_rows}, valid ids 0..{num_rows - 1})")
        if self.num_shards > 1:
            foreign = sharding.shard_of(ids, self.num_shards) != self.shard_id
            if bool(foreign.any()):
                bad = int(ids[foreign][0])
                raise IdOutOfRange(
                    f"{field_name}: id {bad} belongs to shard {bad % self.num_shards}, "
                    f"this is shard {self.shard_id} of {self.num_shards}")
        return sharding.local_index(ids, self.num_shards)

    def _check_grads(self, table: ShardTable, grads: torch.Tensor, n: int) -> None:
        dim = table.spec.dim
        if not isinstance(grads, torch.Tensor) or not grads.is_floating_point():
            raise InvalidArgument(f"grads: need a float tensor of shape ({n}, {dim})")
        if tuple(grads.shape) != (n, dim):
            raise InvalidArgument(
                f"grads: shape {tuple(grads.shape)}, need ({n}, {dim}) for {n} ids "
                f"of table {table.spec.name!r}")
        if n and not bool(torch.isfinite(grads).all()):
            bad = int((~torch.isfinite(grads)).any(dim=1).nonzero()[0, 0])
            raise InvalidArgument(f"grads: row {bad} has a non-finite value (nan or inf)")

    # ---- rows ---------------------------------------------------------------------------

    def pull(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` in request order (repeats allowed). int64 (n,) -> (n, dim) row dtype.

        Each row comes with the weight decay it owes up to the newest clock pushed here
        (``ams.optim``), so it is the row the dense optimizer would hold after that push."""
        table = self.table(name)
        positions = self._positions(table, ids)
        with table.lock:
            out = _with_decay_owed(table, rowcopy.gather(table.rows, positions), positions)
            table.counters.pulls += 1
            table.counters.rows_pulled += positions.numel()
        return out

    def push(self, name: str, ids: torch.Tensor, grads: torch.Tensor, lr: float,
             client_id: str = "", sequence: int = 0, decay_clock: float | None = None) -> bool:
        """Apply sparse momentum SGD to exactly the pushed rows.

        ids: int64 (n,), repeats summed first; grads: float (n, dim); lr >= 0.
        ``(client_id, sequence)`` with a non-empty client id makes the push idempotent: a
        repeat returns False and changes nothing. ``decay_clock``: the step's decay clock
        (``ams.optim``); the rows first take the weight decay of the steps they sat out, and
        the clock advances by this step's decay. None: no catch-up, clocks unchanged.
        Returns True when applied.
        """
        table = self.table(name)
        positions = self._positions(table, ids)
        self._check_grads(table, grads, positions.numel())
        if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise InvalidArgument(f"lr={lr!r} must be a finite number >= 0")
        clocked = decay_clock is not None and table.spec.weight_decay > 0
        if decay_clock is not None:
            _check_clock(decay_clock)
            if clocked and lr * table.spec.weight_decay >= 1:
                raise InvalidArgument(
                    f"lr={lr} x weight_decay={table.spec.weight_decay} must stay below 1 for "
                    "the decay clock")
        if positions.numel() == 0:
            return True
        unique, inverse = torch.unique(positions, return_inverse=True)
        summed = torch.zeros((unique.numel(), table.spec.dim), dtype=torch.float32)
        summed.index_add_(0, inverse, grads.to(torch.float32))
        if client_id and not self._claim(client_id, sequence):
            return False
        try:
            with table.lock:
                row_clock = table.row_clock.index_select(0, unique) if clocked else None
                table.optimizer.apply(table.rows, table.state, unique, summed, float(lr),
                                      catch_up_factors(row_clock, decay_clock) if clocked
                                      else None)
                if clocked:
                    after = float(decay_clock) + step_decay(float(lr), table.spec.weight_decay)
                    table.row_clock.index_copy_(0, unique, row_clock.clamp(min=after))
                    table.clock = max(table.clock, after)
                table.counters.pushes += 1
                table.counters.rows_pushed += positions.numel()
        except BaseException:
            if client_id:
                self._release(client_id, sequence)
            raise
        return True

    def _claim(self, client_id: str, sequence: int) -> bool:
        with self._applied_lock:
            seen = self._applied.setdefault(client_id, OrderedDict())
            if sequence in seen:
                return False
            seen[sequence] = None
            if len(seen) > PUSH_DEDUPE_WINDOW:
                seen.popitem(last=False)
            return True

    def _release(self, client_id: str, sequence: int) -> None:
        with self._applied_lock:
            self._applied.get(client_id, OrderedDict()).pop(sequence, None)

    def scan(self, name: str, block_rows: int = 65536
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Blocks of (ids int64 (b,) ascending, rows (b, dim) row dtype) covering the shard,
        with the weight decay they owe (as ``pull``)."""
        table = self.table(name)
        if block_rows <= 0:
            raise InvalidArgument(f"block_rows={block_rows} must be > 0")
        n = table.rows.shape[0]
        for start in range(0, n, block_rows):
            stop = min(start + block_rows, n)
            with table.lock:
                rows = _with_decay_owed(table, table.rows[start:stop].clone(),
                                        torch.arange(start, stop))
            yield sharding.owned_ids(table.spec.num_rows, self.shard_id, self.num_shards,
                                     start, stop), rows

    # ---- neighbor lists ----------------------------------------------------------------

    def neighbors(self, name: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Neighbor lists of ``ids`` (request order) as CSR: offsets int64 (n+1,),
        neighbors int64 (offsets[-1],)."""
        table = self.table(name)
        positions = self._positions(table, ids)
        graph = table.graph
        if graph is None:
            raise FailedPrecondition(
                f"table {name!r} has no neighbor graph yet: build it first "
                "(ams.graph_build.build_graph or 'xcls graph build')")
        return graph.lookup(positions)

    def set_neighbors(self, name: str, ids: torch.Tensor, offsets: torch.Tensor,
                      neighbors: torch.Tensor, version: int, step: int,
                      replace_all: bool) -> int:
        """Store neighbor lists (CSR, see ``neighbors``) for owned ``ids``.

        ``replace_all``: the lists belong to a new table of this ``version``, which may arrive in
        several calls (messages are size-limited); it replaces the current table once its calls
        have covered every owned row exactly once, and a call of another version starts over.
        Otherwise the lists of ``ids`` are replaced in place (partial refresh). Returns the graph
        version now in force (0: none yet).
        """
        table = self.table(name)
        positions = self._positions(table, ids)
        n = positions.numel()
        for what, t in (("offsets", offsets), ("neighbors", neighbors)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
                raise InvalidArgument(f"{what}: need an int64 tensor of shape (m,)")
        if offsets.numel() != n + 1 or int(offsets[0]) != 0 \
                or bool((offsets[1:] < offsets[:-1]).any()) \
                or int(offsets[-1]) != neighbors.numel():
            raise InvalidArgument(
                f"offsets: need {n + 1} non-decreasing values from 0 to len(neighbors)="
                f"{neighbors.numel()}")
        if neighbors.numel() and (int(neighbors.min()) < 0
                                  or int(neighbors.max()) >= table.spec.num_rows):
            raise IdOutOfRange(
                f"neighbors: ids must be in 0..{table.spec.num_rows - 1}, got "
                f"{int(neighbors.min())}..{int(neighbors.max())}")
        if torch.unique(positions).numel() != n:
            raise InvalidArgument("ids: repeated ids in one neighbor update")
        with table.lock:
            if replace_all:
                self._stage_graph(table, positions, offsets, neighbors, version, step)
            else:
                if table.graph is None:
                    raise FailedPrecondition(
                        f"table {name!r} has no neighbor graph to refresh; build it first")
                table.graph.update(positions, offsets, neighbors)
                table.graph.version, table.graph.step = version, step
            return table.graph.version if table.graph is not None else 0

    def _stage_graph(self, table: ShardTable, positions: torch.Tensor, offsets: torch.Tensor,
                     neighbors: torch.Tensor, version: int, step: int) -> None:
        """Collect one part of a full graph; install the graph when every row has its list."""
        owned = table.rows.shape[0]
        staged = table.staged_graph
        if staged is None or staged["version"] != version:
            staged = table.staged_graph = {"version": version, "step": step, "parts": [],
                                           "covered": torch.zeros(owned, dtype=torch.bool)}
        seen = staged["covered"][positions]
        if positions.numel() and bool(seen.all()):
            return  # a retried delivery of a part already staged
        if bool(seen.any()):
            raise InvalidArgument(f"ids: some rows already have a list in graph version "
                                  f"{version}; each row is sent once per version")
        staged["covered"][positions] = True
        staged["parts"].append((positions, offsets, neighbors))
        if not bool(staged["covered"].all()):
            return
        graph = NeighborTable.from_parts(staged["parts"], owned)
        graph.version, graph.step = version, staged["step"]
        table.graph, table.staged_graph = graph, None

    # ---- introspection ------------------------------------------------------------------

    def stats(self) -> dict:
        """Per-table counters and sizes, JSON-able."""
        out = {"shard_id": self.shard_id, "num_shards": self.num_shards, "tables": {}}
        for name, t in list(self.tables.items()):
            g = t.graph
            out["tables"][name] = {
                "spec": t.spec.describe(),
                "owned_rows": t.rows.shape[0],
                "row_bytes": t.rows.numel() * t.rows.element_size(),
                "state_bytes": t.state.numel() * t.state.element_size(),
                "decay_clock": t.clock,
                **vars(replace(t.counters)),
                "graph_version": g.version if g else 0,
                "graph_step": g.step if g else -1,
                "graph_k": g.k if g else 0,
            }
        return out


def _check_clock(clock: float) -> None:
    if not isinstance(clock, (int, float)) or not math.isfinite(clock) or clock < 0:
        raise InvalidArgument(f"decay_clock={clock!r} must be a finite number >= 0")


def _with_decay_owed(table: ShardTable, rows: torch.Tensor, positions: torch.Tensor
                     ) -> torch.Tensor:
    """``rows`` (m, dim), a copy of the rows at local ``positions`` (m,), times the decay each
    owes up to the table's clock (rounded once to the row dtype); ``rows`` itself when none
    is owed. Call under the table's lock."""
    if table.clock == 0.0 or rows.shape[0] == 0:
        return rows
    factors = catch_up_factors(table.row_clock.index_select(0, positions), table.clock)
    return (rows.to(torch.float32) * factors.to(torch.float32)[:, None]).to(rows.dtype)

"""One shard's class rows and optimizer state, in torch tensors. Pure: no gRPC, no I/O.

A table is split over shards by ``ams.sharding`` (id mod S). The shard keeps its part as two
dense tensors, ``rows`` and ``state`` (momentum), of shape (owned, dim), addressed by
``id // S``, and each row's weight-decay clock (see ``ams.optim``). Every public method
validates its arguments completely before it changes anything, so a bad request leaves the
shard exactly as it was.
"""

from __future__ import annotations

import math
import os
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
    shorten,
)
from ams.graph.csr import NeighborTable
from ams.optim import RowUpdate, SparseMomentumSGD, catch_up_factors, step_decay
from ams.rowinit import initial_rows
from ams.wire import MAX_REPLY_PAYLOAD_BYTES

# Per-client memory of applied push sequences. A retry arrives within a deadline or two, so a
# window of recent sequences per client is enough to apply each push once.
PUSH_DEDUPE_WINDOW = 4096
# Clients whose pushes a table remembers; the one that pushed least recently goes first. A
# client forgotten this way stopped pushing long before any retry of its could arrive.
PUSH_DEDUPE_CLIENTS = 1024
MAX_CLIENT_ID = 128
MAX_TABLE_NAME = 128
MAX_SEQUENCE = 2**64  # the wire field is uint64


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
            raise InvalidArgument(f"table name {shorten(self.name)}: need 1..{MAX_TABLE_NAME} "
                                  "printable characters, no '/'")
        if not isinstance(self.num_rows, int) or not 0 < self.num_rows < 2**62:
            raise InvalidArgument(
                f"num_rows={shorten(self.num_rows)} must be an integer in [1, 2**62)")
        if not isinstance(self.dim, int) or not 0 < self.dim <= 65536:
            raise InvalidArgument(f"dim={shorten(self.dim)} must be an integer in [1, 65536]")
        object.__setattr__(self, "dtype", parse_row_dtype(self.dtype, "dtype"))
        object.__setattr__(self, "state_dtype", parse_row_dtype(self.state_dtype, "state_dtype"))
        for name in ("momentum", "weight_decay", "init_std"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise InvalidArgument(f"{name}={shorten(value)} must be a finite number >= 0")
        if self.momentum >= 1:
            raise InvalidArgument(f"momentum={self.momentum} must be < 1")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise InvalidArgument(f"seed={shorten(self.seed)} must be an integer in [0, 2**63)")

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

    def bytes_per_shard(self, num_shards: int) -> int:
        """Memory the largest part of this table takes on one of ``num_shards`` shards: rows,
        state and decay clocks."""
        owned = sharding.owned_count(self.num_rows, 0, num_shards)
        row_bytes = self.dim * _itemsize(self.dtype)
        state_bytes = self.state_width * _itemsize(self.state_dtype)
        return owned * (row_bytes + state_bytes + 8)


@dataclass
class TableCounters:
    pulls: int = 0
    pushes: int = 0
    rows_pulled: int = 0
    rows_pushed: int = 0


class PushDedupe:
    """The (client id, sequence) pairs of the pushes a table applied, so that a retried push
    applies once.

    Bounded: the newest ``PUSH_DEDUPE_WINDOW`` sequences of each client, and the
    ``PUSH_DEDUPE_CLIENTS`` clients that pushed most recently (least recent forgotten first).
    Not thread-safe: its table's lock guards it, so it always agrees with the table's rows.
    """

    def __init__(self) -> None:
        self._clients: OrderedDict[str, OrderedDict[int, None]] = OrderedDict()

    def __contains__(self, key: tuple[str, int]) -> bool:
        client_id, sequence = key
        return sequence in self._clients.get(client_id, ())

    def add(self, client_id: str, sequence: int) -> None:
        seen = self._clients.setdefault(client_id, OrderedDict())
        self._clients.move_to_end(client_id)
        seen[sequence] = None
        if len(seen) > PUSH_DEDUPE_WINDOW:
            seen.popitem(last=False)
        if len(self._clients) > PUSH_DEDUPE_CLIENTS:
            self._clients.popitem(last=False)

    def merge(self, other: PushDedupe) -> None:
        """Add ``other``'s pairs (a table restored from several pieces holds all of them)."""
        for client_id, sequences in other._clients.items():
            for sequence in sequences:
                self.add(client_id, sequence)

    def to_json(self) -> list:
        """JSON-able form: [[client id, [sequence, ...]], ...], least recent first."""
        return [[client_id, list(seen)] for client_id, seen in self._clients.items()]

    @classmethod
    def from_json(cls, data: object) -> PushDedupe:
        """Inverse of ``to_json``; ``InvalidArgument`` for anything malformed."""
        out = cls()
        if not isinstance(data, list):
            raise InvalidArgument(f"push dedupe state: need a list, got {type(data).__name__}")
        for item in data:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], list)):
                raise InvalidArgument(f"push dedupe state: malformed entry {shorten(item)}")
            _check_client(item[0], 0)
            for sequence in item[1]:
                _check_client(item[0], sequence)
                out.add(item[0], sequence)
        return out


@dataclass(frozen=True)
class TableCopy:
    """A consistent copy of one shard's table, taken at one instant (see
    ``ShardStore.copy_table``): tensors as in ``ShardTable``, the graph's CSR tensors and
    (version, step, k) or None, and the push dedupe state (``PushDedupe.to_json``)."""

    spec: TableSpec
    rows: torch.Tensor
    state: torch.Tensor
    row_clock: torch.Tensor
    clock: float
    graph: tuple[torch.Tensor, torch.Tensor, int, int, int] | None
    dedupe: list


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
    dedupe: PushDedupe = field(default_factory=PushDedupe)
    lock: threading.Lock = field(default_factory=threading.Lock)


class ShardStore:
    """The tables of shard ``shard_id`` of ``num_shards``.

    Thread-safe: each request is applied atomically per table (a push never interleaves with
    another push or a pull of the same table).
    """

    def __init__(self, shard_id: int = 0, num_shards: int = 1,
                 max_rows_per_request: int = 1 << 20,
                 max_reply_bytes: int = MAX_REPLY_PAYLOAD_BYTES) -> None:
        """``max_rows_per_request``: ids one request may name; ``max_reply_bytes``: tensor
        bytes one reply (pull, scan block, neighbor lists) may carry, checked before the reply
        is built, so local shards refuse what a remote one would."""
        if not 0 <= shard_id < num_shards:
            raise InvalidArgument(f"shard_id={shard_id} must be in [0, num_shards={num_shards})")
        self.shard_id = shard_id
        self.num_shards = num_shards
        self.max_rows_per_request = max_rows_per_request
        self.max_reply_bytes = max_reply_bytes
        self.tables: dict[str, ShardTable] = {}
        self._tables_lock = threading.Lock()

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
                        f"table {shorten(spec.name)} exists with {existing.spec.describe()}, "
                        f"not {spec.describe()}")
                return False
            rows, state, row_clock = self._allocate(spec)
            self.tables[spec.name] = ShardTable(
                spec, rows, state, row_clock, SparseMomentumSGD(spec.momentum, spec.weight_decay))
            return True

    def _allocate(self, spec: TableSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Initial rows, zero state and zero decay clocks of this shard's part of ``spec``;
        ``RequestTooLarge`` when the memory cannot be had."""
        needed = spec.bytes_per_shard(self.num_shards)
        advice = "use more shards, fewer rows or a smaller dtype"
        physical = _physical_memory_bytes()
        # Past physical memory an allocation may still succeed (overcommit) and the process
        # be killed while the rows are filled in; refuse it before it starts.
        if physical is not None and needed > physical:
            raise RequestTooLarge(
                f"table {shorten(spec.name)} needs {needed} bytes on each of {self.num_shards} "
                f"shards, more than this machine's {physical} bytes of memory; {advice}")
        try:
            ids = sharding.owned_ids(spec.num_rows, self.shard_id, self.num_shards)
            rows = initial_rows(ids, spec.dim, spec.seed, spec.init_std, spec.dtype)
            state = torch.zeros((ids.numel(), spec.state_width), dtype=spec.state_dtype)
            row_clock = torch.zeros(ids.numel(), dtype=torch.float64)
        except (RuntimeError, MemoryError) as e:  # torch raises RuntimeError when malloc fails
            raise RequestTooLarge(
                f"table {shorten(spec.name)} needs {needed} bytes on each of {self.num_shards} "
                f"shards and this shard cannot allocate them ({shorten(str(e))}); "
                f"{advice}") from None
        return rows, state, row_clock

    def table(self, name: str) -> ShardTable:
        try:
            return self.tables[name]
        except KeyError:
            known = shorten(", ".join(sorted(self.tables)), 200) if self.tables else "none"
            raise TableNotFound(f"unknown table {shorten(name)} (tables here: {known})") from None

    def install_table(self, spec: TableSpec, rows: torch.Tensor, state: torch.Tensor,
                      row_clock: torch.Tensor, clock: float,
                      graph: NeighborTable | None = None,
                      dedupe: PushDedupe | None = None) -> None:
        """Put a whole restored table in place (replacing one of the same name), with the
        push dedupe state that goes with its rows (None: none remembered)."""
        n = sharding.owned_count(spec.num_rows, self.shard_id, self.num_shards)
        for what, t, shape, dtype in (
                ("rows", rows, (n, spec.dim), spec.dtype),
                ("state", state, (n, spec.state_width), spec.state_dtype),
                ("row_clock", row_clock, (n,), torch.float64)):
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise InvalidArgument(
                    f"{what} of table {shorten(spec.name)}: {tuple(t.shape)} {t.dtype}, "
                    f"need {shape} {dtype}")
        _check_clock(clock)
        with self._tables_lock:
            self.tables[spec.name] = ShardTable(
                spec, rows, state, row_clock,
                SparseMomentumSGD(spec.momentum, spec.weight_decay), clock, graph,
                dedupe=dedupe if dedupe is not None else PushDedupe())

    def copy_table(self, name: str) -> TableCopy:
        """A copy of table ``name`` at one instant: its tensors, clock, graph and push dedupe
        state, taken under the table's lock, so the rows hold exactly the pushes the dedupe
        state remembers. The lock is held for memory copies only (a snapshot writes the
        copy to disk afterwards, while pushes and pulls go on)."""
        table = self.table(name)
        with table.lock:
            g = table.graph
            # a graph's tensors are replaced, never written in place: references suffice
            graph = (g.offsets, g.neighbors, g.version, g.step, g.k) if g is not None else None
            return TableCopy(table.spec, table.rows.clone(), table.state.clone(),
                             table.row_clock.clone(), table.clock, graph,
                             table.dedupe.to_json())

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
                f"{field_name}: id {bad} is outside table {shorten(table.spec.name)} "
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
                f"of table {shorten(table.spec.name)}")
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
        self._check_reply(positions.numel() * _row_bytes(table.spec), f"a pull of "
                          f"{positions.numel()} rows", _row_bytes(table.spec), "rows per pull")
        with table.lock:
            out = _with_decay_owed(table, rowcopy.gather(table.rows, positions), positions)
            table.counters.pulls += 1
            table.counters.rows_pulled += positions.numel()
        return out

    def push(self, name: str, ids: torch.Tensor, grads: torch.Tensor, lr: float,
             client_id: str = "", sequence: int = 0, decay_clock: float | None = None) -> bool:
        """Apply sparse momentum SGD to exactly the pushed rows.

        ids: int64 (n,), repeats summed first; grads: float (n, dim); lr >= 0.
        ``(client_id, sequence)`` with a non-empty client id (at most ``MAX_CLIENT_ID``
        characters; sequence in [0, 2**64)) makes the push idempotent: a repeat returns False
        and changes nothing (see ``PushDedupe`` for how long a pair is remembered).
        ``decay_clock``: the step's decay clock (``ams.optim``); the rows first take the weight
        decay of the steps they sat out, and the clock advances by this step's decay. None: no
        catch-up, clocks unchanged. Returns True when applied.

        A push whose result would hold a non-finite value (after rounding to the table's
        dtypes) is refused whole with ``InvalidArgument``: no row, state, clock or counter
        changes, and its sequence is not remembered, so a corrected retry applies.
        """
        table = self.table(name)
        _check_client(client_id, sequence)
        positions = self._positions(table, ids)
        self._check_grads(table, grads, positions.numel())
        if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise InvalidArgument(f"lr={shorten(lr)} must be a finite number >= 0")
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
        with table.lock:  # the dedupe check, the update and its record are one step
            if client_id and (client_id, sequence) in table.dedupe:
                return False
            row_clock = table.row_clock.index_select(0, unique) if clocked else None
            update = table.optimizer.compute(
                table.rows, table.state, unique, summed, float(lr),
                catch_up_factors(row_clock, decay_clock) if clocked else None)
            self._refuse_non_finite(table, update, lr)
            table.optimizer.commit(table.rows, table.state, update)
            if clocked:
                after = float(decay_clock) + step_decay(float(lr), table.spec.weight_decay)
                table.row_clock.index_copy_(0, unique, row_clock.clamp(min=after))
                table.clock = max(table.clock, after)
            table.counters.pushes += 1
            table.counters.rows_pushed += positions.numel()
            if client_id:
                table.dedupe.add(client_id, sequence)
        return True

    def _refuse_non_finite(self, table: ShardTable, update: RowUpdate, lr: float) -> None:
        """``InvalidArgument`` naming the first row that ``update`` would make non-finite."""
        found = update.first_non_finite()
        if found is None:
            return
        what, index = found
        class_id = int(update.positions[index]) * self.num_shards + self.shard_id
        kind = "row" if what == "rows" else "momentum"
        raise InvalidArgument(
            f"push refused: the {kind} of class {class_id} in table {shorten(table.spec.name)} "
            f"would become non-finite (over the range of {DTYPE_NAMES[table.spec.dtype]} rows, "
            f"{DTYPE_NAMES[table.spec.state_dtype]} state) at lr={lr}; nothing was changed. "
            "Lower the learning rate or clip the gradients")

    def scan(self, name: str, block_rows: int | None = None
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Blocks of (ids int64 (b,) ascending, rows (b, dim) row dtype) covering the shard,
        with the weight decay they owe (as ``pull``). ``block_rows`` None: 65536, or fewer
        where a block of 65536 rows would exceed the reply limit."""
        table = self.table(name)
        if block_rows is None:
            block_rows = min(65536, max(1, self.max_reply_bytes // (_row_bytes(table.spec) + 8)))
        if block_rows <= 0:
            raise InvalidArgument(f"block_rows={block_rows} must be > 0")
        n = table.rows.shape[0]
        block_bytes = _row_bytes(table.spec) + 8  # each row travels with its int64 id
        self._check_reply(min(block_rows, n) * block_bytes,
                          f"a scan block of {min(block_rows, n)} rows", block_bytes, "block_rows")
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
                f"table {shorten(name)} has no neighbor graph yet: build it first "
                "(ams.graph_build.build_graph or 'xcls graph build')")
        listed = int(graph.lengths().index_select(0, positions).sum())
        self._check_reply(8 * (positions.numel() + 1 + listed),
                          f"the neighbor lists of {positions.numel()} rows", 8 * (graph.k + 1),
                          "rows per call")
        return graph.lookup(positions)

    def _check_reply(self, nbytes: int, what: str, bytes_per_row: int, unit: str) -> None:
        """``RequestTooLarge`` when a reply of ``nbytes`` would exceed ``max_reply_bytes``,
        telling the caller how many ``unit`` fit (at ``bytes_per_row`` each)."""
        if nbytes <= self.max_reply_bytes:
            return
        fit = max(1, self.max_reply_bytes // max(1, bytes_per_row))
        raise RequestTooLarge(
            f"{what} makes a {nbytes}-byte reply, over the {self.max_reply_bytes}-byte message "
            f"limit; split the request (about {fit} {unit} fit in one reply)")

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
                        f"table {shorten(name)} has no neighbor graph to refresh; build it first")
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


def _physical_memory_bytes() -> int | None:
    """The machine's memory, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _row_bytes(spec: TableSpec) -> int:
    return spec.dim * _itemsize(spec.dtype)


def _check_client(client_id: object, sequence: object) -> None:
    """A push's (client id, sequence): a string of at most ``MAX_CLIENT_ID`` characters and
    an integer in [0, 2**64), else ``InvalidArgument``."""
    if not isinstance(client_id, str) or len(client_id) > MAX_CLIENT_ID:
        raise InvalidArgument(f"client_id {shorten(client_id)}: need a string of at most "
                              f"{MAX_CLIENT_ID} characters")
    if isinstance(sequence, bool) or not isinstance(sequence, int) \
            or not 0 <= sequence < MAX_SEQUENCE:
        raise InvalidArgument(f"sequence={shorten(sequence)} must be an integer in [0, 2**64)")


def _check_clock(clock: float) -> None:
    if not isinstance(clock, (int, float)) or not math.isfinite(clock) or clock < 0:
        raise InvalidArgument(f"decay_clock={shorten(clock)} must be a finite number >= 0")


def _with_decay_owed(table: ShardTable, rows: torch.Tensor, positions: torch.Tensor
                     ) -> torch.Tensor:
    """``rows`` (m, dim), a copy of the rows at local ``positions`` (m,), times the decay each
    owes up to the table's clock (rounded once to the row dtype); ``rows`` itself when none
    is owed. Call under the table's lock."""
    if table.clock == 0.0 or rows.shape[0] == 0:
        return rows
    factors = catch_up_factors(table.row_clock.index_select(0, positions), table.clock)
    return (rows.to(torch.float32) * factors.to(torch.float32)[:, None]).to(rows.dtype)

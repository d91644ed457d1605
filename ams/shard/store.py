"""One shard's class rows and optimizer state, in torch tensors. Pure: no gRPC.

A table is split over shards by ``ams.sharding`` (id mod S). The shard keeps its part as two
dense tensors, ``rows`` and ``state`` (momentum), of shape (owned, dim), addressed by
``id // S``, and each row's weight-decay clock (see ``ams.shard.optim``), in memory or in files
mapped into memory (``ams.shard.storage``; the only I/O here). Every public method
validates its arguments completely before it changes anything, so a bad request leaves the
shard exactly as it was.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ams import sharding
from ams.alloc import release_free_memory
from ams.dtypes import DTYPE_NAMES, parse_row_dtype
from ams.errors import (
    AmsError,
    FailedPrecondition,
    IdOutOfRange,
    InvalidArgument,
    RequestTooLarge,
    TableExists,
    TableNotFound,
    shorten,
)
from ams.shard import rowcopy
from ams.shard.neighbor_lists import INT32_CLASSES, NeighborTable, check_lists, id_dtype
from ams.shard.optim import (
    MAX_RATE,
    SparseMomentumSGD,
    all_finite,
    catch_up_factors,
    step_decay,
)
from ams.shard.rowinit import MAX_ABS_NORMAL, initial_rows
from ams.shard.slots import RowSlots
from ams.shard.storage import (
    MappedFiles,
    StorageKind,
    TableTensors,
    open_storage,
    prefetch_rows,
    prefetch_slots_ahead,
)
from ams.wire.limits import MAX_REPLY_PAYLOAD_BYTES
from ams.wire.pieces import ascending_unique

# Per-client memory of applied push sequences. A retry arrives within a deadline or two, so a
# window of recent sequences per client is enough to apply each push once.
PUSH_DEDUPE_WINDOW = 4096
# Clients whose pushes a table remembers; the one that pushed least recently goes first. A
# client forgotten this way stopped pushing long before any retry of its could arrive.
PUSH_DEDUPE_CLIENTS = 1024
MAX_CLIENT_ID = 128
MAX_TABLE_NAME = 128
MAX_SEQUENCE = 2**64  # the wire field is uint64
_FLOAT_MAX = sys.float_info.max


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
        _nonnegative("momentum", self.momentum)
        _nonnegative("weight_decay", self.weight_decay, MAX_RATE)
        _nonnegative("init_std", self.init_std)
        if self.momentum >= 1:
            raise InvalidArgument(f"momentum={self.momentum} must be < 1")
        # a larger std would fill the new table with infinities
        max_std = float(torch.finfo(self.dtype).max) / MAX_ABS_NORMAL
        if self.init_std > max_std:
            raise InvalidArgument(f"init_std={self.init_std:g} overflows {DTYPE_NAMES[self.dtype]} "
                                  f"rows: must be at most {max_std:.6g}")
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
        row_bytes = self.dim * self.dtype.itemsize
        state_bytes = self.state_width * self.state_dtype.itemsize
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
    staged_graph: dict | None = None  # parts of the next full graph, see set_neighbors
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


class ShardStore:
    """The tables of shard ``shard_id`` of ``num_shards``.

    Thread-safe: each request is applied atomically per table (a push never interleaves with
    another push or a pull of the same table).
    """

    def __init__(self, shard_id: int = 0, num_shards: int = 1,
                 max_rows_per_request: int = 1 << 20,
                 max_reply_bytes: int = MAX_REPLY_PAYLOAD_BYTES,
                 storage: str = StorageKind.MEMORY,
                 storage_dir: str | Path | None = None) -> None:
        """``max_rows_per_request``: ids one request may name; ``max_reply_bytes``: tensor
        bytes one reply (pull, scan block, neighbor lists) may carry, checked before the reply
        is built, so local shards refuse what a remote one would.

        ``storage``: where the tables' rows, state and decay clocks live (``ams.shard.storage``):
        "memory" (``storage_dir`` unused), or "mmap", in files under ``storage_dir`` (which the
        shards of a cluster may share), mapped into memory. An mmap store reopens, here, the
        tables that a store before it on ``storage_dir`` closed (``close``), and discards those
        it did not close (a warning each); ``StorageError`` when a table's files are damaged
        or belong to another table or shard layout (nothing is deleted then), or another store
        uses the directory.
        """
        if not 0 <= shard_id < num_shards:
            raise InvalidArgument(f"shard_id={shard_id} must be in [0, num_shards={num_shards})")
        self.shard_id = shard_id
        self.num_shards = num_shards
        self.max_rows_per_request = max_rows_per_request
        self.max_reply_bytes = max_reply_bytes
        self.storage = open_storage(storage, storage_dir, shard_id, num_shards)
        self.tables: dict[str, ShardTable] = {}
        self._tables_lock = threading.Lock()
        try:
            reopened = self.storage.reopen(TableSpec.from_description, PushDedupe.from_json)
        except BaseException:
            self.storage.close()
            raise
        for t in reopened:
            self.tables[t.spec.name] = _new_table(t.spec, t.tensors, t.clock, dedupe=t.dedupe)

    # ---- tables -------------------------------------------------------------------------

    def create_table(self, spec: TableSpec) -> bool:
        """Create the shard's part of a table with its initial rows and zero state.

        Returns False if an identical table exists; a different one with that name raises
        ``TableExists``. ``RequestTooLarge`` when the storage cannot hold it (memory: more
        than the machine's; mmap: ``StorageFull``, more than the disk or the file-size limit
        allows, and no file is left behind).
        """
        with self._tables_lock:
            existing = self.tables.get(spec.name)
            if existing is not None:
                if existing.spec != spec:
                    raise TableExists(
                        f"table {shorten(spec.name)} exists with {existing.spec.describe()}, "
                        f"not {spec.describe()}")
                return False
            staged = self.storage.stage(spec)
            try:
                # a new table's rows are in position order (``RowSlots.identity``)
                _fill_initial_rows(staged.rows[:self.storage.owned(spec)], spec,
                                   self.shard_id, self.num_shards)
                tensors = self.storage.install(spec, staged)
            except BaseException:
                self.storage.discard(staged)
                raise
            self.tables[spec.name] = _new_table(spec, tensors)
        release_free_memory()  # the initial rows' scratch would stay resident otherwise
        return True

    def table(self, name: str) -> ShardTable:
        try:
            return self.tables[name]
        except KeyError:
            known = shorten(", ".join(sorted(self.tables)), 200) if self.tables else "none"
            raise TableNotFound(f"unknown table {shorten(name)} (tables here: {known})") from None

    def install_table(self, spec: TableSpec, tensors: TableTensors, clock: float,
                      graph: NeighborTable | None = None,
                      dedupe: PushDedupe | None = None) -> None:
        """Put a whole restored table in place (replacing one of the same name, and for mmap
        its files), with the push dedupe state that goes with its rows (None: none
        remembered). ``tensors``: from ``self.storage.stage(spec)``, filled in; they belong
        to the store from now on (discarded when refused)."""
        with self._tables_lock:
            try:
                for what, (shape, dtype) in self.storage.shapes(spec).items():
                    t = getattr(tensors, what)
                    if tuple(t.shape) != shape or t.dtype != dtype:
                        raise InvalidArgument(
                            f"{what} of table {shorten(spec.name)}: {tuple(t.shape)} "
                            f"{t.dtype}, need {shape} {dtype}")
                _nonnegative("decay_clock", clock)
                installed = self.storage.install(spec, tensors)
            except BaseException:
                self.storage.discard(tensors)
                raise
            self.tables[spec.name] = _new_table(spec, installed, clock,
                                                self._with_lists_kept(graph), dedupe)

    def copy_table(self, name: str) -> TableCopy:
        """A copy of table ``name`` at one instant: its tensors, clock, graph and push dedupe
        state, taken under the table's lock, so the rows hold exactly the pushes the dedupe
        state remembers. The lock is held for the copy only (a snapshot writes the copy to
        disk afterwards, while pushes and pulls go on). An mmap table is copied into scratch
        files, not RAM (``Storage.copy``; ``StorageFull`` when the disk cannot hold them);
        their space returns when the copy is dropped."""
        table = self.table(name)
        with table.lock:
            g = table.graph
            # a graph's tensors are replaced, never written in place: references suffice
            graph = (g.offsets, g.neighbors, g.version, g.step, g.k) if g is not None else None
            return TableCopy(table.spec, *self.storage.copy(table.tensors), table.clock, graph,
                             table.dedupe.to_json())

    def close(self) -> None:
        """Keep the tables for a later store, and let one open the storage dir.

        An mmap table's pages are written to its files (msync), and its ``table.json`` marks
        it closed with its decay clock and push dedupe state; a store made on the same
        storage dir reopens it (its neighbor graph is not kept: build it again). Memory tables
        are dropped. Afterwards the store holds no tables, and a push that was waiting for a
        table is refused. A table that cannot be kept (``StorageError``, raised once every
        other table is closed) is discarded by the next store. Calling it again does nothing.
        """
        failed: AmsError | None = None
        with self._tables_lock:
            for table in self.tables.values():
                with table.lock:
                    table.closed = True
                    try:
                        self.storage.close_table(table.spec, table.tensors, table.clock,
                                                 table.dedupe.to_json())
                    except AmsError as e:
                        failed = failed or e
            self.tables.clear()
            self.storage.close()
        if failed is not None:
            raise failed

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
        lo, hi = rowcopy.bounds(ids)
        num_rows = table.spec.num_rows
        if lo < 0 or hi >= num_rows:
            bad = lo if lo < 0 else hi
            raise IdOutOfRange(
                f"{field_name}: id {bad} is outside table {shorten(table.spec.name)} "
                f"(num_rows={num_rows}, valid ids 0..{num_rows - 1})")
        local = sharding.local_index(ids, self.num_shards)
        if self.num_shards > 1:
            # an id's shard is what its local index leaves over: one integer division, not two
            values = ids.numpy()
            foreign = values - local.numpy() * self.num_shards != self.shard_id
            if foreign.any():
                bad = int(values[foreign][0])
                raise IdOutOfRange(
                    f"{field_name}: id {bad} belongs to shard {bad % self.num_shards}, "
                    f"this is shard {self.shard_id} of {self.num_shards}")
        return local

    def _check_grads(self, table: ShardTable, grads: torch.Tensor, n: int) -> None:
        dim = table.spec.dim
        if not isinstance(grads, torch.Tensor) or not grads.is_floating_point():
            raise InvalidArgument(f"grads: need a float tensor of shape ({n}, {dim})")
        if tuple(grads.shape) != (n, dim):
            raise InvalidArgument(
                f"grads: shape {tuple(grads.shape)}, need ({n}, {dim}) for {n} ids "
                f"of table {shorten(table.spec.name)}")

    # ---- rows ---------------------------------------------------------------------------

    def pull(self, name: str, ids: torch.Tensor, out: torch.Tensor | None = None
             ) -> torch.Tensor:
        """Rows of ``ids`` in request order (repeats allowed). int64 (n,) -> (n, dim) row dtype,
        a new tensor, or ``out`` (contiguous (n, dim) of the row dtype) written and returned;
        nothing is written to it when the ids are refused.

        Each row comes with the weight decay it owes up to the newest clock pushed here
        (``ams.shard.optim``), so it is the row the dense optimizer would hold after that push."""
        table = self.table(name)
        positions = self._positions(table, ids)
        self._check_reply(positions.numel() * _row_bytes(table.spec), f"a pull of "
                          f"{positions.numel()} rows", _row_bytes(table.spec), "rows per pull")
        prefetch_rows(table.tensors, positions)
        with table.lock:
            at = table.tensors.at(positions)
            out = _with_decay_owed(table, rowcopy.gather(table.rows, at, out), at)
            table.counters.pulls += 1
            table.counters.rows_pulled += positions.numel()
        return out

    def push(self, name: str, ids: torch.Tensor, grads: torch.Tensor, lr: float,
             client_id: str = "", sequence: int = 0, decay_clock: float | None = None) -> bool:
        """Apply sparse momentum SGD to exactly the pushed rows.

        ids: int64 (n,), repeats summed first; grads: float (n, dim); lr >= 0. ``(client_id,
        sequence)`` with a non-empty client id (at most ``MAX_CLIENT_ID`` characters; sequence in
        [0, 2**64)) makes the push idempotent: a repeat returns False and changes nothing (see
        ``PushDedupe`` for how long a pair is remembered). ``decay_clock``: the step's decay clock
        (``ams.shard.optim``); the rows first take the weight decay of the steps they sat out, and
        the clock advances by this step's decay. None: no catch-up, clocks unchanged. Returns True
        when applied.

        A push whose result would hold a non-finite value (after rounding to the table's
        dtypes) is refused whole with ``InvalidArgument``: no row, state, clock or counter
        changes, and its sequence is not remembered, so a corrected retry applies.
        """
        table = self.table(name)
        _check_client(client_id, sequence)
        positions = self._positions(table, ids)
        self._check_grads(table, grads, positions.numel())
        lr = _nonnegative("lr", lr, MAX_RATE)
        clocked = decay_clock is not None and table.spec.weight_decay > 0
        if decay_clock is not None:
            decay_clock = _nonnegative("decay_clock", decay_clock)
            if clocked and lr * table.spec.weight_decay >= 1:
                raise InvalidArgument(
                    f"lr={lr} x weight_decay={table.spec.weight_decay} must stay below 1 for "
                    "the decay clock")
        if positions.numel() == 0:
            return True
        prefetch_rows(table.tensors, positions)
        unique, summed = _summed_by_position(positions, grads)
        prefetch_slots_ahead(table.tensors, unique.numel())
        with table.lock:  # the dedupe check, the update and its record are one step
            if table.closed:  # its files already say which pushes they hold
                raise FailedPrecondition(f"table {shorten(name)}: the store was closed")
            if client_id and (client_id, sequence) in table.dedupe:
                return False
            at = table.tensors.at(unique)
            # a slotted table moves the rows, so their clocks move too, updated or not
            row_clock = table.row_clock.index_select(0, at) \
                if clocked or table.slots is not None else None
            catch_up = catch_up_factors(row_clock, decay_clock) if clocked else None
            if table.slots is None:  # in place, or refused with nothing changed
                self._refuse_non_finite(table, table.optimizer.step(
                    table.rows, table.state, at, summed, float(lr), catch_up),
                    lr, grads, unique)
            else:  # the new values go to new slots, taken once nothing can be refused
                update = table.optimizer.compute(table.rows, table.state, at, summed,
                                                 float(lr), catch_up)
                self._refuse_non_finite(table, update.first_non_finite(), lr, grads, unique)
                at = table.slots.relocate(unique)
                table.optimizer.commit(table.rows, table.state, replace(update, positions=at))
            if clocked:
                after = float(decay_clock) + step_decay(float(lr), table.spec.weight_decay)
                row_clock = row_clock.clamp(min=after)
                table.clock = max(table.clock, after)
            if row_clock is not None:
                table.row_clock.index_copy_(0, at, row_clock)
            table.counters.pushes += 1
            table.counters.rows_pushed += positions.numel()
            if client_id:
                table.dedupe.add(client_id, sequence)
            if table.touched is None:  # 1 byte per row, only for tables that take pushes
                table.touched = torch.zeros(table.owned, dtype=torch.bool)
            table.touched.numpy()[unique.numpy()] = True  # numpy: torch's index_put costs more
        return True

    def take_touched(self, name: str, max_ids: int | None = None) -> torch.Tensor:
        """Global ids (int64 (m,), ascending) of the rows pushes changed since they were last
        taken, at most ``max_ids`` (None: as many as one reply holds), the smallest first;
        those are forgotten in the same step under the table's lock, so a push is either in
        this answer or in a later one. A graph build takes them before it reads the rows."""
        table = self.table(name)
        limit = self.max_reply_bytes // 8 if max_ids is None else max_ids
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidArgument(f"max_ids={shorten(max_ids)} must be an integer >= 1")
        self._check_reply(8 * limit, f"up to {limit} touched ids", 8, "ids")
        with table.lock:
            if table.touched is None:
                return torch.empty(0, dtype=torch.int64)
            positions = table.touched.nonzero().view(-1)[:limit]
            table.touched[positions] = False
        return positions * self.num_shards + self.shard_id

    def _refuse_non_finite(self, table: ShardTable, found: tuple[str, int] | None, lr: float,
                           grads: torch.Tensor, positions: torch.Tensor) -> None:
        """``InvalidArgument`` naming the first non-finite gradient row of the push, or else
        the first row the update would have made non-finite (``found``, from
        ``RowUpdate.first_non_finite``: an index into local ``positions``, int64 (m,)); nothing
        when ``found`` is None. A non-finite gradient always makes the update non-finite, so
        ``grads`` is looked at only then: one pass over the pushed rows fewer in every push
        that is accepted."""
        if found is None:
            return
        if not all_finite(grads):
            bad = int((~torch.isfinite(grads)).any(dim=1).nonzero()[0, 0])
            raise InvalidArgument(f"grads: row {bad} has a non-finite value (nan or inf)")
        what, index = found
        class_id = int(positions[index]) * self.num_shards + self.shard_id
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
        start = 0
        while True:
            ids, rows = self.scan_block(name, start, block_rows)
            if not ids.numel():
                return
            yield ids, rows
            start += ids.numel()

    def scan_block(self, name: str, start: int, block_rows: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block of ``scan`` that starts at the shard's ``start``-th row (0-based, in id
        order): ids int64 (b,) ascending, rows (b, dim) with the decay they owe; empty (b = 0)
        from the end of the shard on. ``block_rows``: as ``scan``."""
        table = self.table(name)
        if block_rows is None:
            block_rows = min(65536, max(1, self.max_reply_bytes // (_row_bytes(table.spec) + 8)))
        for field_name, value, low in (("block_rows", block_rows, 1), ("start", start, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgument(f"{field_name}={shorten(value)} must be an integer >= {low}")
        n = table.owned
        block_bytes = _row_bytes(table.spec) + 8  # each row travels with its int64 id
        self._check_reply(min(block_rows, n) * block_bytes,
                          f"a scan block of {min(block_rows, n)} rows", block_bytes, "block_rows")
        start = min(start, n)
        stop = min(start + block_rows, n)
        positions = torch.arange(start, stop)
        # a slotted table's rows lie in slots all over its files: their pages are read
        # together, not one fault at a time
        prefetch_rows(table.tensors, positions)
        with table.lock:
            at = table.tensors.at(positions)
            rows = _with_decay_owed(table, table.rows[start:stop].clone()
                                    if table.slots is None else rowcopy.gather(table.rows, at),
                                    at)
        return sharding.owned_ids(table.spec.num_rows, self.shard_id, self.num_shards, start,
                                  stop), rows

    # ---- neighbor lists ----------------------------------------------------------------

    def neighbors(self, name: str, ids: torch.Tensor
                  ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Neighbor lists of ``ids`` (request order) in the graph's layout and id dtype
        (``NeighborTable.lookup``): (None, neighbors (n, k)) fixed width, or (offsets int64
        (n+1,), neighbors (offsets[-1],)) CSR; ids int32 in tables of fewer than 2**31
        classes, int64 otherwise."""
        table = self.table(name)
        positions = self._positions(table, ids)
        graph = table.graph
        if graph is not None and graph.fixed:
            # advice only: a graph replaced meanwhile costs a read, never a wrong list
            self.storage.read_ahead(graph.neighbors, positions)
        with table.lock:  # an update replaces the graph's offsets and neighbors together
            graph = table.graph
            if graph is None:
                raise FailedPrecondition(
                    f"table {shorten(name)} has no neighbor graph yet: build it first "
                    "(ams.graph.build.build_graph or 'xcls graph build')")
            row_bytes = graph.k * graph.neighbors.element_size() + (0 if graph.fixed else 8)
            self._check_reply(graph.lookup_nbytes(positions),
                              f"the neighbor lists of {positions.numel()} rows", row_bytes,
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

    def set_neighbors(self, name: str, ids: torch.Tensor, offsets: torch.Tensor | None,
                      neighbors: torch.Tensor, version: int, step: int,
                      replace_all: bool) -> int:
        """Store neighbor lists for owned ``ids`` (n,), in either layout (see ``neighbors``):
        offsets None and neighbors (n, k), or offsets int64 (n+1,) and neighbors
        (offsets[-1],); ids int32 (only in tables of fewer than 2**31 classes) or int64, each
        in 0..num_rows-1. The table keeps them compact whatever the layout sent.

        ``replace_all``: the lists belong to a new table of this ``version``, which may arrive in
        several calls (messages are size-limited); it replaces the current table once its calls
        have covered every owned row exactly once, and a call of another version starts over.
        Otherwise the lists of ``ids`` are replaced in place (partial refresh). Returns the graph
        version now in force (0: none yet).
        """
        table = self.table(name)
        positions = self._positions(table, ids)
        n = positions.numel()
        try:
            check_lists(offsets, neighbors, n)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        num_rows = table.spec.num_rows
        if neighbors.dtype == torch.int32 and num_rows >= INT32_CLASSES:
            raise InvalidArgument(
                f"neighbors: int32 ids cannot name the {num_rows} classes of table "
                f"{shorten(name)}; send int64")
        if neighbors.numel() and (int(neighbors.min()) < 0
                                  or int(neighbors.max()) >= num_rows):
            raise IdOutOfRange(
                f"neighbors: ids must be in 0..{num_rows - 1}, got "
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
                table.graph.update(positions, offsets, neighbors, self._graph_lists)
                table.graph.version, table.graph.step = version, step
            return table.graph.version if table.graph is not None else 0

    def _graph_lists(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor for a graph's fixed-width lists. mmap storage keeps it in a scratch file
        (``Storage.scratch``): the lists then share the page cache with the rows instead of
        holding RAM of their own, which a table larger than memory needs for its rows."""
        return self.storage.scratch(shape, dtype, "a neighbor graph")

    def _with_lists_kept(self, graph: NeighborTable | None) -> NeighborTable | None:
        """``graph`` with fixed-width lists made elsewhere (restored, assembled from parts)
        moved where the storage keeps a graph's lists (``Storage.kept``)."""
        if graph is not None and graph.fixed:
            graph.neighbors = self.storage.kept(graph.neighbors, "a neighbor graph")
        return graph

    def _stage_graph(self, table: ShardTable, positions: torch.Tensor,
                     offsets: torch.Tensor | None, neighbors: torch.Tensor, version: int,
                     step: int) -> None:
        """Collect one part of a full graph; install the graph when every row has its list.

        Fixed-width parts of one width are written straight into the (owned, k) table of the
        graph's id dtype as they arrive, so staging a graph sent in int64 blocks costs the
        finished table and no copy of the parts; any other mix is kept as parts and assembled
        at the end."""
        owned = table.owned
        num_classes = table.spec.num_rows
        staged = table.staged_graph
        if staged is None or staged["version"] != version:
            staged = table.staged_graph = {"version": version, "step": step, "parts": [],
                                           "lists": None,
                                           "covered": torch.zeros(owned, dtype=torch.bool)}
        seen = staged["covered"][positions]
        if positions.numel() and bool(seen.all()):
            return  # a retried delivery of a part already staged
        if bool(seen.any()):
            raise InvalidArgument(f"ids: some rows already have a list in graph version "
                                  f"{version}; each row is sent once per version")
        lists = staged["lists"]
        if offsets is None and not staged["parts"] and (
                lists is None or lists.shape[1] == neighbors.shape[1]):
            if lists is None:
                lists = staged["lists"] = self._graph_lists((owned, neighbors.shape[1]),
                                                            id_dtype(num_classes))
            lists[positions] = neighbors.to(lists.dtype)
        else:
            if lists is not None:  # another layout or width after all: keep what came as a part
                before = staged["covered"].nonzero().squeeze(1)
                staged["parts"].append((before, None, lists[before]))
                staged["lists"] = None
            staged["parts"].append((positions, offsets, neighbors))
        staged["covered"][positions] = True
        if not bool(staged["covered"].all()):
            return
        if staged["lists"] is not None:
            graph = NeighborTable(None, staged["lists"], num_classes=num_classes)
        else:
            graph = self._with_lists_kept(
                NeighborTable.from_parts(staged["parts"], owned, num_classes=num_classes))
        graph.version, graph.step = version, staged["step"]
        table.graph, table.staged_graph = graph, None

    # ---- introspection ------------------------------------------------------------------

    def stats(self) -> dict:
        """Per-table counters and sizes, and the storage kind, JSON-able."""
        out = {"shard_id": self.shard_id, "num_shards": self.num_shards,
               "storage": self.storage.kind.value, "tables": {}}
        for name, t in list(self.tables.items()):
            g = t.graph
            out["tables"][name] = {
                "spec": t.spec.describe(),
                "owned_rows": t.owned,
                "row_bytes": t.rows.numel() * t.rows.element_size(),
                "state_bytes": t.state.numel() * t.state.element_size(),
                "decay_clock": t.clock,
                **vars(replace(t.counters)),
                "graph_version": g.version if g else 0,
                "graph_step": g.step if g else -1,
                "graph_k": g.k if g else 0,
                "graph_bytes": g.nbytes() if g else 0,
            }
        return out


def _new_table(spec: TableSpec, tensors: TableTensors, clock: float = 0.0,
               graph: NeighborTable | None = None, dedupe: PushDedupe | None = None
               ) -> ShardTable:
    return ShardTable(spec, tensors.rows, tensors.state, tensors.row_clock,
                      SparseMomentumSGD(spec.momentum, spec.weight_decay), clock, graph,
                      dedupe=dedupe if dedupe is not None else PushDedupe(),
                      files=tensors.files, slots=tensors.slots)


# Rows given their initial values at a time when a table is made: bounds the temporaries
# (ids, float32 values) whatever the table's size.
INIT_BLOCK_ROWS = 1 << 18


def _fill_initial_rows(rows: torch.Tensor, spec: TableSpec, shard_id: int,
                       num_shards: int) -> None:
    """Write the initial rows (``ams.shard.rowinit``) of shard ``shard_id`` of ``num_shards``'s part
    of ``spec`` into ``rows`` (owned, dim) of the row dtype, block by block."""
    for start in range(0, rows.shape[0], INIT_BLOCK_ROWS):
        stop = min(start + INIT_BLOCK_ROWS, rows.shape[0])
        ids = sharding.owned_ids(spec.num_rows, shard_id, num_shards, start, stop)
        initial_rows(ids, spec.dim, spec.seed, spec.init_std, spec.dtype, out=rows[start:stop])


def _row_bytes(spec: TableSpec) -> int:
    return spec.dim * spec.dtype.itemsize


def _check_client(client_id: object, sequence: object) -> None:
    """A push's (client id, sequence): a string of at most ``MAX_CLIENT_ID`` characters and
    an integer in [0, 2**64), else ``InvalidArgument``."""
    if not isinstance(client_id, str) or len(client_id) > MAX_CLIENT_ID:
        raise InvalidArgument(f"client_id {shorten(client_id)}: need a string of at most "
                              f"{MAX_CLIENT_ID} characters")
    if isinstance(sequence, bool) or not isinstance(sequence, int) \
            or not 0 <= sequence < MAX_SEQUENCE:
        raise InvalidArgument(f"sequence={shorten(sequence)} must be an integer in [0, 2**64)")


def _nonnegative(name: str, value: object, high: float = _FLOAT_MAX) -> float:
    """``value`` as a float in [0, ``high``], else ``InvalidArgument``. Compares before it
    converts: a JSON integer may be far past float64 (and int64, which torch would make it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 <= value <= high:
        bound = "a finite number >= 0" if high == _FLOAT_MAX else f"a number in [0, {high:.6g}]"
        raise InvalidArgument(f"{name}={shorten(value)} must be {bound}")
    return float(value)


def _summed_by_position(positions: torch.Tensor, grads: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique positions int64 (m,) ascending, float32 (m, dim) gradients summed per position,
    in request order) of a push's positions (n,) and grads (n, dim), as the client sorts its
    pushes (``ascending_unique``). Clients send each id once, in ascending order; such a push
    passes through without a sort or a copy."""
    keys, values, source = ascending_unique(positions, grads.to(torch.float32), None)
    return keys, values if source is None else rowcopy.gather(values, source)


def _with_decay_owed(table: ShardTable, rows: torch.Tensor, at: torch.Tensor
                     ) -> torch.Tensor:
    """``rows`` (m, dim), a copy of the rows in slots ``at`` (int64 (m,)) that the caller
    owns, multiplied in place by the decay each owes up to the table's clock (in float32,
    rounded once to the row dtype), and returned. Call under the table's lock."""
    if table.clock == 0.0 or rows.shape[0] == 0:
        return rows
    factors = catch_up_factors(table.row_clock.index_select(0, at), table.clock)
    # in place: the product is taken in float32 and rounded into the row dtype, the same
    # values as widening a copy first, without a second reply-sized buffer
    return rows.mul_(factors.to(torch.float32)[:, None])

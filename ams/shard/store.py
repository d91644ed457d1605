"""One shard's class rows and optimizer state, in torch tensors. Pure: no gRPC.

A table is split over shards by ``ams.sharding`` (id mod S). The shard keeps its part as two
dense tensors, ``rows`` and ``state`` (momentum), of shape (owned, dim), addressed by
``id // S``, and each row's weight-decay clock (see ``ams.shard.optim``), in memory or in files
mapped into memory (``ams.shard.storage``; the only I/O here). Every public method
validates its arguments completely before it changes anything, so a bad request leaves the
shard exactly as it was.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from ams import sharding
from ams.alloc import release_free_memory
from ams.errors import (
    AmsError,
    FailedPrecondition,
    IdOutOfRange,
    InvalidArgument,
    TableExists,
    TableNotFound,
    shorten,
)
from ams.limits import MAX_IDS_PER_REQUEST, MAX_REPLY_PAYLOAD_BYTES
from ams.shard import rowcopy
from ams.shard.checks import (
    check_grads,
    check_reply,
    checked_rates,
    owned_positions,
    refuse_non_finite,
)
from ams.shard.dedupe import PushDedupe, check_client
from ams.shard.mapped import MmapStorage
from ams.shard.neighbor_lists import INT32_CLASSES, NeighborTable, StagedGraph, check_lists
from ams.shard.optim import RowUpdate, all_finite, catch_up_factors, step_decay
from ams.shard.page_advice import prefetch_rows, prefetch_slots_ahead
from ams.shard.rowcopy import ascending_unique
from ams.shard.spec import TableSpec, nonnegative
from ams.shard.storage import MemoryStorage, Storage, StorageKind, TableTensors
from ams.shard.table import ShardTable, TableCopy, fill_initial_rows, new_table


class ShardStore:
    """The tables of shard ``shard_id`` of ``num_shards``.

    Thread-safe: each request is applied atomically per table (a push never interleaves with
    another push or a pull of the same table).
    """

    def __init__(self, shard_id: int = 0, num_shards: int = 1,
                 storage: str = StorageKind.MEMORY,
                 storage_dir: str | Path | None = None) -> None:
        """A request may name at most ``ams.limits.MAX_IDS_PER_REQUEST`` ids, and a reply
        (pull, scan block, neighbor lists) carry at most ``ams.limits.MAX_REPLY_PAYLOAD_BYTES``
        of tensors, checked before the reply is built, so local shards refuse what a remote one
        would.

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
        self.storage = open_storage(storage, storage_dir, shard_id, num_shards)
        self.tables: dict[str, ShardTable] = {}
        self._tables_lock = threading.Lock()
        try:
            reopened = self.storage.reopen(TableSpec.from_description, PushDedupe.from_json)
        except BaseException:
            self.storage.close()
            raise
        for t in reopened:
            self.tables[t.spec.name] = new_table(t.spec, t.tensors, t.clock, dedupe=t.dedupe)

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
                fill_initial_rows(staged.rows[:self.storage.owned(spec)], spec,
                                   self.shard_id, self.num_shards)
                tensors = self.storage.install(spec, staged)
            except BaseException:
                self.storage.discard(staged)
                raise
            self.tables[spec.name] = new_table(spec, tensors)
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
                nonnegative("decay_clock", clock)
                installed = self.storage.install(spec, tensors)
            except BaseException:
                self.storage.discard(tensors)
                raise
            self.tables[spec.name] = new_table(spec, installed, clock,
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

    def _owned_positions(self, table: ShardTable, ids: torch.Tensor) -> torch.Tensor:
        """``checks.owned_positions`` of ``ids`` in ``table`` on this shard."""
        return owned_positions(ids, table.spec, self.shard_id, self.num_shards,
                               MAX_IDS_PER_REQUEST)

    # ---- rows ---------------------------------------------------------------------------

    def pull(self, name: str, ids: torch.Tensor, out: torch.Tensor | None = None
             ) -> torch.Tensor:
        """Rows of ``ids`` in request order (repeats allowed). int64 (n,) -> (n, dim) row dtype,
        a new tensor, or ``out`` (contiguous (n, dim) of the row dtype) written and returned;
        nothing is written to it when the ids are refused.

        Each row comes with the weight decay it owes up to the newest clock pushed here
        (``ams.shard.optim``), so it is the row the dense optimizer would hold after that push."""
        table = self.table(name)
        positions = self._owned_positions(table, ids)
        row_bytes = table.spec.dim * table.spec.dtype.itemsize
        check_reply(positions.numel() * row_bytes, MAX_REPLY_PAYLOAD_BYTES,
                    f"a pull of {positions.numel()} rows", row_bytes, "rows per pull")
        prefetch_rows(table.tensors, positions)
        with table.lock:
            at = table.tensors.at(positions)
            out = table.with_decay_owed(rowcopy.gather(table.rows, at, out), at)
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
        the clock advances by this step's decay, on a push of no rows too (a step none of whose
        rows live here). None: no catch-up, clocks unchanged. Returns True when applied.

        A push whose result would hold a non-finite value (after rounding to the table's
        dtypes) is refused whole with ``InvalidArgument``: no row, state, clock or counter
        changes, and its sequence is not remembered, so a corrected retry applies.
        """
        table = self.table(name)
        check_client(client_id, sequence)
        positions = self._owned_positions(table, ids)
        check_grads(grads, positions.numel(), table.spec)
        lr, decay_clock, clocked = checked_rates(table.spec, lr, decay_clock)
        # the clock after this step: every row here, pushed or resting, owes decay up to it
        after = float(decay_clock) + step_decay(float(lr), table.spec.weight_decay) \
            if clocked else None
        if positions.numel() == 0:  # none of the step's rows live here; its clock still does
            if after is not None:
                with table.lock:
                    if table.closed:
                        raise FailedPrecondition(f"table {shorten(name)}: the store was closed")
                    table.clock = max(table.clock, after)
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
                refuse_non_finite(table.spec, table.optimizer.step(
                    table.rows, table.state, at, summed, float(lr), catch_up),
                    lr, grads, self._class_ids(unique))
            else:  # the new values go to new slots, taken once nothing can be refused
                update = table.optimizer.compute(table.rows, table.state, at, summed,
                                                 float(lr), catch_up)
                refuse_non_finite(table.spec, update.first_non_finite(), lr, grads,
                                  self._class_ids(unique))
                at = table.slots.relocate(unique)
                table.optimizer.commit(table.rows, table.state, replace(update, positions=at))
            if after is not None:
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
            table.touched[unique] = True
        return True

    def read_rows(self, name: str, ids: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        """The rows of ``ids`` as stored, for a working copy of this shard's rows kept
        elsewhere (``write_rows``): ids int64 (m,) owned -> (rows (m, dim) of the row dtype,
        without the decay they owe; state (m, state width) of the state dtype; row_clock
        float64 (m,), the decay clock each row was brought up to; the table's clock), copies
        in request order, taken under the table's lock."""
        table = self.table(name)
        spec = table.spec
        positions = owned_positions(ids, spec, self.shard_id, self.num_shards, table.owned)
        with table.lock:
            at = table.tensors.at(positions)
            rows = rowcopy.gather(table.rows, at)
            state = rowcopy.gather(table.state, at) if spec.state_width \
                else table.state.new_empty((positions.numel(), 0))
            return rows, state, table.row_clock.index_select(0, at), table.clock

    def write_rows(self, name: str, ids: torch.Tensor, rows: torch.Tensor, state: torch.Tensor,
                   row_clock: torch.Tensor, clock: float) -> None:
        """Put rows that were updated outside the store back in place: a working copy of this
        shard's rows kept elsewhere (collective placement's slice in GPU memory,
        ``workers.device_slice``) writes back the rows its updates changed, before anything
        reads them here.

        ids: int64 (m,) ascending, unique, owned; rows: (m, dim) of the row dtype; state:
        (m, state width) of the state dtype; row_clock: float64 (m,), the decay clock each row
        was brought up to; clock: the newest decay clock its updates reached (the table's
        clock becomes the larger of the two). The rows count as pushed (``take_touched``).
        Everything is checked before anything is written; non-finite values are refused.
        """
        table = self.table(name)
        spec = table.spec
        positions = owned_positions(ids, spec, self.shard_id, self.num_shards, table.owned)
        m = positions.numel()
        if m > 1 and not bool((positions[1:] > positions[:-1]).all()):
            raise InvalidArgument("ids: need ascending ids, each once")
        for what, t, shape, dtype in (("rows", rows, (m, spec.dim), spec.dtype),
                                      ("state", state, (m, spec.state_width), spec.state_dtype),
                                      ("row_clock", row_clock, (m,), torch.float64)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype \
                    or t.device.type != "cpu":
                got = f"{t.dtype} {tuple(t.shape)} on {t.device}" \
                    if isinstance(t, torch.Tensor) else type(t).__name__
                raise InvalidArgument(f"{what}: need a CPU {dtype} tensor of shape {shape}, "
                                      f"got {got}")
            if not all_finite(t):
                raise InvalidArgument(f"{what}: non-finite values (nan or inf)")
        clock = nonnegative("clock", clock)
        if m == 0:
            return
        with table.lock:
            if table.closed:
                raise FailedPrecondition(f"table {shorten(name)}: the store was closed")
            # a slotted table takes new slots, as a push does, so its files never hold a
            # half-written row
            at = positions if table.slots is None else table.slots.relocate(positions)
            table.optimizer.commit(table.rows, table.state,
                                   RowUpdate(at, rows, state if spec.state_width else None))
            table.row_clock.index_copy_(0, at, row_clock)
            table.clock = max(table.clock, clock)
            if table.touched is None:
                table.touched = torch.zeros(table.owned, dtype=torch.bool)
            table.touched[positions] = True

    def take_touched(self, name: str, max_ids: int | None = None) -> torch.Tensor:
        """Global ids (int64 (m,), ascending) of the rows pushes changed since they were last
        taken, at most ``max_ids`` (None: as many as one reply holds), the smallest first;
        those are forgotten in the same step under the table's lock, so a push is either in
        this answer or in a later one. A graph build takes them before it reads the rows."""
        table = self.table(name)
        limit = MAX_REPLY_PAYLOAD_BYTES // 8 if max_ids is None else max_ids
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidArgument(f"max_ids={shorten(max_ids)} must be an integer >= 1")
        check_reply(8 * limit, MAX_REPLY_PAYLOAD_BYTES, f"up to {limit} touched ids", 8, "ids")
        with table.lock:
            if table.touched is None:
                return torch.empty(0, dtype=torch.int64)
            positions = table.touched.nonzero().view(-1)[:limit]
            table.touched[positions] = False
        return self._class_ids(positions)

    def _class_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """The global class ids of local ``positions`` (int64 (m,))."""
        return positions * self.num_shards + self.shard_id

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
        block_bytes = table.spec.dim * table.spec.dtype.itemsize + 8  # rows with their ids
        if block_rows is None:
            block_rows = min(65536, max(1, MAX_REPLY_PAYLOAD_BYTES // block_bytes))
        for field_name, value, low in (("block_rows", block_rows, 1), ("start", start, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgument(f"{field_name}={shorten(value)} must be an integer >= {low}")
        n = table.owned
        check_reply(min(block_rows, n) * block_bytes, MAX_REPLY_PAYLOAD_BYTES,
                    f"a scan block of {min(block_rows, n)} rows", block_bytes, "block_rows")
        start = min(start, n)
        stop = min(start + block_rows, n)
        positions = torch.arange(start, stop)
        # a slotted table's rows lie in slots all over its files: their pages are read
        # together, not one fault at a time
        prefetch_rows(table.tensors, positions)
        with table.lock:
            at = table.tensors.at(positions)
            rows = table.with_decay_owed(table.rows[start:stop].clone()
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
        positions = self._owned_positions(table, ids)
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
            check_reply(graph.lookup_nbytes(positions), MAX_REPLY_PAYLOAD_BYTES,
                        f"the neighbor lists of {positions.numel()} rows", row_bytes,
                        "rows per call")
            return graph.lookup(positions)

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
        positions = self._owned_positions(table, ids)
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
                staged = table.staged_graph
                if staged is None or staged.version != version:
                    staged = table.staged_graph = StagedGraph(version, step, table.owned,
                                                              table.spec.num_rows)
                try:
                    graph = staged.add(positions, offsets, neighbors, self._graph_lists)
                except ValueError as e:
                    raise InvalidArgument(str(e)) from None
                if graph is not None:
                    table.graph, table.staged_graph = self._with_lists_kept(graph), None
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


def _summed_by_position(positions: torch.Tensor, grads: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique positions int64 (m,) ascending, float32 (m, dim) gradients summed per position,
    in request order) of a push's positions (n,) and grads (n, dim), as the client sorts its
    pushes (``ascending_unique``). Clients send each id once, in ascending order; such a push
    passes through without a sort or a copy."""
    keys, values, source = ascending_unique(positions, grads.to(torch.float32), None)
    return keys, values if source is None else rowcopy.gather(values, source)


def open_storage(kind: str, storage_dir: str | Path | None, shard_id: int,
                 num_shards: int) -> Storage:
    """The storage of shard ``shard_id`` of ``num_shards``: ``kind`` "memory" (which keeps
    no files and ignores ``storage_dir``) or "mmap" (needs ``storage_dir``; ``StorageError``
    when it cannot be used or another store uses it). ``InvalidArgument`` for anything
    else."""
    try:
        kind = StorageKind(kind)
    except ValueError:
        raise InvalidArgument(f"storage={shorten(kind)}: need one of "
                              f"{', '.join(repr(k.value) for k in StorageKind)}") from None
    if kind == StorageKind.MEMORY:
        return MemoryStorage(shard_id, num_shards)
    if storage_dir is None:
        raise InvalidArgument("storage='mmap' needs a storage_dir for the table files")
    return MmapStorage(Path(storage_dir), shard_id, num_shards)

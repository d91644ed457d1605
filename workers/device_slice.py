"""Collective placement's slice in GPU memory: the rows a rank's head reads and updates every
step, kept on the device the head computes on.

In collective placement each rank holds its slice of the class rows in an in-process shard
(``ams.client.local.LocalShard``), in host memory; graph builds, snapshots, evaluation and the
other ranks read them there between steps. A step that read its active rows from there and
pushed their gradients back would move them over PCIe twice: at 1M classes, partial at 10 %
moves 205 MB each way. So on a GPU a ``DeviceSlice`` keeps a working copy of the slice (rows,
momentum and each row's decay clock) in the GPU's memory, as PartialFC keeps its slice: the
head pulls from it, and the row update applies to it the update an AMS shard applies
(``ams.shard.optim.SparseMomentumSGD`` with the decay clock), on the device.

The shard stays the copy everything else reads. Before anything does, the rows changed since
the last write-back go back to it (:meth:`DeviceSlice.write_back`, which
``workers.row_update.RowUpdater.flush`` calls); after a restore replaced the shard's rows, the
working copy is loaded again (:meth:`DeviceSlice.reload`). It is loaded on first use, so a
process that only evaluates never fills the GPU with it.
"""

from __future__ import annotations

import torch

from ams.errors import InvalidArgument, RequestTooLarge, shorten
from ams.shard.checks import check_grads, checked_rates, owned_positions, refuse_non_finite
from ams.shard.optim import SparseMomentumSGD, catch_up_factors, step_decay
from ams.shard.spec import TableSpec
from ams.shard.store import ShardStore
from ams.sharding import owned_ids

# Rows moved per call of ShardStore.read_rows (a load) and write_rows (a write-back): bounds the
# device's and the host's temporaries (64k rows of d = 512 float32 with momentum: 256 MB),
# whatever the slice's size.
TRANSFER_ROWS = 1 << 16


class DeviceSlice:
    """A working copy of table ``table`` of ``store`` (this rank's shard of the class rows) on
    ``device``: the same pulls and pushes as the store, answered on the device.

    Used from one thread at a time: the trainer pulls only after the pushes it waits for are
    applied, and writes back only once none is pending (``workers.row_update``).
    """

    def __init__(self, store: ShardStore, table: str, device: torch.device | str) -> None:
        self.store, self.table = store, table
        self.device = torch.device(device)
        self._spec = store.table(table).spec
        self._optimizer = SparseMomentumSGD(self._spec.momentum, self._spec.weight_decay)
        self._rows: torch.Tensor | None = None  # (owned, dim) row dtype; None: not loaded
        self._state = self._row_clock = self._changed = None
        self._clock = 0.0

    # ---- the store's side -------------------------------------------------------------

    def reload(self) -> None:
        """Forget the working copy: the next pull or push loads the shard's rows again (after
        a restore replaced them). Changes not written back are dropped."""
        self._rows = self._state = self._row_clock = self._changed = None

    def write_back(self) -> None:
        """Write the rows that pushes changed since the last write-back, with their momentum
        and decay clocks, to the shard (``ShardStore.write_rows``)."""
        if self._changed is None:
            return
        changed = self._changed.nonzero().view(-1)
        for start in range(0, changed.numel(), TRANSFER_ROWS):
            part = changed[start:start + TRANSFER_ROWS]
            ids = part.cpu() * self.store.num_shards + self.store.shard_id
            self.store.write_rows(self.table, ids, self._rows.index_select(0, part).cpu(),
                                  self._state.index_select(0, part).cpu(),
                                  self._row_clock.index_select(0, part).cpu(), self._clock)
        self._changed.zero_()

    # ---- the head's and the row update's side ----------------------------------------

    def spec(self, name: str) -> TableSpec:
        """The table's spec."""
        self._check_table(name)
        return self._spec

    def pull(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` (int64 (n,) on the CPU, classes of this slice; repeats allowed) in
        request order: (n, dim) of the row dtype on the device, each with the weight decay it
        owes up to the newest clock pushed (as ``ShardStore.pull``)."""
        self._check_table(name)
        positions = self._positions(ids).to(self.device, non_blocking=True)
        self._load()
        rows = self._rows.index_select(0, positions)
        if self._clock == 0.0 or rows.shape[0] == 0:
            return rows
        factors = catch_up_factors(self._row_clock.index_select(0, positions), self._clock)
        return rows.mul_(factors.to(torch.float32)[:, None])

    def push(self, name: str, ids: torch.Tensor, grads: torch.Tensor, lr: float,
             decay_clock: float | None = None) -> None:
        """Sparse momentum SGD on the rows of ``ids`` (int64 (n,) on the CPU, repeats summed)
        with ``grads`` float (n, dim) (moved to the device if elsewhere), exactly as
        ``ShardStore.push`` applies it: the rows first take the decay they owe at
        ``decay_clock`` (None: no catch-up, clocks unchanged), and an update whose result
        would not be finite is refused whole (``InvalidArgument``) with nothing changed."""
        spec = self._spec
        self._check_table(name)
        positions = self._positions(ids)
        check_grads(grads, positions.numel(), spec)
        lr, decay_clock, clocked = checked_rates(spec, lr, decay_clock)
        # the clock after this step: every row of the slice, pushed or resting, owes decay up to it
        after = float(decay_clock) + step_decay(float(lr), spec.weight_decay) if clocked else None
        if positions.numel() == 0 and after is None:
            return
        self._load()
        if positions.numel() == 0:  # none of the step's rows are here; its clock still counts
            self._clock = max(self._clock, after)
            return
        grads = grads.to(self.device, torch.float32)
        unique, summed = positions, grads
        # a head's active classes come ascending, each once: no sort needed to know it
        if positions.numel() > 1 and not bool((positions[1:] > positions[:-1]).all()):
            unique, inverse = torch.unique(positions, return_inverse=True)
            if unique.numel() < positions.numel():  # a repeated id: its gradients summed
                summed = torch.zeros((unique.numel(), spec.dim), dtype=torch.float32,
                                     device=self.device).index_add_(0, inverse.to(self.device),
                                                                    grads)
            else:  # each id once, in another order: the update takes them as they came
                unique = positions
        at = unique.to(self.device, non_blocking=True)
        row_clock = self._row_clock.index_select(0, at) if clocked else None
        catch_up = catch_up_factors(row_clock, decay_clock) if clocked else None
        update = self._optimizer.compute(self._rows, self._state, at, summed, float(lr),
                                         catch_up)
        refuse_non_finite(spec, update.first_non_finite(), lr, grads,
                          unique * self.store.num_shards + self.store.shard_id)
        self._optimizer.commit(self._rows, self._state, update)
        if after is not None:
            self._row_clock.index_copy_(0, at, row_clock.clamp(min=after))
            self._clock = max(self._clock, after)
        self._changed[at] = True

    # ---- parts ------------------------------------------------------------------------

    def _check_table(self, name: str) -> None:
        if name != self.table:
            raise InvalidArgument(f"this slice holds table {shorten(self.table)}, not "
                                  f"{shorten(name)}")

    def _positions(self, ids: torch.Tensor) -> torch.Tensor:
        """Local positions (int64 (n,), CPU) of ``ids``, each checked to be in this slice."""
        if isinstance(ids, torch.Tensor):
            ids = ids.cpu()
        return owned_positions(ids, self._spec, self.store.shard_id, self.store.num_shards,
                               self.store.table(self.table).owned)

    def _load(self) -> None:
        """The shard's rows, momentum and decay clocks to the device, unless they are there."""
        if self._rows is not None:
            return
        spec, store = self._spec, self.store
        owned = store.table(self.table).owned
        try:
            rows = torch.empty((owned, spec.dim), dtype=spec.dtype, device=self.device)
            state = torch.empty((owned, spec.state_width), dtype=spec.state_dtype,
                                device=self.device)
            row_clock = torch.empty(owned, dtype=torch.float64, device=self.device)
            changed = torch.zeros(owned, dtype=torch.bool, device=self.device)
        # torch.OutOfMemoryError on a GPU; RuntimeError where the host's malloc fails
        except RuntimeError as e:
            raise RequestTooLarge(
                f"this rank's slice of table {shorten(self.table)} ({owned} rows: "
                f"{owned * (spec.bytes_per_row + 1)} bytes with their momentum and decay "
                f"clocks) does not fit in the memory of {self.device} "
                f"({shorten(str(e))}); keep the rows in host shards "
                f"(head.placement = \"ams\"), or use more ranks or a smaller row dtype") \
                from None
        clock = 0.0
        for start in range(0, owned, TRANSFER_ROWS):
            stop = min(start + TRANSFER_ROWS, owned)
            ids = owned_ids(spec.num_rows, store.shard_id, store.num_shards, start, stop)
            part = store.read_rows(self.table, ids)
            for into, values in zip((rows, state, row_clock), part[:3], strict=True):
                into[start:stop].copy_(values)
            clock = part[3]
        self._rows, self._state, self._row_clock, self._clock = rows, state, row_clock, clock
        self._changed = changed

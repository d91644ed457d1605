"""The update of the class rows: the one owner of what happens to dL/dW after the head.

Per step, :meth:`RowUpdater.update` takes the row gradient of the active classes that the
head computed, combines the data-parallel ranks' gradients into one push, attaches the
step's learning rate and weight-decay clock, and pushes to the AMS, whose shards apply the
sparse update (``ams.shard.optim``).

The weight-decay clock. The dense optimizer shrinks every row by ``1 - lr·wd`` in every step;
a sampled head's row sits most steps out. The clock ``D_t = sum over s < t of -log(1 - lr_s·wd)``
travels with each push, and a shard settles a row's debt of skipped decay from it when the
row is next pushed, so sparse pushes match dense SGD on every row.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from ams.shard.optim import step_decay
from ams.shard.spec import TableSpec


class RowPusher(Protocol):
    """The part of the AMS client API the row update uses (``ams.connect(...)`` satisfies it)."""

    def spec(self, name: str) -> TableSpec:
        """The table's spec (its weight decay sets the clock's rate)."""
        ...

    def push(self, table: str, ids: torch.Tensor, grads: torch.Tensor, lr: float,
             decay_clock: float | None = None) -> None:
        """Apply the table's sparse SGD with gradients float (n, dim) to rows ids int64 (n,)."""
        ...


def decay_clocks(lrs: Iterable[float], weight_decay: float) -> list[float]:
    """The weight-decay clock at the start of each step and after the last:
    ``out[t] = sum over s < t of -log(1 - lrs[s] * weight_decay)``; len(lrs) + 1 values.
    ``lr * weight_decay`` must stay below 1 (config validation and the store refuse it)."""
    out = [0.0]
    for lr in lrs:
        out.append(out[-1] + step_decay(lr, weight_decay))
    return out


class RowUpdater:
    """Pushes each step's row gradients of one table with that step's lr and decay clock.

    store: the AMS client; table: the class-row table; lrs: the rows' learning rate of each
    step (0-based, one per step of the run); rank / world: this worker's data-parallel
    position (a process group must exist when ``world > 1``).

    Several ranks send one push per step: rank 0 pushes the mean over ranks of their
    batch-mean gradients, the gradient of the global batch mean. Separate pushes would give a
    row ``world`` momentum updates per step, applied in arrival order.
    """

    def __init__(self, store: RowPusher, table: str, lrs: Sequence[float], *, rank: int = 0,
                 world: int = 1) -> None:
        self.store, self.table = store, table
        self.rank, self.world = rank, world
        self.lrs = list(lrs)
        self.clocks = decay_clocks(self.lrs, store.spec(table).weight_decay)

    def update(self, step: int, ids: torch.Tensor, row_grad: torch.Tensor) -> None:
        """Push step ``step``'s gradients: ids int64 (A,) active classes (unique per rank),
        row_grad float32 (A, dim) CPU dL/dW of those rows. Every rank calls it every step."""
        combined = self._combine(ids, row_grad)
        if combined is not None:
            self.store.push(self.table, *combined, lr=self.lrs[step],
                            decay_clock=self.clocks[step])

    def _combine(self, ids: torch.Tensor, row_grad: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids, grads) to push from this rank, None on the ranks that push nothing. The
        gather also orders every rank's prefetch pull of this step before the push."""
        if self.world == 1:
            return ids, row_grad
        parts: list = [None] * self.world
        dist.all_gather_object(parts, (ids, row_grad))
        if self.rank != 0:
            return None
        return (torch.cat([i for i, _ in parts]),
                torch.cat([g for _, g in parts]) / self.world)

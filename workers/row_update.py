"""The update of the class rows: the one owner of what happens to dL/dW after the head.

Per step, :meth:`RowUpdater.update` takes the row gradient of the active classes that the head
computed and hands it to a pusher thread, which combines the data-parallel ranks' gradients,
attaches the step's learning rate and weight-decay clock, and pushes to the AMS, whose shards
apply the sparse update (``ams.shard.optim``). The push of step t runs while the trainer runs
the backbone's backward of step t and the forward of step t+1; nothing reads the rows before
it is applied: the trainer waits for it (:meth:`RowUpdater.wait_pushed`) before the head of
step t+1, the prefetch thread before it pulls rows of a later step
(``workers.prefetch``), and a graph build, a checkpoint or an evaluation after
:meth:`RowUpdater.flush`. So the rows each step sees do not depend on thread timing: those
after step t-d-1's push, with ``d`` the prefetch depth (0: the strict order).

Several data-parallel ranks (W > 1). Each rank's gradient is the gradient of the mean loss over
its own samples; a row's update is the mean over ranks (the gradient of the global batch's mean
loss), applied once per step. Rank r pushes the rows of the classes c with ``c % W == r`` (with
as many shards as ranks, shard r's rows): the ranks hand each other the gradients of those rows
in one all-to-all, tensors in the updater's own gloo group (its collectives run on the pusher
thread, beside the trainer thread's DDP), and each rank pushes what it received, the ranks' parts
in rank order and divided by W (the client sums a repeated id in request order). So each rank
sends about its own share of rows and pushes about one rank's share, where gathering everything
at rank 0 put W shares through one process. A barrier of the group after the pushes makes a
step pushed only once every rank's part is applied. Each rank's client numbers its pushes, so a
retried push is applied once (exactly-once as for any client). The rows after a step do not
depend on W beyond float32 summation order, and reruns with the same W are bit-identical.

The weight-decay clock. The dense optimizer shrinks every row by ``1 - lr·wd`` in every step;
a sampled head's row sits most steps out. The clock ``D_t = sum over s < t of -log(1 - lr_s·wd)``
travels with each push, and a shard settles a row's debt of skipped decay from it when the
row is next pushed, so sparse pushes match dense SGD on every row.

On CUDA the row gradient is copied to pinned host memory without blocking the trainer; the
pusher thread waits for that copy (a CUDA event) before it sends. Collective placement's slice
in GPU memory (``workers.device_slice.DeviceSlice``) takes the gradient where it is instead, and
:meth:`RowUpdater.flush` writes the rows it changed back to the shard.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
import torch.distributed as dist

from ams.shard.optim import step_decay
from ams.shard.spec import TableSpec
from workers.device_slice import DeviceSlice

# Bytes of one id on the wire: int64.
_ID_BYTES = 8


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


@dataclass(frozen=True)
class RowTraffic:
    """What one rank's row updates moved, summed over the steps pushed so far; bytes count
    int64 ids and float32 gradients.

    own_rows / own_bytes: the row gradients this rank's head computed (its share).
    sent_rows / sent_bytes: of those, the rows handed to other ranks to push.
    received_rows / received_bytes: rows other ranks handed to this rank to push.
    pushed_rows / pushed_bytes: the distinct rows this rank pushed to the AMS.
    """

    own_rows: int = 0
    own_bytes: int = 0
    sent_rows: int = 0
    sent_bytes: int = 0
    received_rows: int = 0
    received_bytes: int = 0
    pushed_rows: int = 0
    pushed_bytes: int = 0


@dataclass
class _Update:
    """One step's row gradients on their way to the pusher thread."""

    step: int
    ids: torch.Tensor  # int64 (A,)
    grads: torch.Tensor  # float32 (A, dim), CPU (pinned when copied from CUDA)
    copied: torch.cuda.Event | None  # set once a non-blocking device-to-host copy is done


class RowUpdater:
    """Pushes each step's row gradients of one table with that step's lr and decay clock, on a
    thread of its own, one step at a time in step order.

    store: the AMS client, or a ``DeviceSlice`` (collective placement on a GPU); table: the
    class-row table; lrs: the rows' learning rate of each step (0-based, one per step of the
    run); rank / world: this worker's data-parallel position (a default process group must
    exist when ``world > 1``; every rank constructs its updater at the same point, which makes
    the updater's own gloo group).

    Use::

        rows = RowUpdater(client, "fc", head_lrs, rank=rank, world=world)
        rows.wait_pushed(step - 1)      # before the head of step reads rows
        rows.update(step, ids, grads)   # returns at once; the push runs behind
        rows.flush()                    # before anything else reads the rows
        rows.close()
    """

    def __init__(self, store: RowPusher, table: str, lrs: Sequence[float], *, rank: int = 0,
                 world: int = 1) -> None:
        self.store, self.table = store, table
        self.rank, self.world = rank, world
        self.lrs = list(lrs)
        self.clocks = decay_clocks(self.lrs, store.spec(table).weight_decay)
        # its own group: the pusher thread's collectives must not interleave with DDP's
        self._group = dist.new_group(backend="gloo") if world > 1 else None
        self._cond = threading.Condition()
        self._queue: collections.deque[_Update | None] = collections.deque()
        self._pending: collections.deque[int] = collections.deque()  # steps not yet pushed
        self._error: BaseException | None = None
        self._traffic = RowTraffic()
        self._thread: threading.Thread | None = None

    # ---- the trainer's side ------------------------------------------------------------

    def update(self, step: int, ids: torch.Tensor, row_grad: torch.Tensor) -> None:
        """Hand over step ``step``'s gradients and return: ids int64 (A,) active classes
        (unique per rank, CPU), row_grad float32 (A, dim) dL/dW of those rows, on the CPU or
        a CUDA device (then copied to pinned host memory without blocking, unless the store
        is a ``DeviceSlice``, which takes it there). Neither may be changed afterwards. Every
        rank calls it for every step, in step order. Raises the error of an earlier push that
        failed."""
        copied = None
        if row_grad.device.type == "cuda" and not isinstance(self.store, DeviceSlice):
            host = torch.empty(row_grad.shape, dtype=torch.float32, pin_memory=True)
            host.copy_(row_grad, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            row_grad = host
        with self._cond:
            self._raise_failure()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="row-pusher",
                                                daemon=True)
                self._thread.start()
            self._pending.append(step)
            self._queue.append(_Update(step, ids, row_grad, copied))
            self._cond.notify_all()

    def wait_pushed(self, step: int, timeout: float | None = None) -> bool:
        """Block until the pushes of every step up to ``step`` handed over so far are applied on
        the shards (by every rank); True then, False when ``timeout`` seconds passed first.
        Raises the error of a push that failed."""
        with self._cond:
            done = self._cond.wait_for(
                lambda: self._error is not None or not self._pending
                or self._pending[0] > step, timeout)
            self._raise_failure()
            return done

    def flush(self) -> None:
        """Block until every push handed over is applied (raises the error of one that
        failed); a ``DeviceSlice`` then writes the rows it changed back to its shard."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or not self._pending)
            self._raise_failure()
        if isinstance(self.store, DeviceSlice):
            self.store.write_back()

    def reload(self) -> None:
        """After a restore replaced the shard's rows: a ``DeviceSlice`` loads them again."""
        if isinstance(self.store, DeviceSlice):
            self.store.reload()

    def close(self) -> None:
        """Stop the pusher thread after the push it is sending; the ones still queued are
        dropped (the trainer flushes first when it finishes; closing on an error must not
        wait for ranks that may be gone)."""
        with self._cond:
            thread, self._thread = self._thread, None
            self._queue.clear()
            self._pending.clear()
            if thread is not None:
                self._queue.append(None)
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout=30)

    @property
    def traffic(self) -> RowTraffic:
        """What this rank's pushes so far moved (:class:`RowTraffic`)."""
        with self._cond:
            return self._traffic

    # ---- the pusher thread -------------------------------------------------------------

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                item = self._queue.popleft()
            if item is None:
                return
            try:
                if item.copied is not None:
                    item.copied.synchronize()
                traffic = self._push(item)
            except BaseException as e:  # handed to the trainer's and prefetch's waits
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                if self._pending:  # emptied when closed meanwhile
                    self._pending.popleft()
                self._traffic = traffic
                self._cond.notify_all()

    def _push(self, item: _Update) -> RowTraffic:
        """Combine and push one step; returns the traffic counts with this step's added."""
        ids, grads = item.ids, item.grads
        row_bytes = _ID_BYTES + grads.shape[1] * 4
        sent = received = 0
        if self.world > 1:
            ids, grads, sent, received = self._exchange(ids, grads)
            grads = grads / self.world
        # pushed with no rows too: the shards learn the step's decay clock
        self.store.push(self.table, ids, grads, lr=self.lrs[item.step],
                        decay_clock=self.clocks[item.step])
        if self._group is not None:
            dist.barrier(group=self._group)  # every rank's part of this step is applied
        pushed = int(torch.unique(ids).numel())
        t = self._traffic
        own = int(item.ids.numel())
        return replace(t, own_rows=t.own_rows + own, own_bytes=t.own_bytes + own * row_bytes,
                       sent_rows=t.sent_rows + sent, sent_bytes=t.sent_bytes + sent * row_bytes,
                       received_rows=t.received_rows + received,
                       received_bytes=t.received_bytes + received * row_bytes,
                       pushed_rows=t.pushed_rows + pushed,
                       pushed_bytes=t.pushed_bytes + pushed * row_bytes)

    def _exchange(self, ids: torch.Tensor, grads: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        """Send each row to the rank that pushes it (``id % W``) and receive this rank's rows
        from all: (ids int64 (R,), grads float32 (R, dim) of every rank in rank order, rows
        sent to other ranks, rows received from them)."""
        world, group = self.world, self._group
        owner = ids % world
        order = torch.argsort(owner, stable=True)
        send_counts = torch.bincount(owner, minlength=world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        total = sum(recv_splits)
        out_ids = torch.empty(total, dtype=torch.int64)
        out_grads = torch.empty((total, grads.shape[1]), dtype=torch.float32)
        dist.all_to_all_single(out_ids, ids[order], recv_splits, send_splits, group=group)
        dist.all_to_all_single(out_grads, grads.float()[order], recv_splits, send_splits,
                               group=group)
        sent = sum(send_splits) - send_splits[self.rank]
        received = total - recv_splits[self.rank]
        return out_ids, out_grads, sent, received

"""Prepare (select active classes + pull rows) for step t+depth while step t computes.

Determinism: the active classes of batch u are selected after step ``u - depth - 1`` has
finished (a graph rebuild between steps included), and its rows pulled once that step's push is
applied on the shards too (the row update pushes behind the trainer, ``workers.row_update``;
``wait_pushed`` tells when), and before step ``u - depth`` pushes (the trainer calls
``wait_prepared`` before it hands its push over). So the rows a step sees do not depend on
thread timing, and a run is reproducible; ``depth = 0`` is the strict order (pull after the
previous push). The selection, which reads no row, runs while that push is applied: only the
pull waits for it.

On CUDA the pulled rows are copied to pinned host memory and on to the device on a stream of
this thread's own, without blocking: the copy of batch u runs while the trainer computes, and
:meth:`PreparedBatch.on_device` makes the trainer's stream wait for it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from workers.batch_plan import Batch
from workers.heads import ActiveBatch
from workers.selection import Selection


@dataclass
class PreparedBatch:
    """A loaded batch with its active classes and pulled rows (``active``, on the CPU: what a
    checkpoint keeps), and the same on the training device (``staged``; ``copied``: the CUDA
    event its copy records, None on the CPU)."""

    batch: Batch
    active: ActiveBatch
    # seconds this thread spent on it by phase ("data": waiting for the loader, "prepare":
    # select + pull), observed when its step ends (workers.metrics)
    seconds: dict[str, float] = field(default_factory=dict)
    staged: ActiveBatch | None = None
    copied: torch.cuda.Event | None = None

    def on_device(self) -> ActiveBatch:
        """The batch on the training device, once the current stream has waited for its copy
        (call it on the thread that computes with it)."""
        if self.staged is None:
            return self.active
        if self.copied is not None:
            stream = torch.cuda.current_stream(self.staged.rows.device)
            stream.wait_event(self.copied)
            # made on the copy stream, used on this one: not reused before this one is done
            for tensor in (self.staged.rows, self.staged.target, self.staged.log_weight):
                tensor.record_stream(stream)
        return self.staged


def stage(active: ActiveBatch, device: torch.device, stream: torch.cuda.Stream
          ) -> tuple[ActiveBatch, torch.cuda.Event]:
    """``active``'s rows, targets and logQ weights on CUDA ``device``, copied from pinned host
    memory on ``stream`` without blocking; the event is recorded once they are there.
    ``active_ids`` stay on the CPU, where the row update needs them."""
    with torch.cuda.stream(stream):
        rows, target, log_weight = (t.pin_memory().to(device, non_blocking=True)
                                    for t in (active.rows, active.target, active.log_weight))
        copied = torch.cuda.Event()
        copied.record(stream)
    return replace(active, rows=rows, target=target, log_weight=log_weight), copied


_END = object()


class Preparer(Protocol):
    """The two halves of a head's ``prepare`` (``workers.heads.RowHead``)."""

    def select(self, labels: torch.Tensor) -> Selection:
        """labels int64 (B,) -> the batch's active classes; reads no row."""
        ...

    def pull(self, selection: Selection) -> ActiveBatch:
        """The batch of ``selection``, its rows pulled."""
        ...


class Prefetcher:
    """Iterates over ``PreparedBatch`` for steps ``start_step, start_step+1, ...``.

    batches: the loader's batches from ``start_step`` on; head: selects a batch's classes and
    pulls their rows (:class:`Preparer`); restored: ActiveBatches prepared before a checkpoint
    for the first batches (used instead of preparing them again, so a resumed run sees the
    same rows);
    wait_pushed: ``wait_pushed(step, timeout)`` is True once the row update of ``step`` is
    applied on the shards, False after ``timeout`` seconds
    (``workers.row_update.RowUpdater.wait_pushed``; None: pushes are done when a step is);
    device: where the trainer computes (CUDA: batches are staged there, see ``stage``).
    """

    def __init__(self, batches: Iterator[Batch], head: Preparer, depth: int, start_step: int,
                 restored: list[ActiveBatch] | None = None, *,
                 wait_pushed: Callable[[int, float], bool] | None = None,
                 device: torch.device | None = None) -> None:
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self.depth = depth
        self._wait_pushed = wait_pushed
        self._device = device if device is not None and device.type == "cuda" else None
        self._stream = torch.cuda.Stream(self._device) if self._device is not None else None
        self._batches = batches
        self._head = head
        self._restored = list(restored or [])
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth + 1)
        self._cond = threading.Condition()
        self._steps_done = start_step
        self._prepared = start_step  # index of the next batch to prepare
        self._finished = False
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            mark = time.perf_counter()
            for u, batch in enumerate(self._batches, start=self._prepared):
                loaded = time.perf_counter()
                with self._cond:
                    self._cond.wait_for(
                        lambda u=u: self._stop or self._steps_done >= u - self.depth)
                    if self._stop:
                        return
                started = time.perf_counter()
                if self._restored:
                    active = self._restored.pop(0)
                else:
                    selection = self._head.select(batch[2])
                    waited = time.perf_counter()
                    if not self._pushed(u - self.depth - 1):
                        return
                    started += time.perf_counter() - waited  # not counted as preparing
                    active = self._head.pull(selection)
                seconds = {"data": loaded - mark, "prepare": time.perf_counter() - started}
                prepared = PreparedBatch(batch, active, seconds)
                if self._stream is not None:
                    prepared.staged, prepared.copied = stage(active, self._device, self._stream)
                # queued before it counts as prepared: a checkpoint taken once wait_prepared
                # returns finds it in pending() (its classes were drawn from the sampler whose
                # state the checkpoint keeps)
                self._put(prepared)
                with self._cond:
                    self._prepared = u + 1
                    self._cond.notify_all()
                mark = time.perf_counter()
        except BaseException as e:  # handed to the trainer thread
            self._error = e
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()
            self._put(_END)

    def _pushed(self, step: int) -> bool:
        """Wait until the push of ``step`` is applied; False when closed first."""
        while self._wait_pushed is not None and not self._wait_pushed(step, 0.1):
            if self._stop:
                return False
        return not self._stop

    def _put(self, item: object) -> None:
        while not self._stop:
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> PreparedBatch:
        item = self._queue.get()
        if item is _END:
            if self._error is not None:
                raise self._error
            raise StopIteration
        return item

    def wait_prepared(self, step: int) -> None:
        """Block until batch ``step + depth`` is prepared (or the data ran out): called by the
        trainer before step ``step`` pushes."""
        with self._cond:
            self._cond.wait_for(lambda: self._finished or self._prepared > step + self.depth)
        if self._error is not None:
            raise self._error

    def step_done(self) -> None:
        """The trainer finished a step (its push and any rebuild/checkpoint after it)."""
        with self._cond:
            self._steps_done += 1
            self._cond.notify_all()

    def pending(self) -> list[ActiveBatch]:
        """Prepared batches not yet handed to the trainer (for a checkpoint at a step boundary,
        when the prefetch thread is idle)."""
        return [item.active for item in list(self._queue.queue) if item is not _END]

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            # A run that stops mid-epoch leaves the batch source suspended with live loader
            # workers; closing it shuts them down now rather than at some later collection.
            close = getattr(self._batches, "close", None)
            if close is not None:
                close()

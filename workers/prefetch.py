"""Prepare (select active classes + pull rows) for step t+depth while step t computes.

Determinism: the rows of batch u are pulled after step ``u - depth - 1`` has finished and
before step ``u - depth`` pushes (the trainer calls ``wait_prepared`` before it pushes). So the
rows a step sees do not depend on thread timing, and a run is reproducible; ``depth = 0`` is
the strict order (pull after the previous push).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.batch_plan import Batch
from workers.heads import ActiveBatch


@dataclass
class PreparedBatch:
    """A loaded batch with its active classes and pulled rows."""

    batch: Batch
    active: ActiveBatch
    # seconds this thread spent on it by phase ("data": waiting for the loader, "prepare":
    # select + pull), observed when its step ends (workers.metrics)
    seconds: dict[str, float] = field(default_factory=dict)


_END = object()


class Prefetcher:
    """Iterates over ``PreparedBatch`` for steps ``start_step, start_step+1, ...``.

    batches: the loader's batches from ``start_step`` on; prepare: labels int64 (B,) ->
    ActiveBatch; restored: ActiveBatches prepared before a checkpoint for the first batches
    (used instead of preparing them again, so a resumed run sees the same rows).
    """

    def __init__(self, batches: Iterator[Batch], prepare: Callable[[torch.Tensor], ActiveBatch],
                 depth: int, start_step: int, restored: list[ActiveBatch] | None = None) -> None:
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self.depth = depth
        self._batches = batches
        self._prepare = prepare
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
                active = self._restored.pop(0) if self._restored else self._prepare(batch[2])
                seconds = {"data": loaded - mark, "prepare": time.perf_counter() - started}
                with self._cond:
                    self._prepared = u + 1
                    self._cond.notify_all()
                self._put(PreparedBatch(batch, active, seconds))
                mark = time.perf_counter()
        except BaseException as e:  # handed to the trainer thread
            self._error = e
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()
            self._put(_END)

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

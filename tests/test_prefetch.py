"""The trainer's prefetch thread: when it prepares a batch and when it waits."""

from __future__ import annotations

import threading
import time

import torch

from workers.heads import ActiveBatch
from workers.prefetch import Prefetcher


def labelled(count: int):
    """Batches whose only label is their index."""
    for u in range(count):
        yield torch.empty(0), torch.empty(0), torch.tensor([u])


class Prepared:
    """A prepare that keeps the label of each batch it was asked for, in order."""

    def __init__(self) -> None:
        self.labels: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, labels: torch.Tensor) -> ActiveBatch:
        with self.lock:
            self.labels.append(int(labels[0]))
        return batch_of(int(labels[0]))

    def seen(self, label: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if label in self.labels:
                    return True
            time.sleep(0.005)
        return False


def batch_of(label: int) -> ActiveBatch:
    return ActiveBatch(active_ids=torch.tensor([label]), target=torch.zeros(1, dtype=torch.int64),
                       rows=torch.zeros(1, 1), log_weight=torch.zeros(1))


def run_steps(prefetcher: Prefetcher, steps: int, first: int = 0) -> list[int]:
    """Steps ``first, first+1, ...`` as the trainer runs them; the label of each one's batch."""
    got = []
    for step in range(first, first + steps):
        got.append(int(next(prefetcher).active.active_ids[0]))
        prefetcher.wait_prepared(step)
        prefetcher.step_done()
    return got


def test_a_batch_is_prepared_only_after_the_step_depth_before_it_finished():
    prepare = Prepared()
    prefetcher = Prefetcher(labelled(4), prepare, depth=1, start_step=0)
    try:
        assert int(next(prefetcher).active.active_ids[0]) == 0
        assert prepare.seen(1, timeout=10)  # one step ahead: batch 1 while step 0 runs
        assert not prepare.seen(2, timeout=0.3)  # batch 2 waits for step 0 to finish
        prefetcher.wait_prepared(0)
        prefetcher.step_done()
        assert prepare.seen(2, timeout=10)
        assert run_steps(prefetcher, 3, first=1) == [1, 2, 3]
    finally:
        prefetcher.close()
    assert prepare.labels == [0, 1, 2, 3]


def test_restored_batches_are_not_prepared_again():
    prepare = Prepared()
    prefetcher = Prefetcher(labelled(3), prepare, depth=1, start_step=0,
                            restored=[batch_of(100)])
    try:
        assert run_steps(prefetcher, 3) == [100, 1, 2]
    finally:
        prefetcher.close()
    assert prepare.labels == [1, 2]

"""The trainer's prefetch thread: when it prepares a batch and when it waits."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

import ams
from workers.heads import ActiveBatch
from workers.prefetch import Prefetcher
from workers.row_update import RowUpdater
from workers.selection import Selection


def labelled(count: int):
    """Batches whose only label is their index."""
    for u in range(count):
        yield torch.empty(0), torch.empty(0), torch.tensor([u])


class Prepared:
    """A head's select and pull that keep the label of each batch they were asked for, in
    order."""

    def __init__(self) -> None:
        self.labels: list[int] = []  # pulled
        self.selected: list[int] = []
        self.lock = threading.Lock()

    def select(self, labels: torch.Tensor) -> Selection:
        with self.lock:
            self.selected.append(int(labels[0]))
        return Selection(active=labels, target=torch.zeros(1, dtype=torch.int64),
                         log_weight=torch.zeros(1))

    def pull(self, selection: Selection) -> ActiveBatch:
        with self.lock:
            self.labels.append(int(selection.active[0]))
        return batch_of(int(selection.active[0]))

    def seen(self, label: int, timeout: float, selected: bool = False) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if label in (self.selected if selected else self.labels):
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


class GatedStore:
    """A real AMS client whose pushes wait for a gate: a push the test holds in flight."""

    def __init__(self) -> None:
        self.client = ams.connect(local_shards=1)
        self.client.create_table("fc", num_rows=8, dim=2, momentum=0.0, weight_decay=0.0)
        self.spec, self.gate = self.client.spec, threading.Event()

    def push(self, *args, **kwargs) -> None:
        self.gate.wait(timeout=30)
        self.client.push(*args, **kwargs)


def test_a_batch_is_prepared_only_after_the_push_depth_before_it_is_applied():
    store = GatedStore()
    rows = RowUpdater(store, "fc", [0.1] * 4)
    prepare = Prepared()
    prefetcher = Prefetcher(labelled(4), prepare, depth=1, start_step=0,
                            wait_pushed=rows.wait_pushed)
    try:
        assert int(next(prefetcher).active.active_ids[0]) == 0
        prefetcher.wait_prepared(0)  # batch 1: nothing to wait for before step 0
        rows.update(0, torch.tensor([3]), torch.ones(1, 2))  # held in flight
        prefetcher.step_done()
        assert prepare.seen(2, timeout=10, selected=True)  # selected meanwhile,
        assert not prepare.seen(2, timeout=0.3)  # but pulled only after push 0 is applied
        store.gate.set()
        assert prepare.seen(2, timeout=10)
        assert rows.wait_pushed(0, timeout=0)
    finally:
        prefetcher.close()
        rows.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host")
def test_cuda_batches_are_staged_on_the_device_as_prepared():
    device = torch.device("cuda", 0)

    class Head:
        def select(self, labels: torch.Tensor) -> Selection:
            return Selection(active=labels, target=labels, log_weight=labels)

        def pull(self, selection: Selection) -> ActiveBatch:
            g = torch.Generator().manual_seed(int(selection.active[0]))
            return ActiveBatch(active_ids=torch.arange(5),
                               target=torch.randint(5, (3,), generator=g),
                               rows=torch.randn(5, 4, generator=g), log_weight=torch.rand(5))

    prefetcher = Prefetcher(labelled(3), Head(), depth=1, start_step=0, device=device)
    try:
        for step in range(3):
            prepared = next(prefetcher)
            staged = prepared.on_device()
            assert staged.rows.device == staged.target.device == device
            assert staged.active_ids.device.type == "cpu"
            for name in ("rows", "target", "log_weight"):
                assert torch.equal(getattr(staged, name).cpu(), getattr(prepared.active, name))
            prefetcher.wait_prepared(step)
            prefetcher.step_done()
    finally:
        prefetcher.close()


@pytest.mark.parametrize("depth", [1, 2])
def test_at_a_step_boundary_pending_holds_every_batch_prepared_ahead(depth):
    """A checkpoint keeps pending() with the head's sampler state: a batch whose classes were
    selected but which pending() missed is selected again on resume from an advanced
    generator, and the resumed run leaves the uninterrupted one. Thread switches every
    microsecond make the trainer run into any gap between "prepared" and "in the queue"."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    steps = 10000
    prefetcher = Prefetcher(labelled(steps + depth), Prepared(), depth=depth, start_step=0)
    missing = []
    try:
        for step in range(steps):
            next(prefetcher)
            prefetcher.wait_prepared(step)
            pending = [int(a.active_ids[0]) for a in prefetcher.pending()]
            if pending != list(range(step + 1, step + 1 + depth)):
                missing.append((step, pending))
            prefetcher.step_done()
    finally:
        sys.setswitchinterval(previous)
        prefetcher.close()
    assert missing == []

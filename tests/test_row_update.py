"""workers.row_update: sparse pushes with the decay clock against dense float64 SGD, and the
pushes of several data-parallel ranks (real gloo processes, real shard processes) against the
dense update of the global batch, with the traffic each rank carried."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import ams
from ams.errors import ShardRestarted
from tests.conftest import DEVICES, free_port, set_torchrun_env
from workers.distributed import process_group
from workers.row_update import RowTraffic, RowUpdater, decay_clocks
from xcls.shards import shard_processes

N, D = 30, 6


def make_client(weight_decay: float):
    client = ams.connect(local_shards=2)
    client.create_table("fc", num_rows=N, dim=D, momentum=0.0, weight_decay=weight_decay,
                        seed=3)
    return client


def test_decay_clocks_sum_the_log_shrink_of_each_step():
    lrs, wd = [0.5, 0.25, 0.0, 1.5], 0.1
    want = [0.0]
    for lr in lrs:
        want.append(want[-1] - math.log(1.0 - lr * wd))
    assert decay_clocks(lrs, wd) == pytest.approx(want, rel=1e-15)


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_updates_equal_dense_sgd_with_weight_decay(device):
    # A sampled head pushes a few rows per step; the rows that sit out still owe the dense
    # optimizer's decay of every step, which the clock settles. On CUDA the gradients come
    # from the device and reach the shards through pinned memory.
    wd = 0.05
    client = make_client(wd)
    lrs = [0.9 / (1 + t) for t in range(10)]
    updater = RowUpdater(client, "fc", lrs)
    dense = client.pull("fc", torch.arange(N)).double()
    g = torch.Generator().manual_seed(5)
    try:
        for t, lr in enumerate(lrs):
            ids = torch.unique(torch.randint(0, N, (4,), generator=g))
            grads = torch.randn(ids.numel(), D, generator=g)
            updater.update(t, ids, grads.to(device))
            updater.flush()
            full = torch.zeros(N, D, dtype=torch.float64)
            full[ids] = grads.double()
            dense = dense - lr * (full + wd * dense)
            torch.testing.assert_close(client.pull("fc", torch.arange(N)).double(), dense,
                                       rtol=1e-5, atol=1e-6)
    finally:
        updater.close()


class GatedStore:
    """The AMS client with pushes held until a gate opens, to see what waits for them."""

    def __init__(self, client) -> None:
        self.client, self.gate = client, threading.Event()
        self.spec = client.spec

    def push(self, *args, **kwargs) -> None:
        self.gate.wait(timeout=30)
        self.client.push(*args, **kwargs)


def test_a_push_runs_behind_and_waits_report_when_it_is_applied():
    client = make_client(0.0)
    store = GatedStore(client)
    updater = RowUpdater(store, "fc", [0.5, 0.5])
    before = client.pull("fc", torch.arange(N))
    try:
        updater.update(0, torch.tensor([2, 5]), torch.ones(2, D))  # returns while held
        assert not updater.wait_pushed(0, timeout=0.2)
        assert updater.wait_pushed(-1, timeout=0)  # nothing before step 0 was handed over
        assert torch.equal(client.pull("fc", torch.arange(N)), before)
        store.gate.set()
        assert updater.wait_pushed(0, timeout=30)
        after = client.pull("fc", torch.arange(N))
        torch.testing.assert_close(after[[2, 5]], before[[2, 5]] - 0.5)
        assert updater.traffic == RowTraffic(own_rows=2, own_bytes=2 * (8 + 4 * D),
                                             pushed_rows=2, pushed_bytes=2 * (8 + 4 * D))
    finally:
        updater.close()


def test_a_failed_push_is_raised_to_every_waiter_and_to_the_next_update():
    client = make_client(0.0)
    updater = RowUpdater(client, "fc", [0.5, 0.5])
    client.invalidate("test: the shards rolled back")  # the client refuses every push now
    try:
        updater.update(0, torch.tensor([1]), torch.ones(1, D))
        with pytest.raises(ShardRestarted, match="the shards rolled back"):
            updater.wait_pushed(0)
        with pytest.raises(ShardRestarted):
            updater.flush()
        with pytest.raises(ShardRestarted):
            updater.update(1, torch.tensor([1]), torch.ones(1, D))
    finally:
        updater.close()


# ---- several ranks -----------------------------------------------------------------------

STEPS, WD = 3, 0.01
LRS = [0.5, 0.4, 0.3]
OWN, SHARED = 40, 40  # rows only this rank takes, rows every rank takes (a step's labels)
ROWS = 1000


def rank_updates(rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids int64 sorted unique, float32 grads) of each step on ``rank``: its own rows and the
    rows every rank of the step shares, as heads' active sets overlap."""
    out = []
    for t in range(STEPS):
        shared = torch.randperm(ROWS, generator=torch.Generator().manual_seed(1000 + t))[:SHARED]
        g = torch.Generator().manual_seed(100 * world + 10 * rank + t)
        ids = torch.unique(torch.cat([shared, torch.randint(ROWS, (OWN,), generator=g)]))
        out.append((ids, torch.randn(ids.numel(), D, generator=g)))
    return out


def _rank_main(rank: int, world: int, port: int, addresses: list[str], tables: list[str],
               out: str) -> None:
    set_torchrun_env(rank, world, port)
    with process_group(world, torch.device("cpu")), ams.connect(addresses) as client:
        traffic = {}
        for table in tables:  # the same steps again on a table of its own: a rerun
            updater = RowUpdater(client, table, LRS, rank=rank, world=world)
            for t, (ids, grads) in enumerate(rank_updates(rank, world)):
                updater.wait_pushed(t - 1)
                updater.update(t, ids, grads)
            updater.flush()
            traffic[table] = updater.traffic
            updater.close()
        torch.save(traffic, Path(out) / f"rank{rank}.pt")


def dense_reference(before: torch.Tensor, world: int) -> torch.Tensor:
    """Float64 dense SGD with weight decay over the global batch: each step's gradient is the
    mean over ranks of each rank's (batch-mean) gradient, every row decays."""
    w = before.double()
    for t in range(STEPS):
        grad = torch.zeros_like(w)
        for rank in range(world):
            ids, grads = rank_updates(rank, world)[t]
            grad.index_add_(0, ids, grads.double() / world)
        w = w - LRS[t] * (grad + WD * w)
    return w


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_push_their_shares_of_the_global_batch_update(tmp_path, world):
    tables = ["fc", "fc_rerun"]
    with shard_processes(2, xcls_flags=["-q"], log_dir=tmp_path) as shards:
        addresses = [shard.address for shard in shards]
        with ams.connect(addresses) as client:
            for table in tables:
                client.create_table(table, num_rows=ROWS, dim=D, momentum=0.0,
                                    weight_decay=WD, seed=3)
            before = client.pull("fc", torch.arange(ROWS))
        mp.spawn(_rank_main, args=(world, free_port(), addresses, tables, str(tmp_path)),
                 nprocs=world, join=True)
        with ams.connect(addresses) as client:
            after = {table: client.pull(table, torch.arange(ROWS)) for table in tables}
    torch.testing.assert_close(after["fc"].double(), dense_reference(before, world),
                               rtol=1e-5, atol=1e-6)
    assert torch.equal(after["fc"], after["fc_rerun"])  # bit-identical with the same W

    traffic = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    assert all(t["fc"] == t["fc_rerun"] for t in traffic)
    row_bytes = 8 + 4 * D
    for rank, t in enumerate(traffic):
        steps = rank_updates(rank, world)
        mine = [ids[ids % world == rank] for ids, _ in steps]
        union_mine = [torch.unique(torch.cat([rank_updates(r, world)[s][0] for r in
                                              range(world)])) for s in range(STEPS)]
        pushed = sum(int((u % world == rank).sum()) for u in union_mine)
        own = sum(ids.numel() for ids, _ in steps)
        # what the other ranks hold of this rank's share, step by step
        received = sum(int((ids % world == rank).sum()) for q in range(world) if q != rank
                       for ids, _ in rank_updates(q, world))
        assert t["fc"] == RowTraffic(
            own_rows=own, own_bytes=own * row_bytes,
            sent_rows=own - sum(m.numel() for m in mine),
            sent_bytes=(own - sum(m.numel() for m in mine)) * row_bytes,
            received_rows=received, received_bytes=received * row_bytes,
            pushed_rows=pushed, pushed_bytes=pushed * row_bytes)
    # nothing is lost or made up in the exchange, and no rank pushes more than a share: the
    # funnel through rank 0 pushed every rank's rows
    assert sum(t["fc"].sent_rows for t in traffic) == sum(t["fc"].received_rows
                                                          for t in traffic)
    shares = [t["fc"].own_bytes for t in traffic]
    assert max(t["fc"].pushed_bytes for t in traffic) <= min(shares)

"""workers.row_update: sparse pushes with the decay clock against dense float64 SGD, and the
one combined push of several data-parallel ranks (real gloo processes)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import ams
from tests.conftest import free_port, set_torchrun_env
from workers.distributed import process_group
from workers.row_update import RowUpdater, decay_clocks

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


def test_sparse_updates_equal_dense_sgd_with_weight_decay():
    # A sampled head pushes a few rows per step; the rows that sit out still owe the dense
    # optimizer's decay of every step, which the clock settles.
    wd = 0.05
    client = make_client(wd)
    lrs = [0.9 / (1 + t) for t in range(10)]
    updater = RowUpdater(client, "fc", lrs)
    dense = client.pull("fc", torch.arange(N)).double()
    g = torch.Generator().manual_seed(5)
    for t, lr in enumerate(lrs):
        ids = torch.unique(torch.randint(0, N, (4,), generator=g))
        grads = torch.randn(ids.numel(), D, generator=g)
        updater.update(t, ids, grads)
        full = torch.zeros(N, D, dtype=torch.float64)
        full[ids] = grads.double()
        dense = dense - lr * (full + wd * dense)
        torch.testing.assert_close(client.pull("fc", torch.arange(N)).double(), dense,
                                   rtol=1e-5, atol=1e-6)


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    set_torchrun_env(rank, world, port)
    with process_group(world, torch.device("cpu")):
        client = make_client(0.01)  # each rank its own store: only rank 0's may change
        before = client.pull("fc", torch.arange(N))
        g = torch.Generator().manual_seed(100 + rank)
        ids = torch.tensor([1, 4, 7]) if rank == 0 else torch.tensor([4, 9])  # 4 on both
        grads = torch.randn(ids.numel(), D, generator=g)
        RowUpdater(client, "fc", [0.5], rank=rank, world=world).update(0, ids, grads)
        torch.save({"before": before, "after": client.pull("fc", torch.arange(N)),
                    "ids": ids, "grads": grads}, Path(out) / f"rank{rank}.pt")


def test_ranks_send_one_push_of_the_mean_gradient(tmp_path):
    mp.spawn(_rank_main, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # float64 reference, dense SGD over the global batch: its gradient is the mean over ranks
    # of each rank's batch-mean gradient (a row taken by both ranks gets both halves), and
    # every row decays
    w = parts[0]["before"].double()
    grad = torch.zeros(N, D, dtype=torch.float64)
    for p in parts:
        grad.index_add_(0, p["ids"], p["grads"].double() / 2)
    want = w - 0.5 * (grad + 0.01 * w)
    torch.testing.assert_close(parts[0]["after"].double(), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(parts[1]["after"], parts[1]["before"])  # rank 1 pushed nothing

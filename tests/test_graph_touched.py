"""Touched rows: ShardStore.push marks what it changed, take_touched hands the marks out once;
GraphUpdater refreshes just those classes' lists and rebuilds in full when it should."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ams
from ams.errors import AmsError, InvalidArgument, RequestTooLarge
from ams.graph.build import GraphMethod, GraphUpdater, build_graph
from ams.shard import store as store_module
from ams.shard.spec import TableSpec
from ams.shard.store import ShardStore

D = 4


def shard(shard_id: int = 1, num_shards: int = 3) -> ShardStore:
    store = ShardStore(shard_id, num_shards)
    store.create_table(TableSpec("fc", num_rows=30, dim=D, momentum=0.0, weight_decay=1e-3))
    return store


def test_push_marks_exactly_the_pushed_ids_and_take_clears_them():
    store = shard()
    assert store.take_touched("fc").tolist() == []  # never pushed
    store.push("fc", torch.tensor([22, 4, 4, 13]), torch.ones(4, D), lr=0.1)
    store.push("fc", torch.tensor([7]), torch.ones(1, D), lr=0.0, decay_clock=0.5)
    got = store.take_touched("fc")
    assert got.dtype == torch.int64 and got.tolist() == [4, 7, 13, 22]  # global ids, ascending
    assert store.take_touched("fc").tolist() == []
    store.push("fc", torch.tensor([1]), torch.ones(1, D), lr=0.1)
    assert store.take_touched("fc").tolist() == [1]


def test_take_at_most_max_ids_smallest_first(monkeypatch):
    store = shard(0, 2)
    store.push("fc", torch.tensor([0, 2, 8, 10, 28]), torch.ones(5, D), lr=0.1)
    assert store.take_touched("fc", 3).tolist() == [0, 2, 8]
    assert store.take_touched("fc", 3).tolist() == [10, 28]
    monkeypatch.setattr(store_module, "MAX_REPLY_PAYLOAD_BYTES", 80)  # ten int64 ids a reply
    small = shard(0, 2)
    small.push("fc", torch.arange(0, 30, 2), torch.ones(15, D), lr=0.1)
    with pytest.raises(RequestTooLarge, match="11 touched ids"):
        small.take_touched("fc", 11)
    assert small.take_touched("fc").tolist() == list(range(0, 20, 2))
    assert small.take_touched("fc").tolist() == list(range(20, 30, 2))


@pytest.mark.parametrize("max_ids", [0, -1, 2.5, True])
def test_bad_max_ids_take_nothing(max_ids):
    store = shard()
    store.push("fc", torch.tensor([4]), torch.ones(1, D), lr=0.1)
    with pytest.raises(InvalidArgument, match="max_ids"):
        store.take_touched("fc", max_ids)
    assert store.take_touched("fc").tolist() == [4]


def test_refused_and_repeated_pushes_mark_nothing():
    store = shard()
    bad_grads = torch.ones(2, D)
    bad_grads[1, 0] = float("nan")
    refused = [
        lambda: store.push("fc", torch.tensor([4, 7]), bad_grads, lr=0.1),
        lambda: store.push("fc", torch.tensor([4, 5]), torch.ones(2, D), lr=0.1),  # not owned
        lambda: store.push("fc", torch.tensor([4]), torch.ones(1, D), lr=-1.0),
        lambda: store.push("fc", torch.tensor([4]), torch.full((1, D), 3e38), lr=10.0),
    ]
    for push in refused:
        with pytest.raises(AmsError):
            push()
    assert store.take_touched("fc").tolist() == []
    assert store.push("fc", torch.tensor([10]), torch.ones(1, D), 0.1, "w", 1)
    assert store.take_touched("fc").tolist() == [10]
    assert not store.push("fc", torch.tensor([13]), torch.ones(1, D), 0.1, "w", 1)  # a retry
    assert store.take_touched("fc").tolist() == []


def test_client_takes_from_every_shard_or_some():
    client = ams.connect(local_shards=3)
    client.create_table("fc", num_rows=40, dim=D)
    client.push("fc", torch.tensor([5, 7, 7, 39, 2]), torch.ones(5, D), lr=0.1)
    assert client.take_touched("fc").tolist() == [2, 5, 7, 39]
    assert client.take_touched("fc").tolist() == []
    client.push("fc", torch.arange(9), torch.ones(9, D), lr=0.1)
    assert client.take_touched("fc", shards=[1]).tolist() == [1, 4, 7]
    assert client.take_touched("fc").tolist() == [0, 2, 3, 5, 6, 8]
    client.close()


# ---- GraphUpdater ------------------------------------------------------------------------

N, K = 400, 6


def exact_lists(rows: torch.Tensor, k: int) -> np.ndarray:
    x = rows.double().numpy()
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    scores = x @ x.T
    np.fill_diagonal(scores, np.inf)
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def moved_table() -> ams.ShardedClient:
    client = ams.connect(local_shards=2)
    client.create_table("fc", num_rows=N, dim=D, momentum=0.0, weight_decay=0.0, seed=3)
    return client


def move(client: ams.ShardedClient, ids: list[int], seed: int) -> None:
    """Push large random steps to ``ids``: their neighbors change."""
    gen = torch.Generator().manual_seed(seed)
    client.push("fc", torch.tensor(ids), torch.randn(len(ids), D, generator=gen), lr=1.0)


def test_touched_refresh_recomputes_only_the_moved_classes():
    client = moved_table()
    updater = GraphUpdater(client, "fc", K, refresh="touched", full_every=2)
    first = updater.update(0)
    assert first.full and first.version == 1 and first.classes == N
    before = client.neighbors("fc", torch.arange(N))

    moved = [3, 50, 51, 222, 399]
    move(client, moved, seed=1)
    report = updater.update(10)
    assert not report.full and report.classes == len(moved) and report.version == 1
    assert report.method is GraphMethod.EXACT and report.recall is None
    after = client.neighbors("fc", torch.arange(N))
    expected = exact_lists(client.pull("fc", torch.arange(N)), K)
    np.testing.assert_array_equal(after[moved].numpy(), expected[moved])
    others = torch.ones(N, dtype=torch.bool)
    others[moved] = False
    assert torch.equal(after[others], before[others])  # untouched lists stay as they were

    idle = updater.update(20)  # nothing moved
    assert not idle.full and idle.classes == 0 and idle.version == 1
    third = updater.update(30)  # after full_every = 2 refreshes: full again
    assert third.full and third.version == 2
    assert client.take_touched("fc").tolist() == []
    client.close()


def test_full_when_more_moved_than_a_refresh_pays_for_or_asked():
    client = moved_table()
    updater = GraphUpdater(client, "fc", K, refresh="touched", full_every=0)
    updater.update(0)
    move(client, list(range(N // 2)), seed=2)  # a refresh would score N/2 * N pairs
    report = updater.update(1)
    assert report.full and report.version == 2
    np.testing.assert_array_equal(client.neighbors("fc", torch.arange(N)).numpy(),
                                  exact_lists(client.pull("fc", torch.arange(N)), K))

    # a new updater (a resumed run) starts with a full build whatever has moved
    move(client, [7], seed=3)
    assert GraphUpdater(client, "fc", K, refresh="touched").update(2).full
    # refresh "full" always rebuilds; a build takes the touched set with it
    move(client, [8], seed=4)
    full = GraphUpdater(client, "fc", K).update(3)
    assert full.full and full.version == 4
    assert client.take_touched("fc").tolist() == []
    client.close()


def test_build_takes_the_touched_set_first():
    client = moved_table()
    move(client, [1, 2], seed=5)
    build_graph(client, "fc", K)
    assert client.take_touched("fc").tolist() == []
    client.close()


@pytest.mark.parametrize("kwargs,needle", [
    ({"method": "annoy"}, "annoy"), ({"refresh": "some"}, "some"),
    ({"full_every": -1}, "full_every=-1"),
])
def test_updater_refuses_bad_options(kwargs, needle):
    client = moved_table()
    with pytest.raises(InvalidArgument, match=needle):
        GraphUpdater(client, "fc", K, **kwargs)
    client.close()

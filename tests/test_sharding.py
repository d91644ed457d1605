"""Routing, and the client's split / fan-out / reassembly (and a push's dedupe), against a
one-shard store."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ams
from ams import sharding

N, D = 97, 4


@given(st.integers(1, 300), st.integers(1, 9))
def test_owned_ids_partition_the_table(num_rows, num_shards):
    parts = [sharding.owned_ids(num_rows, s, num_shards) for s in range(num_shards)]
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(num_rows))
    for s, ids in enumerate(parts):
        assert ids.numel() == sharding.owned_count(num_rows, s, num_shards)
        assert bool((sharding.shard_of(ids, num_shards) == s).all())
        assert torch.equal(sharding.local_index(ids, num_shards), torch.arange(ids.numel()))


@given(st.lists(st.integers(0, 10**12), max_size=60), st.integers(1, 7))
def test_split_by_shard_keeps_order_and_covers(ids, num_shards):
    t = torch.tensor(ids, dtype=torch.int64)
    parts = sharding.split_by_shard(t, num_shards)
    assert sorted(torch.cat(parts).tolist()) == list(range(len(ids)))
    for s, pos in enumerate(parts):
        assert pos.tolist() == sorted(pos.tolist())  # request order within a shard
        assert all(i % num_shards == s for i in t[pos].tolist())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, N - 1), max_size=80), st.integers(1, 4))
def test_client_pull_push_equal_one_store(ids, num_shards):
    ref = ams.connect(local_shards=1)
    sharded = ams.connect(local_shards=num_shards)
    for c in (ref, sharded):
        c.create_table("fc", num_rows=N, dim=D, seed=5)
    t = torch.tensor(ids, dtype=torch.int64)
    grads = torch.randn(len(ids), D, generator=torch.Generator().manual_seed(len(ids)))
    ref.push("fc", t, grads, lr=0.3)
    sharded.push("fc", t, grads, lr=0.3)
    everything = torch.arange(N)
    torch.testing.assert_close(sharded.pull("fc", everything), ref.pull("fc", everything),
                               rtol=0, atol=1e-7)
    assert torch.equal(sharded.pull("fc", t), ref.pull("fc", everything)[t])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, N - 1), max_size=80), st.integers(1, 4), st.booleans())
def test_client_push_is_plain_sgd_on_each_rows_summed_gradient(ids, num_shards, ascending):
    """Against a float64 dense update: unsorted ids, repeats, and ids already ascending and
    unique (``ascending``; the path that skips the client's sort) alike."""
    if ascending:
        ids = sorted(set(ids))
    client = ams.connect(local_shards=num_shards)
    client.create_table("fc", num_rows=N, dim=D, seed=5, momentum=0.0, weight_decay=0.0)
    everything = torch.arange(N)
    expected = client.pull("fc", everything).double()
    t = torch.tensor(ids, dtype=torch.int64)
    grads = torch.randn(len(ids), D, generator=torch.Generator().manual_seed(len(ids)))
    client.push("fc", t, grads, lr=0.3)
    expected.index_add_(0, t, grads.double(), alpha=-0.3)
    torch.testing.assert_close(client.pull("fc", everything).double(), expected, rtol=0,
                               atol=1e-6)


def test_client_splits_requests_into_the_backends_pieces(monkeypatch):
    from ams.client.local import LocalShard

    monkeypatch.setattr(LocalShard, "piece_bytes", 3 * D * 4)  # 3 rows per call
    client = ams.connect(local_shards=2)
    client.create_table("fc", num_rows=N, dim=D)
    ids = torch.tensor([5, 1, 2, 8, 9, 11, 40, 5, 60])
    rows = client.pull("fc", ids)
    stats = client.stats()
    assert sum(s["tables"]["fc"]["pulls"] for s in stats) >= 4
    whole = ams.connect(local_shards=1)
    whole.create_table("fc", num_rows=N, dim=D)
    assert torch.equal(rows, whole.pull("fc", ids))
    grads = torch.randn(ids.numel(), D, generator=torch.Generator().manual_seed(1))
    for c in (client, whole):
        c.push("fc", ids, grads, lr=0.1)
    assert sum(s["tables"]["fc"]["pushes"] for s in client.stats()) >= 3  # 8 ids, 3 per piece
    everything = torch.arange(N)
    torch.testing.assert_close(client.pull("fc", everything), whole.pull("fc", everything),
                               rtol=0, atol=1e-7)


def test_pieces_of_a_shard_are_of_about_one_size(monkeypatch):
    """A shard's 7 rows at most 3 a piece go as 3 + 2 + 2, not 3 + 3 + 1; pushes alike."""
    from ams.client.local import LocalShard
    from ams.shard.store import ShardStore

    sizes: list[tuple[str, int]] = []
    pull, push = ShardStore.pull, ShardStore.push

    def recorded_pull(self, name, ids, out=None):
        sizes.append(("pull", ids.numel()))
        return pull(self, name, ids, out)

    def recorded_push(self, name, ids, *args, **kwargs):
        sizes.append(("push", ids.numel()))
        return push(self, name, ids, *args, **kwargs)

    monkeypatch.setattr(LocalShard, "piece_bytes", 3 * D * 4)
    monkeypatch.setattr(ShardStore, "pull", recorded_pull)
    monkeypatch.setattr(ShardStore, "push", recorded_push)
    client = ams.connect(local_shards=1)
    client.create_table("fc", num_rows=N, dim=D)
    ids = torch.arange(7)
    client.pull("fc", ids)
    client.push("fc", ids, torch.ones(7, D), lr=0.1)
    assert sorted(sizes) == [("pull", 2), ("pull", 2), ("pull", 3),
                             ("push", 2), ("push", 2), ("push", 3)]

"""Graph builds through the client API on in-process shards: the in-memory symmetric build and
the ring build give the float64 brute force's lists."""

from __future__ import annotations

import logging

import numpy as np
import torch

import ams
from ams.graph import topk
from ams.graph.build import build_graph

N, D, K = 700, 10, 6


def test_in_memory_and_ring_builds_equal_brute_force(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(topk, "CPU_BLOCK_ROWS", 96)  # several blocks of 700 rows on 3 shards
    client = ams.connect(local_shards=3, data_dir=tmp_path / "ams")
    client.create_table("fc", num_rows=N, dim=D, seed=5)
    x = client.pull("fc", torch.arange(N)).double().numpy()
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    scores = x @ x.T
    np.fill_diagonal(scores, np.inf)  # the class itself first
    expected = np.argsort(-scores, axis=1, kind="stable")[:, :K]

    with caplog.at_level(logging.INFO, logger="ams.graph.build"):
        assert build_graph(client, "fc", k=K).version == 1
    assert "in_memory=1" in caplog.text
    np.testing.assert_array_equal(client.neighbors("fc", torch.arange(N)).numpy(), expected)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ams.graph.build"):
        # a resume directory needs the ring (per-block resume); so do several builders
        assert build_graph(client, "fc", k=K, resume_dir=tmp_path / "resume").version == 2
    assert "in_memory" not in caplog.text
    np.testing.assert_array_equal(client.neighbors("fc", torch.arange(N)).numpy(), expected)
    client.close()


def test_a_shard_without_lists_makes_the_graph_incomplete():
    """A shard that restarted empty holds no lists while the others do: the trainer must
    build again rather than take the newest version anywhere for a complete graph."""
    from ams.graph.build import current_graph_version, graph_on_every_shard

    client = ams.connect(local_shards=2)
    client.create_table("fc", num_rows=40, dim=8)
    assert not graph_on_every_shard(client, "fc")
    build_graph(client, "fc", k=3)
    assert graph_on_every_shard(client, "fc")
    client.shards[0].store.table("fc").graph = None  # what an empty restart leaves
    assert current_graph_version(client, "fc") == 1
    assert not graph_on_every_shard(client, "fc")

"""IVF neighbor lists (ams.graph.ivf, build_graph method ivf) against a float64 brute force:
recall on clustered rows, exhaustive probing equals the exact lists up to float16 near-ties,
the class itself first, the logged recall equals a recall computed here."""

from __future__ import annotations

import logging
import sys

import numpy as np
import pytest
import torch

import ams
from ams.errors import InvalidArgument
from ams.graph import IvfIndex, ivf_knn, list_recall, resolve_nlist, sample_ids
from ams.graph import build as graph_build
from ams.graph.build import GraphMethod, build_graph, current_graph_version, refresh_graph
from ams.graph.ivf import load_faiss
from tests.test_selection import priority_order
from workers.heads import NeighborClasses

N, D, K = 3000, 16, 10
# float16 storage moves a unit-row score by at most about 2**-10; candidates closer than
# this to the k-th score may trade places with it
FP16_TIE = 2.0**-9


def clustered(n: int, dim: int, seed: int) -> torch.Tensor:
    """Rows around n/50 Gaussian centres (within-cluster cosine ~0.9), float64 (n, dim)."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(max(1, n // 50), dim, generator=gen, dtype=torch.float64)
    rows = centres[torch.randint(centres.shape[0], (n,), generator=gen)]
    return rows + 0.3 * torch.randn(n, dim, generator=gen, dtype=torch.float64)


def exact_scores(rows: torch.Tensor) -> np.ndarray:
    x = rows.double().numpy()
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    return x @ x.T


def exact_lists(scores: np.ndarray, k: int) -> np.ndarray:
    """float64 top-k ids per row, the row itself first."""
    s = scores.copy()
    np.fill_diagonal(s, np.inf)
    return np.argsort(-s, axis=1, kind="stable")[:, :k]


def brute_force_recall(found: np.ndarray, exact: np.ndarray) -> float:
    hits = sum(len(set(f.tolist()) & set(e.tolist())) for f, e in zip(found, exact, strict=True))
    return hits / exact.size


@pytest.fixture(scope="module")
def rows() -> torch.Tensor:
    return clustered(N, D, seed=3)


@pytest.fixture(scope="module")
def scores(rows) -> np.ndarray:
    return exact_scores(rows)


def test_default_probing_finds_most_true_neighbors_self_first(rows, scores):
    ids, got = ivf_knn(rows, K, seed=1)
    assert ids.shape == (N, K) and ids.dtype == torch.int64 and got.dtype == torch.float32
    assert torch.equal(ids[:, 0], torch.arange(N))
    assert brute_force_recall(ids.numpy(), exact_lists(scores, K)) >= 0.95
    assert bool((got[:, 1:-1] >= got[:, 2:]).all()), "rank order after the class itself"


def test_exhaustive_probing_equals_exact_lists_up_to_fp16_ties(rows, scores):
    nlist = resolve_nlist(0, N)
    ids, _ = ivf_knn(rows, K, nlist=nlist, nprobe=nlist, seed=2)
    nb = ids.numpy()
    assert (nb[:, 0] == np.arange(N)).all()
    kth = -np.sort(-scores, axis=1)[:, K - 1]
    for i in range(N):
        assert len(set(nb[i].tolist())) == K
        # equal sets, but for classes within float16 error of the k-th score: every listed
        # class reaches the cut less that error, every class clearly above it is listed
        assert (scores[i, nb[i]] >= kth[i] - FP16_TIE).all(), i
        assert set(np.flatnonzero(scores[i] > kth[i] + FP16_TIE)) <= set(nb[i].tolist()), i


def test_self_first_against_duplicates_and_global_ids():
    base = clustered(400, 8, seed=4)
    base[1] = base[0]  # an exact duplicate: either may rank the other first
    base[2] = 3 * base[0]  # same direction, other norm: the same unit row
    global_ids = torch.arange(400, dtype=torch.int64) * 7 + 3
    ids, got = ivf_knn(base, 5, ids=global_ids, nlist=4, nprobe=4)
    assert torch.equal(ids[:, 0], global_ids)
    for i in (0, 1, 2):
        others = {int(global_ids[j]) for j in (0, 1, 2) if j != i}
        assert set(ids[i, 1:3].tolist()) == others
    assert torch.allclose(got[:, 0], torch.ones(400))


def test_fewer_rows_than_k_pad_with_minus_one():
    ids, got = ivf_knn(clustered(6, 4, seed=5), 9, nlist=1, nprobe=1)
    assert torch.equal(ids[:, 0], torch.arange(6))
    assert bool((ids[:, 6:] == -1).all()) and bool(torch.isneginf(got[:, 6:]).all())
    assert all(set(ids[i, :6].tolist()) == set(range(6)) for i in range(6))


def test_resolve_nlist():
    assert resolve_nlist(0, 1_000_000) == 4000  # 4 sqrt(N)
    assert resolve_nlist(0, 100) == 2  # lists of at least TRAIN_ROWS_PER_LIST rows
    assert resolve_nlist(0, 10) == 1
    assert resolve_nlist(0, 10**12) == 1 << 16
    assert resolve_nlist(7, 10) == 7
    for bad in (-1, 11):
        with pytest.raises(ValueError, match="nlist"):
            resolve_nlist(bad, 10)


def test_sample_ids_are_distinct_seeded_and_capped():
    for n, count in ((10, 4), (10**9, 1000), (50, 80)):
        got = sample_ids(n, count, seed=9)
        assert got.dtype == torch.int64 and got.numel() == min(n, count)
        assert bool((got[1:] > got[:-1]).all()) and int(got.min()) >= 0 and int(got.max()) < n
        assert torch.equal(got, sample_ids(n, count, seed=9))
    assert not torch.equal(sample_ids(10**9, 1000, 1), sample_ids(10**9, 1000, 2))


def test_list_recall_hand_computed():
    found = torch.tensor([[0, 1, 2], [3, 4, -1]])
    exact = torch.tensor([[0, 2, 5], [3, 4, 6]])
    assert list_recall(found, exact) == pytest.approx(4 / 6)
    assert list_recall(exact, exact) == 1.0
    with pytest.raises(ValueError, match="row counts"):
        list_recall(found[:1], exact)


def test_index_refuses_misuse():
    index = IvfIndex(4, 2, 2)
    rows = torch.randn(10, 4)
    with pytest.raises(ValueError, match="train the index"):
        index.add(torch.arange(10), rows)
    with pytest.raises(ValueError, match="training rows"):
        index.train(rows[:1])
    index.train(rows)
    with pytest.raises(ValueError, match="do not match"):
        index.add(torch.arange(10), torch.randn(10, 5))
    with pytest.raises(TypeError, match="int64"):
        index.add(torch.arange(10, dtype=torch.int32), rows)
    assert index.size == 0
    with pytest.raises(ValueError, match=">= 1"):
        IvfIndex(4, 0, 1)


def test_missing_faiss_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # makes "import faiss" fail
    with pytest.raises(ImportError, match="pip install faiss-cpu"):
        load_faiss()
    with pytest.raises(ImportError, match="ivf graph method"):
        IvfIndex(4, 2, 2)


# ---- through the client (in-process shards) --------------------------------------------


def table_with_rows(rows: torch.Tensor, shards: int = 3) -> ams.ShardedClient:
    """In-process shards holding ``rows`` (float32 rounding): plain SGD at lr 1 moves the
    initial rows onto them in one push."""
    client = ams.connect(local_shards=shards)
    n, d = rows.shape
    client.create_table("fc", num_rows=n, dim=d, momentum=0.0, weight_decay=0.0, seed=1)
    ids = torch.arange(n)
    client.push("fc", ids, client.pull("fc", ids).float() - rows.float(), lr=1.0)
    client.take_touched("fc")
    return client


def test_build_graph_ivf_logs_a_recall_equal_to_brute_force(rows, caplog, monkeypatch):
    n = 1500
    client = table_with_rows(rows[:n])
    stored = client.pull("fc", torch.arange(n))
    exact = exact_lists(exact_scores(stored), K)
    monkeypatch.setattr(graph_build, "RECALL_QUERIES", n)
    with caplog.at_level(logging.INFO, logger="ams.graph.build"):
        report = build_graph(client, "fc", K, method="ivf", nprobe=2, seed=4)
    lists = client.neighbors("fc", torch.arange(n))
    assert torch.equal(lists[:, 0], torch.arange(n))
    assert report.version == 1 and report.method is GraphMethod.IVF and report.full
    assert report.classes == n and report.sampled == n
    # every class sampled: the estimate is the recall of the whole graph
    assert report.recall == pytest.approx(brute_force_recall(lists.numpy(), exact), abs=1e-12)
    assert report.recall >= 0.9
    assert "method=ivf" in caplog.text and f"sampled={n}" in caplog.text
    assert f"recall_at_k={report.recall:.4f}" in caplog.text

    caplog.clear()
    monkeypatch.setattr(graph_build, "RECALL_QUERIES", 200)
    with caplog.at_level(logging.INFO, logger="ams.graph.build"):
        again = build_graph(client, "fc", K, method="ivf")
    assert again.version == 2 and again.sampled == 200 and 0 <= again.recall <= 1
    assert "sampled=200" in caplog.text
    client.close()


def test_short_ivf_lists_stay_short_and_k_stays_the_graphs(rows, monkeypatch):
    """One probed list of a few rows per class leaves every IVF list short of k: the
    recall is still reported at k (against brute force), a knn head takes the short lists
    -1 padded (it refused them as a graph of a smaller k), and a refresh gives the classes
    it touches exact lists of k (it kept the length of the first one's short list)."""
    n, k = 1500, 64
    client = table_with_rows(rows[:n])
    stored = client.pull("fc", torch.arange(n))
    scores = exact_scores(stored)
    monkeypatch.setattr(graph_build, "RECALL_QUERIES", n)
    report = build_graph(client, "fc", k, method="ivf", nlist=300, nprobe=1)
    lists = client.neighbors("fc", torch.arange(n))
    assert lists.shape[1] < k
    padded = torch.full((n, k), -1, dtype=torch.int64)
    padded[:, :lists.shape[1]] = lists
    assert report.recall == pytest.approx(
        brute_force_recall(padded.numpy(), exact_lists(scores, k)), abs=1e-12)

    # the head's selection against the plain-Python priority order of the short lists
    # (labels, then the lists rank by rank): a budget of 12 cuts the order (the first 12 are
    # the active set), one of 40 takes all of it (about 30) and tops it up with random classes
    labels = torch.tensor([5, 9, 5])
    order = priority_order(labels.tolist(), lists[labels].tolist())
    assert 12 < len(order) < 40
    for budget in (12, 40):
        chosen = NeighborClasses(client, "fc", n, k, budget,
                                 torch.Generator().manual_seed(0))(labels)
        active = chosen.active.tolist()
        assert len(active) == len(set(active)) == budget
        assert set(order[:budget]) <= set(active)
        assert torch.equal(chosen.active[chosen.target], labels)

    moved = torch.tensor([3, 700])
    refresh_graph(client, "fc", moved, k)
    refreshed = client.neighbors("fc", moved)
    for i, c in enumerate(moved.tolist()):
        kth = np.sort(scores[c])[-k]
        assert (refreshed[i] >= 0).sum() == k and refreshed[i, 0] == c
        assert (scores[c, refreshed[i, :k].numpy()] >= kth - 1e-6).all()
    client.close()


def test_bad_build_arguments_change_nothing(rows):
    client = table_with_rows(rows[:300])
    build_graph(client, "fc", K)
    before = client.neighbors("fc", torch.arange(300))
    client.push("fc", torch.tensor([4, 9]), torch.ones(2, D), lr=0.1)
    for kwargs, needle in (({"method": "annoy"}, "method='annoy' is not one of 'exact', 'ivf'"),
                           ({"method": "ivf", "nlist": 301}, "nlist=301"),
                           ({"method": "ivf", "nprobe": 0}, "nprobe=0"),
                           ({"method": "ivf", "resume_dir": "x"}, "exact method only")):
        with pytest.raises(InvalidArgument, match=needle):
            build_graph(client, "fc", K, **kwargs)
    assert current_graph_version(client, "fc") == 1
    assert torch.equal(client.neighbors("fc", torch.arange(300)), before)
    assert client.take_touched("fc").tolist() == [4, 9]  # still marked for the next refresh
    client.close()

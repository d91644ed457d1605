"""ams.graph.knn / ams.graph.ring against a float64 numpy brute force."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ams.graph import (
    ScoreBuffer,
    TopKAccumulator,
    assign_shards,
    build_shard_neighbors,
    fused_filter,
    knn,
    refresh_neighbors,
    ring,
    ring_order,
    topk,
)
from tests.conftest import DEVICES

TOL = 1e-5
BIG = 5_000_000_000  # global ids above 2**32


def random_rows(n: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def clustered_rows(n: int, d: int, seed: int, clusters: int = 25, spread: float = 0.05):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(clusters, d, generator=g)
    which = torch.randint(clusters, (n,), generator=g)
    return centers[which] + spread * torch.randn(n, d, generator=g)


def reference_scores(rows: torch.Tensor) -> np.ndarray:
    x = rows.double().numpy()
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-300)
    return x @ x.T


def assert_exact(ids: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor, k: int,
                 offset: int = 0, queries: np.ndarray | None = None) -> None:
    """Lists equal the float64 brute force up to exact ties: row itself first, distinct ids,
    reported scores are the true scores of the reported ids, and nothing better was missed.
    ``queries``: the positions in ``rows`` of the rows the lists belong to, in list order
    (None: every row, in order)."""
    n = rows.shape[0]
    q = np.arange(n) if queries is None else np.asarray(queries)
    assert ids.dtype == torch.int64 and scores.dtype == torch.float32
    assert ids.shape == scores.shape == (len(q), k)
    ref = reference_scores(rows)[q]
    pos = ids.numpy() - offset
    got = scores.double().numpy()
    assert ((pos >= 0) & (pos < n)).all()  # real rows only, no wrap-around in the look-up
    assert (pos[:, 0] == q).all()
    assert all(len(set(r)) == k for r in pos)
    assert np.abs(np.take_along_axis(ref, pos, axis=1) - got).max() < TOL
    assert (np.diff(got[:, 1:], axis=1) <= TOL).all()
    others = ref.copy()
    others[np.arange(len(q)), q] = -np.inf
    kth_best = -np.sort(-others, axis=1)[:, k - 2]
    assert (got[:, 1:].min(axis=1) >= kth_best - TOL).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("make", [random_rows, clustered_rows])
@pytest.mark.parametrize("block_size", [97, 4096])
def test_knn_is_exact(make, block_size, device):
    rows = make(700, 24, seed=1)
    ids, scores = knn(rows, 10, block_size=block_size, device=device)
    assert ids.device.type == scores.device.type == "cpu"
    assert_exact(ids, scores, rows, 10)


def test_knn_global_ids_above_int32():
    rows = clustered_rows(300, 16, seed=2)
    global_ids = torch.arange(300, dtype=torch.int64) * 3 + BIG
    ids, scores = knn(rows, 8, block_size=64, ids=global_ids, device="cpu")
    assert int(ids.min()) >= BIG
    positions = (ids - BIG) // 3
    assert torch.equal(positions * 3 + BIG, ids)
    assert_exact(positions, scores, rows, 8)


def test_knn_puts_row_first_among_duplicates():
    base = random_rows(50, 8, seed=3)
    rows = torch.cat([base, base, base])  # every vector three times
    ids, scores = knn(rows, 3, block_size=16, device="cpu")
    assert torch.equal(ids[:, 0], torch.arange(150))
    assert torch.allclose(scores, torch.ones(150, 3), atol=TOL)
    expect = {frozenset({i % 50, i % 50 + 50, i % 50 + 100}) for i in range(150)}
    assert {frozenset(r.tolist()) for r in ids} == expect


def low_precision_on(monkeypatch, device: str, low: bool) -> None:
    """Make searches on ``device`` score in fp16 (``low``) or fp32, whatever the device."""
    types = {torch.device(device).type}
    monkeypatch.setattr(topk, "LOW_PRECISION_DEVICE_TYPES",
                        frozenset(types if low else set()))


@pytest.mark.parametrize("device", DEVICES)
def test_low_precision_rerank_equals_fp32(device, monkeypatch):
    rows = clustered_rows(600, 32, seed=4, spread=0.02)  # many near-ties: hard for fp16
    low_precision_on(monkeypatch, device, True)
    ids16, scores16 = knn(rows, 12, block_size=128, device=device)
    low_precision_on(monkeypatch, device, False)
    ids32, scores32 = knn(rows, 12, block_size=128, device=device)
    assert_exact(ids16, scores16, rows, 12)
    assert torch.allclose(scores16, scores32, atol=1e-6, rtol=0)


def test_fewer_rows_than_k_pads():
    rows = random_rows(4, 5, seed=5)
    ids, scores = knn(rows, 6, device="cpu")
    assert (ids[:, 4:] == -1).all() and torch.isneginf(scores[:, 4:]).all()
    assert_exact(ids[:, :4], scores[:, :4], rows, 4)


def test_k1_is_self():
    rows = random_rows(10, 5, seed=6)
    ids, scores = knn(rows, 1, device="cpu")
    assert torch.equal(ids[:, 0], torch.arange(10))
    assert torch.allclose(scores, torch.ones(10, 1), atol=TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_rows_in_other_dtypes_are_cast(dtype):
    rows = clustered_rows(200, 16, seed=7).to(dtype)
    ids, scores = knn(rows, 5, block_size=64, device="cpu")
    assert_exact(ids, scores, rows.float(), 5)


def test_accumulator_streams_blocks_in_any_order_and_size():
    rows = clustered_rows(400, 12, seed=8)
    all_ids = torch.arange(400, dtype=torch.int64) + BIG
    acc = TopKAccumulator(all_ids[100:230], rows[100:230], 7, device="cpu", low_precision=False,
                          key_block_rows=33)
    order = torch.randperm(400, generator=torch.Generator().manual_seed(0))
    for chunk in torch.split(order, 57):
        acc.update(all_ids[chunk], rows[chunk])
    ids, scores = acc.result()
    ref_ids, ref_scores = knn(rows, 7, ids=all_ids, device="cpu")
    assert torch.allclose(scores, ref_scores[100:230], atol=TOL)
    assert_exact(torch.cat([ref_ids[:100], ids, ref_ids[230:]]) - BIG,
                 torch.cat([ref_scores[:100], scores, ref_scores[230:]]), rows, 7)


@pytest.mark.parametrize("low_precision", [False, True])
@pytest.mark.parametrize("key_block_rows", [3, 40])
def test_accumulator_keys_in_ascending_score_order(low_precision, key_block_rows):
    # Keys arrive worst first, so every key beats the running k-th score: the candidate queue
    # overflows (chunks of 3 keys) or a single chunk exceeds it (40 keys > q*(k-1)); both must
    # still give the exact lists, and sharing the queue between accumulators must be safe.
    rows = clustered_rows(300, 10, seed=3, clusters=2, spread=0.3)
    ref = reference_scores(rows)
    queries = [torch.arange(0, 4), torch.arange(4, 9)]
    buffer = ScoreBuffer()
    accs = [TopKAccumulator(q, rows[q], 5, device="cpu", low_precision=low_precision,
                            key_block_rows=key_block_rows, score_buffer=buffer) for q in queries]
    order = torch.from_numpy(np.argsort(ref[0], kind="stable").copy())
    for chunk in torch.split(order, 60):
        for acc in accs:
            acc.update(chunk, rows[chunk])
    for q, acc in zip(queries, accs, strict=True):
        ids, scores = acc.result()
        others = ref[q.numpy()].copy()
        others[np.arange(len(q)), q.numpy()] = -np.inf
        kth = -np.sort(-others, axis=1)[:, 3]
        np.testing.assert_allclose(scores[:, 1:].double().numpy(),
                                   np.take_along_axis(ref[q.numpy()], ids[:, 1:].numpy(), 1),
                                   atol=TOL)
        assert (scores[:, 1:].double().numpy().min(axis=1) >= kth - TOL).all()
        assert (ids[:, 0] == q).all() and all(len(set(r)) == 5 for r in ids.tolist())


def test_assign_shards_and_ring_order():
    assert assign_shards(5, 2) == [[0, 2, 4], [1, 3]]
    assert assign_shards(2, 3) == [[0], [1], []]
    assert ring_order(2, 4) == [2, 3, 0, 1]
    assert ring_order(0, 1) == [0]
    with pytest.raises(ValueError):
        ring_order(4, 4)


class FakeShards:
    """In-memory shards: class c lives on shard c % num_shards, scanned in ascending id order
    in blocks of ``block`` rows, stored in ``dtype``."""

    def __init__(self, rows: torch.Tensor, num_shards: int, block: int, offset: int = BIG,
                 dtype: torch.dtype = torch.float32) -> None:
        self.rows, self.num_shards, self.block, self.offset = rows, num_shards, block, offset
        self.dtype = dtype
        self.calls = 0
        self.fail_at: int | None = None

    def ids_of(self, shard: int) -> torch.Tensor:
        return torch.arange(shard, self.rows.shape[0], self.num_shards, dtype=torch.int64)

    def scan(self, shard: int):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            raise ConnectionError("shard went away")
        pos = self.ids_of(shard)
        for chunk in torch.split(pos, self.block):
            yield chunk + self.offset, self.rows[chunk].to(self.dtype)

    def scan_all(self):
        for shard in range(self.num_shards):
            yield from self.scan(shard)


def ring_build(shards: FakeShards, k: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Build every home shard and put the lists back in global row order."""
    n = shards.rows.shape[0]
    neigh = torch.full((n, k), -2, dtype=torch.int64)
    scores = torch.zeros(n, k)
    for home in range(shards.num_shards):
        ids, nb, sc = build_shard_neighbors(home, shards.num_shards, shards.scan, k, **kw)
        assert torch.equal(ids, shards.ids_of(home) + shards.offset)
        neigh[ids - shards.offset], scores[ids - shards.offset] = nb, sc
    return neigh, scores


def test_ring_over_three_shards_equals_single_build(monkeypatch):
    rows = clustered_rows(500, 16, seed=9)
    shards = FakeShards(rows, num_shards=3, block=40, dtype=torch.float16)
    monkeypatch.setattr(topk, "CPU_BLOCK_ROWS", 50)  # several query blocks; 40-row scans
    neigh, scores = ring_build(shards, 9, device="cpu", progress=True)
    half = rows.half().float()
    ref_ids, ref_scores = knn(half, 9, device="cpu")
    assert torch.allclose(scores, ref_scores, atol=TOL)
    assert_exact(neigh - BIG, scores, half, 9)


def test_ring_low_precision_equals_fp32(monkeypatch):
    rows = clustered_rows(300, 16, seed=10, spread=0.02)
    shards = FakeShards(rows, num_shards=3, block=32)
    monkeypatch.setattr(topk, "CPU_BLOCK_ROWS", 40)
    low_precision_on(monkeypatch, "cpu", True)
    _, scores16 = ring_build(shards, 6, device="cpu")
    low_precision_on(monkeypatch, "cpu", False)
    neigh, scores32 = ring_build(shards, 6, device="cpu")
    assert torch.allclose(scores16, scores32, atol=1e-6, rtol=0)
    assert_exact(neigh - BIG, scores32, rows, 6)


def test_resume_after_interrupted_build(tmp_path, monkeypatch):
    rows = clustered_rows(400, 16, seed=11)
    # One 32-row query block per pass: a pass scans the 3 other shards (home stays in memory).
    monkeypatch.setattr(topk, "CPU_BLOCK_ROWS", 32)
    monkeypatch.setattr(ring, "PASS_MEMORY_BYTES", 1)
    kw = dict(device="cpu")
    shards = FakeShards(rows, num_shards=4, block=25)
    whole = build_shard_neighbors(1, 4, shards.scan, 8, **kw)
    num_blocks = -(-100 // 32)

    shards.calls, shards.fail_at = 0, 1 + 3 * 2 + 2  # home scan, two passes, then mid-pass
    with pytest.raises(ConnectionError):
        build_shard_neighbors(1, 4, shards.scan, 8, resume_dir=tmp_path, **kw)
    assert len(list(tmp_path.glob("*.pt"))) == 2

    shards.calls, shards.fail_at = 0, None
    resumed = build_shard_neighbors(1, 4, shards.scan, 8, resume_dir=tmp_path, **kw)
    assert shards.calls == 1 + 3 * (num_blocks - 2)  # finished blocks were not recomputed
    for a, b in zip(whole, resumed, strict=True):
        assert torch.equal(a, b)
    assert not list(tmp_path.glob(".*tmp"))


def test_resume_ignores_blocks_of_another_k(tmp_path, monkeypatch):
    """Blocks kept by a k=4 build are not reused by a k=6 build over the same rows: the k=6
    lists of the home rows equal the float64 brute force over all 90 rows."""
    rows = random_rows(90, 8, seed=12)
    shards = FakeShards(rows, num_shards=2, block=16)
    monkeypatch.setattr(topk, "CPU_BLOCK_ROWS", 16)
    build_shard_neighbors(0, 2, shards.scan, 4, resume_dir=tmp_path, device="cpu")
    ids, neigh, scores = build_shard_neighbors(0, 2, shards.scan, 6, resume_dir=tmp_path,
                                               device="cpu")
    home = np.arange(0, 90, 2)  # shard 0 of 2 holds the even rows, in ascending order
    assert torch.equal(ids, torch.from_numpy(home) + BIG)
    assert_exact(neigh, scores, rows, 6, offset=BIG, queries=home)


def test_resume_computes_damaged_blocks_again(tmp_path, caplog, monkeypatch):
    """A block file that cannot be read, or holds lists of another shape for the same ids and
    k, is computed again: the build equals the brute force, with no block taken on trust."""
    rows = random_rows(90, 8, seed=14)
    shards = FakeShards(rows, num_shards=2, block=16)
    monkeypatch.setattr(topk, "CPU_BLOCK_ROWS", 16)
    build_shard_neighbors(0, 2, shards.scan, 4, resume_dir=tmp_path, device="cpu")
    blocks = sorted(tmp_path.glob("*.pt"))
    assert len(blocks) == 3
    blocks[0].write_bytes(blocks[0].read_bytes()[:100])  # truncated
    blocks[1].write_bytes(b"not a torch file")
    saved = torch.load(blocks[2], weights_only=True)
    torch.save({**saved, "neighbors": saved["neighbors"][:, :2]}, blocks[2])  # narrower lists
    with caplog.at_level("WARNING", logger="ams.graph.ring"):
        ids, neigh, scores = build_shard_neighbors(0, 2, shards.scan, 4, resume_dir=tmp_path,
                                                   device="cpu")
    assert caplog.text.count("graph_block_unreadable") == 2
    home = np.arange(0, 90, 2)  # shard 0 of 2 holds the even rows, in ascending order
    assert torch.equal(ids, torch.from_numpy(home) + BIG)
    assert_exact(neigh, scores, rows, 4, offset=BIG, queries=home)


def test_partial_refresh_equals_rows_of_full_build(monkeypatch):
    rows = clustered_rows(450, 16, seed=13)
    shards = FakeShards(rows, num_shards=3, block=50)
    full_ids, full_scores = knn(rows, 7, device="cpu", ids=torch.arange(450) + BIG)
    pick = torch.randperm(450, generator=torch.Generator().manual_seed(1))[:70]
    monkeypatch.setattr(topk, "CPU_BLOCK_ROWS", 32)  # 3 query blocks; the 50-row scans split
    neigh, scores = refresh_neighbors(pick + BIG, rows[pick], shards.scan_all(), 7,
                                      device="cpu")
    assert torch.equal(neigh[:, 0], pick + BIG)
    assert torch.allclose(scores, full_scores[pick], atol=TOL)
    # Neighbor sets agree wherever the float64 scores leave no tie at the cut.
    ref = reference_scores(rows)
    for i, p in enumerate(pick.tolist()):
        cut = np.sort(ref[p])[::-1]
        if cut[6] - cut[7] > 1e-4:
            assert set(neigh[i].tolist()) == set(full_ids[p].tolist())


@pytest.mark.skipif(not (torch.cuda.is_available() and fused_filter.triton is not None),
                    reason="the fused filter needs CUDA and Triton")
@pytest.mark.parametrize("q, b, d", [(300, 517, 128), (129, 40, 20)])
def test_fused_filter_returns_the_pairs_a_float64_compare_returns(q, b, d):
    g = torch.Generator().manual_seed(q)
    queries = torch.nn.functional.normalize(torch.randn(q, d, generator=g), dim=1)
    keys = torch.nn.functional.normalize(torch.randn(b, d, generator=g), dim=1)
    query_ids = torch.arange(q) + 7
    key_ids = torch.arange(b)  # ids 7.. are shared: those pairs must be skipped
    threshold = torch.rand(q, generator=g) * 0.4 - 0.1
    dev = torch.device("cuda", torch.cuda.current_device())
    found = fused_filter.FusedFilter(q * b, dev).candidates(
        queries.half().to(dev), keys.half().to(dev), query_ids.to(dev), key_ids.to(dev),
        threshold.to(dev))
    rows, cols = (t.cpu() for t in found)
    scores = queries.half().double() @ keys.half().double().T
    expect = (scores >= threshold.double()[:, None]) & (query_ids[:, None] != key_ids[None, :])
    got = torch.zeros(q, b, dtype=torch.bool)
    got[rows, cols] = True
    assert rows.numel() == int(got.sum())  # no pair twice
    borderline = (scores - threshold.double()[:, None]).abs() < 1e-5
    assert bool(((got == expect) | borderline).all())
    assert fused_filter.FusedFilter(3, dev).candidates(
        queries.half().to(dev), keys.half().to(dev), query_ids.to(dev), key_ids.to(dev),
        threshold.to(dev)) is None  # more than its capacity: the caller scores unfused

"""ShardStore and SparseMomentumSGD against torch.optim.SGD on a dense float64 copy, on
each storage (memory, mmap)."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from ams import errors
from ams.shard import store as store_module
from ams.shard.spec import TableSpec
from ams.shard.store import ShardStore
from tests.conftest import (
    Storages,
    dense_sgd_with_sparse_grads,
    in_position_order,
    reference_sgd_step,
)

N, D = 50, 8
STORAGE: Storages | None = None  # the storage of the running test, see _on_each_storage


@pytest.fixture(autouse=True)
def _on_each_storage(storage, monkeypatch):
    """Every test here runs once per storage kind; make_store builds its stores on it."""
    monkeypatch.setattr(sys.modules[__name__], "STORAGE", storage)


def make_store(shard_id=0, num_shards=1, **spec_kw) -> ShardStore:
    store = STORAGE.store(shard_id, num_shards)
    kw = dict(name="fc", num_rows=N, dim=D, momentum=0.9, weight_decay=5e-4, seed=3)
    kw.update(spec_kw)
    store.create_table(TableSpec(**kw))
    return store


def owned(store: ShardStore) -> torch.Tensor:
    return torch.arange(store.shard_id, N, store.num_shards)


@pytest.mark.parametrize("shard_id,num_shards", [(0, 1), (1, 3)])
def test_push_matches_dense_sgd(shard_id, num_shards, update_path):
    store = make_store(shard_id, num_shards)
    mine = owned(store)
    w = store.pull("fc", mine).double()
    v = torch.zeros_like(w)
    g = torch.Generator().manual_seed(0)
    for step in range(5):
        pos = torch.randint(0, mine.numel(), (12,), generator=g)  # repeats on purpose
        ids = mine[pos]
        grads = torch.randn(12, D, generator=g)
        lr = 0.1 / (step + 1)
        assert store.push("fc", ids, grads, lr)
        reference_sgd_step(w, v, pos, grads, lr, 0.9, 5e-4)
    torch.testing.assert_close(store.pull("fc", mine).double(), w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(in_position_order(store)[1].double(), v, rtol=1e-6, atol=1e-7)


def test_push_without_momentum_is_plain_sgd_and_keeps_no_state(update_path):
    store = make_store(momentum=0.0, weight_decay=0.01)
    assert tuple(in_position_order(store)[1].shape) == (N, 0)
    w = store.pull("fc", owned(store)).double()
    v = torch.zeros_like(w)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        ids = torch.randint(0, N, (15,), generator=g)
        grads = torch.randn(15, D, generator=g)
        assert store.push("fc", ids, grads, 0.5 / (step + 1))
        reference_sgd_step(w, v, ids, grads, 0.5 / (step + 1), 0.0, 0.01)
    torch.testing.assert_close(store.pull("fc", owned(store)).double(), w, rtol=1e-6, atol=1e-7)
    assert store.stats()["tables"]["fc"]["state_bytes"] == 0


@pytest.mark.parametrize("shard_id,num_shards", [(0, 1), (2, 3)])
def test_decay_clock_makes_sparse_pushes_equal_dense_sgd(shard_id, num_shards, update_path):
    wd = 0.05  # large, so a row that sits out steps visibly owes decay
    store = make_store(shard_id, num_shards, momentum=0.0, weight_decay=wd)
    mine = owned(store)
    g = torch.Generator().manual_seed(4)
    steps = []
    for step in range(8):
        # a few rows per step, so most rows sit out several steps between pushes
        pos = torch.randint(0, mine.numel(), (3,), generator=g)
        steps.append((pos, torch.randn(3, D, generator=g), 0.9 / (1 + step)))
    clocks = [0.0]  # the clock at the start of each step: sum of -log(1 - lr wd) before it
    for _, _, lr in steps:
        clocks.append(clocks[-1] - math.log1p(-lr * wd))
    dense = dense_sgd_with_sparse_grads(store.pull("fc", mine).double(), steps, wd)
    for t, (pos, grads, lr) in enumerate(steps):
        assert store.push("fc", mine[pos], grads, lr, decay_clock=clocks[t])
        # pull and scan both settle the decay owed up to the newest clock
        torch.testing.assert_close(store.pull("fc", mine).double(), dense[t], rtol=1e-6,
                                   atol=1e-7)
    scanned = torch.cat([rows for _, rows in store.scan("fc", block_rows=4)]).double()
    torch.testing.assert_close(scanned, dense[-1], rtol=1e-6, atol=1e-7)
    assert store.stats()["tables"]["fc"]["decay_clock"] == pytest.approx(clocks[-1])


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-6), ("float16", 1e-3),
                                       ("bfloat16", 8e-3)])
def test_pull_settles_the_decay_owed_in_every_row_dtype_and_leaves_the_table(dtype, tol):
    """Rows that sat out steps come back times exp(row clock - clock), rounded once to the
    row dtype (a float64 reference), and the stored rows are not touched by the pull."""
    wd, lr = 0.05, 0.5
    store = make_store(momentum=0.0, weight_decay=wd, dtype=dtype)
    before = store.pull("fc", torch.arange(N)).double()
    clock = 0.0
    for _ in range(3):  # three steps that push row 0 only: every other row owes their decay
        assert store.push("fc", torch.tensor([0]), torch.zeros(1, D), lr, decay_clock=clock)
        clock -= math.log1p(-lr * wd)
    expected = before[1:] * math.exp(-clock)
    for _ in range(2):  # the second pull sees the same stored rows as the first
        got = store.pull("fc", torch.arange(1, N)).double()
        torch.testing.assert_close(got, expected, rtol=tol, atol=0)


def test_push_without_clock_leaves_resting_rows_alone():
    store = make_store(momentum=0.0, weight_decay=0.05)
    before = store.pull("fc", torch.tensor([5]))
    store.push("fc", torch.tensor([1]), torch.ones(1, D), 0.5)
    assert torch.equal(store.pull("fc", torch.tensor([5])), before)
    assert store.stats()["tables"]["fc"]["decay_clock"] == 0.0


def test_untouched_rows_and_state_bit_identical():
    store = make_store()
    before_rows = in_position_order(store)[0]
    store.push("fc", torch.tensor([3, 7, 3]), torch.ones(3, D), 0.5)
    rows, state, _ = in_position_order(store)
    untouched = torch.ones(N, dtype=torch.bool)
    untouched[[3, 7]] = False
    assert torch.equal(rows[untouched], before_rows[untouched])
    assert torch.equal(state[untouched], torch.zeros_like(state[untouched]))
    assert not torch.equal(rows[3], before_rows[3])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_tables_follow_float64_reference(dtype, update_path):
    store = make_store(dtype=dtype, state_dtype=dtype)
    w = store.pull("fc", torch.arange(N)).double()
    v = torch.zeros_like(w)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, N, (10,), generator=g)
        grads = torch.randn(10, D, generator=g) * 0.01
        store.push("fc", ids, grads, 0.1)
        reference_sgd_step(w, v, ids, grads, 0.1, 0.9, 5e-4)
        # the store rounds once per step; follow it so errors do not compound in the check
        w = store.pull("fc", torch.arange(N)).double()
        v = in_position_order(store)[1].double()
    tol = 1e-2 if dtype == "bfloat16" else 2e-3
    torch.testing.assert_close(store.pull("fc", torch.arange(N)).double(), w, rtol=tol, atol=tol)


def test_initial_rows_do_not_depend_on_shard_count():
    whole = make_store().pull("fc", torch.arange(N))
    for s in range(4):
        part = make_store(s, 4)
        ids = owned(part)
        assert torch.equal(part.pull("fc", ids), whole[ids])
    assert abs(float(whole.std()) - 0.01) < 0.002


def test_pull_request_order_with_repeats():
    store = make_store()
    whole = store.pull("fc", torch.arange(N))
    ids = torch.tensor([9, 2, 9, 0, 49])
    assert torch.equal(store.pull("fc", ids), whole[ids])


def test_push_dedupe_by_client_sequence():
    once, twice = make_store(), make_store()
    ids, grads = torch.tensor([1, 2]), torch.ones(2, D)
    assert once.push("fc", ids, grads, 0.1, "c", 7)
    assert twice.push("fc", ids, grads, 0.1, "c", 7)
    assert not twice.push("fc", ids, grads, 0.1, "c", 7)
    assert torch.equal(in_position_order(once)[0], in_position_order(twice)[0])
    assert twice.push("fc", ids, grads, 0.1, "c", 8)  # a new sequence applies


def snapshot_state(store):
    return (*in_position_order(store), torch.tensor(store.table("fc").clock))


@pytest.mark.parametrize("call,error", [
    (lambda s: s.pull("nope", torch.tensor([1])), errors.TableNotFound),
    (lambda s: s.pull("fc", torch.tensor([N])), errors.IdOutOfRange),
    (lambda s: s.pull("fc", torch.tensor([-1])), errors.IdOutOfRange),
    (lambda s: s.pull("fc", torch.tensor([1.0])), errors.InvalidArgument),
    (lambda s: s.pull("fc", torch.tensor([[1]])), errors.InvalidArgument),
    (lambda s: s.push("fc", torch.tensor([1, N]), torch.ones(2, D), 0.1), errors.IdOutOfRange),
    (lambda s: s.push("fc", torch.tensor([1]), torch.ones(1, D + 1), 0.1),
     errors.InvalidArgument),
    (lambda s: s.push("fc", torch.tensor([1, 2]), torch.ones(1, D), 0.1), errors.InvalidArgument),
    (lambda s: s.push("fc", torch.tensor([1]), torch.full((1, D), float("nan")), 0.1),
     errors.InvalidArgument),
    (lambda s: s.push("fc", torch.tensor([1]), torch.full((1, D), float("inf")), 0.1),
     errors.InvalidArgument),
    (lambda s: s.push("fc", torch.tensor([1]), torch.ones(1, D), float("nan")),
     errors.InvalidArgument),
    (lambda s: s.push("fc", torch.tensor([1]), torch.ones(1, D), -1.0), errors.InvalidArgument),
    # finite, but no float32 factor: the update's arithmetic could not take it
    (lambda s: s.push("fc", torch.tensor([1]), torch.ones(1, D), 1e39), errors.InvalidArgument),
    # an integer past float64, as JSON may carry it: refused, not an OverflowError
    (lambda s: s.push("fc", torch.tensor([1]), torch.ones(1, D), 10**400),
     errors.InvalidArgument),
    (lambda s: s.push("fc", torch.tensor([1]), torch.ones(1, D), 0.1, decay_clock=10**400),
     errors.InvalidArgument),
    (lambda s: s.push("fc", torch.tensor([1]), torch.ones(1, D, dtype=torch.int64), 0.1),
     errors.InvalidArgument),
    (lambda s: s.neighbors("fc", torch.tensor([1])), errors.FailedPrecondition),
    (lambda s: s.push("fc", torch.tensor([1]), torch.ones(1, D), 0.1, decay_clock=float("nan")),
     errors.InvalidArgument),
    (lambda s: s.push("fc", torch.tensor([1]), torch.ones(1, D), 0.1, decay_clock=-1.0),
     errors.InvalidArgument),
    (lambda s: s.push("fc", torch.tensor([1]), torch.ones(1, D), 0.1, decay_clock="0"),
     errors.InvalidArgument),
    (lambda s: s.push("fc", torch.tensor([1]), torch.ones(1, D), 2500.0, decay_clock=0.0),
     errors.InvalidArgument),  # lr x weight_decay >= 1
])
def test_bad_requests_raise_and_change_nothing(call, error):
    store = make_store()
    before = snapshot_state(store)
    with pytest.raises(error) as info:
        call(store)
    assert str(info.value)  # a message a person can act on
    after = snapshot_state(store)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=False))


def test_foreign_id_is_out_of_range_and_names_the_owner():
    store = make_store(1, 3)
    with pytest.raises(errors.IdOutOfRange, match="belongs to shard 2"):
        store.pull("fc", torch.tensor([1, 2]))


def test_request_size_limit(monkeypatch):
    store = make_store()
    monkeypatch.setattr(store_module, "MAX_IDS_PER_REQUEST", 4)
    with pytest.raises(errors.RequestTooLarge, match="limit is 4"):
        store.pull("fc", torch.arange(5))


@pytest.mark.parametrize("kw", [
    dict(num_rows=0), dict(num_rows=-5), dict(dim=0), dict(dtype="int8"), dict(momentum=1.0),
    dict(momentum=-0.1), dict(weight_decay=float("nan")), dict(name=""), dict(name="a/b"),
    dict(seed=-1), dict(name="x" * 200), dict(weight_decay=1e39),
    dict(init_std=1e300), dict(init_std=2e4, dtype="float16"),
])
def test_bad_table_specs(kw):
    base = dict(name="t", num_rows=10, dim=4)
    base.update(kw)
    with pytest.raises(errors.InvalidArgument):
        TableSpec(**base)


def test_a_decay_clock_given_as_an_integer_beyond_int64_is_a_number_like_any_other():
    """JSON gives a number with no fraction as an int; a decay clock of 2**64 applies as its
    float value: the rows that sat out decay to zero (float64 reference: exp(-2**64) = 0)."""
    store = make_store(momentum=0.0)  # weight_decay 5e-4
    ids = torch.tensor([1, 5])
    assert store.push("fc", ids[:1], torch.zeros(1, D), 0.01, decay_clock=0.5)
    # at a small clock the step's own decay shows: 0.5 + -log(1 - lr wd), worked out here
    # (-log1p(-5e-6) is about 5e-6, far above the tolerance, so a step left out fails)
    clock = store.stats()["tables"]["fc"]["decay_clock"]
    assert clock == pytest.approx(0.5 - math.log1p(-0.01 * 5e-4), rel=1e-12, abs=0)
    assert store.push("fc", ids, torch.zeros(2, D), 0.01, decay_clock=2**64)
    assert float(store.pull("fc", ids).abs().max()) == 0.0
    # at 2**64 a step of 5e-6 is far below float64's spacing (4096): the clock is 2**64 as
    # a float, not an int, nan or inf, and not stuck at the earlier 0.5
    clock = store.stats()["tables"]["fc"]["decay_clock"]
    assert isinstance(clock, float) and clock == float(2**64)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_largest_init_std_a_spec_takes_gives_finite_rows(dtype):
    """A spec refuses an init_std whose rows would overflow its dtype, and the largest one it
    takes fills a table with finite rows of about that spread."""
    limit = float(torch.finfo(getattr(torch, dtype)).max) / 6
    with pytest.raises(errors.InvalidArgument, match="overflows"):
        TableSpec(name="t", num_rows=10, dim=4, dtype=dtype, init_std=limit * 1.01)
    store = STORAGE.store(0, 1)
    store.create_table(TableSpec(name="t", num_rows=20_000, dim=64, dtype=dtype,
                                 init_std=limit))
    rows = store.pull("t", torch.arange(20_000)).to(torch.float64)
    assert bool(torch.isfinite(rows).all())
    assert 0.5 * limit < float(rows.std()) < 1.5 * limit


def test_create_table_idempotent_and_conflict():
    store = make_store()
    assert not store.create_table(TableSpec(name="fc", num_rows=N, dim=D, momentum=0.9,
                                            weight_decay=5e-4, seed=3))
    with pytest.raises(errors.TableExists):
        store.create_table(TableSpec(name="fc", num_rows=N, dim=D + 1))


def test_scan_covers_owned_ids_in_order():
    store = make_store(2, 3)
    blocks = list(store.scan("fc", block_rows=4))
    ids = torch.cat([b[0] for b in blocks])
    assert torch.equal(ids, owned(store))
    assert torch.equal(torch.cat([b[1] for b in blocks]), store.pull("fc", ids))


def test_full_graph_arrives_in_parts_and_installs_when_complete():
    store = make_store(1, 2)  # owns 25 rows: ids 1, 3, ..., 49
    mine = owned(store)
    lists = torch.stack([mine, (mine + 2) % N, (mine + 4) % N], dim=1)

    def send(rows, version):
        offsets = torch.arange(0, 3 * rows.numel() + 1, 3)
        return store.set_neighbors("fc", mine[rows], offsets, lists[rows].reshape(-1), version,
                                   step=5, replace_all=True)

    assert send(torch.arange(0, 10), 1) == 0  # not complete: no graph yet
    assert send(torch.arange(0, 10), 1) == 0  # a retried part is harmless
    with pytest.raises(errors.InvalidArgument, match="already have a list"):
        send(torch.arange(5, 15), 1)
    assert send(torch.arange(10, 25), 1) == 1
    offsets, got = store.neighbors("fc", mine[[3, 20]])
    # CSR parts whose lists all have k entries install as one fixed-width int32 table
    assert offsets is None and got.dtype == torch.int32
    assert got.tolist() == lists[[3, 20]].tolist()
    assert send(torch.arange(0, 24), 2) == 1  # version 2 incomplete: version 1 stays
    assert send(torch.arange(24, 25), 2) == 2


@pytest.mark.parametrize("third", ["fixed", "csr", "wider"])
def test_full_graph_in_fixed_width_parts_then_any_layout(third):
    store = make_store(1, 2)  # owns 25 rows: ids 1, 3, ..., 49
    mine = owned(store)
    width = 4 if third == "wider" else 3
    lists = torch.stack([(mine + 2 * j) % N for j in range(width)], dim=1)  # int64
    expected = {int(i): lists[r, :3].tolist() for r, i in enumerate(mine)}

    def send(rows, layout):
        part = lists[rows, :width if layout == "wider" else 3]
        if layout == "csr":
            short = part[:, :2]  # lists of 2: the table becomes CSR
            for r in rows.tolist():
                expected[int(mine[r])] = short[rows.tolist().index(r)].tolist()
            offsets = torch.arange(0, 2 * rows.numel() + 1, 2)
            return store.set_neighbors("fc", mine[rows], offsets, short.reshape(-1), 1, step=0,
                                       replace_all=True)
        if layout == "wider":
            for r in rows.tolist():
                expected[int(mine[r])] = lists[r].tolist()
        return store.set_neighbors("fc", mine[rows], None, part, 1, step=0, replace_all=True)

    assert send(torch.arange(0, 8), "fixed") == 0
    assert send(torch.arange(8, 16), "fixed") == 0
    assert send(torch.arange(16, 25), third) == 1
    for i, want in expected.items():  # against the lists as sent, row by row
        offsets, got = store.neighbors("fc", torch.tensor([i]))
        assert got.reshape(-1).tolist() == want
    offsets, got = store.neighbors("fc", mine)
    assert got.dtype == torch.int32 and (offsets is None) == (third == "fixed")


def test_client_sends_big_graphs_in_chunks(monkeypatch):
    import ams
    import ams.client.sharded

    monkeypatch.setattr(ams.client.sharded, "REQUEST_BYTES", 8 * 5 * 4)  # 4 lists of k=3 per call
    client = ams.connect(local_shards=2)
    client.create_table("fc", num_rows=N, dim=D)
    lists = torch.stack([torch.arange(N), (torch.arange(N) + 1) % N], dim=1)
    client.set_neighbors("fc", torch.arange(N), lists, version=1, step=0, replace_all=True)
    assert torch.equal(client.neighbors("fc", torch.arange(N)), lists)


# ---- pushes whose result is not finite ----------------------------------------------------

NON_FINITE_PUSHES = [  # (row and state dtype, ids, gradient value per id, lr)
    ("float32", [4], 3e38, 10.0),
    ("float32", [4, 4], 3e38, 1.0),  # each gradient is finite, their sum is not
    ("float16", [4], 7e5, 0.1),  # float16 overflows at 65504
    ("bfloat16", [4], 3e38, 10.0),
]


@pytest.mark.parametrize("dtype,ids,value,lr", NON_FINITE_PUSHES)
def test_push_with_non_finite_result_is_refused_whole(dtype, ids, value, lr, update_path):
    store = make_store(dtype=dtype, state_dtype=dtype)
    store.push("fc", torch.tensor([4, 9]), torch.ones(2, D), 0.1, "c", 1, decay_clock=0.0)
    before = snapshot_state(store)
    counters = store.stats()["tables"]["fc"]
    bad_ids = torch.tensor([*ids, 7])  # a harmless row in the same push changes neither
    grads = torch.cat([torch.full((len(ids), D), value), torch.full((1, D), 0.01)])
    with pytest.raises(errors.InvalidArgument, match="non-finite") as info:
        store.push("fc", bad_ids, grads, lr, "c", 2, decay_clock=0.01)
    assert "class 4" in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot_state(store), strict=True))
    assert store.stats()["tables"]["fc"] == counters
    # the refused sequence is not remembered: the corrected push under it applies
    w, v = store.pull("fc", torch.arange(N)).double(), in_position_order(store)[1].double()
    good = torch.full((len(ids), D), 0.01)
    assert store.push("fc", torch.tensor(ids), good, 0.1, "c", 2)
    reference_sgd_step(w, v, torch.tensor(ids), good, 0.1, 0.9, 5e-4)
    tol = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1e-2}[dtype]
    torch.testing.assert_close(store.pull("fc", torch.arange(N)).double(), w, rtol=tol,
                               atol=tol)
    assert torch.isfinite(in_position_order(store)[0].float()).all()


# ---- reply sizes, table sizes, long values -------------------------------------------------


def refuse_to_gather(monkeypatch):
    """Make any row gather fail: a refused request must not build its reply first."""
    from ams.shard import rowcopy

    def gather(rows, index):
        raise AssertionError("the reply was being built")

    monkeypatch.setattr(rowcopy, "gather", gather)


def test_pull_over_the_message_limit_is_refused_before_the_reply_is_built(monkeypatch):
    store = make_store(dim=128, momentum=0.0)
    refuse_to_gather(monkeypatch)
    ids = torch.zeros(600_000, dtype=torch.int64)  # 600k x 128 x 4 bytes: 307 MB of rows
    with pytest.raises(errors.RequestTooLarge, match="split the request") as info:
        store.pull("fc", ids)
    assert str(600_000 * 128 * 4) in str(info.value)


def test_scan_blocks_and_neighbor_lists_fit_the_reply_limit(monkeypatch):
    store = make_store()

    def reply_limit(nbytes: int) -> None:
        monkeypatch.setattr(store_module, "MAX_REPLY_PAYLOAD_BYTES", nbytes)

    reply_limit(5 * (D * 4 + 8))  # five rows and their ids
    with pytest.raises(errors.RequestTooLarge, match="block_rows"):
        next(store.scan("fc", block_rows=6))
    blocks = list(store.scan("fc"))  # the default block size fits
    assert max(ids.numel() for ids, _ in blocks) == 5
    assert torch.equal(torch.cat([ids for ids, _ in blocks]), torch.arange(N))
    lists = torch.stack([torch.arange(N), (torch.arange(N) + 1) % N], dim=1)
    store.set_neighbors("fc", torch.arange(N), torch.arange(0, 2 * N + 1, 2),
                        lists.reshape(-1), version=1, step=0, replace_all=True)
    reply_limit(3 * 2 * 4)  # three fixed-width lists of two int32 ids
    assert store.neighbors("fc", torch.arange(3))[1].numel() == 6
    with pytest.raises(errors.RequestTooLarge, match="24-byte message limit"):
        store.neighbors("fc", torch.arange(4))
    # a short list makes the table CSR: offsets (8 bytes a row, plus one) travel too
    store.set_neighbors("fc", torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([1]),
                        version=1, step=0, replace_all=False)
    reply_limit(8 * 4 + 4 * (2 + 1 + 2))  # rows 0, 1, 2: offsets and 5 ids
    offsets, got = store.neighbors("fc", torch.arange(3))
    assert offsets.tolist() == [0, 2, 3, 5] and got.tolist() == [0, 1, 1, 2, 3]
    with pytest.raises(errors.RequestTooLarge, match="makes a 68-byte reply"):
        store.neighbors("fc", torch.arange(4))


@pytest.mark.parametrize("memory", ["known", "unknown"])
def test_table_too_large_for_memory_is_a_typed_error(monkeypatch, memory):
    import ams.shard.storage

    if memory == "unknown":  # then the allocation itself fails, and is reported
        monkeypatch.setattr(ams.shard.storage, "_physical_memory_bytes", lambda: None)
    store = make_store()
    huge = TableSpec(name="huge", num_rows=2**61, dim=4, momentum=0.0)
    # float32 rows of 4 and a float64 decay clock per slot (mmap: spare slots too)
    needed = store.storage.capacity(huge) * (4 * 4 + 8)
    # mmap: more than the disk's free space, StorageFull (a RequestTooLarge)
    with pytest.raises(errors.RequestTooLarge, match=f"needs {needed} bytes"):
        store.create_table(huge)
    assert list(store.tables) == ["fc"]
    if STORAGE.kind == "mmap":  # nothing half made is left beside the live table
        assert sorted(p.name for p in store.storage.root.iterdir()) == [".lock", "fc"]


def test_shorten_cuts_long_values():
    assert errors.shorten("abc") == "'abc'"
    long = errors.shorten("x" * 1000)
    assert long.startswith("'xxx") and long.endswith("…(1002 chars)")
    assert len(long) == errors.ECHO_CHARS + len("…(1002 chars)")


def test_error_messages_quote_long_values_briefly():
    store = make_store()
    huge = "x" * 1_000_000
    calls = [
        lambda: store.pull(huge, torch.tensor([1])),
        lambda: store.push(huge, torch.tensor([1]), torch.ones(1, D), 0.1),
        lambda: store.push("fc", torch.tensor([1]), torch.ones(1, D), 0.1, huge, 1),
        lambda: TableSpec(name=huge, num_rows=10, dim=4),
        lambda: store.neighbors(huge, torch.tensor([1])),
    ]
    for call in calls:
        with pytest.raises(errors.AmsError) as info:
            call()
        assert "(1000002 chars)" in str(info.value)
        assert len(str(info.value)) < 400


@pytest.mark.parametrize("client_id,sequence", [("c" * 129, 1), (7, 1), ("c", -1),
                                                ("c", 2**64), ("c", 1.5)])
def test_bad_client_id_or_sequence_is_refused(client_id, sequence):
    store = make_store()
    before = snapshot_state(store)
    with pytest.raises(errors.InvalidArgument, match="client_id|sequence"):
        store.push("fc", torch.tensor([1]), torch.ones(1, D), 0.1, client_id, sequence)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot_state(store), strict=True))
    assert store.push("fc", torch.tensor([1]), torch.ones(1, D), 0.1, "c" * 128, 2**64 - 1)


def test_dedupe_memory_is_bounded_per_client_and_in_clients():
    from ams.shard.dedupe import PUSH_DEDUPE_CLIENTS, PUSH_DEDUPE_WINDOW, PushDedupe

    dedupe = PushDedupe()
    for c in range(PUSH_DEDUPE_CLIENTS):
        dedupe.add(f"c{c}", 1)
    dedupe.add("c0", 2)  # c0 pushed most recently now; c1 is the least recent
    dedupe.add("new", 1)
    assert ("c0", 1) in dedupe and ("new", 1) in dedupe and ("c1", 1) not in dedupe
    for s in range(PUSH_DEDUPE_WINDOW + 1):
        dedupe.add("w", s)
    assert ("w", 0) not in dedupe and ("w", 1) in dedupe and ("w", PUSH_DEDUPE_WINDOW) in dedupe
    assert PushDedupe.from_json(dedupe.to_json()).to_json() == dedupe.to_json()

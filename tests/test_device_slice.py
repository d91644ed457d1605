"""workers.device_slice.DeviceSlice, the working copy of a collective rank's slice on its compute
device: its pushes against the float64 optimizer (sparse momentum SGD, and the decay clock
against dense SGD on the whole slice), its load and write-back through ``ShardStore.read_rows``
and ``write_rows`` on each storage kind, reloading after the shard's rows were replaced, and
refused input; and a training run on it against one on the shard. On the CPU everywhere, and
on CUDA where there is a GPU."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from ams import errors
from ams.shard.spec import TableSpec
from tests.conftest import dense_sgd_with_sparse_grads, in_position_order, reference_sgd_step
from workers.device_slice import DeviceSlice
from workers.row_update import decay_clocks

N, D = 40, 8
SHARD, SHARDS = 1, 3  # a slice that is not the whole table: ids are mapped to positions

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


def make_slice(storage, device, **spec_kw):
    """(store, slice ids int64 (n,), DeviceSlice on ``device``) of shard SHARD of SHARDS."""
    store = storage.store(SHARD, SHARDS)
    spec = dict(name="fc", num_rows=N, dim=D, momentum=0.9, weight_decay=5e-4, seed=2,
                init_std=0.3)
    store.create_table(TableSpec(**{**spec, **spec_kw}))
    ids = torch.arange(SHARD, N, SHARDS)
    return store, ids, DeviceSlice(store, "fc", device)


@pytest.mark.parametrize("device", DEVICES)
def test_pushes_are_sparse_momentum_sgd_and_reach_the_store_only_when_written_back(
        storage, device):
    store, ids, rows = make_slice(storage, device)
    start = store.pull("fc", ids)
    w, v = start.double(), torch.zeros(ids.numel(), D, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    touched = set()
    for step in range(5):
        positions = torch.randint(0, ids.numel(), (9,), generator=g)  # repeats on purpose
        grads = torch.randn(9, D, generator=g)
        rows.push("fc", ids[positions], grads.to(device), 0.2 / (step + 1))
        reference_sgd_step(w, v, positions, grads, 0.2 / (step + 1), 0.9, 5e-4)
        touched |= {int(i) for i in ids[positions]}
    got = rows.pull("fc", ids)
    assert got.device.type == device
    torch.testing.assert_close(got.double().cpu(), w, rtol=1e-6, atol=1e-7)
    # a working copy: the shard holds the rows it started from until the write-back
    assert torch.equal(store.pull("fc", ids), start)
    assert store.take_touched("fc").numel() == 0

    rows.write_back()
    torch.testing.assert_close(store.pull("fc", ids).double(), w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(in_position_order(store)[1].double(), v, rtol=1e-6, atol=1e-7)
    assert store.take_touched("fc").tolist() == sorted(touched)  # a graph refresh sees them


@pytest.mark.parametrize("device", DEVICES)
def test_the_decay_clock_makes_its_pushes_equal_dense_sgd_in_the_slice_and_the_store(
        storage, device):
    wd = 0.05  # large, so a row that sits out steps visibly owes decay
    store, ids, rows = make_slice(storage, device, momentum=0.0, weight_decay=wd)
    g = torch.Generator().manual_seed(4)
    # steps 3 and 7 have none of their rows in this slice: its rows decay all the same
    steps = [(torch.randint(0, ids.numel(), (0 if step in (3, 7) else 3,), generator=g),
              torch.randn(0 if step in (3, 7) else 3, D, generator=g), 0.9 / (1 + step))
             for step in range(8)]
    clocks = decay_clocks([lr for _, _, lr in steps], wd)
    dense = dense_sgd_with_sparse_grads(store.pull("fc", ids).double(), steps, wd)
    touched = set()
    for t, (positions, grads, lr) in enumerate(steps):
        rows.push("fc", ids[positions], grads.to(device), lr, decay_clock=clocks[t])
        touched |= {int(i) for i in ids[positions]}
        # each pulled row comes with the decay it owes up to the newest clock
        torch.testing.assert_close(rows.pull("fc", ids).double().cpu(), dense[t], rtol=1e-6,
                                   atol=1e-7)
    rows.write_back()
    # the shard settles the same debts from the clocks written back with the rows
    torch.testing.assert_close(store.pull("fc", ids).double(), dense[-1], rtol=1e-6, atol=1e-7)
    assert store.take_touched("fc").tolist() == sorted(touched)
    # the next pushes go on from where the shard stands, rows that sat out included
    store.push("fc", ids[:1], torch.zeros(1, D), 0.5, decay_clock=clocks[-1])
    after = dense[-1] * (1 - 0.5 * wd)
    torch.testing.assert_close(store.pull("fc", ids).double(), after, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("order", [[1, 5, 9], [9, 1, 5], [5, 1, 5, 9]])
def test_each_row_takes_its_own_gradients_in_any_order(storage, order):
    store, ids, rows = make_slice(storage, "cpu", momentum=0.0, weight_decay=0.0)
    w = store.pull("fc", ids).double()
    grads = torch.randn(len(order), D, generator=torch.Generator().manual_seed(5))
    rows.push("fc", ids[order], grads, 0.5)
    w.index_add_(0, torch.tensor(order), grads.double(), alpha=-0.5)
    torch.testing.assert_close(rows.pull("fc", ids).double(), w, rtol=1e-6, atol=1e-7)


def test_a_slice_larger_than_one_transfer_loads_and_writes_back_every_row(storage):
    from workers.device_slice import TRANSFER_ROWS

    store = storage.store(SHARD, SHARDS)
    n = SHARDS * (TRANSFER_ROWS + 5)  # the slice holds one transfer's rows and five more
    store.create_table(TableSpec(name="fc", num_rows=n, dim=2, momentum=0.5, weight_decay=0.0,
                                 seed=1))
    ids = torch.arange(SHARD, n, SHARDS)
    rows = DeviceSlice(store, "fc", "cpu")
    w, v = store.pull("fc", ids).double(), torch.zeros(ids.numel(), 2, dtype=torch.float64)
    grads = torch.randn(ids.numel(), 2, generator=torch.Generator().manual_seed(3))
    rows.push("fc", ids, grads, 0.1)
    reference_sgd_step(w, v, torch.arange(ids.numel()), grads, 0.1, 0.5, 0.0)
    rows.write_back()
    torch.testing.assert_close(store.pull("fc", ids).double(), w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(in_position_order(store)[1].double(), v, rtol=1e-6, atol=1e-7)
    assert torch.equal(store.take_touched("fc", max_ids=ids.numel()), ids)


@pytest.mark.parametrize("device", DEVICES)
def test_reload_reads_the_rows_a_restore_put_in_the_shard(storage, device):
    store, ids, rows = make_slice(storage, device, momentum=0.0, weight_decay=0.0)
    rows.push("fc", ids[:2], torch.ones(2, D, device=device), 1.0)  # dropped by the reload
    store.push("fc", ids[2:3], torch.ones(1, D), 1.0)  # the shard's rows change beneath it
    rows.reload()
    torch.testing.assert_close(rows.pull("fc", ids).cpu(), store.pull("fc", ids))
    rows.write_back()  # nothing pushed since the reload: nothing to write
    assert store.take_touched("fc").tolist() == [int(ids[2])]


# A slice of 400k rows of d = 64 with momentum (208 MB) loaded in a process whose address space
# has room for 64 MB more: its first tensor (102 MB) cannot be allocated.
TOO_LARGE_FOR_HOST = """
import json, resource, sys, torch
from ams import errors
from ams.shard.spec import TableSpec
from ams.shard.store import ShardStore
from workers.device_slice import DeviceSlice

rows = int(sys.argv[1])
store = ShardStore()
store.create_table(TableSpec(name="fc", num_rows=rows, dim=64, momentum=0.9, seed=1))
ids = torch.arange(0, rows, 997)
copy = DeviceSlice(store, "fc", "cpu")
with open("/proc/self/status") as f:
    size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (size + (64 << 20), hard))
try:
    copy.pull("fc", ids)
    refused = None
except errors.RequestTooLarge as e:
    refused = str(e)
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
print(json.dumps({"refused": refused,
                  "then_loads": torch.equal(copy.pull("fc", ids), store.pull("fc", ids))}))
"""


def test_a_slice_too_large_for_the_memory_it_loads_into_is_refused_with_what_to_do():
    import json
    import subprocess
    import sys

    rows = 400_000
    done = subprocess.run([sys.executable, "-c", TOO_LARGE_FOR_HOST, str(rows)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout)
    assert got["refused"] is not None, "the load fitted: the limit no longer bites"
    assert got["refused"].startswith(
        f"this rank's slice of table 'fc' ({rows} rows: {rows * (64 * 4 + 64 * 4 + 8 + 1)} "
        "bytes with their momentum and decay clocks) does not fit in the memory of cpu")
    assert 'head.placement = "ams"' in got["refused"]
    assert got["then_loads"]  # nothing was lost: with room, the slice loads the shard's rows


@CUDA
def test_a_slice_too_large_for_free_cuda_memory_is_refused_and_loads_once_there_is_room(storage):
    store, ids, rows = make_slice(storage, "cuda", num_rows=1 << 20, dim=64)
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - (64 << 20), dtype=torch.uint8, device="cuda")  # 64 MB left
    with pytest.raises(errors.RequestTooLarge, match=r'does not fit in the memory of cuda.*'
                       r'head\.placement = "ams"'):
        rows.pull("fc", ids)
    del hog
    torch.cuda.empty_cache()
    torch.testing.assert_close(rows.pull("fc", ids).cpu(), store.pull("fc", ids))


@pytest.mark.parametrize("call, error", [
    (lambda r, ids: r.pull("other", ids[:1]), errors.InvalidArgument),
    (lambda r, ids: r.pull("fc", torch.tensor([0])), errors.IdOutOfRange),  # shard 0's class
    (lambda r, ids: r.pull("fc", torch.tensor([N + SHARD])), errors.IdOutOfRange),
    (lambda r, ids: r.pull("fc", ids[:2].float()), errors.InvalidArgument),
    (lambda r, ids: r.push("fc", torch.tensor([0]), torch.ones(1, D), 0.1), errors.IdOutOfRange),
    (lambda r, ids: r.push("fc", ids[:2], torch.ones(1, D), 0.1), errors.InvalidArgument),
    (lambda r, ids: r.push("fc", ids[:1], torch.ones(1, D + 1), 0.1), errors.InvalidArgument),
    (lambda r, ids: r.push("fc", ids[:1], torch.full((1, D), math.nan), 0.1),
     errors.InvalidArgument),
    (lambda r, ids: r.push("fc", ids[:1], torch.full((1, D), 1e38), 1e3),  # overflows a row
     errors.InvalidArgument),
    (lambda r, ids: r.push("fc", ids[:1], torch.ones(1, D), -0.1), errors.InvalidArgument),
    (lambda r, ids: r.push("fc", ids[:1], torch.ones(1, D), 500.0, decay_clock=0.0),
     errors.InvalidArgument),  # lr x weight_decay >= 1
    (lambda r, ids: r.push("fc", ids[:1], torch.ones(1, D), 0.1, decay_clock=-1.0),
     errors.InvalidArgument),
])
def test_bad_pulls_and_pushes_are_refused_and_change_nothing(storage, call, error):
    store, ids, rows = make_slice(storage, "cpu", weight_decay=0.01)
    rows.push("fc", ids[:3], torch.ones(3, D), 0.1, decay_clock=0.0)
    before = rows.pull("fc", ids)
    with pytest.raises(error):
        call(rows, ids)
    assert torch.equal(rows.pull("fc", ids), before)
    rows.write_back()
    assert torch.equal(store.pull("fc", ids), before)


def test_read_rows_gives_the_stored_rows_state_and_clocks_in_request_order(storage):
    store = storage.store(SHARD, SHARDS)
    store.create_table(TableSpec(name="fc", num_rows=N, dim=D, momentum=0.9, weight_decay=0.1,
                                 seed=2))
    ids = torch.arange(SHARD, N, SHARDS)
    store.push("fc", ids[2:5], torch.ones(3, D), 0.5, decay_clock=0.0)
    store.push("fc", ids[:1], torch.ones(1, D), 0.5, decay_clock=0.2)
    want = in_position_order(store)
    picked = torch.tensor([4, 0, 4, 7])
    rows, state, row_clock, clock = store.read_rows("fc", ids[picked])
    for got, stored in zip((rows, state, row_clock), want, strict=True):
        assert torch.equal(got, stored[picked])
    assert clock == pytest.approx(0.2 - math.log1p(-0.5 * 0.1))
    for bad, error in ((torch.tensor([0]), errors.IdOutOfRange),
                       (torch.tensor([N + SHARD]), errors.IdOutOfRange),
                       (ids[:2].float(), errors.InvalidArgument)):
        with pytest.raises(error):
            store.read_rows("fc", bad)


def test_write_rows_refuses_what_does_not_fit_the_table_and_changes_nothing(storage):
    store = storage.store(SHARD, SHARDS)
    store.create_table(TableSpec(name="fc", num_rows=N, dim=D, momentum=0.9, seed=2))
    ids = torch.arange(SHARD, N, SHARDS)[:3]
    rows, state, clock = torch.ones(3, D), torch.ones(3, D), torch.zeros(3, dtype=torch.float64)
    before = in_position_order(store)
    bad = [
        dict(ids=ids.flip(0)),  # not ascending
        dict(ids=torch.tensor([0, SHARD, SHARD + SHARDS])),  # another shard's class
        dict(rows=rows.half()), dict(rows=torch.ones(3, D + 1)),
        dict(state=torch.ones(3, 1)), dict(row_clock=clock.float()),
        dict(rows=torch.full((3, D), math.inf)), dict(clock=-1.0),
    ]
    for change in bad:
        args = {"ids": ids, "rows": rows, "state": state, "row_clock": clock, "clock": 0.0,
                **change}
        with pytest.raises((errors.InvalidArgument, errors.IdOutOfRange)):
            store.write_rows("fc", **args)
    for want, got in zip(before, in_position_order(store), strict=True):
        assert torch.equal(want, got)
    assert store.take_touched("fc").numel() == 0


def collective_trainer(cfg, device_rows: bool):
    """``xcls.run.build_run``'s parts of a one-rank collective run on the CPU, the head's slice
    as a ``DeviceSlice`` (on the CPU here; a GPU run's is on its GPU) when ``device_rows``."""
    from xcls import run as parts

    cpu = torch.device("cpu")
    data = parts.create_datasets(cfg)
    out_dir = parts.create_out_dir(cfg)
    client = parts.create_client(cfg, out_dir, 0, 1, lease=False)
    parts.create_table(cfg, client, data.num_classes)
    backbone = parts.create_backbone(cfg, data.train.metadata, cpu, 1)
    head = parts.create_head(cfg, client, data.num_classes, 0, 1, cpu)
    assert head.device_rows is None  # on the CPU the trainer reads the shard itself
    if device_rows:
        head.device_rows = DeviceSlice(client.shards[0].store, cfg.ams.table, cpu)
    return parts.create_trainer(cfg, client, data, backbone, head,
                                parts.create_graph_updater(cfg, client, cpu), None, cpu, 0, 1)


def test_a_run_on_the_working_copy_equals_one_on_the_shard_through_graphs_evals_and_resume(
        glyphs_small, tmp_path):
    """Graph rebuilds, evaluations and checkpoints between steps read the shard, so each must
    see every update the working copy took, and a resumed run must load the restored rows: the
    run on a working copy takes the same steps as the run on the shard, bit for bit (both
    update with the same arithmetic on the CPU), resumed halfway or not."""
    from workers.checkpoint import checkpoint_dir
    from xcls.config import load_config

    def run(out, device_rows):
        cfg = load_config(None, [f"{k}={v}" for k, v in {
            "data.train": glyphs_small / "train", "data.test": glyphs_small / "test",
            "data.batch_size": 16, "data.num_workers": 0, "model.dim": 16,
            "head.kind": "knn", "head.placement": "collective", "head.k": 4,
            "head.budget": 40, "graph.k": 8, "graph.rebuild_every": 8,
            "optim.warmup_steps": 5, "optim.head_momentum": 0.5,
            "optim.head_weight_decay": 0.01, "train.max_steps": 24,
            "train.checkpoint_every": 12, "train.eval_every": 10, "train.log_every": 4,
            "train.threads": 1, "train.device": "cpu", "train.out_dir": out}.items()])
        trainer = collective_trainer(cfg, device_rows)
        result = trainer.train()
        rows = trainer.client.pull("fc", torch.arange(trainer.head.num_classes))
        trainer.client.close()
        return result, rows

    on_shard, shard_rows = run(tmp_path / "shard", device_rows=False)
    on_copy, copy_rows = run(tmp_path / "copy", device_rows=True)
    assert [r["loss"] for r in on_copy.history] == [r["loss"] for r in on_shard.history]
    assert on_copy.eval == on_shard.eval and on_copy.eval["step"] == 24
    assert torch.equal(copy_rows, shard_rows)

    # back to the checkpoint of step 12: the restored rows, and 12 steps on them
    shutil.rmtree(checkpoint_dir(tmp_path / "copy", 24))
    resumed, resumed_rows = run(tmp_path / "copy", device_rows=True)
    assert resumed.steps == 24 and resumed.eval == on_shard.eval
    assert torch.equal(resumed_rows, shard_rows)

"""LMDB snapshots: exact round trip, resharding, refusal of partial/corrupt pieces."""

from __future__ import annotations

import json
import math
import shutil

import lmdb
import pytest
import torch

import ams
from ams import snapshot
from ams.errors import SnapshotError
from ams.store import ShardStore

N, D = 103, 6


def trained_client(data_dir, num_shards, dtype="float32", momentum=0.9):
    """A table after three clocked pushes (weight decay 0.05, so the decay clocks matter)."""
    client = ams.connect(local_shards=num_shards, data_dir=data_dir)
    client.create_table("fc", num_rows=N, dim=D, dtype=dtype, seed=1, momentum=momentum,
                        weight_decay=0.05)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        ids = torch.randint(0, N, (40,), generator=g)
        client.push("fc", ids, torch.randn(40, D, generator=g), lr=0.1,
                    decay_clock=-step * math.log1p(-0.1 * 0.05))
    return client


def full_state(client):
    """Rows, momentum and decay clocks of every class, in class-id order, gathered from the
    shards, and the newest clock of any shard."""
    rows = client.pull("fc", torch.arange(N))
    spec = client.spec("fc")
    state = torch.empty((N, spec.state_width), dtype=spec.state_dtype)
    row_clock = torch.empty(N, dtype=torch.float64)
    for s, shard in enumerate(client.shards):
        table = shard.store.table("fc")
        state[torch.arange(s, N, client.num_shards)] = table.state
        row_clock[torch.arange(s, N, client.num_shards)] = table.row_clock
    clock = max(shard.store.table("fc").clock for shard in client.shards)
    return rows, state, row_clock, torch.tensor(clock)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_bit_identical(tmp_path, dtype):
    src = trained_client(tmp_path, 2, dtype)
    src.snapshot(step=10)
    dst = ams.connect(local_shards=2, data_dir=tmp_path)
    assert dst.restore() == 10
    for a, b in zip(full_state(src), full_state(dst), strict=False):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


@pytest.mark.parametrize("old,new,momentum", [(2, 3, 0.9), (3, 1, 0.9), (1, 4, 0.9),
                                              (2, 3, 0.0)])
def test_restore_into_other_shard_count(tmp_path, old, new, momentum):
    src = trained_client(tmp_path, old, momentum=momentum)
    src.snapshot(step=5)
    dst = ams.connect(local_shards=new, data_dir=tmp_path)
    assert dst.restore() == 5
    for a, b in zip(full_state(src), full_state(dst), strict=False):
        assert torch.equal(a, b)


def test_latest_skips_corrupt_and_partial(tmp_path):
    client = trained_client(tmp_path, 2)
    client.snapshot(step=1)
    good = full_state(client)
    client.push("fc", torch.tensor([1, 2]), torch.ones(2, D), lr=1.0)
    client.snapshot(step=2)
    client.push("fc", torch.tensor([3]), torch.ones(1, D), lr=1.0)
    client.snapshot(step=3)
    # step 3: one piece missing (a shard died before writing); step 2: a flipped byte
    shutil.rmtree(snapshot.step_dir(tmp_path, 3) / snapshot.piece_name(1, 2))
    piece = snapshot.step_dir(tmp_path, 2) / snapshot.piece_name(0, 2)
    env = lmdb.open(str(piece), map_size=1 << 30)
    with env.begin(write=True) as txn:
        key = b"fc/rows/000000"
        value = bytearray(txn.get(key))
        value[5] ^= 0xFF
        txn.put(key, bytes(value))
    env.close()
    # a temporary directory from a writer killed mid-write is ignored
    (snapshot.step_dir(tmp_path, 4) / ".tmp-shard-00000-of-00002-dead").mkdir(parents=True)

    fresh = ams.connect(local_shards=2, data_dir=tmp_path)
    assert fresh.restore() == 1
    for a, b in zip(good, full_state(fresh), strict=False):
        assert torch.equal(a, b)
    with pytest.raises(SnapshotError, match="checksum mismatch"):
        fresh.restore(step=2)
    with pytest.raises(SnapshotError, match="missing"):
        fresh.restore(step=3)


def test_manifest_describes_the_piece(tmp_path):
    trained_client(tmp_path, 2).snapshot(step=7)
    manifest = json.loads((snapshot.step_dir(tmp_path, 7) / snapshot.piece_name(1, 2)
                           / "manifest.json").read_text())
    assert manifest["format_version"] == snapshot.FORMAT_VERSION
    assert manifest["step"] == 7 and manifest["shard_id"] == 1 and manifest["num_shards"] == 2
    table = manifest["tables"]["fc"]
    assert table["spec"]["num_rows"] == N and table["spec"]["dim"] == D
    assert table["owned_rows"] == N // 2
    assert manifest["checksum"].startswith("sha256:")


@pytest.mark.parametrize("clock", ["soon", -1.0, None])
def test_hostile_decay_clock_in_manifest_is_refused(tmp_path, clock):
    trained_client(tmp_path, 1).snapshot(step=1)
    path = snapshot.step_dir(tmp_path, 1) / snapshot.piece_name(0, 1) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["tables"]["fc"]["decay_clock"] = clock
    path.write_text(json.dumps(manifest))
    with pytest.raises(SnapshotError, match="malformed snapshot"):
        snapshot.restore_into(ShardStore(0, 1), tmp_path)


def test_garbage_manifest_is_refused(tmp_path):
    trained_client(tmp_path, 1).snapshot(step=1)
    (snapshot.step_dir(tmp_path, 1) / snapshot.piece_name(0, 1) / "manifest.json").write_text("{")
    with pytest.raises(SnapshotError, match="manifest unreadable"):
        snapshot.restore_into(ShardStore(0, 1), tmp_path)


def test_large_table_beyond_lmdb_default_map_size(tmp_path):
    store = ShardStore(0, 1)
    client = ams.connect(local_shards=1, data_dir=tmp_path)
    client.create_table("big", num_rows=40_000, dim=128)  # 20 MiB rows + 20 MiB momentum
    client.snapshot(step=0)
    snapshot.restore_into(store, tmp_path)
    assert torch.equal(store.table("big").rows, client.shards[0].store.table("big").rows)


def test_no_snapshot_at_all(tmp_path):
    with pytest.raises(SnapshotError, match="no snapshots"):
        snapshot.restore_into(ShardStore(0, 1), tmp_path)

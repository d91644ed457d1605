"""LMDB snapshots: exact round trip, resharding, refusal of partial/corrupt pieces and
manifests, the push dedupe state, pruning."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import resource
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import lmdb
import pytest
import torch

from ams.errors import SnapshotError
from ams.graph.build import build_graph, graph_on_every_shard
from ams.shard import restore, snapshot
from ams.shard.manifest import FORMAT_VERSION, load_manifest, verify_files
from ams.wire.pieces import PushPieces
from tests.conftest import Storages, in_position_order

N, D = 103, 6
STORAGE: Storages | None = None  # the storage of the running test, see _on_each_storage


@pytest.fixture(autouse=True)
def _on_each_storage(storage, monkeypatch):
    """Every test here runs once per storage kind: its stores and clients are built on it."""
    monkeypatch.setattr(sys.modules[__name__], "STORAGE", storage)


def trained_client(data_dir, num_shards, dtype="float32", momentum=0.9, keep_snapshots=3):
    """A table after three clocked pushes (weight decay 0.05, so the decay clocks matter)."""
    client = STORAGE.connect(local_shards=num_shards, data_dir=data_dir,
                             keep_snapshots=keep_snapshots)
    client.create_table("fc", num_rows=N, dim=D, dtype=dtype, seed=1, momentum=momentum,
                        weight_decay=0.05)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        ids = torch.randint(0, N, (40,), generator=g)
        client.push("fc", ids, torch.randn(40, D, generator=g), lr=0.1,
                    decay_clock=-step * math.log1p(-0.1 * 0.05))
    return client


def flip_byte(path, where):
    """Invert the byte at fraction ``where`` of the file."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0xFF
    path.write_bytes(bytes(data))


def full_state(client):
    """Rows, momentum and decay clocks of every class, in class-id order, gathered from the
    shards, and the newest clock of any shard."""
    rows = client.pull("fc", torch.arange(N))
    spec = client.spec("fc")
    state = torch.empty((N, spec.state_width), dtype=spec.state_dtype)
    row_clock = torch.empty(N, dtype=torch.float64)
    for s, shard in enumerate(client.shards):
        _, state[torch.arange(s, N, client.num_shards)], \
            row_clock[torch.arange(s, N, client.num_shards)] = in_position_order(shard.store)
    clock = max(shard.store.table("fc").clock for shard in client.shards)
    return rows, state, row_clock, torch.tensor(clock)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_bit_identical(tmp_path, dtype):
    src = trained_client(tmp_path, 2, dtype)
    src.snapshot(step=10)
    dst = STORAGE.connect(local_shards=2, data_dir=tmp_path)
    assert dst.restore() == 10
    for a, b in zip(full_state(src), full_state(dst), strict=False):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b)


@pytest.mark.parametrize("old,new,momentum", [(2, 3, 0.9), (3, 1, 0.9), (1, 4, 0.9),
                                              (2, 3, 0.0)])
def test_restore_into_other_shard_count(tmp_path, old, new, momentum):
    src = trained_client(tmp_path, old, momentum=momentum)
    src.snapshot(step=5)
    dst = STORAGE.connect(local_shards=new, data_dir=tmp_path)
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
    flip_byte(snapshot.step_dir(tmp_path, 2) / snapshot.piece_name(0, 2) / "data.mdb", 0.5)
    # a temporary directory from a writer killed mid-write is ignored
    (snapshot.step_dir(tmp_path, 4) / ".tmp-shard-00000-of-00002-dead").mkdir(parents=True)

    fresh = STORAGE.connect(local_shards=2, data_dir=tmp_path)
    assert fresh.restore() == 1
    for a, b in zip(good, full_state(fresh), strict=False):
        assert torch.equal(a, b)
    with pytest.raises(SnapshotError, match="checksum mismatch"):
        fresh.restore(step=2)
    with pytest.raises(SnapshotError, match=r"shards \[1\] of 2 wrote no piece"):
        fresh.restore(step=3)


def test_manifest_describes_the_piece(tmp_path):
    trained_client(tmp_path, 2).snapshot(step=7)
    manifest = json.loads((snapshot.step_dir(tmp_path, 7) / snapshot.piece_name(1, 2)
                           / "manifest.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION
    assert manifest["step"] == 7 and manifest["shard_id"] == 1 and manifest["num_shards"] == 2
    table = manifest["tables"]["fc"]
    assert table["spec"]["num_rows"] == N and table["spec"]["dim"] == D
    assert table["owned_rows"] == N // 2
    assert manifest["checksum"].startswith("sha256:")


def test_garbage_manifest_is_refused(tmp_path):
    trained_client(tmp_path, 1).snapshot(step=1)
    (snapshot.step_dir(tmp_path, 1) / snapshot.piece_name(0, 1) / "manifest.json").write_text("{")
    with pytest.raises(SnapshotError, match="manifest unreadable"):
        restore.restore_into(STORAGE.store(0, 1), tmp_path)


def two_steps(data_dir, num_shards=1):
    """Snapshots 1 and 2 of a trained table (keeping all); the full state at step 1."""
    client = trained_client(data_dir, num_shards, keep_snapshots=0)
    client.snapshot(step=1)
    good = full_state(client)
    client.push("fc", torch.tensor([1, 2]), torch.ones(2, D), lr=1.0)
    client.snapshot(step=2)
    return good


def piece_dir(data_dir, step, shard=0, num_shards=1):
    return snapshot.step_dir(data_dir, step) / snapshot.piece_name(shard, num_shards)


def edit_manifest(piece, change, reseal):
    """Apply ``change`` to the piece's manifest; ``reseal``: write its matching checksum too,
    as a writer with a bug would, so only the field checks stand in the way."""
    manifest = json.loads((piece / "manifest.json").read_text())
    change(manifest)
    text = json.dumps(manifest, indent=1).encode()
    (piece / "manifest.json").write_bytes(text)
    if reseal:
        (piece / "manifest.sha256").write_text(
            f"{hashlib.sha256(text).hexdigest()}  manifest.json\n")


def restores_step_1(data_dir, good):
    fresh = STORAGE.connect(local_shards=1, data_dir=data_dir)
    assert fresh.restore() == 1
    for a, b in zip(good, full_state(fresh), strict=True):
        assert torch.equal(a, b)


def _table(m):
    return m["tables"]["fc"]


# Edits a valid manifest survives but for its checksum: the values are plausible.
PLAUSIBLE_EDITS = {
    "decay_clock": lambda m: _table(m).update(decay_clock=0.5),
    "weight_decay": lambda m: _table(m)["spec"].update(weight_decay=0.0),
    "momentum": lambda m: _table(m)["spec"].update(momentum=0.5),
}
# Edits that make a manifest wrong however it is checksummed.
MALFORMED_EDITS = {
    "dim": lambda m: _table(m)["spec"].update(dim=D + 1),
    "table_renamed": lambda m: m.update(tables={"other": _table(m)}),
    "tables_not_a_dict": lambda m: m.update(tables=[]),
    "spec_extra_key": lambda m: _table(m)["spec"].update(bogus=1),
    "spec_dtype": lambda m: _table(m)["spec"].update(dtype="int8"),
    "decay_clock_text": lambda m: _table(m).update(decay_clock="soon"),
    "decay_clock_negative": lambda m: _table(m).update(decay_clock=-1.0),
    "decay_clock_null": lambda m: _table(m).update(decay_clock=None),
    "rows_shape": lambda m: _table(m)["rows"].update(shape=[1, D]),
    "rows_chunks": lambda m: _table(m)["rows"].update(chunks=10**9),
    "num_rows_huge": lambda m: _table(m)["spec"].update(num_rows=2**61),
    "file_outside_piece": lambda m: m.update(files={"../../x": m["files"]["data.mdb"]}),
    "file_size": lambda m: m["files"]["data.mdb"].update(size=-1),
    "no_checksum": lambda m: m.pop("checksum"),
    "shard_id": lambda m: m.update(shard_id=5),
    "step": lambda m: m.update(step="1"),
    "format_version": lambda m: m.update(format_version=2),
    "graph_garbage": lambda m: _table(m).update(graph={"version": 1}),
}


@pytest.mark.parametrize("edit", [*PLAUSIBLE_EDITS, *MALFORMED_EDITS])
def test_edited_manifest_falls_back_to_previous_step(tmp_path, edit):
    good = two_steps(tmp_path)
    edit_manifest(piece_dir(tmp_path, 2), {**PLAUSIBLE_EDITS, **MALFORMED_EDITS}[edit],
                  reseal=False)
    with pytest.raises(SnapshotError, match="manifest unreadable: its SHA-256 does not match"):
        restore.restore_into(STORAGE.store(0, 1), tmp_path, step=2)
    restores_step_1(tmp_path, good)


@pytest.mark.parametrize("edit", MALFORMED_EDITS)
def test_malformed_manifest_with_valid_checksum_is_refused(tmp_path, edit):
    good = two_steps(tmp_path)
    edit_manifest(piece_dir(tmp_path, 2), MALFORMED_EDITS[edit], reseal=True)
    with pytest.raises(SnapshotError, match="malformed manifest|format_version"):
        restore.restore_into(STORAGE.store(0, 1), tmp_path, step=2)
    restores_step_1(tmp_path, good)


def test_manifest_nested_too_deep_with_valid_checksum_is_refused(tmp_path):
    good = two_steps(tmp_path)
    text = b"[" * 100_000
    (piece_dir(tmp_path, 2) / "manifest.json").write_bytes(text)
    (piece_dir(tmp_path, 2) / "manifest.sha256").write_text(
        f"{hashlib.sha256(text).hexdigest()}  manifest.json\n")
    with pytest.raises(SnapshotError, match="manifest unreadable"):
        restore.restore_into(STORAGE.store(0, 1), tmp_path, step=2)
    restores_step_1(tmp_path, good)


@pytest.mark.parametrize("where", [0.0, 0.3, 0.7, 0.999])
def test_flipped_byte_in_manifest_falls_back(tmp_path, where):
    good = two_steps(tmp_path)
    flip_byte(piece_dir(tmp_path, 2) / "manifest.json", where)
    restores_step_1(tmp_path, good)


@pytest.mark.parametrize("damage", ["manifest.sha256 missing", "manifest.sha256 garbage",
                                    "manifest.json missing", "data.mdb missing"])
def test_missing_piece_files_fall_back(tmp_path, damage):
    good = two_steps(tmp_path)
    name, what = damage.split()
    path = piece_dir(tmp_path, 2) / name
    if what == "missing":
        path.unlink()
    else:
        path.write_text("not a checksum")
    restores_step_1(tmp_path, good)


def test_truncated_data_file_is_found_before_lmdb_opens_it(tmp_path):
    two_steps(tmp_path)
    piece = piece_dir(tmp_path, 2)
    data = piece / "data.mdb"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    with pytest.raises(SnapshotError, match="truncated or damaged"):
        verify_files(piece, load_manifest(piece))


def test_changed_value_behind_forged_file_checksums_is_caught(tmp_path):
    good = two_steps(tmp_path)
    piece = piece_dir(tmp_path, 2)
    env = lmdb.open(str(piece), map_size=1 << 30)
    with env.begin(write=True) as txn:
        value = bytearray(txn.get(b"fc/rows/000000"))
        value[5] ^= 0xFF
        txn.put(b"fc/rows/000000", bytes(value))
    env.close()
    data = (piece / "data.mdb").read_bytes()
    edit_manifest(piece, lambda m: m["files"].update(
        {"data.mdb": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}),
        reseal=True)
    with pytest.raises(SnapshotError, match="checksum mismatch"):
        restore.restore_into(STORAGE.store(0, 1), tmp_path, step=2)
    restores_step_1(tmp_path, good)


def test_damaged_snapshot_leaves_live_tables_alone(tmp_path):
    two_steps(tmp_path, num_shards=2)
    flip_byte(piece_dir(tmp_path, 2, 1, 2) / "data.mdb", 0.5)
    live = trained_client(tmp_path / "other", 2)
    live.push("fc", torch.tensor([5]), torch.ones(1, D), lr=0.3)
    for shard in live.shards:
        shard.data_dir = tmp_path
    before = full_state(live)
    with pytest.raises(SnapshotError, match="checksum mismatch"):
        live.restore(step=2)
    for a, b in zip(before, full_state(live), strict=True):
        assert torch.equal(a, b)


def test_wide_step_numbers_sort_numerically(tmp_path):
    client = trained_client(tmp_path, 1, keep_snapshots=0)
    big = 10**12 + 5
    for step in (999, big, 10**13):
        client.snapshot(step=step)
    assert snapshot.list_steps(tmp_path) == [10**13, big, 999]
    assert (tmp_path / "snapshots" / "step-000000000999").is_dir()  # 12 digits at least
    fresh = STORAGE.connect(local_shards=1, data_dir=tmp_path)
    assert fresh.restore() == 10**13
    assert fresh.stats()[0]["last_snapshot_step"] == 10**13
    shutil.rmtree(snapshot.step_dir(tmp_path, 10**13))
    assert fresh.restore() == big


def test_last_snapshot_step_reads_the_restored_step(tmp_path):
    trained_client(tmp_path, 2).snapshot(step=7)
    fresh = STORAGE.connect(local_shards=2, data_dir=tmp_path)
    assert [s["last_snapshot_step"] for s in fresh.stats()] == [-1, -1]
    assert fresh.restore() == 7
    assert [s["last_snapshot_step"] for s in fresh.stats()] == [7, 7]


# ---- neighbor graphs written between the pieces --------------------------------------------


def graph_lists(shift):
    """Class c's list: c, then c + shift, c + 2 * shift (mod N)."""
    return torch.stack([(torch.arange(N) + j * shift) % N for j in range(3)], dim=1)


def install_graph(client, version, step, shift=1):
    client.set_neighbors("fc", torch.arange(N), graph_lists(shift), version=version, step=step,
                         replace_all=True)


def graph_dropped(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == restore.__name__ and "snapshot_graph_dropped" in r.getMessage()]


# What the graph build between shard 0's piece and shard 1's did: shard 0's piece holds the
# lists before it (None: no graph yet), shard 1's those after it; no graph after it: none.
GRAPHS_BETWEEN_PIECES = {
    "only-shard-1-has-one": (None, (1, 7)),
    "only-shard-0-has-one": ((1, 7), None),
    "versions-differ": ((1, 7), (2, 8)),
}


@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize("case", GRAPHS_BETWEEN_PIECES)
def test_a_graph_not_in_every_piece_of_one_version_is_not_restored(tmp_path, caplog, case,
                                                                    new):
    before, after = GRAPHS_BETWEEN_PIECES[case]
    src = trained_client(tmp_path, 2, keep_snapshots=0)
    if before is not None:
        install_graph(src, *before, shift=1)
    src.shards[0].snapshot(5)
    if after is None:  # a shard that restarted empty between the two pieces
        src.shards[1].store.table("fc").graph = None
    else:
        install_graph(src, *after, shift=2)
    src.shards[1].snapshot(5)

    dst = STORAGE.connect(local_shards=new, data_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger=restore.__name__):
        assert dst.restore() == 5
    for a, b in zip(full_state(src), full_state(dst), strict=True):
        assert torch.equal(a, b)  # the rows are restored whole all the same
    # every restored shard took rows from both pieces: none has a graph, so the trainer
    # builds one before its next step (it checks graph_on_every_shard)
    assert [s.store.table("fc").graph for s in dst.shards] == [None] * new
    assert not graph_on_every_shard(dst, "fc")
    versions = ",".join(f"{snapshot.piece_name(i, 2)}:{'none' if g is None else f'{g[0]}/k3'}"
                        for i, g in enumerate((before, after)))
    assert graph_dropped(caplog) == new * [
        f"snapshot_graph_dropped table='fc' step=5 versions={versions} reason='the pieces "
        "hold no graph or graphs of different versions; the table is restored without one, "
        "and the next graph build makes it'"]
    build_graph(dst, "fc", 3, step=6)
    assert graph_on_every_shard(dst, "fc")


def test_a_graph_refreshed_between_the_pieces_is_restored_at_its_newest_step(tmp_path, caplog):
    src = trained_client(tmp_path, 2, keep_snapshots=0)
    install_graph(src, version=4, step=7)
    src.shards[0].snapshot(5)
    # a refresh keeps the version and moves the step of the shards it writes to
    src.set_neighbors("fc", torch.tensor([1]), graph_lists(1)[1:2], version=4, step=9,
                      replace_all=False)
    src.shards[1].snapshot(5)
    dst = STORAGE.connect(local_shards=1, data_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger=restore.__name__):
        assert dst.restore() == 5
    graph = dst.shards[0].store.table("fc").graph
    assert (graph.version, graph.step, graph.k) == (4, 9, 3)
    assert torch.equal(dst.neighbors("fc", torch.arange(N)), graph_lists(1))
    assert graph_dropped(caplog) == []


# ---- push dedupe state --------------------------------------------------------------------


def plain_sgd_client(data_dir, num_shards):
    """No momentum, no weight decay: one push of g at lr moves a row by exactly -lr * g."""
    client = STORAGE.connect(local_shards=num_shards, data_dir=data_dir)
    client.create_table("fc", num_rows=N, dim=D, seed=1, momentum=0.0, weight_decay=0.0)
    return client



def push_once(shard, ids, grads, lr, sequence):
    """Whether ``shard`` applied this push of client "worker-a" now (False: before)."""
    (applied,) = shard.push("fc", PushPieces.one(ids, grads, sequence), lr, "worker-a", None)
    return applied

def test_dedupe_state_survives_snapshot_and_restore(tmp_path):
    client = plain_sgd_client(tmp_path, 2)
    ids, grads = torch.tensor([1, 3]), torch.full((2, D), 0.5)
    start = client.pull("fc", ids).double()
    assert push_once(client.shards[1], ids, grads, 0.1, 41)
    client.snapshot(step=1)
    once = start - 0.1 * 0.5  # float64 reference of the push applied once
    fresh = plain_sgd_client(tmp_path, 2)
    assert fresh.restore() == 1
    assert not push_once(fresh.shards[1], ids, grads, 0.1, 41)
    torch.testing.assert_close(fresh.pull("fc", ids).double(), once, rtol=0, atol=1e-7)
    assert push_once(fresh.shards[1], ids, grads, 0.1, 42)  # a new one applies


def test_dedupe_state_follows_rows_into_another_shard_count(tmp_path):
    client = plain_sgd_client(tmp_path, 2)
    ids, grads = torch.tensor([1, 3]), torch.full((2, D), 0.5)
    once = client.pull("fc", ids).double() - 0.1 * 0.5
    assert push_once(client.shards[1], ids, grads, 0.1, 41)
    client.snapshot(step=1)
    three = plain_sgd_client(tmp_path, 3)
    assert three.restore() == 1
    # id 3 now lives on shard 0 of 3, id 1 on shard 1: both remember the push
    assert not push_once(three.shards[0], ids[1:], grads[1:], 0.1, 41)
    assert not push_once(three.shards[1], ids[:1], grads[:1], 0.1, 41)
    torch.testing.assert_close(three.pull("fc", ids).double(), once, rtol=0, atol=1e-7)


def test_live_restore_replaces_the_dedupe_state(tmp_path):
    client = plain_sgd_client(tmp_path, 1)
    ids, grads = torch.tensor([4]), torch.full((1, D), 0.25)
    once = client.pull("fc", ids).double() - 0.2 * 0.25
    client.snapshot(step=1)
    assert push_once(client.shards[0], ids, grads, 0.2, 9)
    assert client.restore() == 1  # the restored rows lack push 9 ...
    assert push_once(client.shards[0], ids, grads, 0.2, 9)  # ... so it applies
    torch.testing.assert_close(client.pull("fc", ids).double(), once, rtol=0, atol=1e-7)
    assert not push_once(client.shards[0], ids, grads, 0.2, 9)


def test_snapshot_writes_outside_the_table_lock(tmp_path, monkeypatch):
    client = trained_client(tmp_path, 1)
    table = client.shards[0].store.table("fc")
    lock_free = []
    put = snapshot._put_tensor

    def put_and_check(txn, key, tensor, digest):
        if table.lock.acquire(blocking=False):  # a push or pull could run now
            table.lock.release()
            lock_free.append(True)
        else:
            lock_free.append(False)
        return put(txn, key, tensor, digest)

    monkeypatch.setattr(snapshot, "_put_tensor", put_and_check)
    client.snapshot(step=1)
    assert lock_free and all(lock_free)


# ---- pruning ----------------------------------------------------------------------------


def steps_with_piece(data_dir, shard, num_shards):
    return sorted(s for s in snapshot.list_steps(data_dir)
                  if (piece_dir(data_dir, s, shard, num_shards)).is_dir())


def test_prune_keeps_newest_complete_steps_and_steps_in_progress(tmp_path):
    three = trained_client(tmp_path, 3, keep_snapshots=0)
    three.snapshot(step=0)  # an earlier shard count
    client = trained_client(tmp_path, 2, keep_snapshots=0)
    for step in range(1, 6):
        client.snapshot(step=step)
    client.shards[0].snapshot(6)  # step 6: shard 1 is still writing
    leftovers = [snapshot.step_dir(tmp_path, s) / f".tmp-{snapshot.piece_name(i, 2)}-dead"
                 for s, i in ((3, 0), (6, 0), (6, 1))]
    for d in leftovers:
        d.mkdir()

    snapshot.prune_snapshots(tmp_path, 0, 2, keep=2)
    assert steps_with_piece(tmp_path, 0, 2) == [4, 5, 6]
    assert steps_with_piece(tmp_path, 1, 2) == [1, 2, 3, 4, 5]  # not shard 0's to remove
    assert not (piece_dir(tmp_path, 0, 0, 3).exists() or piece_dir(tmp_path, 0, 2, 3).exists())
    assert piece_dir(tmp_path, 0, 1, 3).exists()
    assert [d.exists() for d in leftovers] == [False, False, True]

    snapshot.prune_snapshots(tmp_path, 1, 2, keep=2)
    assert steps_with_piece(tmp_path, 1, 2) == [4, 5]
    assert snapshot.list_steps(tmp_path) == [6, 5, 4]  # emptied step directories are gone
    assert not leftovers[2].exists()
    fresh = STORAGE.connect(local_shards=2, data_dir=tmp_path)
    assert fresh.restore() == 5


def test_prune_keeps_everything_with_keep_zero_or_no_complete_step(tmp_path):
    client = trained_client(tmp_path, 2, keep_snapshots=0)
    for step in range(1, 5):
        client.shards[0].snapshot(step)  # shard 1 never wrote: no step is complete
    snapshot.prune_snapshots(tmp_path, 0, 2, keep=1)
    assert steps_with_piece(tmp_path, 0, 2) == [1, 2, 3, 4]
    for step in range(1, 5):
        client.shards[1].snapshot(step)
    snapshot.prune_snapshots(tmp_path, 0, 2, keep=0)
    assert steps_with_piece(tmp_path, 0, 2) == [1, 2, 3, 4]
    snapshot.prune_snapshots(tmp_path, 0, 2, keep=1, protect=(2,))
    assert steps_with_piece(tmp_path, 0, 2) == [2, 4]


def test_prune_skips_a_step_the_other_shards_removed_after_it_was_listed(tmp_path,
                                                                        monkeypatch, caplog):
    """Shards sharing a data dir prune side by side: a step directory listed by one shard can
    be gone by the time it looks inside (the last of the others removed it). That step is
    done, not a failure, and the older steps are still pruned."""
    client = trained_client(tmp_path, 2, keep_snapshots=0)
    for step in range(1, 6):
        client.snapshot(step=step)
    listed = snapshot.list_steps(tmp_path)
    for step in (1, 3):  # what the other shard (the last one there) did meanwhile
        shutil.rmtree(snapshot.step_dir(tmp_path, step))
    monkeypatch.setattr(snapshot, "list_steps", lambda data_dir: listed)
    with caplog.at_level(logging.WARNING, logger="ams.shard.snapshot"):
        snapshot.prune_after_snapshot(tmp_path, 0, 2, keep=2, written=5)
    assert "snapshot_prune_failed" not in caplog.text
    assert steps_with_piece(tmp_path, 0, 2) == [4, 5]
    assert steps_with_piece(tmp_path, 1, 2) == [2, 4, 5]  # not shard 0's to remove


def test_local_shards_prune_after_each_snapshot(tmp_path):
    client = trained_client(tmp_path, 2, keep_snapshots=2)
    for step in range(1, 6):
        client.snapshot(step=step)
    # each shard prunes as it finishes writing: one that finishes step 5 before the other
    # still counts 3 among the 2 newest complete steps and keeps its piece of 3, so at most
    # one step more than asked remains
    assert snapshot.list_steps(tmp_path) in ([5, 4], [5, 4, 3])
    default = trained_client(tmp_path / "default", 1)
    for step in range(1, 6):
        default.snapshot(step=step)
    assert snapshot.list_steps(tmp_path / "default") == [5, 4, 3]


@contextmanager
def file_size_limit(limit):
    """Writes of this process past ``limit`` bytes of a file fail with EFBIG, as on a full
    disk (Python ignores SIGXFSZ)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


# a piece of trained_client's table is 20 KiB: past its two meta pages its writes fail
SNAPSHOT_FAILS = 8192


def restore_messages(caplog):
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == restore.__name__]


def test_a_failed_snapshot_leaves_no_step_and_no_restore_warning(tmp_path, caplog):
    client = trained_client(tmp_path, 1)
    client.snapshot(step=1)
    good = full_state(client)
    with file_size_limit(SNAPSHOT_FAILS), \
            pytest.raises(SnapshotError, match="snapshot step 2 not written"):
        client.snapshot(step=2)
    assert snapshot.list_steps(tmp_path) == [1]  # no empty step-000000000002
    fresh = STORAGE.connect(local_shards=1, data_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger=restore.__name__):
        assert fresh.restore() == 1
    # the restored step alone: nothing skipped, nothing to fall back from
    assert restore_messages(caplog) == [
        ("INFO", f"snapshot_restored step=1 path={snapshot.step_dir(tmp_path, 1)} tables=1")]
    for a, b in zip(good, full_state(fresh), strict=True):
        assert torch.equal(a, b)


def test_steps_shards_failed_to_write_are_reported_as_incomplete(tmp_path, caplog):
    client = trained_client(tmp_path, 2, keep_snapshots=0)
    client.snapshot(step=1)
    client.shards[1].snapshot(2)
    with file_size_limit(SNAPSHOT_FAILS), pytest.raises(SnapshotError, match="not written"):
        client.shards[0].snapshot(2)
    # shard 0's write is gone, shard 1's piece stays with its step directory
    assert [p.name for p in snapshot.step_dir(tmp_path, 2).iterdir()] == [
        snapshot.piece_name(1, 2)]
    crashed = snapshot.step_dir(tmp_path, 3) / f".tmp-{snapshot.piece_name(0, 2)}-dead"
    crashed.mkdir(parents=True)  # a write that a kill -9 interrupted
    fresh = STORAGE.connect(local_shards=2, data_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger=restore.__name__):
        assert fresh.restore() == 1
    incomplete = [
        ("WARNING", f"snapshot_incomplete step=3 reason='{snapshot.step_dir(tmp_path, 3)}: no "
                    "shard wrote its piece (1 being written, or left by a crash)'; trying an "
                    "older step"),
        ("WARNING", f"snapshot_incomplete step=2 reason='{snapshot.step_dir(tmp_path, 2)}: "
                    "shards [0] of 2 wrote no piece (their snapshot failed or was interrupted, "
                    "or is being written)'; trying an older step")]
    restored = ("INFO", f"snapshot_restored step=1 path={snapshot.step_dir(tmp_path, 1)} "
                        "tables=1")
    # each shard says so (the two restore side by side)
    assert sorted(restore_messages(caplog)) == sorted(2 * [*incomplete, restored])

    # pruning removes the crashed write, and the step directory that held nothing else
    snapshot.prune_snapshots(tmp_path, 0, 2, keep=1)
    assert snapshot.list_steps(tmp_path) == [2, 1]


@pytest.mark.parametrize("crash", ["between-the-renames", "after-the-renames"])
def test_a_step_written_again_keeps_a_whole_piece_whenever_a_crash_comes(tmp_path, monkeypatch,
                                                                         crash):
    client = trained_client(tmp_path, 1, keep_snapshots=2)
    client.snapshot(step=1)
    client.snapshot(step=2)
    piece = piece_dir(tmp_path, 2)
    shutil.copytree(piece, tmp_path / "old-piece")
    old = full_state(client)
    client.push("fc", torch.tensor([1, 2]), torch.ones(2, D), lr=1.0)
    new = full_state(client)
    aside = piece.parent / f"{snapshot.ASIDE}{piece.name}"
    if crash == "between-the-renames":
        # the rename of the new piece into place fails once, as a crash just before it
        # would stop it: whatever was done to the old piece before it is done
        rename, failed = os.rename, []

        def new_piece_not_moved_in(src, dst):
            if Path(dst) == piece and not failed:
                failed.append(src)
                raise OSError(errno.EIO, "the process dies here")
            rename(src, dst)

        monkeypatch.setattr(os, "rename", new_piece_not_moved_in)
        with pytest.raises(SnapshotError, match="snapshot step 2 not written"):
            client.snapshot(step=2)
        assert failed and not piece.exists() and aside.is_dir()
        whole = old
    else:
        client.snapshot(step=2)
        # the new piece came in; the old one, aside, was not removed yet
        shutil.copytree(tmp_path / "old-piece", aside)
        whole = new

    fresh = STORAGE.connect(local_shards=1, data_dir=tmp_path)
    assert fresh.restore() == 2
    for a, b in zip(whole, full_state(fresh), strict=True):
        assert torch.equal(a, b)
    # the next snapshot's prune puts the piece back in place or removes the one aside
    client.snapshot(step=3)
    assert [p.name for p in piece.parent.iterdir()] == [piece.name]
    assert fresh.restore(step=2) == 2
    for a, b in zip(whole, full_state(fresh), strict=True):
        assert torch.equal(a, b)


def test_large_table_beyond_lmdb_default_map_size(tmp_path):
    store = STORAGE.store(0, 1)
    client = STORAGE.connect(local_shards=1, data_dir=tmp_path)
    client.create_table("big", num_rows=40_000, dim=128)  # 20 MiB rows + 20 MiB momentum
    client.snapshot(step=0)
    restore.restore_into(store, tmp_path)
    assert torch.equal(in_position_order(store, "big")[0],
                       in_position_order(client.shards[0].store, "big")[0])


def test_no_snapshot_at_all(tmp_path):
    with pytest.raises(SnapshotError, match="no snapshots"):
        restore.restore_into(STORAGE.store(0, 1), tmp_path)


@pytest.mark.parametrize("old", [2, 4, 6])
def test_a_restore_loads_exactly_the_pieces_that_hold_its_rows(tmp_path, monkeypatch, old):
    """Every piece of the step is verified, but a shard loads only the pieces holding rows it
    owns. Brute force over the table's ids with the sharding rule (id i lives on shard
    i % count): piece p of ``old`` is loaded by shard s of ``new`` exactly when some id is
    both p mod old and s mod new. 4 -> 6 and 6 -> 4 load some pieces and skip others."""
    src = trained_client(tmp_path, old)
    src.snapshot(step=7)
    calls = []  # (piece's shard, piece's shard count, loaded) of each piece read
    read_piece = restore.read_piece

    def recording_read_piece(path, load=True):
        manifest, tensors = read_piece(path, load)
        calls.append((manifest["shard_id"], manifest["num_shards"], load))
        return manifest, tensors

    monkeypatch.setattr(restore, "read_piece", recording_read_piece)
    for new in (1, 2, 3, 4, 6):
        for shard in range(new):
            calls.clear()
            store = STORAGE.store(shard, new)
            assert restore.restore_into(store, tmp_path)[0] == 7
            brute = {p for p in range(old)
                     if any(i % old == p and i % new == shard for i in range(N))}
            assert sorted((p, count) for p, count, _ in calls) == [(p, old) for p in range(old)]
            assert {p for p, _, loaded in calls if loaded} == brute, (old, new, shard)

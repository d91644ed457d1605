"""Snapshot faults against real ``xcls serve shard`` processes on 127.0.0.1: damaged pieces and
manifests at start-up and through the Restore RPC, exactly-once pushes across kill -9, pruning,
--require-auth. The tests damage the files themselves."""

from __future__ import annotations

import json

import pytest
import torch

import ams
from ams import errors
from ams.client.remote import RemoteShard
from ams.shard.snapshot import list_steps, piece_name, step_dir
from ams.wire.pieces import PushPieces

N, D = 400, 8


def drive(client, seed):
    """A few pushes with a weight-decay clock."""
    g = torch.Generator().manual_seed(seed)
    for step in range(3):
        ids = torch.randint(0, N, (100,), generator=g)
        client.push("fc", ids, torch.randn(100, D, generator=g), lr=0.05,
                    decay_clock=0.01 * step)


def two_snapshots(procs):
    """Snapshots 1 and 2 of a trained table; the rows at step 1 (all classes, in order)."""
    client = ams.connect([p.address for p in procs])
    client.create_table("fc", num_rows=N, dim=D, seed=4)
    drive(client, seed=0)
    client.snapshot(step=1)
    good = client.pull("fc", torch.arange(N))
    drive(client, seed=1)
    client.snapshot(step=2)
    client.close()
    return good


def truncate(path, fraction=0.5):
    with open(path, "r+b") as f:
        f.truncate(int(path.stat().st_size * fraction))


def restart(procs):
    for p in procs:
        p.kill9()
    for p in procs:
        p.start()


def assert_serves_step_1(procs, good):
    client = ams.connect([p.address for p in procs])
    assert torch.equal(client.pull("fc", torch.arange(N)), good)
    assert [s["last_snapshot_step"] for s in client.stats()] == [1] * len(procs)
    client.close()
    for p in procs:
        assert "Traceback" not in p.log()
        assert "snapshot_skipped step=2" in p.log()


def test_truncated_piece_start_up_serves_previous_good_step(shard_cluster):
    procs = shard_cluster(2, ["--restore", "latest", "--keep-snapshots", "0"])
    good = two_snapshots(procs)
    truncate(step_dir(procs[0].data_dir, 2) / piece_name(1, 2) / "data.mdb")
    restart(procs)  # each shard reads every piece: both must skip step 2, neither may die
    assert_serves_step_1(procs, good)


def test_restore_rpc_with_damaged_snapshot_keeps_the_live_table(shard_cluster):
    procs = shard_cluster(2, ["--keep-snapshots", "0"])
    good = two_snapshots(procs)
    truncate(step_dir(procs[0].data_dir, 2) / piece_name(0, 2) / "data.mdb")
    client = ams.connect([p.address for p in procs])
    drive(client, seed=2)
    live = client.pull("fc", torch.arange(N))
    with pytest.raises(errors.AmsError, match="truncated or damaged"):
        client.restore(step=2)
    assert torch.equal(client.pull("fc", torch.arange(N)), live)
    assert client.restore() == 1  # latest: falls back past the damaged step
    assert torch.equal(client.pull("fc", torch.arange(N)), good)
    assert [s["last_snapshot_step"] for s in client.stats()] == [1, 1]
    client.close()


MANIFEST_EDITS = {
    "momentum": lambda m: m["tables"]["fc"]["spec"].update(momentum=0.5),
    "dim": lambda m: m["tables"]["fc"]["spec"].update(dim=D + 1),
    "table_list": lambda m: m.update(tables={}),
    "decay_clock": lambda m: m["tables"]["fc"].update(decay_clock=3.0),
}


@pytest.mark.parametrize("damage", [*MANIFEST_EDITS, "flipped_byte"])
def test_damaged_manifest_start_up_falls_back_without_traceback(shard_cluster, damage):
    procs = shard_cluster(1, ["--restore", "latest", "--keep-snapshots", "0"])
    good = two_snapshots(procs)
    path = step_dir(procs[0].data_dir, 2) / piece_name(0, 1) / "manifest.json"
    if damage == "flipped_byte":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    else:
        manifest = json.loads(path.read_text())
        MANIFEST_EDITS[damage](manifest)
        path.write_text(json.dumps(manifest, indent=1))
    restart(procs)
    assert_serves_step_1(procs, good)


def push_request(sequence, value=0.5):
    return PushPieces.one(torch.tensor([3, 8]), torch.full((2, D), value), sequence)


def push(proc, piece):
    """Whether the shard applied ``piece`` now (False: it had applied that sequence)."""
    shard = RemoteShard(proc.address, timeout=10)
    try:
        (applied,) = shard.push("fc", piece, 0.1, "worker-7", None)
    finally:
        shard.close()
    return applied


def test_retried_push_applies_once_across_kill9_and_restore(shard_cluster):
    (proc,) = shard_cluster(1, ["--restore", "latest"])
    client = ams.connect([proc.address])
    client.create_table("fc", num_rows=N, dim=D, seed=4, momentum=0.0, weight_decay=0.0)
    ids = torch.tensor([3, 8])
    start = client.pull("fc", ids).double()
    client.close()
    step = 0.1 * 0.5  # how far one push moves each value: plain SGD, float64 reference
    assert push(proc, push_request(41))
    ams.connect([proc.address]).snapshot(step=1)
    assert push(proc, push_request(42))  # after the snapshot: lost with the crash
    restart([proc])
    assert not push(proc, push_request(41))  # in the restored rows: a retry is a repeat
    assert push(proc, push_request(42))  # not in them: the retry applies
    client = ams.connect([proc.address])
    torch.testing.assert_close(client.pull("fc", ids).double(), start - 2 * step, rtol=0,
                               atol=1e-6)
    # a live restore replaces the remembered pushes with the snapshot's
    assert client.restore() == 1
    assert push(proc, push_request(42))
    assert not push(proc, push_request(41))
    torch.testing.assert_close(client.pull("fc", ids).double(), start - 2 * step, rtol=0,
                               atol=1e-6)
    client.close()


def test_shard_keeps_newest_snapshots_and_clears_leftovers(shard_cluster):
    procs = shard_cluster(2, ["--keep-snapshots", "2"])
    data_dir = procs[0].data_dir
    leftover = step_dir(data_dir, 1) / f".tmp-{piece_name(0, 2)}-dead"
    leftover.mkdir(parents=True)  # what a shard killed mid-write leaves behind
    client = ams.connect([p.address for p in procs])
    client.create_table("fc", num_rows=N, dim=D, seed=4)
    for step in range(1, 6):
        client.snapshot(step=step)
        # a shard that prunes before the other finished the step still sees the one before
        # as one of the newest complete: at most one step more than asked for is left
        steps = list_steps(data_dir)
        assert steps[:2] == list(range(step, 0, -1))[:2] and len(steps) <= 3
    assert list_steps(data_dir)[:2] == [5, 4]
    assert not leftover.exists()
    client.close()


def test_require_auth_serves_only_with_a_token(shard_cluster, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    (proc,) = shard_cluster(1, ["--require-auth"], token_file=token_file)
    with pytest.raises(errors.Unauthenticated):
        ams.connect([proc.address])
    client = ams.connect([proc.address], token="s3cret")
    client.create_table("fc", num_rows=10, dim=4)
    assert client.pull("fc", torch.tensor([3])).shape == (1, 4)
    client.close()

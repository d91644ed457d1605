"""``xcls serve shard --storage mmap`` processes over gRPC: tables in files under
DATA_DIR/tables, snapshot and restore, tables kept across a clean stop; storage errors at
start are one line and exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import ams
from ams.shard.spec import TableSpec
from ams.shard.store import ShardStore

N, D = 1000, 16


def drive(client, steps, seed):
    """Pushes with a weight-decay clock, so rows that sit out a step owe decay."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        ids = torch.randint(0, N, (300,), generator=g)
        client.push("fc", ids, torch.randn(300, D, generator=g), lr=0.05,
                    decay_clock=0.01 * step)


def rows(client) -> torch.Tensor:
    return client.pull("fc", torch.arange(N))


def test_mmap_shards_serve_snapshot_restore_and_keep_tables(shard_cluster, tmp_path):
    procs = shard_cluster(2, ["--storage", "mmap"], data_dir=tmp_path)
    remote = ams.connect([p.address for p in procs])
    ref = ams.connect(local_shards=2)  # memory storage, the same shard layout
    for client in (remote, ref):
        client.create_table("fc", num_rows=N, dim=D, seed=4)
        drive(client, 3, seed=0)
    assert [s["storage"] for s in remote.stats()] == ["mmap", "mmap"]
    assert torch.equal(rows(remote), rows(ref))
    for s in range(2):
        assert (tmp_path / "tables" / f"shard-0000{s}-of-00002" / "fc" / "rows.bin").is_file()

    remote.snapshot(step=1)
    at_step_1 = rows(remote)
    drive(remote, 2, seed=1)
    assert not torch.equal(rows(remote), at_step_1)
    assert remote.restore() == 1
    assert torch.equal(rows(remote), at_step_1)
    drive(remote, 2, seed=2)
    kept = rows(remote)
    remote.close()

    assert [p.terminate() for p in procs] == [0, 0]  # a clean stop keeps the tables
    again = shard_cluster(2, ["--storage", "mmap"], data_dir=tmp_path)
    client = ams.connect([p.address for p in again])
    assert torch.equal(rows(client), kept)
    client.close()


def serve(data_dir, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xcls", "-q", "serve", "shard", "--shard-id",
                           "0", "--num-shards", "1", *args], capture_output=True, text=True,
                          timeout=120, cwd=data_dir)


@pytest.mark.parametrize("case,needle", [
    ("no data dir", "--storage mmap needs --data-dir"),
    ("unknown kind", "storage='disk': need one of 'memory', 'mmap'"),
    ("truncated file", "rows.bin: "),
])
def test_storage_error_at_start_is_one_line_and_exit_2(tmp_path, case, needle):
    args = ["--storage", "mmap", "--data-dir", str(tmp_path)]
    if case == "no data dir":
        args = ["--storage", "mmap"]
    elif case == "unknown kind":
        args = ["--storage", "disk", "--data-dir", str(tmp_path)]
    else:
        store = ShardStore(0, 1, storage="mmap", storage_dir=tmp_path / "tables")
        store.create_table(TableSpec(name="fc", num_rows=N, dim=D))
        store.close()
        path = tmp_path / "tables" / "shard-00000-of-00001" / "fc" / "rows.bin"
        with open(path, "r+b") as f:
            f.truncate(100)
    done = serve(tmp_path, *args)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], \
        done.stderr
    if case == "truncated file":
        assert "restore a snapshot" in lines[0] and path.stat().st_size == 100

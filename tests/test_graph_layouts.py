"""Compact neighbor graphs in the store and in snapshots: the layout (fixed width or CSR) and id
dtype (int32 or int64) kept, sent and stored, against plain Python lists."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

import ams
from ams import errors
from ams.errors import SnapshotError
from ams.shard import restore, snapshot
from ams.shard.spec import TableSpec
from ams.shard.store import ShardStore

N, D, K = 103, 4, 5


def model_lists(short: dict[int, int] | None = None) -> list[list[int]]:
    """Class c's list: c, then c + 7, c + 14, ... (mod N), K long, or ``short[c]`` long."""
    short = short or {}
    return [[(c + 7 * j) % N for j in range(short.get(c, K))] for c in range(N)]


def padded(lists: list[list[int]], width: int = K) -> torch.Tensor:
    return torch.tensor([r + [-1] * (width - len(r)) for r in lists], dtype=torch.int64)


def client_with_graph(data_dir: Path, num_shards: int, lists: list[list[int]]):
    client = ams.connect(local_shards=num_shards, data_dir=data_dir, keep_snapshots=0)
    client.create_table("fc", num_rows=N, dim=D, seed=1)
    client.set_neighbors("fc", torch.arange(N), padded(lists), version=3, step=9,
                         replace_all=True)
    return client


def graphs(client) -> list:
    return [shard.store.table("fc").graph for shard in client.shards]


def test_store_keeps_full_lists_fixed_width_int32_and_ragged_ones_csr(tmp_path):
    lists = model_lists()
    client = client_with_graph(tmp_path, 2, lists)
    for g in graphs(client):
        assert g.fixed and g.neighbors.dtype == torch.int32 and g.k == K
    stats = [s["tables"]["fc"] for s in client.stats()]
    assert [s["graph_bytes"] for s in stats] == [52 * K * 4, 51 * K * 4]
    # a refresh that keeps every list at K keeps the fixed layout
    lists[4] = [4, 0, 1, 2, 3]
    client.set_neighbors("fc", torch.tensor([4]), padded([lists[4]]), version=4, step=10,
                         replace_all=False)
    assert all(g.fixed for g in graphs(client))
    # one that shortens a list makes that shard's table CSR
    lists[6] = [6, 5]
    client.set_neighbors("fc", torch.tensor([6]), padded([lists[6]]), version=5, step=11,
                         replace_all=False)
    assert [g.fixed for g in graphs(client)] == [False, True]
    assert graphs(client)[0].neighbors.dtype == torch.int32
    assert torch.equal(client.neighbors("fc", torch.arange(N)), padded(lists))


def test_client_sends_int32_fixed_width_when_it_can(tmp_path, monkeypatch):
    client = ams.connect(local_shards=2)
    client.create_table("fc", num_rows=N, dim=D)
    sent = []
    for shard in client.shards:
        def spy(table, ids, offsets, neighbors, *rest, original=shard.set_neighbors):
            sent.append((offsets is None, str(neighbors.dtype), neighbors.dim()))
            return original(table, ids, offsets, neighbors, *rest)
        monkeypatch.setattr(shard, "set_neighbors", spy)
    lists = model_lists()
    client.set_neighbors("fc", torch.arange(N), padded(lists), version=1, step=0,
                         replace_all=True)
    assert sent == [(True, "torch.int32", 2)] * 2
    sent.clear()
    lists[4] = [4, 1]  # padded: shard 0 gets CSR, shard 1 fixed width
    client.set_neighbors("fc", torch.tensor([4, 5]), padded([lists[4], lists[5]]), version=1,
                         step=1, replace_all=False)
    assert sorted(sent) == [(False, "torch.int32", 1), (True, "torch.int32", 2)]
    assert torch.equal(client.neighbors("fc", torch.arange(N)), padded(lists))
    sent.clear()
    # ids that do not fit int32 travel as int64, so the shard refuses them instead of a
    # wrapped id that would land in range
    with pytest.raises(errors.IdOutOfRange):
        client.set_neighbors("fc", torch.tensor([4]), torch.tensor([[2**32 + 4] * K]),
                             version=1, step=2, replace_all=False)
    assert sent == [(True, "torch.int64", 2)]
    assert torch.equal(client.neighbors("fc", torch.arange(N)), padded(lists))


def test_store_refuses_bad_lists_and_changes_nothing(tmp_path):
    client = client_with_graph(tmp_path, 1, model_lists())
    store = client.shards[0].store
    before = store.table("fc").graph.neighbors
    ids = torch.tensor([1, 2])
    cases = [
        (None, torch.tensor([[1, 2]]), errors.InvalidArgument, r"need shape \(2, k\)"),
        (torch.tensor([0, 1, 2]), torch.tensor([[1], [2]]), errors.InvalidArgument,
         "need a 1-d tensor"),
        (None, torch.tensor([[1.0], [2.0]]), errors.InvalidArgument, "int32 or int64"),
        (None, torch.tensor([[1], [N]], dtype=torch.int32), errors.IdOutOfRange,
         f"0..{N - 1}"),
        (None, torch.tensor([[1], [2**32 + 1]]), errors.IdOutOfRange, f"0..{N - 1}"),
    ]
    for replace_all in (False, True):
        for offsets, neighbors, error, needle in cases:
            with pytest.raises(error, match=needle):
                store.set_neighbors("fc", ids, offsets, neighbors, 7, 0, replace_all)
    table = store.table("fc")
    assert table.graph.neighbors is before and table.staged_graph is None
    assert (table.graph.version, table.graph.step) == (3, 9)


def test_store_keeps_int64_ids_from_2_31_classes_and_refuses_int32_there():
    num_rows, shards = 2**31 + 5, 2**16  # a shard owns about 32k rows
    store = ShardStore(1, shards)
    store.create_table(TableSpec(name="big", num_rows=num_rows, dim=1, momentum=0.0))
    owned = store.tables["big"].rows.shape[0]
    ids = torch.arange(owned) * shards + 1
    lists = torch.stack([ids, torch.full_like(ids, num_rows - 1)], dim=1)
    with pytest.raises(errors.InvalidArgument, match="int32 ids cannot name"):
        store.set_neighbors("big", ids, None, lists.to(torch.int32), 1, 0, True)
    assert store.set_neighbors("big", ids, None, lists, 1, 0, True) == 1
    graph = store.tables["big"].graph
    assert graph.fixed and graph.neighbors.dtype == torch.int64
    offsets, got = store.neighbors("big", ids[-2:])
    assert offsets is None and got.tolist() == lists[-2:].tolist()


# ---- snapshots --------------------------------------------------------------------------


def manifest_of(piece: Path) -> dict:
    return json.loads((piece / "manifest.json").read_text())


def pieces(data_dir: Path, step: int) -> list[Path]:
    return sorted(p for p in snapshot.step_dir(data_dir, step).iterdir()
                  if p.name.startswith("shard-"))


@pytest.mark.parametrize("old,new", [(2, 2), (2, 3), (3, 1)])
@pytest.mark.parametrize("short", [{}, {4: 2, 50: 1, 51: 3}])
def test_graph_round_trip_through_snapshots_keeps_the_layout(tmp_path, old, new, short):
    lists = model_lists(short)
    src = client_with_graph(tmp_path, old, lists)
    src.snapshot(step=1)
    for s, piece in enumerate(pieces(tmp_path, 1)):
        graph = manifest_of(piece)["tables"]["fc"]["graph"]
        assert graph["id_dtype"] == "int32" and (graph["version"], graph["k"]) == (3, K)
        mine = range(s, N, old)
        ragged = any(len(lists[c]) != K for c in mine)
        assert graph["layout"] == ("csr" if ragged else "fixed")
        assert ("offsets" in graph) == ragged
        listed = sum(len(lists[c]) for c in mine)
        assert graph["neighbors"]["shape"] == ([listed] if ragged else [len(mine), K])
    dst = ams.connect(local_shards=new, data_dir=tmp_path)
    assert dst.restore() == 1
    assert torch.equal(dst.neighbors("fc", torch.arange(N)), padded(lists))
    for s, g in enumerate(graphs(dst)):
        mine = range(s, N, new)
        assert g.neighbors.dtype == torch.int32 and (g.version, g.step, g.k) == (3, 9, K)
        assert g.fixed == all(len(lists[c]) == K for c in mine)


def reseal(piece: Path, change) -> None:
    """Apply ``change`` to the manifest and write its matching checksum, as a writer with a
    bug would, so only the field checks stand in the way."""
    manifest = manifest_of(piece)
    change(manifest)
    text = json.dumps(manifest, indent=1).encode()
    (piece / "manifest.json").write_bytes(text)
    (piece / "manifest.sha256").write_text(f"{hashlib.sha256(text).hexdigest()}  "
                                           "manifest.json\n")


def _graph(m: dict) -> dict:
    return m["tables"]["fc"]["graph"]


@pytest.mark.parametrize("change,needle", [
    (lambda m: _graph(m).update(layout="dense"), "graph layout"),
    (lambda m: _graph(m).update(id_dtype="int16"), "graph id_dtype"),
    (lambda m: _graph(m).update(id_dtype="int64"), "dtype 'int32', need int64"),
    (lambda m: _graph(m).update(k=K + 1), "shape"),
    (lambda m: _graph(m).update(offsets=_graph(m)["neighbors"]), "no offsets"),
    (lambda m: _graph(m).update(layout="csr"), "KeyError"),
    (lambda m: m.update(format_version=3), "format_version 3, this build reads 4"),
])
def test_malformed_graph_manifest_is_refused(tmp_path, change, needle):
    client = client_with_graph(tmp_path, 1, model_lists())
    client.snapshot(step=1)
    reseal(pieces(tmp_path, 1)[0], change)
    fresh = ShardStore(0, 1)
    with pytest.raises(SnapshotError, match=needle):
        restore.restore_into(fresh, tmp_path, step=1)
    assert fresh.tables == {}

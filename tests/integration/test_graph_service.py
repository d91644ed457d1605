"""Graph build over real shard processes: equal to a brute-force float64 build; Neighbors RPC."""

from __future__ import annotations

import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch

import ams
from ams import codec
from ams.api import shard_pb2 as pb
from ams.api import shard_pb2_grpc as pb_grpc
from ams.graph_build import build_graph, refresh_graph

N, D, K = 600, 12, 8


def brute_force(rows: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 numpy reference: scores of every pair, k-th best score per row."""
    x = rows.double().numpy()
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    scores = x @ x.T
    kth = -np.sort(-scores, axis=1)[:, k - 1]
    return scores, kth


def check_lists(neighbors: torch.Tensor, scores: np.ndarray, kth: np.ndarray) -> None:
    nb = neighbors.numpy()
    assert (nb[:, 0] == np.arange(nb.shape[0])).all(), "the class itself must rank first"
    for i in range(nb.shape[0]):
        got = scores[i, nb[i]]
        assert len(set(nb[i].tolist())) == nb.shape[1]
        assert (got >= kth[i] - 1e-6).all()  # every returned neighbor is in the true top-k
        assert (np.diff(got[1:]) <= 1e-6).all()  # rank order after the class itself


def test_cli_build_on_three_shards_equals_brute_force(shard_cluster):
    procs = shard_cluster(3)
    addresses = ",".join(p.address for p in procs)
    client = ams.connect(addresses)
    client.create_table("fc", num_rows=N, dim=D, seed=2)
    out = subprocess.run([sys.executable, "-m", "xcls", "graph", "build", "--ams", addresses,
                          "--table", "fc", "--k", str(K), "--builders", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "graph version 1" in out.stdout
    scores, kth = brute_force(client.pull("fc", torch.arange(N)), K)
    check_lists(client.neighbors("fc", torch.arange(N)), scores, kth)
    assert {s["tables"]["fc"]["graph_version"] for s in client.stats()} == {1}
    # in-process build through a connected client gives the next version, same lists
    assert build_graph(client, "fc", k=K, step=7) == 2
    check_lists(client.neighbors("fc", torch.arange(N)), scores, kth)
    assert {s["tables"]["fc"]["graph_step"] for s in client.stats()} == {7}
    client.close()


def test_partial_refresh_after_rows_move(shard_cluster):
    procs = shard_cluster(2)
    client = ams.connect([p.address for p in procs])
    client.create_table("fc", num_rows=N, dim=D, seed=2, momentum=0.0, weight_decay=0.0)
    build_graph(client, "fc", k=K)
    moved = torch.tensor([3, 10, 11, 500])
    # pull rows 3.. toward row 40 so their true neighbors change
    target = client.pull("fc", torch.tensor([40])).float()
    rows = client.pull("fc", moved).float()
    client.push("fc", moved, (rows - target) / 0.9, lr=0.9)
    refresh_graph(client, "fc", moved)
    scores, kth = brute_force(client.pull("fc", torch.arange(N)), K)
    nb = client.neighbors("fc", moved)
    for i, c in enumerate(moved.tolist()):
        assert nb[i, 0] == c
        assert (scores[c, nb[i].numpy()] >= kth[c] - 1e-6).all()
        assert 40 in nb[i].tolist()
    client.close()


def test_neighbors_rpc_bad_input(shard_cluster):
    (proc,) = shard_cluster(1)
    client = ams.connect([proc.address])
    client.create_table("fc", num_rows=N, dim=D)
    stub = pb_grpc.ShardStub(grpc.insecure_channel(proc.address))
    with pytest.raises(grpc.RpcError) as info:
        stub.Neighbors(pb.NeighborsRequest(table="fc", ids=codec.encode(torch.tensor([1]))))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "build it first" in info.value.details()
    build_graph(client, "fc", k=K)
    for ids, code in ((torch.tensor([N]), grpc.StatusCode.OUT_OF_RANGE),
                      (torch.tensor([1.5]), grpc.StatusCode.INVALID_ARGUMENT)):
        with pytest.raises(grpc.RpcError) as info:
            stub.Neighbors(pb.NeighborsRequest(table="fc", ids=codec.encode(ids)))
        assert info.value.code() == code
    with pytest.raises(grpc.RpcError) as info:
        stub.Neighbors(pb.NeighborsRequest(table="nope", ids=codec.encode(torch.tensor([1]))))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    bad_offsets = pb.SetNeighborsRequest(
        table="fc", ids=codec.encode(torch.tensor([0, 1])),
        offsets=codec.encode(torch.tensor([0, 5, 3])), neighbors=codec.encode(torch.arange(3)),
        graph_version=9)
    with pytest.raises(grpc.RpcError) as info:
        stub.SetNeighbors(bad_offsets)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # a snapshot carries the graph: restart from it and the lists are the same
    lists = client.neighbors("fc", torch.arange(N))
    client.snapshot(step=1)
    restored = ams.connect(local_shards=2, data_dir=proc.data_dir)
    assert restored.restore() == 1
    assert torch.equal(restored.neighbors("fc", torch.arange(N)), lists)
    client.close()


@pytest.fixture(scope="module")
def one_shard_with_table(module_cluster):
    (proc,) = module_cluster(1)
    with ams.connect([proc.address]) as client:
        client.create_table("fc", num_rows=N, dim=D)
    return proc


@pytest.mark.parametrize("args,needle", [
    (["--table", "fc", "--k", "0"], "--k 0"),
    (["--table", "nope"], "unknown table 'nope'"),
    (["--table", "fc", "--k", str(N + 1)], "k=601"),
    (["--table", "fc", "--builders", "0"], "--builders 0"),
    (["--table", "fc", "--builders", "2", "--builder-index", "5"], "builder_index=5"),
    pytest.param(["--table", "fc", "--device", "cuda"], "--device cuda: no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")),
])
def test_cli_bad_arguments(one_shard_with_table, args, needle):
    proc = one_shard_with_table
    out = subprocess.run([sys.executable, "-m", "xcls", "graph", "build", "--ams", proc.address,
                          *args], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and needle in out.stderr, out.stderr


def test_cli_unreachable_shard():
    out = subprocess.run([sys.executable, "-m", "xcls", "graph", "build", "--ams",
                          "127.0.0.1:1", "--table", "fc", "--connect-timeout", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "not reachable" in out.stderr

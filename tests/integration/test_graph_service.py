"""Graph build over real shard processes: equal to a brute-force float64 build; Neighbors RPC."""

from __future__ import annotations

import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch

import ams
from ams.api import shard_pb2 as pb
from ams.api import shard_pb2_grpc as pb_grpc
from ams.graph.build import build_graph, refresh_graph
from ams.wire import codec
from tests.conftest import refused_in_process
from xcls.cli import main

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
    assert build_graph(client, "fc", k=K, step=7).version == 2
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
    refresh_graph(client, "fc", moved, K)
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


def test_compact_lists_over_the_wire(shard_cluster):
    """Fixed-width int32 lists travel without offsets, ragged ones as CSR; hostile requests
    are refused and change nothing; the layout survives a snapshot."""
    (proc,) = shard_cluster(1)
    client = ams.connect([proc.address])
    client.create_table("fc", num_rows=N, dim=D)
    lists = [[(c + 5 * j) % N for j in range(K)] for c in range(N)]  # reference, by class
    client.set_neighbors("fc", torch.arange(N), torch.tensor(lists), version=1, step=0,
                         replace_all=True)
    stub = pb_grpc.ShardStub(grpc.insecure_channel(proc.address))

    def ask(ids: list[int]) -> pb.NeighborsReply:
        return stub.Neighbors(pb.NeighborsRequest(table="fc", ids=codec.encode(
            torch.tensor(ids))))

    (stats,) = client.stats()
    assert stats["tables"]["fc"]["graph_bytes"] == N * K * 4  # int32, no offsets
    reply = ask([3, 599, 3])
    assert not reply.HasField("offsets")
    assert (reply.neighbors.dtype, list(reply.neighbors.shape)) == (pb.INT32, [3, K])
    assert codec.decode(reply.neighbors, "n").tolist() == [lists[3], lists[599], lists[3]]
    # a refresh sent fixed width in int32, as a raw request with no offsets
    lists[10] = [10, 1, 2, 3, 4, 5, 6, 7]
    stub.SetNeighbors(pb.SetNeighborsRequest(
        table="fc", ids=codec.encode(torch.tensor([10])),
        neighbors=codec.encode(torch.tensor([lists[10]], dtype=torch.int32)), graph_version=2))
    # a short list as CSR with int32 ids: the shard keeps and answers CSR
    lists[11] = [11, 0]
    stub.SetNeighbors(pb.SetNeighborsRequest(
        table="fc", ids=codec.encode(torch.tensor([11])),
        offsets=codec.encode(torch.tensor([0, 2])),
        neighbors=codec.encode(torch.tensor(lists[11], dtype=torch.int32)), graph_version=3))
    reply = ask([11, 10])
    assert codec.decode(reply.offsets, "o").tolist() == [0, 2, 2 + K]
    assert reply.neighbors.dtype == pb.INT32
    assert codec.decode(reply.neighbors, "n").tolist() == lists[11] + lists[10]
    expected = torch.tensor([r + [-1] * (K - len(r)) for r in lists])
    assert torch.equal(client.neighbors("fc", torch.arange(N)), expected)

    ids2 = codec.encode(torch.tensor([0, 1]))
    hostile = [
        (dict(neighbors=codec.encode(torch.tensor([[0] * K, [N] * K], dtype=torch.int32))),
         grpc.StatusCode.OUT_OF_RANGE),
        (dict(neighbors=codec.encode(torch.zeros((3, K), dtype=torch.int32))),
         grpc.StatusCode.INVALID_ARGUMENT),
        (dict(offsets=codec.encode(torch.tensor([0, K, 2 * K])),
              neighbors=codec.encode(torch.zeros((2, K), dtype=torch.int32))),
         grpc.StatusCode.INVALID_ARGUMENT),
        (dict(neighbors=codec.encode(torch.zeros((2, K)))), grpc.StatusCode.INVALID_ARGUMENT),
        (dict(neighbors=codec.encode(torch.zeros(2 * K, dtype=torch.int32))),
         grpc.StatusCode.INVALID_ARGUMENT),
    ]
    for replace_all in (False, True):
        for fields, code in hostile:
            with pytest.raises(grpc.RpcError) as info:
                stub.SetNeighbors(pb.SetNeighborsRequest(
                    table="fc", ids=ids2, graph_version=9, replace_all=replace_all, **fields))
            assert info.value.code() == code, info.value.details()
    assert torch.equal(client.neighbors("fc", torch.arange(N)), expected)
    assert client.stats()[0]["tables"]["fc"]["graph_version"] == 3
    client.snapshot(step=1)
    restored = ams.connect(local_shards=2, data_dir=proc.data_dir)
    assert restored.restore() == 1
    assert torch.equal(restored.neighbors("fc", torch.arange(N)), expected)
    shards = [shard.store.table("fc").graph for shard in restored.shards]
    assert [g.fixed for g in shards] == [True, False]  # class 11 is odd: shard 1
    assert {g.neighbors.dtype for g in shards} == {torch.int32}
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
    (["--table", "fc", "--builders", "2", "--builder-index", "5"],
     "--builder-index 5 must be in [0, --builders 2)"),
    (["--table", "fc", "--version", "-3"], "--version -3 must be >= 0"),
    (["--table", "fc", "--step", "-3"], "--step -3 must be >= 0"),
    (["--table", "fc", "--connect-timeout", "nan"], "--connect-timeout nan"),
    (["--table", ""], "a table name is required"),
    (["--table", "fc", "--resume-dir", sys.executable], "is not a directory"),
    (["--table", "fc", "--device", "banana"], "--device 'banana': not a device"),
    pytest.param(["--table", "fc", "--device", "cuda"], "--device cuda: no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA")),
])
def test_cli_bad_arguments(one_shard_with_table, args, needle, capsys):
    """Each refused in one line with exit code 2 (the command run in this process; the
    unreachable shard below runs it as a process)."""
    proc = one_shard_with_table
    err = refused_in_process(["graph", "build", "--ams", proc.address, *args], capsys)
    assert needle in err, err


@pytest.mark.parametrize("address", ["nohostport", "127.0.0.1:0", "127.0.0.1:99999"])
def test_cli_malformed_address_is_refused_without_waiting(address, capsys):
    """ams.connect checks every address first: a typo is not waited on as an unreachable
    shard (--connect-timeout, 30 s by default)."""
    assert main(["graph", "build", "--ams", address, "--table", "fc"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"address {address!r}: expected host:port" in err, err


def test_cli_unreachable_shard():
    out = subprocess.run([sys.executable, "-m", "xcls", "graph", "build", "--ams",
                          "127.0.0.1:1", "--table", "fc", "--connect-timeout", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "not reachable" in out.stderr

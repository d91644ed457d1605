"""Real ``xcls serve shard`` processes on 127.0.0.1, driven over gRPC."""

from __future__ import annotations

import collections
import math
import random
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

import ams
from ams import errors
from ams.api import shard_pb2 as pb
from ams.api import shard_pb2_grpc as pb_grpc
from ams.limits import PIECE_BYTES
from ams.server.service import create_server
from ams.shard.store import ShardStore
from ams.wire import codec
from tests.conftest import wait_until
from xcls.config import load_config
from xcls.run import connect_ams
from xcls.shards import spawn, stop

N, D = 1000, 16


def reference_client():
    ref = ams.connect(local_shards=1)
    ref.create_table("fc", num_rows=N, dim=D, seed=4)
    return ref


def drive(client, steps=4, seed=0):
    """Pushes with a weight-decay clock, so rows that sit out a step owe decay."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        ids = torch.randint(0, N, (300,), generator=g)
        client.push("fc", ids, torch.randn(300, D, generator=g), lr=0.05,
                    decay_clock=0.01 * step)


def test_remote_equals_in_process(shard_cluster):
    procs = shard_cluster(2)
    remote = ams.connect([p.address for p in procs])
    remote.create_table("fc", num_rows=N, dim=D, seed=4)
    ref = reference_client()
    drive(remote)
    drive(ref)
    ids = torch.randint(0, N, (2000,))
    torch.testing.assert_close(remote.pull("fc", ids), ref.pull("fc", ids), rtol=0, atol=1e-7)
    scanned = torch.cat([r for _, r in remote.scan("fc")])
    scanned_ids = torch.cat([i for i, _ in remote.scan("fc")])
    assert torch.equal(scanned, remote.pull("fc", scanned_ids))
    assert sorted(scanned_ids.tolist()) == list(range(N))
    stats = remote.stats()
    assert [s["shard_id"] for s in stats] == [0, 1]
    assert sum(s["tables"]["fc"]["owned_rows"] for s in stats) == N
    remote.close()


def test_a_table_created_over_grpc_has_exactly_the_spec_asked_for(shard_cluster):
    """Specs travel as doubles: 5e-4 is not a float32, and a spec rounded on the way would be
    another table to an in-process store that reopens or restores it."""
    procs = shard_cluster(1)
    with ams.connect([procs[0].address]) as remote:
        remote.create_table("fc", num_rows=10, dim=4, momentum=0.3, weight_decay=5e-4,
                            init_std=0.01)
    with ams.connect([procs[0].address]) as fresh:  # asks the shard, not its own memory
        spec = fresh.spec("fc")
    assert (spec.momentum, spec.weight_decay, spec.init_std) == (0.3, 5e-4, 0.01)


def test_health_and_graceful_sigterm(shard_cluster):
    (proc,) = shard_cluster(1)
    with grpc.insecure_channel(proc.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="xcls.ams.Shard"), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert proc.terminate() == 0
    assert "stopped" in proc.log()


@pytest.fixture(scope="module")
def raw_stub(module_cluster):
    procs = module_cluster(2)
    client = ams.connect([p.address for p in procs])
    client.create_table("fc", num_rows=N, dim=D, seed=4)
    channel = grpc.insecure_channel(procs[0].address)
    yield pb_grpc.ShardStub(channel), client
    channel.close()
    client.close()


def _ids(values, dtype=torch.int64):
    return codec.encode(torch.tensor(values, dtype=dtype))


BAD_REQUESTS = [
    ("CreateTable", pb.CreateTableRequest(spec=pb.TableSpec(name="t", num_rows=0, dim=4,
                                                            dtype=pb.FLOAT32)),
     grpc.StatusCode.INVALID_ARGUMENT, "num_rows"),
    ("CreateTable", pb.CreateTableRequest(spec=pb.TableSpec(name="t", num_rows=10, dim=4)),
     grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
    ("CreateTable", pb.CreateTableRequest(spec=pb.TableSpec(name="fc", num_rows=N, dim=D + 1,
                                                            dtype=pb.FLOAT32)),
     grpc.StatusCode.ALREADY_EXISTS, "fc"),
    # rows of this std would all be infinite in float16
    ("CreateTable", pb.CreateTableRequest(spec=pb.TableSpec(name="t", num_rows=10, dim=4,
                                                            dtype=pb.FLOAT16, init_std=1e5)),
     grpc.StatusCode.INVALID_ARGUMENT, "init_std=100000 overflows float16 rows"),
    ("Neighbors", pb.NeighborsRequest(table="fc", ids=_ids([0])),
     grpc.StatusCode.FAILED_PRECONDITION, "no neighbor graph"),
    ("Neighbors", pb.NeighborsRequest(table="fc", ids=_ids([N + 2])),
     grpc.StatusCode.OUT_OF_RANGE, str(N + 2)),
    ("Neighbors", pb.NeighborsRequest(table="zz", ids=_ids([0])),
     grpc.StatusCode.NOT_FOUND, "zz"),
    ("CreateTable", pb.CreateTableRequest(spec=pb.TableSpec(name="huge", num_rows=2**61, dim=4,
                                                            dtype=pb.FLOAT32)),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "huge"),
    # hostile tensors: the control plane still decodes ids (rows travel as frames)
    ("Neighbors", pb.NeighborsRequest(table="fc", ids=pb.Tensor(dtype=pb.INT64, shape=[3],
                                                                data=b"\0" * 20)),
     grpc.StatusCode.INVALID_ARGUMENT, "ids"),
    ("Neighbors", pb.NeighborsRequest(table="fc", ids=codec.encode(torch.zeros(2))),
     grpc.StatusCode.INVALID_ARGUMENT, "int64"),
    ("SetNeighbors", pb.SetNeighborsRequest(table="fc", ids=_ids([0]), neighbors=pb.Tensor(
        dtype=pb.INT32, shape=[0, 2**40, 2**40], data=b"")),
     grpc.StatusCode.INVALID_ARGUMENT, "too large for a tensor"),
    ("Neighbors", pb.NeighborsRequest(table="x" * 1_000_000, ids=_ids([0])),
     grpc.StatusCode.NOT_FOUND, "(1000002 chars)"),
    ("Neighbors", pb.NeighborsRequest(table="fc", ids=pb.Tensor(
        dtype=pb.INT64, shape=[1] * 100_000, data=bytes(8))),
     grpc.StatusCode.INVALID_ARGUMENT, "(300000 chars)"),
]


@pytest.mark.parametrize("method,request_msg,code,needle", BAD_REQUESTS,
                         ids=[f"{m}-{c.name}-{i}" for i, (m, _, c, _) in enumerate(BAD_REQUESTS)])
def test_bad_input_gets_status_and_changes_nothing(raw_stub, method, request_msg, code, needle):
    stub, client = raw_stub
    before = client.pull("fc", torch.arange(N))
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, method)(request_msg, timeout=10)
    assert info.value.code() == code, info.value.details()
    assert needle in info.value.details()
    assert len(info.value.details()) < 1000  # long values are quoted briefly
    assert torch.equal(client.pull("fc", torch.arange(N)), before)
    # still serving
    assert stub.Stats(pb.StatsRequest(), timeout=10).num_shards == 2


_HOSTILE_INTS = [0, 1, -1, 7, N - 1, N, 2**31 - 1, 2**31, 2**62, 2**63 - 1, -2**63]
_HOSTILE_FLOATS = [0.0, -0.0, 1e-320, 0.5, 1.0, 1e5, 1e308, -1e308, float("nan"),
                   float("inf")]


def _hostile_tensor(rng: random.Random) -> pb.Tensor:
    """A wire tensor of any dtype code and a shape of 0-3 dims (some empty with huge
    dimensions), often with a byte length that fits it, holding ids in and out of range (or
    random bytes)."""
    dtype = rng.randrange(7)
    shape = [rng.choice([0, 1, 2, 5, 12, -1, 2**40]) for _ in range(rng.randrange(4))]
    if rng.random() < 0.2:  # no elements, yet dimensions whose strides pass int64
        shape = [0, 2**40, 2**40]
    count = math.prod(max(0, s) for s in shape)
    if rng.random() < 0.7 and count <= 4096 and dtype in (pb.INT64, pb.INT32):
        values = np.array([rng.choice(_HOSTILE_INTS + list(range(0, N, 37)))
                           for _ in range(count)], dtype=np.int64)
        data = values.tobytes() if dtype == pb.INT64 else values.astype(np.int32).tobytes()
    else:
        data = rng.randbytes(rng.choice([0, 4, 8, 24, rng.randrange(64)]))
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


def _hostile_request(rng: random.Random) -> tuple[str, object]:
    """A control request with field values picked from the edges of their types."""
    table = rng.choice(["fc", "fc", "nope", "", "a/b", "\x00", "x" * 300])
    method = rng.choice(["CreateTable", "Snapshot", "Restore", "Neighbors", "SetNeighbors",
                         "TakeTouched"])
    if method == "CreateTable":
        return method, pb.CreateTableRequest(spec=pb.TableSpec(
            name=rng.choice(["t", "fc", "", "a/b", "x" * 200]), num_rows=rng.choice(
                _HOSTILE_INTS), dim=rng.choice([0, 1, 8, 65536, 65537, -1, 2**31 - 1]),
            dtype=rng.randrange(7), state_dtype=rng.randrange(7),
            momentum=rng.choice(_HOSTILE_FLOATS), weight_decay=rng.choice(_HOSTILE_FLOATS),
            seed=rng.choice([0, 2**63, 2**64 - 1]), init_std=rng.choice(_HOSTILE_FLOATS)))
    if method in ("Snapshot", "Restore"):
        step = rng.choice(_HOSTILE_INTS)
        return method, (pb.SnapshotRequest if method == "Snapshot" else pb.RestoreRequest)(
            step=step)
    if method == "TakeTouched":
        return method, pb.TakeTouchedRequest(table=table, max_ids=rng.choice(_HOSTILE_INTS))
    ids = _ids([rng.randrange(0, N, 2) for _ in range(rng.randrange(1, 9))]) \
        if rng.random() < 0.5 else _hostile_tensor(rng)
    if method == "Neighbors":
        return method, pb.NeighborsRequest(table=table, ids=ids)
    request = pb.SetNeighborsRequest(
        table=table, ids=ids, neighbors=_hostile_tensor(rng),
        graph_version=rng.choice(_HOSTILE_INTS), graph_step=rng.choice(_HOSTILE_INTS),
        replace_all=rng.random() < 0.5)
    if rng.random() < 0.4:
        request.offsets.CopyFrom(_hostile_tensor(rng))
    return method, request


def test_random_hostile_control_requests_get_a_status_that_is_not_internal(shard_cluster,
                                                                          tmp_path):
    """600 control requests with fields at the edges of their types (seeded): each ends OK
    or with a status that names the caller's error, never INTERNAL or UNKNOWN; the shard
    serves on, and its log holds no traceback."""
    procs = shard_cluster(2, data_dir=tmp_path)
    rng = random.Random(11)
    statuses: collections.Counter[str] = collections.Counter()
    with ams.connect([p.address for p in procs]) as client, \
            grpc.insecure_channel(procs[0].address) as channel:
        client.create_table("fc", num_rows=N, dim=D, seed=4)
        client.snapshot(step=5)
        stub = pb_grpc.ShardStub(channel)
        for _ in range(600):
            method, request = _hostile_request(rng)
            try:
                getattr(stub, method)(request, timeout=20)
                statuses["OK"] += 1
            except grpc.RpcError as e:
                assert e.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), \
                    (method, e.details(), str(request)[:500])
                statuses[e.code().name] += 1
        assert client.pull("fc", torch.arange(N)).shape == (N, D)
    assert statuses["INVALID_ARGUMENT"] > 100 and statuses["OK"] > 20, statuses
    logs = list(tmp_path.glob("*.log"))
    assert logs and not any("Traceback" in p.read_text(errors="replace") for p in logs)


# bytes no message parses: a wire type that does not exist, a length past the end (huge, small)
UNDECODABLE = (b"\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x0a\x05ab")


def undecodable_request_codes(address: str, service) -> set[tuple[str, str]]:
    """(method, status) of each ``UNDECODABLE`` request sent to every method of ``service``
    (a protobuf service descriptor) at ``address``."""
    codes = set()
    with grpc.insecure_channel(address) as channel:
        for method in service.methods:
            call = channel.unary_unary(f"/{service.full_name}/{method.name}",
                                       request_serializer=bytes, response_deserializer=bytes)
            for raw in UNDECODABLE:
                try:
                    call(raw, timeout=20)
                    codes.add((method.name, "OK"))
                except grpc.RpcError as e:
                    codes.add((method.name, e.code().name))
    return codes


def test_undecodable_control_requests_are_invalid_argument(shard_cluster, tmp_path):
    """A request that is not a valid message is the caller's error (grpcio's own answer is
    INTERNAL, with a traceback in the shard's log)."""
    procs = shard_cluster(1, data_dir=tmp_path)
    service = pb.DESCRIPTOR.services_by_name["Shard"]
    assert undecodable_request_codes(procs[0].address, service) == {
        (method.name, "INVALID_ARGUMENT") for method in service.methods}
    with ams.connect([procs[0].address]) as client:
        client.create_table("fc", num_rows=N, dim=D, seed=4)
        assert client.pull("fc", torch.arange(N)).shape == (N, D)
    logs = list(tmp_path.glob("*.log"))
    assert logs and not any("Traceback" in p.read_text(errors="replace") for p in logs)


def test_client_raises_typed_errors(raw_stub):
    _, client = raw_stub
    with pytest.raises(errors.IdOutOfRange, match=str(N + 5)):
        client.pull("fc", torch.tensor([1, N + 5]))
    with pytest.raises(errors.TableNotFound):
        client.pull("other", torch.tensor([1]))
    with pytest.raises(errors.InvalidArgument, match="would become non-finite"):
        # finite, so the client sends it; the shard refuses the row it would make
        client.push("fc", torch.tensor([3]), torch.full((1, D), 3e38), lr=10.0)


def test_every_call_of_a_client_ends_by_its_timeout_on_a_stopped_shard(stopped_for):
    """A shard frozen (SIGSTOP) past every call: each call of a client made with
    ``timeout=2`` fails with DEADLINE_EXCEEDED in about 2 s, its retries inside that time,
    snapshots and restores of small tables too (sized by the shard's tables, never an
    hour); a snapshot given its own timeout keeps to it."""
    address, stop = stopped_for
    timeout = 2.0
    with ams.connect([address], timeout=timeout) as client:
        ids = torch.arange(0, N, 7)
        client.pull("fc", ids)  # the table's spec is known, a data connection pooled
        calls = {
            "stats": client.stats,
            "create_table": lambda: client.create_table("other", num_rows=10, dim=4),
            "pull": lambda: client.pull("fc", ids),
            "push": lambda: client.push("fc", ids, torch.ones(ids.numel(), D), 0.1),
            "neighbors": lambda: client.neighbors("fc", ids),
            "set_neighbors": lambda: client.set_neighbors(
                "fc", ids, ids.view(-1, 1), version=1, step=0, replace_all=False),
            "take_touched": lambda: client.take_touched("fc"),
            "snapshot": lambda: client.snapshot(1),
            "restore": lambda: client.restore(1),
            "snapshot_with_timeout": lambda: client.snapshot(1, timeout=1.0),
        }
        stop(60.0)
        for name, call in calls.items():
            started = time.monotonic()
            with pytest.raises(errors.AmsError) as raised:
                call()
            took = time.monotonic() - started
            limit = 1.0 if name == "snapshot_with_timeout" else timeout
            assert raised.value.code == "DEADLINE_EXCEEDED", (name, raised.value)
            assert limit * 0.9 <= took < limit + 1.5, (name, took)


def test_oversized_message_is_resource_exhausted(raw_stub):
    stub, _ = raw_stub
    n = (300 << 20) // 8
    req = pb.NeighborsRequest(table="fc", ids=pb.Tensor(dtype=pb.INT64, shape=[n],
                                                        data=bytes(n * 8)))
    with pytest.raises(grpc.RpcError) as info:
        stub.Neighbors(req, timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_kill9_then_restore_latest_is_bit_identical(shard_cluster):
    procs = shard_cluster(2, ["--restore", "latest"])
    client = ams.connect([p.address for p in procs])
    client.create_table("fc", num_rows=N, dim=D, dtype="float16", seed=4)
    drive(client)
    client.snapshot(step=100)
    rows = client.pull("fc", torch.arange(N))
    stats_before = client.stats()
    drive(client, seed=9)  # after the snapshot: must be lost
    client.close()
    procs[1].kill9()
    procs[1].start()
    procs[0].kill9()
    procs[0].start()
    client = ams.connect([p.address for p in procs])
    assert torch.equal(client.pull("fc", torch.arange(N)), rows)
    # momentum too: the same push from the same state gives the same rows
    ref = ams.connect(local_shards=2, data_dir=procs[0].data_dir)
    assert ref.restore() == 100
    ids, grads = torch.arange(0, N, 7), torch.randn(N // 7 + 1, D)
    client.push("fc", ids, grads, lr=0.1)
    ref.push("fc", ids, grads, lr=0.1)
    assert torch.equal(client.pull("fc", torch.arange(N)), ref.pull("fc", torch.arange(N)))
    assert [s["tables"]["fc"]["owned_rows"] for s in client.stats()] == \
        [s["tables"]["fc"]["owned_rows"] for s in stats_before]
    client.close()


def test_snapshot_of_two_shards_restores_into_three(shard_cluster, tmp_path):
    two = shard_cluster(2)
    client = ams.connect([p.address for p in two])
    client.create_table("fc", num_rows=N, dim=D, seed=4)
    drive(client)
    client.snapshot(step=3)
    rows = client.pull("fc", torch.arange(N))
    client.close()
    for p in two:
        assert p.terminate() == 0
    three = shard_cluster(3, ["--restore", "latest"], data_dir=two[0].data_dir)
    client = ams.connect([p.address for p in three])
    assert torch.equal(client.pull("fc", torch.arange(N)), rows)
    client.close()


def test_wrong_token_is_refused(shard_cluster, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    (proc,) = shard_cluster(1, token_file=token_file)
    with pytest.raises(errors.Unauthenticated, match="token"):
        ams.connect([proc.address], token="wrong")
    with pytest.raises(errors.Unauthenticated):
        ams.connect([proc.address])
    client = ams.connect([proc.address], token="s3cret")
    client.create_table("fc", num_rows=10, dim=4)
    assert client.pull("fc", torch.tensor([3])).shape == (1, 4)
    client.close()


def test_shards_listed_out_of_order_are_refused(shard_cluster):
    procs = shard_cluster(2)
    with pytest.raises(errors.InvalidArgument, match="expected shard 0 of 2"):
        ams.connect([procs[1].address, procs[0].address])


@pytest.mark.parametrize("args,needle", [
    (["--shard-id", "2", "--num-shards", "2"], "--shard-id 2"),
    (["--shard-id", "0", "--num-shards", "1", "--host", "0.0.0.0"], "refusing to serve"),
    (["--shard-id", "0", "--num-shards", "1", "--port", "70000"], "--port"),
    (["--shard-id", "0", "--num-shards", "1", "--data-port", "-1"], "--data-port -1"),
    (["--shard-id", "0", "--num-shards", "1", "--port", "7001", "--data-port", "7001"],
     "give each its own"),
    (["--shard-id", "0", "--num-shards", "1", "--restore", "latest"], "--data-dir"),
    (["--shard-id", "0", "--num-shards", "1", "--auth-token-file", "/nonexistent/t"],
     "cannot read"),
    (["--shard-id", "x", "--num-shards", "1"], "invalid int value"),
    (["--num-shards", "1"], "required"),
    (["--shard-id", "0", "--num-shards", "1", "--require-auth"], "--require-auth"),
    (["--shard-id", "0", "--num-shards", "1", "--keep-snapshots", "-1"], "--keep-snapshots"),
    # a file where the directory goes; no secret is a megabyte (a wrong path is not read whole)
    (["--shard-id", "0", "--num-shards", "1", "--data-dir", sys.executable], "--data-dir"),
    (["--shard-id", "0", "--num-shards", "1", "--port-file", "/nonexistent/dir/port"],
     "/nonexistent/dir is not a directory"),
    (["--shard-id", "0", "--num-shards", "1", "--port-file", "/tmp"],
     "--port-file /tmp is a directory"),
    (["--shard-id", "0", "--num-shards", "1000000000000"], "must be in 1..1048576"),
    # a launch script's unset variable: the tables would go in the current directory
    (["--shard-id", "0", "--num-shards", "1", "--data-dir", ""],
     "--data-dir: must name a directory, not ''"),
    (["--shard-id", "0", "--num-shards", "1", "--auth-token-file", "/dev/zero"],
     "not a secret"),
    (["--shard-id", "0", "--num-shards", "1", "--grace", "inf"], "--grace inf"),
    (["--shard-id", "0", "--num-shards", "1", "--rpc-threads", "0"], "--rpc-threads 0"),
    (["--shard-id", "0", "--num-shards", "1", "--torch-threads", "100000"],
     "--torch-threads 100000 must be in 1..1024"),
])
def test_cli_rejects_bad_arguments(args, needle):
    out = subprocess.run([sys.executable, "-m", "xcls", "serve", "shard", *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2  # refused input: the same code in every command
    assert needle in out.stderr + out.stdout and "Traceback" not in out.stderr


def test_cli_port_in_use_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "xcls", "serve", "shard", "--shard-id", "0",
                              "--num-shards", "1", "--port", str(port)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert f"error: cannot listen on 127.0.0.1:{port}: the port is in use" in out.stderr
        data = subprocess.run([sys.executable, "-m", "xcls", "serve", "shard", "--shard-id", "0",
                               "--num-shards", "1", "--data-port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert data.returncode == 2 and "Traceback" not in data.stderr
    assert f"error: cannot listen on 127.0.0.1:{port} for the data plane" in data.stderr


def test_a_port_a_shard_or_scheduler_serves_on_is_in_use_for_the_next_one():
    """gRPC binds with SO_REUSEPORT by default: a second server on a serving shard's or
    scheduler's port started too, and took half the connections. Now it is refused."""
    from ams.cluster.scheduler import create_scheduler_server

    running = create_server(ShardStore(0, 1))
    scheduler = create_scheduler_server(1)
    try:
        for role, port, args in (("shard", running.port, ["--shard-id", "0", "--num-shards",
                                                          "1"]),
                                 ("scheduler", scheduler.port, ["--num-shards", "1"])):
            out = subprocess.run([sys.executable, "-m", "xcls", "serve", role, *args, "--port",
                                  str(port)], capture_output=True, text=True, timeout=60)
            assert out.returncode == 2 and "Traceback" not in out.stderr, (role, out.stderr)
            assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in out.stderr
    finally:
        running.stop(0)
        scheduler.stop(0)


def test_the_port_file_names_a_serving_shard_only(tmp_path):
    """The port file appears once the shard serves and goes when it stops: not for a shard
    that fails to start, and not after a SIGTERM, also one that comes while the shard still
    tries to register with a scheduler it cannot reach (it waited out the minute of retries,
    and its stale port file stayed)."""
    port_file = tmp_path / "port"
    failed = subprocess.run([sys.executable, "-m", "xcls", "serve", "shard", "--shard-id", "0",
                             "--num-shards", "1", "--data-dir", str(tmp_path / "data"),
                             "--restore", "foo", "--port-file", str(port_file)],
                            capture_output=True, text=True, timeout=60)
    assert failed.returncode == 2 and "--restore 'foo'" in failed.stderr
    assert not port_file.exists()
    with socket.socket() as nobody:  # a scheduler address where nothing listens
        nobody.bind(("127.0.0.1", 0))
        unreachable = f"127.0.0.1:{nobody.getsockname()[1]}"
        shard = subprocess.Popen([sys.executable, "-m", "xcls", "serve", "shard", "--shard-id",
                                  "0", "--num-shards", "1", "--port-file", str(port_file),
                                  "--scheduler", unreachable],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            port = int(wait_until(lambda: port_file.exists() and port_file.read_text(),
                                  "the port file", 60, alive=[shard]))
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="xcls.ams.Shard"), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            time.sleep(1.0)  # registering, retrying the scheduler
            signalled = time.monotonic()
            shard.terminate()
            assert shard.wait(timeout=30) == 0, shard.stdout.read()
            assert time.monotonic() - signalled < 10
        finally:
            shard.kill()
            shard.wait()
    assert not port_file.exists()


def test_restore_of_corrupt_only_snapshot_refuses_to_start(shard_cluster, tmp_path):
    (proc,) = shard_cluster(1)
    client = ams.connect([proc.address])
    client.create_table("fc", num_rows=N, dim=D)
    client.snapshot(step=1)
    client.close()
    assert proc.terminate() == 0
    manifest = next(proc.data_dir.glob("snapshots/step-*/shard-*/manifest.json"))
    manifest.write_text("garbage")
    out = subprocess.run([sys.executable, "-m", "xcls", "serve", "shard", "--shard-id", "0",
                          "--num-shards", "1", "--data-dir", str(proc.data_dir), "--restore",
                          "latest"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "manifest unreadable" in out.stderr


def test_tls_and_token(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    token_file = tmp_path / "token"
    token_file.write_text("t0k3n")
    # Started as scripts/launch_server.sh starts a TLS shard (xcls cluster up's shards serve
    # plaintext on 127.0.0.1); its port file appears once it serves.
    port_file, log_path = tmp_path / "port", tmp_path / "shard.log"
    shard = spawn("shard-0", [sys.executable, "-m", "xcls", "-q", "serve", "shard",
                              "--shard-id", "0", "--num-shards", "1", "--port-file",
                              str(port_file), "--tls-cert", str(cert), "--tls-key", str(key),
                              "--auth-token-file", str(token_file)], log_path=log_path)
    try:
        wait_until(port_file.exists, "the TLS shard's port file", 60, alive=[shard.proc],
                   why=lambda: log_path.read_text(errors="replace"))
        address = f"127.0.0.1:{int(port_file.read_text())}"
        client = ams.connect([address], tls_ca=cert.read_bytes(), token="t0k3n")
        client.create_table("fc", num_rows=10, dim=4)
        assert client.pull("fc", torch.tensor([1, 9])).shape == (2, 4)
        # rows stay in the TLS stream: no shared buffer bypasses it
        assert client.arena is None
        assert {remote.piece_bytes for remote in client.shards} == {PIECE_BYTES}
        client.close()
        with pytest.raises(errors.Unavailable):  # plaintext against a TLS port never connects
            ams.connect([address], token="t0k3n", ready_timeout=2)
        # The commands and the trainer reach TLS shards too: --tls-ca, ams.tls_ca_file.
        built = subprocess.run([sys.executable, "-m", "xcls", "graph", "build", "--ams",
                                address, "--table", "fc", "--k", "3", "--tls-ca", str(cert),
                                "--auth-token-file", str(token_file), "--no-progress"],
                               capture_output=True, text=True, timeout=120)
        assert built.returncode == 0, built.stderr
        cfg = load_config(None, [f"ams.addresses=['{address}']", f"ams.tls_ca_file={cert}",
                                 f"ams.token_file={token_file}"])
        trainer_client = connect_ams(cfg, tmp_path, "t0k3n", tls_ca=cert.read_bytes())
        assert trainer_client.neighbors("fc", torch.tensor([4])).shape == (1, 3)  # the graph
        trainer_client.close()
    finally:
        stop([shard], 30)


def test_a_restoring_shard_says_not_serving_and_refuses_calls_until_ready():
    """A shard binds before it restores its snapshot: health NOT_SERVING (so a check tells
    starting from dead), every shard call UNAVAILABLE, clients wait for SERVING."""
    running = create_server(ShardStore(0, 1), ready=False)
    address = f"127.0.0.1:{running.port}"
    channel = grpc.insecure_channel(address)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="xcls.ams.Shard")
        assert health.Check(request).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.ShardStub(channel).Stats(pb.StatsRequest())
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "restoring its snapshot" in refused.value.details()
        with pytest.raises(errors.Unavailable, match="not serving within"):
            ams.connect([address], ready_timeout=0.5)
        threading.Timer(0.3, running.mark_ready, args=(7,)).start()
        client = ams.connect([address], ready_timeout=30)  # waits until SERVING
        assert health.Check(request).status == health_pb2.HealthCheckResponse.SERVING
        assert client.stats()[0]["last_snapshot_step"] == 7
        client.close()
    finally:
        channel.close()
        running.stop(0)

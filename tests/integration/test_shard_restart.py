"""Shard incarnations: a client never changes, nor reads from, a shard process other than the
one it first talked to, until it relearns them after a coordinated rollback."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import grpc
import pytest
import torch

import ams
from ams import errors
from ams.api import shard_pb2 as pb
from ams.api import shard_pb2_grpc as pb_grpc
from ams.limits import EXPECT_INCARNATION_KEY, INCARNATION_KEY
from ams.server.service import create_server
from ams.shard.store import ShardStore
from tests.conftest import wait_until
from xcls.shards import ShardSupervisor, TooManyRestarts

N, D = 200, 8
ALL = torch.arange(N)


def push_some(client, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One push touching both shards' rows; returns what it sent."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(N, generator=g)[:60]
    grads = torch.randn(60, D, generator=g)
    client.push("fc", ids, grads, lr=0.1)
    return ids, grads


def test_push_to_a_restarted_shard_is_refused_and_leaves_it_untouched(shard_cluster):
    procs = shard_cluster(2, ["--restore", "latest"])
    client = ams.connect([p.address for p in procs])
    client.create_table("fc", num_rows=N, dim=D, seed=4)
    push_some(client, seed=0)
    client.snapshot(step=1)
    old = [s["incarnation"] for s in client.stats()]

    procs[1].kill9()
    procs[1].start()  # back at the snapshot of step 1, as a new process
    observer = ams.connect([p.address for p in procs])  # first contact: the new process
    new = [s["incarnation"] for s in observer.stats()]
    assert new[0] == old[0] and new[1] != old[1]
    before = observer.pull("fc", ALL)

    with pytest.raises(errors.ShardRestarted) as info:
        push_some(client, seed=1)
    message = str(info.value)
    assert procs[1].address in message and "shard 1 of 2" in message
    assert old[1] in message and new[1] in message
    # the refused push reached neither the restarted shard's rows nor its counters
    odd = ALL[1::2]
    assert torch.equal(observer.pull("fc", odd), before[1::2])
    assert observer.stats()[1]["tables"]["fc"]["pushes"] == 0

    # the client stays refused, even for shard 0 alone, until it relearns
    with pytest.raises(errors.ShardRestarted):
        client.pull("fc", torch.tensor([0, 2]))
    with pytest.raises(errors.ShardRestarted):
        list(client.scan("fc"))
    client.relearn_incarnations()
    assert client.restore(1) == 1
    reference = ams.connect(local_shards=2, data_dir=procs[0].data_dir)
    assert reference.restore(1) == 1
    ids, grads = push_some(client, seed=2)
    reference.push("fc", ids, grads, lr=0.1)
    assert torch.equal(client.pull("fc", ALL), reference.pull("fc", ALL))
    for c in (client, observer, reference):
        c.close()


def test_a_call_expecting_another_incarnation_is_aborted_before_the_store():
    store = ShardStore(0, 1)
    running = create_server(store)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = pb_grpc.ShardStub(channel)
            reply, call = stub.Stats.with_call(pb.StatsRequest())
            assert len(running.incarnation) == 32 and reply.incarnation == running.incarnation
            assert dict(call.trailing_metadata())[INCARNATION_KEY] == running.incarnation
            spec = pb.TableSpec(name="fc", num_rows=4, dim=2, dtype=pb.FLOAT32,
                                state_dtype=pb.FLOAT32)
            with pytest.raises(grpc.RpcError) as info:
                stub.CreateTable(pb.CreateTableRequest(spec=spec),
                                 metadata=((EXPECT_INCARNATION_KEY, "0" * 32),))
            assert info.value.code() == grpc.StatusCode.ABORTED
            assert dict(info.value.trailing_metadata())[INCARNATION_KEY] == running.incarnation
            assert store.tables == {}
            stub.CreateTable(pb.CreateTableRequest(spec=spec),
                             metadata=((EXPECT_INCARNATION_KEY, running.incarnation),))
            assert list(store.tables) == ["fc"]
    finally:
        running.stop(0)
    again = create_server(ShardStore(0, 1))
    again.stop(0)
    assert again.incarnation != running.incarnation


def test_invalidate_from_another_thread_fences_row_calls_until_relearned():
    client = ams.connect(local_shards=2)
    client.create_table("fc", num_rows=N, dim=D, seed=4)
    rows = client.pull("fc", ALL)
    watcher = threading.Thread(target=client.invalidate, args=("lease of shard 1 lost",))
    watcher.start()
    watcher.join()
    calls = [lambda: client.pull("fc", ALL), lambda: push_some(client, seed=0),
             lambda: client.snapshot(3), lambda: client.neighbors("fc", ALL),
             lambda: next(client.scan_shard("fc", 0))]
    for call in calls:
        with pytest.raises(errors.ShardRestarted, match="lease of shard 1 lost"):
            call()
    assert len(client.stats()) == 2  # diagnostics still answer
    client.relearn_incarnations()
    assert torch.equal(client.pull("fc", ALL), rows)
    client.close()


def test_supervisor_restarts_a_dead_and_a_hung_shard_then_gives_up(shard_cluster):
    procs = shard_cluster(2)
    supervisor = ShardSupervisor(procs, max_restarts=2, hang_timeout=2.0, ready_timeout=60)
    client = ams.connect([p.address for p in procs])
    first = [s["incarnation"] for s in client.stats()]

    procs[1].kill9()
    supervisor.check()
    assert supervisor.restarts == 1

    hung = procs[0].proc
    hung.send_signal(signal.SIGSTOP)  # alive, but answers nothing

    def restarted_twice() -> bool:
        supervisor.check()
        return supervisor.restarts >= 2

    # 120 s: a bound for a broken supervisor, not a measure
    wait_until(restarted_twice, "the stopped shard's restart", 120)
    assert hung.poll() == -signal.SIGKILL
    # both serve again, on the same addresses, as new incarnations
    again = ams.connect([p.address for p in procs])
    now = [s["incarnation"] for s in again.stats()]
    assert now[0] != first[0] and now[1] != first[1]

    procs[1].kill9()
    with pytest.raises(TooManyRestarts, match="shard 1 exited"):
        supervisor.check()
    client.close()
    again.close()


def test_shards_listen_below_the_ephemeral_range_and_restart_on_their_ports(shard_cluster):
    # a port in the ephemeral range can be taken by any outbound connection while its shard is
    # down, and the restart would then fail with "port in use"
    ephemeral_start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    procs = shard_cluster(2)
    ports = [p.port for p in procs]
    assert len(set(ports)) == 2 and all(0 < port < ephemeral_start for port in ports)
    for p in procs:
        p.kill9()
        p.start()
    assert [p.port for p in procs] == ports
    client = ams.connect([p.address for p in procs])
    assert len(client.stats()) == 2
    client.close()

"""A real ``xcls serve scheduler`` with real shards registered through ``--scheduler``, on
127.0.0.1: discovery, a hung shard declared dead (the workers' client invalidated, the shard
fenced off when it wakes), its restart, and bad input over the wire."""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from ams.api import scheduler_pb2 as pb
from ams.api import scheduler_pb2_grpc as pb_grpc
from ams.cluster.lease import LeaseStatus, Role
from ams.cluster.scheduler import SchedulerClient, create_scheduler_server
from ams.errors import ShardRestarted, Unauthenticated, Unavailable
from tests.conftest import free_port, wait_until
from tests.integration.test_cluster import CHECKPOINTS, train_rows, write_config
from tests.integration.test_shard_server import undecodable_request_codes
from xcls.config import ConfigError, load_config
from xcls.run import connect_ams
from xcls.serve_cmd import EXIT_LEASE_LOST
from xcls.shards import Child, spawn, stop

# Short enough for a quick test, long enough that two busy cores never miss three renewals.
TTL_S = 2.0
# Bounds on waiting for something the test caused; never reached when things work.
PATIENCE_S = 60.0


@dataclass
class Scheduler:
    child: Child
    address: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_scheduler(work_dir: Path, num_shards: int = 2, extra: tuple[str, ...] = (),
                    token: str | None = None) -> Scheduler:
    """``xcls serve scheduler`` on a free port, with ``extra`` arguments, once it answers
    (asked with ``token``)."""
    port_file, log_path = work_dir / "scheduler.port", work_dir / "scheduler.log"
    child = spawn("scheduler", [sys.executable, "-m", "xcls", "serve", "scheduler",
                                "--num-shards", str(num_shards), "--lease-ttl", str(TTL_S),
                                "--port-file", str(port_file), *extra], log_path=log_path)
    wait_until(port_file.exists, "the scheduler's port file", PATIENCE_S, [child.proc],
               log_path.read_text)
    address = f"127.0.0.1:{int(port_file.read_text())}"
    with SchedulerClient(address, token=token) as client:
        client.shards()
    return Scheduler(child, address, log_path)


@pytest.fixture
def scheduler(tmp_path) -> Iterator[Scheduler]:
    sched = start_scheduler(tmp_path)
    yield sched
    stop([sched.child], 10)


def test_undecodable_requests_are_invalid_argument(scheduler):
    service = pb.DESCRIPTOR.services_by_name["Scheduler"]
    assert undecodable_request_codes(scheduler.address, service) == {
        (method.name, "INVALID_ARGUMENT") for method in service.methods}
    assert SchedulerClient(scheduler.address).shards().generation >= 0
    assert "Traceback" not in scheduler.log()


def invalidated(client) -> bool:
    """Whether the client refuses calls now (ids 0 and 2 live on shard 0, the one awake)."""
    try:
        client.pull("fc", torch.tensor([0, 2]))
    except ShardRestarted:
        return True
    return False


def test_workers_find_the_shards_and_a_hung_shard_is_declared_dead(scheduler, shard_cluster,
                                                                   tmp_path, monkeypatch):
    procs = shard_cluster(2, ["--scheduler", scheduler.address])
    sched = SchedulerClient(scheduler.address)
    first = sched.wait_for_shards(timeout=PATIENCE_S)
    assert list(first.addresses) == [p.address for p in procs]

    # A training worker: the scheduler's address is all its config names.
    cfg = load_config(None, [f"ams.scheduler={scheduler.address}"])
    at_exit: list = []  # the worker's lease keeper, which it stops (releasing) at exit
    monkeypatch.setattr(atexit, "register", at_exit.append)
    client = connect_ams(cfg, tmp_path, token=None, lease_rank=0)
    (keeper_stop,) = at_exit
    assert [s["incarnation"] for s in client.stats()] == list(first.incarnations)
    client.create_table("fc", num_rows=100, dim=4, seed=1)
    assert not invalidated(client)

    # Shard 1 hangs past its lease: the generation moves on, the worker's client is refused.
    os.kill(procs[1].proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: invalidated(client), "the worker's client to be invalidated",
                   PATIENCE_S)
        lost = sched.shards()
        assert lost.generation > first.generation
        assert lost.missing() == [1] and lost.addresses[0] == procs[0].address
        assert "lease_expired role=shard slot=1" in scheduler.log()
        assert "generation moved" in keeper_stop.__self__.reason
    finally:
        os.kill(procs[1].proc.pid, signal.SIGCONT)
    # Woken, it learns its lease is gone and stops serving; shard 0 serves on.
    assert procs[1].proc.wait(PATIENCE_S) == EXIT_LEASE_LOST
    assert "fenced" in procs[1].log()
    assert procs[0].proc.poll() is None

    # Its supervisor starts a new incarnation: the map is whole again, one generation on.
    procs[1].start()
    wait_until(lambda: sched.shards().complete, "the restarted shard to register", PATIENCE_S)
    back = sched.shards()
    assert back.addresses == first.addresses
    assert back.incarnations[0] == first.incarnations[0]
    assert back.incarnations[1] not in ("", first.incarnations[1])
    assert back.generation > lost.generation
    # The worker, still alive, kept its lease until it leaves.
    keeper_stop()
    assert "lease_released role=worker slot=0" in scheduler.log()
    assert "lease_expired role=worker" not in scheduler.log()
    sched.close()
    client.close()


def test_a_torchrun_job_through_the_scheduler_rolls_back_past_a_hung_shard(
        scheduler, shard_cluster, glyphs_small, tmp_path):
    """The whole multi-host path on one host: shards register with the scheduler, a 2-rank
    torchrun job finds them there; shard 1 hangs past its lease, the workers exit for a
    rollback, the fenced shard is started again from the newest snapshot (what a supervisor,
    compose's restart policy or an operator does), and torchrun's restart resumes and
    finishes the job."""
    procs = shard_cluster(2, ["--scheduler", scheduler.address, "--restore", "latest"])
    out = tmp_path / "run"
    config = write_config(glyphs_small, out, tmp_path / "exp.toml", max_steps=30)
    log_path = tmp_path / "workers.log"
    with open(log_path, "wb") as log:
        workers = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", "2", "--max-restarts", "2", "-m", "xcls", "train", str(config),
             "--set", f"ams.scheduler={scheduler.address}"],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    try:
        wait_until((out / CHECKPOINTS / f"step-{10:012d}" / "worker.pt").exists,
                   "the first periodic checkpoint", PATIENCE_S, [workers], log_path.read_text)
        os.kill(procs[1].proc.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: "lease_expired role=shard slot=1" in scheduler.log(),
                       "the hung shard's lease to expire", PATIENCE_S)
        finally:
            os.kill(procs[1].proc.pid, signal.SIGCONT)
        assert procs[1].proc.wait(PATIENCE_S) == EXIT_LEASE_LOST
        procs[1].start()
        code = workers.wait(240)
    finally:
        if workers.poll() is None:
            workers.kill()
            workers.wait()
    text = log_path.read_text()
    assert code == 0, text
    assert "rollback_needed" in text
    (back_to,) = re.findall(r"rollback restart=\d+ to_step=(\d+)", text)
    assert int(back_to) in (10, 20), text
    assert int(train_rows(out)[-1]["step"]) == 30
    assert "restored step=" in procs[1].log()
    # both ranks held a worker lease and gave it back at the end
    assert {"0", "1"} <= set(re.findall(r"lease_released role=worker slot=(\d+)",
                                        scheduler.log()))


@pytest.fixture(scope="module")
def idle_scheduler(tmp_path_factory) -> Iterator[Scheduler]:
    """A scheduler nobody registers with (its tests leave it so)."""
    sched = start_scheduler(tmp_path_factory.mktemp("scheduler"))
    yield sched
    stop([sched.child], 10)


@pytest.fixture
def raw_scheduler(idle_scheduler) -> Iterator[pb_grpc.SchedulerStub]:
    with grpc.insecure_channel(idle_scheduler.address) as channel:
        yield pb_grpc.SchedulerStub(channel)


def _register(**fields: object) -> pb.RegisterRequest:
    request = {"role": pb.ROLE_SHARD, "slot": 0, "address": "127.0.0.1:7001",
               "incarnation": "abc", **fields}
    return pb.RegisterRequest(**request)


def test_a_keeper_whose_slot_was_taken_while_the_scheduler_was_away_loses_its_lease():
    """The scheduler restarts, and another incarnation (a shard's replacement) rejoins for a
    slot first: the keeper of the earlier holder, renewing a lease of the scheduler before,
    rejoins, is refused and loses its lease (a shard then exits), and the slot stays taken."""
    port = free_port()
    first = create_scheduler_server(1, lease_ttl=9.0, port=port)
    lost: list[str] = []
    with SchedulerClient(f"127.0.0.1:{port}") as client, \
            SchedulerClient(f"127.0.0.1:{port}") as replacement:
        keeper = client.keep_lease(Role.SHARD, 0, "127.0.0.1:7001", "inc-x", lost.append)
        first.stop(grace=0)
        second = create_scheduler_server(1, lease_ttl=9.0, port=port)
        try:  # the keeper renews every 3 s: the replacement rejoins well before
            replacement.register(Role.SHARD, 0, "127.0.0.1:7002", "inc-y", rejoin=True)
            wait_until(lambda: lost, "the keeper to lose its lease", PATIENCE_S)
            assert "inc-y holds the slot: it was replaced" in lost[0]
            assert replacement.shards().incarnations == ("inc-y",)
        finally:
            keeper.stop()  # its lease was lost: nothing is released
            second.stop(grace=0)


@pytest.mark.parametrize("method, request_", [
    ("Register", _register(role=pb.ROLE_UNSPECIFIED)),
    ("Register", _register(role=7)),
    ("Register", _register(slot=-1)),
    ("Register", _register(slot=2)),
    ("Register", _register(address="h" * 10_000 + ":1")),
    ("Register", _register(address="127.0.0.1")),
    ("Register", _register(incarnation="")),
    ("Register", _register(incarnation="x" * 10_000)),
    ("Renew", pb.RenewRequest(lease_id="x" * 10_000)),
    ("Renew", pb.RenewRequest()),
    ("Release", pb.ReleaseRequest(lease_id="")),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_input_is_invalid_argument_and_changes_nothing(raw_scheduler, method, request_):
    with pytest.raises(grpc.RpcError) as info:
        getattr(raw_scheduler, method)(request_, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    shards = raw_scheduler.Shards(pb.ShardsRequest(), timeout=10)
    assert (list(shards.addresses), shards.generation, shards.complete) == (["", ""], 0, False)


def test_unknown_lease_is_answered_not_refused(raw_scheduler):
    reply = raw_scheduler.Renew(pb.RenewRequest(lease_id="an-earlier-scheduler-1"), timeout=10)
    assert reply.status == pb.LEASE_UNKNOWN


def test_wait_for_shards_names_the_missing_slots(idle_scheduler):
    with SchedulerClient(idle_scheduler.address) as client:
        with pytest.raises(Unavailable, match=r"shards \[0, 1\] not registered"):
            client.wait_for_shards(timeout=0.5)


@pytest.mark.parametrize("args, message", [
    (["--num-shards", "2", "--host", "0.0.0.0"], "refusing"),
    (["--num-shards", "0"], "--num-shards"),
    (["--num-shards", "2", "--lease-ttl", "0"], "--lease-ttl"),
    (["--num-shards", "2", "--lease-ttl", "inf"], "lease TTL inf s must be finite"),
    # a lease the members cannot renew in time would fence every shard at once
    (["--num-shards", "2", "--lease-ttl", "1e-9"],
     "--lease-ttl: lease TTL 1e-09 s must be finite and at least 1 s: members renew every "
     "TTL/3"),
    (["--num-shards", "2", "--lease-ttl", "0.9"], "at least 1 s"),
    (["--num-shards", "2", "--require-auth"], "--require-auth: give --auth-token-file"),
    (["--num-shards", "2", "--grace", "-1"], "--grace -1.0"),
    (["--num-shards", "2", "--port-file", "/nonexistent/dir/port"], "is not a directory"),
    (["--num-shards", "2", "--port-file", "/tmp"], "--port-file /tmp is a directory"),
    # every shard map would list a trillion slots
    (["--num-shards", "1000000000000"], "--num-shards 1000000000000 must be in 1..1048576"),
    (["--num-shards", "2", "--auth-token-file", "/dev/zero"], "not a secret"),
])
def test_scheduler_refuses_bad_options(args, message):
    out = subprocess.run([sys.executable, "-m", "xcls", "serve", "scheduler", *args],
                         capture_output=True, text=True, timeout=PATIENCE_S)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


def test_with_require_auth_no_caller_without_the_token_takes_a_shards_slot(tmp_path):
    """``--require-auth``: the scheduler starts only with a token, and a caller without it
    (anyone on the host, loopback or not) can neither register for a shard's slot, which
    would fence the shard that holds it, nor release its lease, nor read the shard map."""
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    sched = start_scheduler(tmp_path, 1, ("--require-auth", "--auth-token-file",
                                          str(token_file)), token="s3cret")
    try:
        with SchedulerClient(sched.address, token="s3cret") as member, \
                SchedulerClient(sched.address) as stranger:
            grant = member.register(Role.SHARD, 0, "127.0.0.1:7001", "real")
            for call in (lambda: stranger.register(Role.SHARD, 0, "127.0.0.1:7009", "impostor"),
                         lambda: stranger.release(grant.lease_id), stranger.shards):
                with pytest.raises(Unauthenticated):
                    call()
            held = member.shards()
            assert (held.incarnations, held.generation) == (("real",), 0)
            assert member.renew(grant.lease_id)[0] is LeaseStatus.ALIVE
    finally:
        stop([sched.child], 10)


@pytest.mark.parametrize("overrides, message", [
    (["ams.scheduler=127.0.0.1:7000", "ams.addresses=127.0.0.1:7001"], "leave ams.addresses"),
    (["ams.scheduler=127.0.0.1"], "expected host:port"),
    (["ams.scheduler=127.0.0.1:99999"], "expected host:port"),
])
def test_config_refuses_a_bad_scheduler(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)

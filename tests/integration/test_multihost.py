"""Multi-host for real: every host a Linux network namespace with an address of its own on a
bridge (a private /24 in a namespace of the test's own: no traffic leaves the machine), the
roles started as an operator starts them on separate machines. The scheduler on one host,
shards on two through ``scripts/launch_server.sh`` (token and TLS, a certificate naming their
addresses), two workers on two more through ``scripts/launch_worker.sh`` (torchrun's c10d
rendezvous across them). A glyph job trains to a top-1 in AMS placement, through one shard
host's link cut and restored (the workers roll back and finish), and in collective placement
(the ranks serve their slices on their hosts' addresses).

Needs root (``ip netns add``); where namespaces cannot be made the tests skip, saying why."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.integration.conftest import our_processes
from tests.integration.test_cluster import write_config
from xcls.serve_cmd import EXIT_LEASE_LOST
from xcls.shards import Child, spawn, stop

ROOT = Path(__file__).resolve().parents[2]
# The hosts and their addresses: 10.203.0.0/24 exists only on the test's bridge, so it cannot
# collide with a network of the machine's.
SUBNET = "10.203.0"
SCHEDULER_PORT, SHARD_PORT, RDZV_PORT = 7000, 7001, 29400
# Short enough for a quick test, long enough that two busy cores never miss three renewals.
LEASE_TTL_S = 3.0
# Bounds on waiting for something the test caused; never reached when things work.
PATIENCE_S = 240.0
# Chance level of the glyph set's 120 classes, in percent.
CHANCE = 100 / 120
# Namespace names are this machine's: the process id and a count keep two tests' apart.
_networks = itertools.count()


class Network:
    """Hosts as network namespaces named ``<prefix>-<host>``, each with ``eth0`` at
    ``SUBNET.<n>/24`` and loopback, all on one bridge in the namespace ``<prefix>-net``.
    ``close`` stops every process started with ``start`` and deletes every namespace."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.namespaces: list[str] = []
        self.children: list[Child] = []
        self.bridge = self._namespace("net")
        self._ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        self._ip("-n", self.bridge, "link", "set", "dev", "br0", "up")
        self.addresses: dict[str, str] = {}

    @staticmethod
    def _ip(*args: str) -> None:
        out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise OSError(f"ip {' '.join(args)}: {out.stderr.strip()}")

    def _namespace(self, name: str) -> str:
        ns = f"{self.prefix}-{name}"
        self._ip("netns", "add", ns)
        self.namespaces.append(ns)
        self._ip("-n", ns, "link", "set", "dev", "lo", "up")
        return ns

    def add_host(self, name: str) -> str:
        """A new host ``name``; returns its address."""
        ns = self._namespace(name)
        address = f"{SUBNET}.{len(self.addresses) + 1}"
        port = f"p{len(self.addresses) + 1}"  # its end on the bridge (15 characters at most)
        self._ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", port,
                 "netns", self.bridge)
        self._ip("-n", self.bridge, "link", "set", "dev", port, "master", "br0")
        self._ip("-n", self.bridge, "link", "set", "dev", port, "up")
        self._ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        self._ip("-n", ns, "link", "set", "dev", "eth0", "up")
        self.addresses[name] = address
        return address

    def link(self, host: str, up: bool) -> None:
        """Cut (or restore) ``host``'s only link, from inside the host, as a pulled cable or
        a dead switch port would."""
        self._ip("-n", f"{self.prefix}-{host}", "link", "set", "dev", "eth0",
                 "up" if up else "down")

    def start(self, host: str, name: str, argv: list[str], log_path: Path) -> Child:
        """``argv`` on ``host`` (cwd: the repository, as a clone on that host), output to
        ``log_path``."""
        child = spawn(name, ["ip", "netns", "exec", f"{self.prefix}-{host}", "env",
                             f"PYTHON={sys.executable}", *argv], log_path=log_path)
        self.children.append(child)
        return child

    def close(self) -> None:
        stop(self.children, 30)
        for ns in reversed(self.namespaces):
            # a process that outlived its launcher would keep the namespace alive
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                  text=True).stdout.split()
            for pid in pids:
                os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def network(no_orphans) -> Iterator[Network]:
    """A network of the test's own, deleted with every process on it after the test."""
    if shutil.which("ip") is None:
        pytest.skip("no 'ip' command (Debian: apt-get install iproute2)")
    prefix = f"xcls{os.getpid()}n{next(_networks)}"
    try:
        net = Network(prefix)
    except OSError as e:
        subprocess.run(["ip", "netns", "del", f"{prefix}-net"], capture_output=True)
        pytest.skip(f"network namespaces cannot be made here: {e}")
    try:
        yield net
    finally:
        net.close()


def start_workers(net: Network, tmp: Path, config: Path, placement: list[str]) -> list[Child]:
    """``launch_worker.sh`` on both worker hosts: one worker each, a c10d rendezvous on
    worker0's address, as an operator types it on each machine."""
    endpoint = f"{net.addresses['worker0']}:{RDZV_PORT}"
    return [net.start(host, host, [
        "bash", str(ROOT / "scripts" / "launch_worker.sh"), "--nnodes", "2",
        "--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-id", "multihost",
        *placement, str(config)], tmp / f"{host}.log")
        for host in ("worker0", "worker1")]


def summary_line(logs: list[str]) -> str:
    """Rank 0's last line, on whichever host the rendezvous gave rank 0."""
    lines = [m for text in logs for m in re.findall(r"^trained \d+ steps.*$", text, re.M)]
    assert len(lines) == 1, logs
    return lines[0]


def test_ams_placement_across_hosts_survives_a_cut_link(network, glyphs_small, tmp_path):
    net = network
    for host in ("sched", "shard0", "shard1", "worker0", "worker1"):
        net.add_host(host)
    scheduler = f"{net.addresses['sched']}:{SCHEDULER_PORT}"
    token = tmp_path / "token"
    token.write_text(os.urandom(16).hex())
    token.chmod(0o600)
    key, cert = tmp_path / "shard-key.pem", tmp_path / "shard-cert.pem"
    sans = ",".join(f"IP:{net.addresses[h]}" for h in ("shard0", "shard1"))
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=xcls shards", "-addext", f"subjectAltName={sans}",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)

    sched = net.start("sched", "scheduler", [
        sys.executable, "-m", "xcls", "serve", "scheduler", "--num-shards", "2", "--host",
        "0.0.0.0", "--port", str(SCHEDULER_PORT), "--auth-token-file", str(token),
        "--lease-ttl", str(LEASE_TTL_S)], tmp_path / "scheduler.log")

    def shard_cmd(i: int) -> list[str]:
        return ["bash", str(ROOT / "scripts" / "launch_server.sh"), "--scheduler", scheduler,
                "--advertise", net.addresses[f"shard{i}"], "--tls-cert", str(cert),
                "--tls-key", str(key), "--auth-token-file", str(token), str(i), "2",
                str(SHARD_PORT), str(tmp_path / "ams")]

    shards = [net.start(f"shard{i}", f"shard-{i}", shard_cmd(i), tmp_path / f"shard{i}.log")
              for i in range(2)]
    out = tmp_path / "run"
    # long enough that the cut, right after step 10, always comes before the end
    config = write_config(glyphs_small, out, tmp_path / "exp.toml", max_steps=60,
                          test=str(glyphs_small / "test"))
    workers = start_workers(net, tmp_path, config, [
        "--scheduler", scheduler, "--auth-token-file", str(token), "--tls-ca", str(cert)])

    def log(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text(errors="replace")

    # training is past its first periodic checkpoint: cut shard 1's host off
    wait_until((out / "checkpoints" / f"step-{10:012d}" / "worker.pt").exists,
               "the first periodic checkpoint", PATIENCE_S,
               [c.proc for c in (sched, *shards, *workers)])
    net.link("shard1", up=False)
    wait_until(lambda: "lease_expired role=shard slot=1" in log("scheduler"),
               "the cut-off shard's lease to expire", PATIENCE_S,
               [c.proc for c in (sched, shards[0], *workers)])
    net.link("shard1", up=True)
    # back on the network, it learns the cluster gave it up and stops serving; its
    # supervisor (systemd, an operator) starts it again, from the newest snapshot
    assert shards[1].proc.wait(PATIENCE_S) == EXIT_LEASE_LOST, log("shard1")
    assert "fenced" in log("shard1")
    shards[1] = net.start("shard1", "shard-1", shard_cmd(1), tmp_path / "shard1.log")
    for worker in workers:
        assert worker.proc.wait(PATIENCE_S) == 0, log(worker.name)

    logs = [log("worker0"), log("worker1")]
    line = summary_line(logs)
    assert line.startswith("trained 60 steps"), line
    assert float(re.search(r"test top-1 ([\d.]+)%", line).group(1)) > CHANCE, line
    assert any("rollback_needed" in text for text in logs), logs
    # every restart (the cut's; a lease missed on a loaded machine would add one) went back
    # to a checkpoint and resumed from it
    back_to = {int(s) for text in logs for s in re.findall(r"rollback restart=\d+ "
                                                           r"to_step=(\d+)", text)}
    assert back_to and max(back_to) >= 10, logs
    assert all(f"resumed step={step}" in "".join(logs) for step in back_to), logs
    assert "restored step=" in log("shard1")
    # every member came over the network: shards at their own addresses, with TLS and the
    # token; both ranks registered from their hosts
    for i in range(2):
        assert re.search(r"listening shard=\d/2 host=0\.0\.0\.0 .*tls=True auth=True",
                         log(f"shard{i}")), log(f"shard{i}")
    assert {"0", "1"} <= set(re.findall(r"lease_released role=worker slot=(\d+)",
                                        log("scheduler")))
    stop([sched, *shards], 30)
    assert our_processes(tmp_path) == []


def test_collective_placement_across_hosts(network, glyphs_small, tmp_path):
    net = network
    for host in ("worker0", "worker1"):
        net.add_host(host)
    out = tmp_path / "run"
    config = write_config(glyphs_small, out, tmp_path / "exp.toml", max_steps=40,
                          test=str(glyphs_small / "test"))
    workers = start_workers(net, tmp_path, config, ["--collective"])
    for worker in workers:
        assert worker.proc.wait(PATIENCE_S) == 0, \
            (tmp_path / f"{worker.name}.log").read_text(errors="replace")
    logs = [(tmp_path / f"{w.name}.log").read_text(errors="replace") for w in workers]
    line = summary_line(logs)
    assert line.startswith("trained 40 steps"), line
    assert float(re.search(r"test top-1 ([\d.]+)%", line).group(1)) > CHANCE, line
    # each rank served its slice on its host's address, where the other rank reached it
    slices = {m for text in logs for m in re.findall(r"collective_slice rank=\d world=2 "
                                                     r"address=([\d.]+):\d+", text)}
    assert slices == {net.addresses["worker0"], net.addresses["worker1"]}, logs
    assert our_processes(tmp_path) == []

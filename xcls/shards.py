"""Local ``xcls serve shard`` processes: the one way shards are started from Python.

``shard_processes(n, ...)`` starts shards 0..n-1 of n (``python -m xcls serve shard``) side by
side, waits until every one answers its gRPC health check, yields them, and on exit stops them
in order: SIGTERM to all, then a wait for each, SIGKILL after ``stop_timeout``. ``xcls cluster
up``, the integration tests, the benchmarks and the examples all start shards through it; the
shards serve plaintext on 127.0.0.1 (the TLS and multi-host tests start ``xcls serve shard``
as ``scripts/launch_server.sh`` does).

``ShardSupervisor`` restarts a shard that exits or hangs, on its port, up to a restart budget.
Ports left to us come from outside the kernel's ephemeral range (``restartable_ports``), where
no outbound connection can take one while its shard is down.

Every child runs in a session of its own, so a Ctrl-C in the terminal reaches the parent alone
and the order in which things stop stays the parent's. ``spawn`` and ``stop`` are the process
helpers underneath, which ``xcls cluster up`` also uses for its training and slow-gear roles.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from xcls.parent import PARENT_PID_ENV
from xcls.stop_request import StopRequest

log = logging.getLogger(__name__)

# Where shards started from Python listen: xcls cluster up runs every role on this machine
# (shards on several hosts are started by scripts/launch_server.sh, not from here).
HOST = "127.0.0.1"
POLL_S = 0.05
# Seconds a stopped child's output relay may take to pass on what it still had to say.
RELAY_DRAIN_S = 5.0
# How much of a failed shard's log file its start error quotes.
LOG_TAIL_CHARS = 4000
# How often a supervisor asks each shard's health, and how long one answer may take (a busy
# shard still answers within it; a stopped one never does).
HEALTH_PROBE_S = 1.0
HEALTH_TIMEOUT_S = 2.0
# Where restartable ports are drawn from when the kernel does not say where its ephemeral range
# starts (Linux's default start; macOS's range begins higher still).
EPHEMERAL_START = 32768
LOWEST_RESTARTABLE_PORT = 10000


class ShardStartError(RuntimeError):
    """A shard exited, or did not answer its health check in time, while starting."""


class ShardStartTimeout(ShardStartError):
    """A shard was not serving within the ready timeout."""


class StartCancelled(Exception):
    """The caller's ``cancel`` was set while shards were starting."""


# ---- child processes ---------------------------------------------------------------------


@dataclass
class Child:
    """One child process; ``relay`` copies its output to our stderr. ``signalled``: we sent
    it a signal, so a non-zero exit code is no failure of its own; ``reported``: ``stop`` has
    logged its exit code."""

    name: str
    proc: subprocess.Popen
    relay: threading.Thread | None = None
    signalled: bool = False
    reported: bool = False


def _relay(stream: IO[bytes], prefix: str) -> None:
    """Copy a child's output to our stderr line by line, each line behind ``prefix``."""
    for line in iter(stream.readline, b""):
        sys.stderr.write(f"{prefix}{line.decode(errors='replace')}")
        sys.stderr.flush()
    stream.close()


def spawn(name: str, cmd: Sequence[str], *, prefix: str | None = None,
          log_path: Path | None = None) -> Child:
    """Start ``cmd`` in a session of its own, with our environment. Its output is appended to
    ``log_path``; else relayed to our stderr behind ``prefix``; else it writes to our
    stdout/stderr directly."""
    log.debug("spawn role=%s cmd=%s", name, " ".join(cmd))
    # the child ends with us (xcls.parent), unless this thread may end before the process
    # does: the kernel's parent-death signal follows the thread that started the child
    ours = {PARENT_PID_ENV: str(os.getpid())} \
        if threading.current_thread() is threading.main_thread() else {}
    environ = {**os.environ, **ours}
    if log_path is not None:
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=environ)
        return Child(name, proc)
    pipe = subprocess.PIPE if prefix is not None else None
    proc = subprocess.Popen(cmd, stdout=pipe, stderr=subprocess.STDOUT if pipe else None,
                            start_new_session=True, env=environ)
    child = Child(name, proc)
    if prefix is not None:
        child.relay = threading.Thread(target=_relay, args=(proc.stdout, prefix), daemon=True)
        child.relay.start()
    return child


def _child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc; empty where that is unavailable)."""
    found: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        return []
    return found


def stop(children: Sequence[Child], timeout: float, *, signal_children: bool = False) -> None:
    """SIGTERM every live child, then wait for each in turn (SIGKILL once ``timeout`` seconds
    have passed since the signals) and log its exit code, as a warning for one that failed
    before it was asked to stop. Children already stopped by an earlier call are skipped.

    ``signal_children``: signal the processes each child started instead of the child itself,
    for a launcher that exits cleanly once they do. Past the timeout a child's own processes
    get SIGKILL with it: torchrun starts its workers in sessions of their own, and they would
    outlive it.
    """
    children = [c for c in children if not c.reported]
    for child in children:
        if child.proc.poll() is None:
            pids = _child_pids(child.proc.pid) if signal_children else []
            for pid in pids or [child.proc.pid]:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            child.signalled = True
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stuck = _child_pids(child.proc.pid)
            log.error("stop_timeout role=%s pid=%d children=%s; sending SIGKILL", child.name,
                      child.proc.pid, stuck)
            for pid in stuck:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            child.proc.kill()
            child.proc.wait()
        if child.relay is not None:
            # what the child still had to say; a process of its own that still holds the
            # pipe (a DataLoader worker on its way out) must not hold the stop
            child.relay.join(RELAY_DRAIN_S)
        failed = child.proc.returncode != 0 and not child.signalled
        log.log(logging.WARNING if failed else logging.INFO, "stopped role=%s exit_code=%d",
                child.name, child.proc.returncode)
        child.reported = True


# ---- shards ------------------------------------------------------------------------------


def shard_serving(address: str, *, timeout: float = 2.0) -> bool:
    """Whether the plaintext shard at ``address`` answers its gRPC health check with SERVING
    (health checks need no auth token)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from ams.limits import SHARD_SERVICE_NAME

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SHARD_SERVICE_NAME), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def restartable_ports(host: str, count: int) -> list[int]:
    """``count`` distinct ports free on ``host`` now, drawn at random from below the kernel's
    ephemeral range.

    A restarted shard must get its port back. A port the OS picks (a bind to port 0) lies in
    the ephemeral range, from which every outbound connection on this host also takes its local
    port: while the shard is down, a client's connection can take that port and hold it for as
    long as it lives, and the restart fails with "port in use". Below the range only explicit
    binds hand ports out.
    """
    try:
        start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        start = EPHEMERAL_START
    candidates = range(LOWEST_RESTARTABLE_PORT, max(start, LOWEST_RESTARTABLE_PORT + 1000))
    family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    picked: list[int] = []
    # SystemRandom: side-by-side pickers (test workers, several clusters) must not share a seed
    for port in random.SystemRandom().sample(candidates, len(candidates)):
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        picked.append(port)
        if len(picked) == count:
            return picked
    raise OSError(f"no {count} free ports on {host} in {candidates.start}..{candidates.stop - 1}")


class ShardProcess:
    """Shard ``shard_id`` of ``num_shards`` as an ``xcls serve shard`` process on ``HOST``;
    ``address`` once it is serving. It can be killed and started again on the same port
    (``kill9``, ``start``), as a crash and a restart would; ``start`` and ``terminate`` take
    the ``ready_timeout`` and ``stop_timeout`` of the ``shard_processes`` that made it."""

    def __init__(self, shard_id: int, num_shards: int, *, port: int, data_dir: Path | None,
                 port_file: Path, xcls_flags: Sequence[str], options: Sequence[str],
                 log_path: Path | None, ready_timeout: float, stop_timeout: float) -> None:
        self.shard_id, self.num_shards = shard_id, num_shards
        self.port, self.data_dir = port, data_dir
        self.port_file, self.log_path = port_file, log_path
        self.xcls_flags, self.options = list(xcls_flags), list(options)
        self.ready_timeout, self.stop_timeout = ready_timeout, stop_timeout
        self.child: Child | None = None

    @property
    def name(self) -> str:
        return f"shard-{self.shard_id}"

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def proc(self) -> subprocess.Popen:
        """The running (or last) process; a test may signal it directly."""
        if self.child is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.child.proc

    def launch(self) -> None:
        """Start the process (on the port it had, after a restart); see ``wait_serving``."""
        self.port_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "xcls", *self.xcls_flags, "serve", "shard", "--shard-id",
               str(self.shard_id), "--num-shards", str(self.num_shards), "--host", HOST,
               "--port", str(self.port), "--port-file", str(self.port_file), *self.options]
        prefix = None if self.log_path is not None else f"[{self.name}] "
        self.child = spawn(self.name, cmd, prefix=prefix, log_path=self.log_path)

    def wait_serving(self, timeout: float, cancel: StopRequest | None = None, *,
                     since: float | None = None) -> None:
        """Return once the shard answers SERVING; ShardStartError if it exits first,
        ShardStartTimeout ``timeout`` seconds after ``since`` (a ``time.monotonic()``; default:
        now), StartCancelled once ``cancel`` is set."""
        deadline = (time.monotonic() if since is None else since) + timeout
        while True:
            if cancel is not None and cancel.is_set():
                raise StartCancelled
            if self.proc.poll() is not None:
                raise ShardStartError(f"shard {self.shard_id} exited with code "
                                      f"{self.proc.returncode} while starting"
                                      f"{self._output(' (its output is above)')}")
            if time.monotonic() > deadline:
                raise ShardStartTimeout(f"shard {self.shard_id} was not serving after "
                                        f"{timeout:.0f}s{self._output('')}")
            try:
                port = int(self.port_file.read_text())
            except FileNotFoundError:  # not serving yet, or stopped again: the shard removes it
                port = None
            if port is not None and shard_serving(f"{HOST}:{port}"):
                self.port = port
                return
            if cancel is not None:
                cancel.wait(POLL_S)
            else:
                time.sleep(POLL_S)

    def start(self) -> ShardProcess:
        """``launch``, then ``wait_serving`` up to ``ready_timeout`` seconds."""
        self.launch()
        self.wait_serving(self.ready_timeout)
        return self

    def kill9(self) -> None:
        """SIGKILL, as a crash would (no graceful shutdown, nothing flushed)."""
        self.proc.kill()
        self.proc.wait(10)
        self.child.signalled = True

    def terminate(self) -> int:
        """Stop it (SIGTERM, SIGKILL after ``stop_timeout`` seconds); its exit code."""
        stop([self.child], self.stop_timeout)
        return self.proc.returncode

    def log(self) -> str:
        """What it wrote to its log file ("" when its output is relayed instead)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def _output(self, relayed: str) -> str:
        """What an error says of this shard's output: ``relayed`` when it went to our stderr,
        else the end of its log file."""
        if self.log_path is None:
            return relayed
        return f"; the end of {self.log_path}:\n{self.log()[-LOG_TAIL_CHARS:]}"


class TooManyRestarts(RuntimeError):
    """A shard failed once more after the supervisor's restart budget was used up."""


class ShardSupervisor:
    """Keeps shard processes serving: a shard that exits, or that answers no health check for
    ``hang_timeout`` seconds (it is SIGKILLed first), is started again on its port, empty or
    as its options say (e.g. ``--restore latest``). ``max_restarts`` restarts in all; the next
    failure raises TooManyRestarts. ``ready_timeout`` and ``cancel`` apply to each restart as
    in ``ShardProcess.wait_serving``.

    A restarted shard is a new incarnation: clients that knew the old one are refused
    (``ams.errors.ShardRestarted``), and the training workers roll back to their newest
    checkpoint, which puts every shard at that checkpoint's step again.
    """

    def __init__(self, shards: Sequence[ShardProcess], *, max_restarts: int,
                 hang_timeout: float, ready_timeout: float,
                 cancel: StopRequest | None = None) -> None:
        self.shards = list(shards)
        self.max_restarts, self.hang_timeout = max_restarts, hang_timeout
        self.ready_timeout, self.cancel = ready_timeout, cancel
        self.restarts = 0
        now = time.monotonic()
        self._last_answer = {s.shard_id: now for s in self.shards}
        self._next_probe = now

    def check(self) -> None:
        """Restart every shard that exited or hung; call it every poll (the health checks
        themselves go out at most every ``HEALTH_PROBE_S`` seconds)."""
        probe = time.monotonic() >= self._next_probe
        if probe:
            self._next_probe = time.monotonic() + HEALTH_PROBE_S
        for shard in self.shards:
            failure = self._failure(shard, probe)
            if failure is not None:
                self._restart(shard, failure)

    def _failure(self, shard: ShardProcess, probe: bool) -> str | None:
        """Why ``shard`` needs a restart (a hung one is killed here), or None."""
        if shard.proc.poll() is not None:
            return f"exited with code {shard.proc.returncode}"
        if not probe:
            return None
        now = time.monotonic()
        if shard_serving(shard.address, timeout=min(HEALTH_TIMEOUT_S, self.hang_timeout)):
            self._last_answer[shard.shard_id] = now
            return None
        silent = now - self._last_answer[shard.shard_id]
        if silent < self.hang_timeout:
            return None
        shard.kill9()
        return f"hung (no health answer for {silent:.0f}s; killed)"

    def _restart(self, shard: ShardProcess, failure: str) -> None:
        log.error("shard_failed shard=%d restarts=%d reason=%s", shard.shard_id, self.restarts,
                  failure)
        if self.restarts >= self.max_restarts:
            raise TooManyRestarts(f"shard {shard.shard_id} {failure}, and all "
                                  f"{self.max_restarts} restarts allowed (--max-restarts) were "
                                  "used; stopping")
        self.restarts += 1
        shard.launch()
        shard.wait_serving(self.ready_timeout, self.cancel)
        self._last_answer[shard.shard_id] = time.monotonic()
        log.warning("shard_restarted shard=%d restarts=%d address=%s", shard.shard_id,
                    self.restarts, shard.address)


@contextmanager
def shard_processes(num_shards: int, *, data_dir: Path | None = None,
                    ports: Sequence[int] | None = None, token_file: Path | str | None = None,
                    extra_args: Sequence[str] = (), xcls_flags: Sequence[str] = (),
                    log_dir: Path | None = None,
                    ready_timeout: float = 60.0, stop_timeout: float = 30.0,
                    cancel: StopRequest | None = None,
                    metrics_ports: Sequence[int] | None = None) -> Iterator[list[ShardProcess]]:
    """Shards 0..``num_shards``-1 as processes on ``HOST``, serving; stopped in order on exit.

    data_dir: their snapshot directory (``--data-dir``; None: they cannot snapshot); ports:
    shard i listens on ``ports[i]`` (None: ``restartable_ports``); token_file: the shared
    secret clients must send; extra_args: more ``xcls serve shard`` options (e.g.
    ``["--restore", "latest"]``; no TLS: the health checks are plaintext); xcls_flags: global
    ``xcls`` options (e.g. ``["-q"]``); log_dir: append each shard's output to
    ``shard-I-of-N.log`` there (None: relay it to our stderr, each line behind
    ``[shard-I]``). ready_timeout: seconds for all of them to start serving
    (ShardStartTimeout); a shard that exits while starting raises ShardStartError, and a set
    ``cancel`` StartCancelled (the shards started so far are stopped first). stop_timeout:
    seconds to wait after SIGTERM before SIGKILL.
    metrics_ports: shard i serves Prometheus metrics on ``metrics_ports[i]`` (None: none).
    """
    if ports is not None and len(ports) != num_shards:
        raise ValueError(f"ports: {len(ports)} given for {num_shards} shards")
    options: list[str] = []
    if data_dir is not None:
        options += ["--data-dir", str(data_dir)]
    if token_file:
        options += ["--auth-token-file", str(token_file)]
    options += extra_args
    with tempfile.TemporaryDirectory(prefix="xcls-shards-") as port_dir:
        if ports is None:
            ports = restartable_ports(HOST, num_shards)
        shards = [ShardProcess(s, num_shards, port=ports[s],
                               data_dir=data_dir, port_file=Path(port_dir) / f"port-{s}",
                               xcls_flags=xcls_flags, ready_timeout=ready_timeout,
                               stop_timeout=stop_timeout,
                               options=[*options, "--metrics-port", str(metrics_ports[s])]
                               if metrics_ports else options,
                               log_path=log_dir / f"shard-{s}-of-{num_shards}.log"
                               if log_dir is not None else None)
                  for s in range(num_shards)]
        try:
            if data_dir is not None:
                data_dir.mkdir(parents=True, exist_ok=True)
            for shard in shards:  # boot side by side, then wait for each
                shard.launch()
            since = time.monotonic()
            for shard in shards:
                shard.wait_serving(ready_timeout, cancel, since=since)
            log.info("shards_serving addresses=%s data_dir=%s",
                     ",".join(s.address for s in shards), data_dir)
            yield shards
        finally:
            stop([s.child for s in shards if s.child is not None], stop_timeout)

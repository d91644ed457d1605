"""The scheduler of a multi-host job over gRPC: its servicer and server, and its client.

Shards and workers register with it and keep leases (``ams.cluster.lease`` holds every rule);
workers find the shards through it. A lease that expires, a hung member as much as a dead one, moves
the generation on; a worker's lease keeper then invalidates its AMS client, so the trainer rolls
back to its newest checkpoint, and a shard whose own lease is gone stops serving.

    sched = SchedulerClient("10.0.0.2:7000")
    shard_map = sched.wait_for_shards(timeout=300)          # every slot held
    client = ams.connect(shard_map.addresses)
    keeper = sched.keep_lease(Role.WORKER, rank, host, uuid.uuid4().hex,
                              on_lost=client.invalidate, expect=shard_map)
    ...                                                     # train; keeper.stop() at exit
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health

from ams.api import scheduler_pb2 as pb
from ams.api import scheduler_pb2_grpc as pb_grpc
from ams.cluster.lease import Lease, LeaseStatus, LeaseTable, Role, ShardMap
from ams.cluster.metrics import record_expiry, watch_lease_table
from ams.errors import AmsError, FailedPrecondition, InvalidArgument, Unavailable
from ams.server.interceptors import RequestDecodingInterceptor, TokenAuthInterceptor
from ams.server.service import EXCLUSIVE_PORT, start_serving
from ams.wire.status import error_from_rpc, rpc_method

log = logging.getLogger(__name__)

SERVICE_NAME = "xcls.ams.Scheduler"
# Every request is a few short strings; anything near this is an attack or a bug.
MAX_MESSAGE_BYTES = 1 << 20
POLL_S = 0.2
# The shortest lease a scheduler grants. Members renew every TTL/3, each renewal given that
# long: under a third of a second, a busy host or a garbage collection pause delays a
# renewal past it, and every member is declared dead at once.
MIN_LEASE_TTL_S = 1.0
# gRPC handler threads of a scheduler: each call is a few short strings answered under one lock
# in well under a millisecond, so a few threads serve any cluster; more would wait on the lock.
RPC_THREADS = 8
# Seconds a scheduler call may take: it answers in milliseconds when it runs, and a member
# should learn soon that it is unreachable.
CALL_TIMEOUT_S = 10.0
# Seconds a member retries its first registration while the scheduler cannot be reached: the
# members of a cluster may start before their scheduler does.
REGISTER_TIMEOUT_S = 60.0

_ROLES = {pb.ROLE_SHARD: Role.SHARD, pb.ROLE_WORKER: Role.WORKER}
_WIRE_ROLES = {role: wire for wire, role in _ROLES.items()}
_STATUSES = {LeaseStatus.ALIVE: pb.LEASE_ALIVE, LeaseStatus.EXPIRED: pb.LEASE_EXPIRED,
             LeaseStatus.UNKNOWN: pb.LEASE_UNKNOWN}
_WIRE_STATUSES = {wire: status for status, wire in _STATUSES.items()}


def _now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


# ---- the server ----------------------------------------------------------------------------


class SchedulerServicer(pb_grpc.SchedulerServicer):
    """Serves one ``LeaseTable``; every call first expires the leases that are due, so the
    answers never lag the reaper."""

    def __init__(self, table: LeaseTable) -> None:
        self.table = table
        self._lock = threading.Lock()

    def tick(self) -> None:
        """Expire due leases and log each (the reaper calls this between requests)."""
        with self._lock:
            self._expire()

    def _expire(self) -> None:
        for lease in self.table.expire_due(_now_ms()):
            record_expiry(lease)
            _log_lease("lease_expired", lease, self.table.generation, logging.WARNING)

    @rpc_method
    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext
                 ) -> pb.RegisterReply:
        role = _ROLES.get(request.role)
        if role is None:
            raise InvalidArgument(f"role {request.role}: expected ROLE_SHARD or ROLE_WORKER")
        with self._lock:
            self._expire()
            before = self.table.generation
            grant = self.table.register(role, request.slot, request.address,
                                        request.incarnation, _now_ms(), request.rejoin)
        log.info("registered role=%s slot=%d address=%s incarnation=%s lease=%s generation=%d",
                 role, request.slot, request.address, request.incarnation, grant.lease_id,
                 grant.generation)
        if grant.generation != before:
            log.warning("shard_replaced slot=%d incarnation=%s generation=%d", request.slot,
                        request.incarnation, grant.generation)
        return pb.RegisterReply(lease_id=grant.lease_id, ttl_ms=grant.ttl_ms,
                                generation=grant.generation)

    @rpc_method
    def Renew(self, request: pb.RenewRequest, context: grpc.ServicerContext) -> pb.RenewReply:
        with self._lock:
            self._expire()
            renewal = self.table.renew(request.lease_id, _now_ms())
        return pb.RenewReply(status=_STATUSES[renewal.status], generation=renewal.generation)

    @rpc_method
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext
                ) -> pb.ReleaseReply:
        with self._lock:
            self._expire()
            lease = self.table.release(request.lease_id, _now_ms())
            generation = self.table.generation
        if lease is not None:
            _log_lease("lease_released", lease, generation, logging.INFO)
        return pb.ReleaseReply(released=lease is not None)

    @rpc_method
    def Shards(self, request: pb.ShardsRequest, context: grpc.ServicerContext
               ) -> pb.ShardsReply:
        with self._lock:
            self._expire()
            shard_map = self.table.shard_map()
        return pb.ShardsReply(num_shards=shard_map.num_shards, addresses=shard_map.addresses,
                              incarnations=shard_map.incarnations,
                              generation=shard_map.generation, complete=shard_map.complete)


def _log_lease(event: str, lease: Lease, generation: int, level: int) -> None:
    log.log(level, "%s role=%s slot=%d address=%s incarnation=%s generation=%d", event,
            lease.role, lease.slot, lease.address, lease.incarnation, generation)


@dataclass
class RunningScheduler:
    """A started scheduler server and its reaper thread; ``stop`` drains in-flight calls."""

    server: grpc.Server
    port: int
    servicer: SchedulerServicer
    health: health.HealthServicer
    reaper: threading.Thread
    stopping: threading.Event = field(default_factory=threading.Event)

    def stop(self, grace: float = 5.0) -> None:
        self.stopping.set()
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        self.reaper.join()


def _reap(servicer: SchedulerServicer, every_s: float, stopping: threading.Event) -> None:
    """Expire leases on time even when nobody calls (the generation and the log move on)."""
    while not stopping.wait(every_s):
        try:
            servicer.tick()
        except Exception:
            log.exception("reaper_failed")


def check_lease_ttl(seconds: float) -> None:
    """``InvalidArgument`` unless leases of ``seconds`` can be kept: finite, and at least
    ``MIN_LEASE_TTL_S``."""
    if not MIN_LEASE_TTL_S <= seconds < math.inf:
        raise InvalidArgument(
            f"lease TTL {seconds:g} s must be finite and at least {MIN_LEASE_TTL_S:g} s: "
            "members renew every TTL/3, and a shorter lease expires before a renewal can "
            "arrive, which fences every shard at once")


def create_scheduler_server(num_shards: int, *, lease_ttl: float = 10.0,
                            host: str = "127.0.0.1", port: int = 0, token: str | None = None
                            ) -> RunningScheduler:
    """Start a scheduler for a job of ``num_shards`` shards whose leases last ``lease_ttl``
    seconds (``check_lease_ttl``); ``port=0`` picks a free port (``RunningScheduler.port``);
    ``token``: the shared secret every call but a health check must carry (None: anyone who
    reaches the port may register, and so take a shard's slot)."""
    check_lease_ttl(lease_ttl)
    table = LeaseTable(num_shards, max(1, round(lease_ttl * 1000)))
    watch_lease_table(table)
    interceptors = [TokenAuthInterceptor(token)] if token else []
    interceptors.append(RequestDecodingInterceptor())
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), EXCLUSIVE_PORT]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=RPC_THREADS),
                         interceptors=interceptors, options=options)
    servicer = SchedulerServicer(table)
    pb_grpc.add_SchedulerServicer_to_server(servicer, server)
    bound, health_servicer = start_serving(server, SERVICE_NAME, host, port)
    stopping = threading.Event()
    reaper = threading.Thread(target=_reap, args=(servicer, min(1.0, lease_ttl / 4), stopping),
                              name="lease-reaper", daemon=True)
    reaper.start()
    log.info("scheduler instance=%s num_shards=%d ttl_ms=%d", table.instance, num_shards,
             table.ttl_ms)
    return RunningScheduler(server, bound, servicer, health_servicer, reaper, stopping)


# ---- the client ----------------------------------------------------------------------------


def _shard_map(reply: pb.ShardsReply) -> ShardMap:
    return ShardMap(reply.num_shards, tuple(reply.addresses), tuple(reply.incarnations),
                    reply.generation)


class SchedulerClient:
    """The scheduler at ``address`` (host:port). Calls raise the typed ``ams.errors``; a
    scheduler that cannot be reached raises ``Unavailable`` (a call's default timeout:
    ``CALL_TIMEOUT_S``)."""

    def __init__(self, address: str, *, token: str | None = None) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.SchedulerStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def _call(self, name: str, request: object, timeout: float | None = None) -> object:
        try:
            return getattr(self.stub, name)(request, timeout=timeout or CALL_TIMEOUT_S,
                                            metadata=self.metadata)
        except grpc.RpcError as e:
            err = error_from_rpc(e, f"scheduler {self.address} {name}")
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise Unavailable(str(err)) from None
            raise err from None

    def register(self, role: Role, slot: int, address: str, incarnation: str, *,
                 rejoin: bool = False, timeout: float = 60.0) -> pb.RegisterReply:
        """Take a lease for ``slot`` of ``role``; retried while the scheduler cannot be reached,
        up to ``timeout`` seconds (it may start after its members). ``rejoin``: registering
        again after the scheduler restarted (``LeaseTable.register``)."""
        request = pb.RegisterRequest(role=_WIRE_ROLES[Role(role)], slot=slot, address=address,
                                     incarnation=incarnation, rejoin=rejoin)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._call("Register", request)
            except Unavailable:
                if time.monotonic() + POLL_S > deadline:
                    raise
                time.sleep(POLL_S)

    def renew(self, lease_id: str, timeout: float | None = None) -> tuple[LeaseStatus, int]:
        """(status, generation) of one renewal; one attempt."""
        reply = self._call("Renew", pb.RenewRequest(lease_id=lease_id), timeout)
        return _WIRE_STATUSES.get(reply.status, LeaseStatus.UNKNOWN), reply.generation

    def release(self, lease_id: str, timeout: float | None = None) -> bool:
        """Give a lease up; False if it was already gone."""
        return self._call("Release", pb.ReleaseRequest(lease_id=lease_id), timeout).released

    def shards(self) -> ShardMap:
        """The shard map now, complete or not."""
        return _shard_map(self._call("Shards", pb.ShardsRequest()))

    def wait_for_shards(self, timeout: float = 300.0) -> ShardMap:
        """The shard map once every slot is held (``.addresses`` is then a client's shard
        list); Unavailable after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        missing = "all (scheduler unreachable)"
        while True:
            try:
                shard_map = self.shards()
            except Unavailable:
                shard_map = None
            if shard_map is not None:
                if shard_map.complete:
                    return shard_map
                missing = str(shard_map.missing())
            if time.monotonic() + POLL_S > deadline:
                raise Unavailable(f"scheduler {self.address}: shards {missing} not registered "
                                  f"after {timeout:.0f}s")
            time.sleep(POLL_S)

    def keep_lease(self, role: Role, slot: int, address: str, incarnation: str,
                   on_lost: Callable[[str], None], *, expect: ShardMap | None = None
                   ) -> LeaseKeeper:
        """Register and keep the lease on a thread (see ``LeaseKeeper``); raises what
        ``register`` raises. ``expect``: for a worker, the shard map it connected to."""
        keeper = LeaseKeeper(self, Role(role), slot, address, incarnation, on_lost, expect)
        keeper.start()
        return keeper

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> SchedulerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LeaseKeeper:
    """Renews one lease every ttl/3 on a daemon thread and calls ``on_lost(reason)`` once when
    the scheduler says the lease is gone (EXPIRED: it was declared dead, replaced or released;
    renewing then stops). A worker's keeper also calls it when the generation moves past
    ``expect.generation`` (the shard map it trains against; default: the one at registration),
    and renews on until ``stop``: the worker is alive, and its lease expiring on the way out
    would move the generation under the restarted group. A shard's keeper ignores the
    generation, since other members' failures are no reason for it to stop.

    A scheduler that cannot be reached is retried at the same pace: only the scheduler may
    declare a member dead. One that restarted (UNKNOWN) is registered with again, under the
    same incarnation, as a rejoin; a worker then checks that no shard it knows changed its
    incarnation. A rejoin refused (another incarnation holds the slot, or this one was given
    up on) loses the lease, as EXPIRED does.
    """

    def __init__(self, client: SchedulerClient, role: Role, slot: int, address: str,
                 incarnation: str, on_lost: Callable[[str], None],
                 expect: ShardMap | None = None) -> None:
        self.client = client
        self.role, self.slot, self.address, self.incarnation = role, slot, address, incarnation
        self.on_lost = on_lost
        self.expect = expect
        self.lease_id = ""
        self.interval_s = 1.0
        self.generation = expect.generation if expect is not None else None
        self.lost = threading.Event()
        self.reason: str | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{role}-{slot}",
                                        daemon=True)
        self._unreachable = False
        self._gone = False  # the scheduler gave the lease up: nothing left to renew or release

    def start(self) -> None:
        """Register (retrying an unreachable scheduler for ``REGISTER_TIMEOUT_S``), then renew
        on the thread."""
        self._register(REGISTER_TIMEOUT_S)
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing and give the lease up now (a member leaving cleanly) rather than let
        it expire."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if self.lease_id and not self._gone:
            try:  # briefly: a member leaving must not hang on a scheduler that is gone
                self.client.release(self.lease_id, timeout=2.0)
            except AmsError as e:
                log.warning("lease_release_failed lease=%s error=%s", self.lease_id, e)

    # ---- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_s) and not self._gone:
            try:
                self._renew()
            except Exception as e:  # keep renewing: a lost lease is the scheduler's call
                log.exception("lease_renew_failed lease=%s error=%s", self.lease_id, e)

    def _renew(self) -> None:
        try:
            status, generation = self.client.renew(self.lease_id, timeout=self.interval_s)
        except Unavailable as e:
            if not self._unreachable:
                log.warning("scheduler_unreachable lease=%s error=%s", self.lease_id, e)
            self._unreachable = True
            return
        self._unreachable = False
        if status is LeaseStatus.ALIVE:
            self._check_generation(generation)
        elif status is LeaseStatus.EXPIRED:
            self._gone = True
            self._lose(f"the scheduler declared {self.role} {self.slot} (incarnation "
                       f"{self.incarnation}) dead: lease {self.lease_id} expired")
        else:
            log.warning("scheduler_restarted lease=%s; registering again", self.lease_id)
            self.generation = None  # a new scheduler counts from 0
            try:
                self._register(self.interval_s * 3, rejoin=True)
            except FailedPrecondition as e:
                self._gone = True
                self._lose(f"the restarted scheduler refused {self.role} {self.slot} "
                           f"(incarnation {self.incarnation}): {e}")
                return
            self._check_incarnations()

    def _register(self, timeout: float, rejoin: bool = False) -> None:
        reply = self.client.register(self.role, self.slot, self.address, self.incarnation,
                                     rejoin=rejoin, timeout=timeout)
        self.lease_id = reply.lease_id
        self.interval_s = max(0.05, reply.ttl_ms / 3000)
        if self.generation is None:
            self.generation = reply.generation
        self._check_generation(reply.generation)
        log.info("lease_kept role=%s slot=%d lease=%s ttl_ms=%d generation=%d", self.role,
                 self.slot, self.lease_id, reply.ttl_ms, reply.generation)

    def _check_generation(self, generation: int) -> None:
        if self.role is Role.WORKER and generation != self.generation:
            self._lose(f"cluster generation moved from {self.generation} to {generation}: a "
                       "shard or worker was lost or replaced")

    def _check_incarnations(self) -> None:
        """After a scheduler restart: a shard that re-registered under another incarnation
        than the one this worker trained against was restarted meanwhile."""
        if self.role is not Role.WORKER or self.expect is None:
            return
        now = self.client.shards()
        for slot, (was, is_) in enumerate(zip(self.expect.incarnations, now.incarnations,
                                              strict=False)):
            if is_ and is_ != was:
                self._lose(f"shard {slot} restarted (incarnation {was} -> {is_}) while the "
                           "scheduler was away")
                return

    def _lose(self, reason: str) -> None:
        if self.lost.is_set():
            return
        self.reason = reason
        self.lost.set()
        log.error("lease_lost role=%s slot=%d reason=%s", self.role, self.slot, reason)
        try:
            self.on_lost(reason)
        except Exception:
            log.exception("on_lost_failed role=%s slot=%d", self.role, self.slot)

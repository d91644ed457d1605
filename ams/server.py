"""The shard's gRPC servicer and server: decode -> validate -> call the store -> encode; the
server starts the shard's data plane (``ams.dataplane``) beside it, for pulls and pushes.

All validation lives in ``ShardStore`` and ``codec``; a failure becomes a gRPC status with the
store's message, and the store is untouched.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health

from ams import codec, snapshot
from ams.alloc import keep_large_buffers
from ams.api import shard_pb2 as pb
from ams.api import shard_pb2_grpc as pb_grpc
from ams.dataplane import DataPlaneServer
from ams.errors import FailedPrecondition, ShardRestarted
from ams.metrics import instrument_store
from ams.rpc import (
    RequestDecodingInterceptor,
    TokenAuthInterceptor,
    rpc_method,
    set_serving,
    start_serving,
)
from ams.store import ShardStore
from ams.wire import EXPECT_INCARNATION_KEY, GRPC_OPTIONS, INCARNATION_KEY, SHARD_SERVICE_NAME

log = logging.getLogger(__name__)


class ShardServicer(pb_grpc.ShardServicer):
    """Serves one ``ShardStore``. ``data_dir``: where snapshots go (None: snapshots refused);
    ``keep_snapshots``: newest complete steps kept after each snapshot (0: all);
    ``restored_step``: the snapshot step the store was restored from before serving (-1:
    none), what Stats reports until the next snapshot or restore; ``data_port``: the port of
    the shard's data plane (``ams.dataplane``), which Stats tells clients."""

    def __init__(self, store: ShardStore, data_dir: Path | None = None,
                 keep_snapshots: int = 0, restored_step: int = -1, data_port: int = 0) -> None:
        self.store = store
        self.data_port = data_port
        self.data_dir = data_dir
        self.keep_snapshots = keep_snapshots
        self.last_snapshot_step = restored_step

    @rpc_method
    def CreateTable(self, request: pb.CreateTableRequest, context: grpc.ServicerContext
                    ) -> pb.CreateTableReply:
        spec = codec.spec_from_wire(request.spec)
        return pb.CreateTableReply(created=self.store.create_table(spec))

    @rpc_method
    def Snapshot(self, request: pb.SnapshotRequest, context: grpc.ServicerContext
                 ) -> pb.SnapshotReply:
        path = snapshot.write_snapshot(self.store, self._data_dir(), request.step)
        self.last_snapshot_step = request.step
        snapshot.prune_after_snapshot(self.data_dir, self.store.shard_id,
                                      self.store.num_shards, self.keep_snapshots, request.step)
        return pb.SnapshotReply(path=str(path), step=request.step)

    @rpc_method
    def Restore(self, request: pb.RestoreRequest, context: grpc.ServicerContext
                ) -> pb.RestoreReply:
        step = None if request.step < 0 else request.step
        got, path = snapshot.restore_into(self.store, self._data_dir(), step)
        self.last_snapshot_step = got
        return pb.RestoreReply(step=got, path=str(path))

    @rpc_method
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        stats = self.store.stats()
        reply = pb.StatsReply(shard_id=stats["shard_id"], num_shards=stats["num_shards"],
                              last_snapshot_step=self.last_snapshot_step,
                              storage=stats["storage"], data_port=self.data_port)
        for name, t in stats["tables"].items():
            reply.tables.add(
                spec=codec.spec_to_wire(self.store.table(name).spec), owned_rows=t["owned_rows"],
                row_bytes=t["row_bytes"], state_bytes=t["state_bytes"], pulls=t["pulls"],
                pushes=t["pushes"], rows_pulled=t["rows_pulled"], rows_pushed=t["rows_pushed"],
                graph_version=t["graph_version"], graph_step=t["graph_step"],
                graph_k=t["graph_k"], graph_bytes=t["graph_bytes"])
        return reply

    @rpc_method
    def Neighbors(self, request: pb.NeighborsRequest, context: grpc.ServicerContext
                  ) -> pb.NeighborsReply:
        ids = codec.decode(request.ids, "ids", dtype=torch.int64, ndim=1)
        offsets, neighbors = self.store.neighbors(request.table, ids)
        reply = pb.NeighborsReply()
        if offsets is not None:  # CSR; fixed-width lists travel (n, k) without offsets
            codec.encode(offsets, reply.offsets)
        codec.encode(neighbors, reply.neighbors)
        return reply

    @rpc_method
    def SetNeighbors(self, request: pb.SetNeighborsRequest, context: grpc.ServicerContext
                     ) -> pb.SetNeighborsReply:
        version = self.store.set_neighbors(
            request.table,
            codec.decode(request.ids, "ids", dtype=torch.int64, ndim=1),
            codec.decode_optional(request.offsets, "offsets", dtype=torch.int64, ndim=1),
            codec.decode(request.neighbors, "neighbors"),
            request.graph_version, request.graph_step, request.replace_all)
        return pb.SetNeighborsReply(graph_version=version)

    @rpc_method
    def TakeTouched(self, request: pb.TakeTouchedRequest, context: grpc.ServicerContext
                    ) -> pb.TakeTouchedReply:
        reply = pb.TakeTouchedReply()
        codec.encode(self.store.take_touched(request.table, request.max_ids or None), reply.ids)
        return reply

    def _data_dir(self) -> Path:
        if self.data_dir is None:
            raise FailedPrecondition("this shard was started without --data-dir; "
                                     "snapshots are off")
        return self.data_dir


def _is_health_check(handler_call_details: grpc.HandlerCallDetails) -> bool:
    return handler_call_details.method.startswith("/grpc.health.v1.Health/")


def _metadata_value(metadata: Iterable[tuple[str, str | bytes]] | None, key: str) -> str | None:
    for k, value in metadata or ():
        if k == key:
            return value.decode() if isinstance(value, bytes) else value
    return None


def _with_behavior(handler: grpc.RpcMethodHandler,
                   wrap: Callable[[Callable], Callable]) -> grpc.RpcMethodHandler:
    """``handler`` with its behavior replaced by ``wrap(behavior)`` (the shard's calls are
    unary; rows stream over the data plane)."""
    if handler.unary_unary is not None:
        return handler._replace(unary_unary=wrap(handler.unary_unary))
    return handler


class IncarnationInterceptor(grpc.ServerInterceptor):
    """Ties every call to one process of the shard.

    Each reply carries ``incarnation`` (trailing metadata ``xcls-incarnation``, and the
    ``incarnation`` field of a StatsReply). A call whose ``xcls-expect-incarnation`` metadata
    names another incarnation is refused with ABORTED before the servicer runs: its client
    learned an earlier process of this shard, whose state this one need not have (a restart
    comes back empty or at a snapshot), so a push from it must not be applied. Calls without
    the key (first contact, tools) and health checks pass.
    """

    def __init__(self, incarnation: str, shard_id: int, num_shards: int) -> None:
        self.incarnation = incarnation
        self._where = f"shard {shard_id} of {num_shards}"
        self._trailer = ((INCARNATION_KEY, incarnation),)

    def intercept_service(self, continuation: Callable, handler_call_details: object) -> object:
        handler = continuation(handler_call_details)
        if handler is None or _is_health_check(handler_call_details):
            return handler
        expected = _metadata_value(handler_call_details.invocation_metadata,
                                   EXPECT_INCARNATION_KEY)
        if expected is not None and expected != self.incarnation:
            return _with_behavior(handler, lambda _behavior: self._refusal(expected))
        return _with_behavior(handler, self._stamped)

    def _stamped(self, behavior: Callable) -> Callable:
        def stamped(request: object, context: grpc.ServicerContext) -> object:
            context.set_trailing_metadata(self._trailer)
            reply = behavior(request, context)
            if isinstance(reply, pb.StatsReply):
                reply.incarnation = self.incarnation
            return reply

        return stamped

    def _refusal(self, expected: str) -> Callable:
        message = str(ShardRestarted.refusal(self._where, self.incarnation, expected))

        def refuse(request: object, context: grpc.ServicerContext) -> None:
            context.set_trailing_metadata(self._trailer)
            context.abort(grpc.StatusCode.ABORTED, message)

        return refuse


class ReadinessGate(grpc.ServerInterceptor):
    """Refuses the shard's calls with UNAVAILABLE until ``open`` (health checks pass): a shard
    binds its port before it restores its snapshot, so that a health check tells "starting"
    (NOT_SERVING) from "dead" (no answer), and no call sees a half-restored table."""

    def __init__(self, ready: bool) -> None:
        self.ready = threading.Event()
        if ready:
            self.ready.set()

    def open(self) -> None:
        self.ready.set()

    def intercept_service(self, continuation: Callable, handler_call_details: object) -> object:
        handler = continuation(handler_call_details)
        if handler is None or self.ready.is_set() or _is_health_check(handler_call_details):
            return handler

        def refuse(request: object, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          "the shard is restoring its snapshot; it serves once health says "
                          "SERVING")

        return _with_behavior(handler, lambda _behavior: refuse)


@dataclass
class RunningServer:
    """A started shard server; ``stop`` drains in-flight calls first."""

    server: grpc.Server
    port: int
    servicer: ShardServicer
    health: health.HealthServicer
    incarnation: str
    """This start of the shard (uuid4 hex); see ``IncarnationInterceptor``."""
    gate: ReadinessGate
    data_plane: DataPlaneServer

    def mark_ready(self, restored_step: int = -1) -> None:
        """Serve: the store is complete (restored from ``restored_step``, -1: none); health
        turns SERVING and the shard's calls are let through."""
        self.servicer.last_snapshot_step = restored_step
        self.gate.open()
        set_serving(self.health, SHARD_SERVICE_NAME, True)

    def stop(self, grace: float = 30.0) -> None:
        """Stop serving; calls and data-plane requests under way get ``grace`` seconds."""
        self.health.enter_graceful_shutdown()
        stopped = self.server.stop(grace)
        self.data_plane.close(grace)
        stopped.wait()


def create_server(store: ShardStore, *, host: str = "127.0.0.1", port: int = 0,
                  data_dir: Path | None = None, token: str | None = None,
                  tls_cert: bytes | None = None, tls_key: bytes | None = None,
                  max_workers: int = 16, keep_snapshots: int = 0,
                  restored_step: int = -1, ready: bool = True, data_port: int = 0
                  ) -> RunningServer:
    """Start serving ``store``; ``port=0`` picks a free port (see ``RunningServer.port``).
    Pulls and pushes are served on ``data_port`` (0: a free one; ``ams.dataplane``), with the
    same token and TLS.
    ``keep_snapshots``, ``restored_step``: see ``ShardServicer``. ``ready=False``: bound and
    answering health checks (NOT_SERVING), the shard's calls refused with UNAVAILABLE, until
    ``RunningServer.mark_ready`` (after a restore).
    Every start is a new incarnation (``RunningServer.incarnation``)."""
    keep_large_buffers()
    incarnation = uuid.uuid4().hex
    # auth first: an unauthenticated caller learns nothing, not even the incarnation
    interceptors: list[grpc.ServerInterceptor] = [TokenAuthInterceptor(token)] if token else []
    interceptors.append(IncarnationInterceptor(incarnation, store.shard_id, store.num_shards))
    gate = ReadinessGate(ready)
    interceptors.insert(1 if token else 0, gate)  # after auth: strangers learn nothing
    interceptors.insert(0, instrument_store(store))  # first: it sees every refusal
    interceptors.append(RequestDecodingInterceptor())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         interceptors=interceptors, options=GRPC_OPTIONS)
    data_plane = DataPlaneServer(store, host=host, port=data_port, token=token,
                                 tls_cert=tls_cert, tls_key=tls_key, incarnation=incarnation,
                                 ready=gate.ready)
    servicer = ShardServicer(store, data_dir, keep_snapshots, restored_step, data_plane.port)
    pb_grpc.add_ShardServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials([(tls_key, tls_cert)]) \
        if tls_cert is not None else None
    try:
        bound, health_servicer = start_serving(server, SHARD_SERVICE_NAME, host, port,
                                               credentials, serving=ready)
    except OSError:
        data_plane.close()
        raise
    log.info("incarnation shard=%d incarnation=%s data_port=%d", store.shard_id, incarnation,
             data_plane.port)
    return RunningServer(server, bound, servicer, health_servicer, incarnation, gate,
                         data_plane)

"""A shard server: ``create_server`` serves a store on its gRPC control plane and starts its
data plane (``ams.dataplane.server``) beside it, with health checks and a graceful stop;
``start_serving`` and ``set_serving`` are the start-up steps the scheduler shares."""

from __future__ import annotations

import logging
import uuid
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ams.alloc import keep_large_buffers
from ams.api import shard_pb2_grpc as pb_grpc
from ams.dataplane.server import DataPlaneServer
from ams.limits import GRPC_OPTIONS, RPC_THREADS, SHARD_SERVICE_NAME
from ams.server.interceptors import (
    IncarnationInterceptor,
    ReadinessGate,
    RequestDecodingInterceptor,
    RequestMetricsInterceptor,
    TokenAuthInterceptor,
)
from ams.server.servicer import ShardServicer
from ams.shard.metrics import watch_store
from ams.shard.store import ShardStore

log = logging.getLogger(__name__)


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
                  max_workers: int = RPC_THREADS, keep_snapshots: int = 0, ready: bool = True,
                  data_port: int = 0) -> RunningServer:
    """Start serving ``store``; ``port=0`` picks a free port (see ``RunningServer.port``).
    Pulls and pushes are served on ``data_port`` (0: a free one; ``ams.dataplane.server``), with the
    same token and TLS.
    ``keep_snapshots``: see ``ShardServicer``. ``ready=False``: bound and answering health
    checks (NOT_SERVING), the shard's calls refused with UNAVAILABLE, until
    ``RunningServer.mark_ready`` (after a restore, with the step restored).
    Every start is a new incarnation (``RunningServer.incarnation``)."""
    keep_large_buffers()
    incarnation = uuid.uuid4().hex
    # auth first: an unauthenticated caller learns nothing, not even the incarnation
    interceptors: list[grpc.ServerInterceptor] = [TokenAuthInterceptor(token)] if token else []
    interceptors.append(IncarnationInterceptor(incarnation, store.shard_id, store.num_shards))
    gate = ReadinessGate(ready)
    interceptors.insert(1 if token else 0, gate)  # after auth: strangers learn nothing
    watch_store(store)
    interceptors.insert(0, RequestMetricsInterceptor())  # first: it sees every refusal
    interceptors.append(RequestDecodingInterceptor())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         interceptors=interceptors, options=[*GRPC_OPTIONS, EXCLUSIVE_PORT])
    data_plane = DataPlaneServer(store, host=host, port=data_port, token=token,
                                 tls_cert=tls_cert, tls_key=tls_key, incarnation=incarnation,
                                 ready=gate.ready)
    servicer = ShardServicer(store, data_dir, keep_snapshots, data_plane.port)
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


# gRPC binds with SO_REUSEPORT unless told not to: a second shard or scheduler started on a
# port in use then starts too, and the kernel deals the connections out between the two
# processes (a table created through one is missing through the other).
EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)


def start_serving(server: grpc.Server, service_name: str, host: str, port: int,
                  credentials: grpc.ServerCredentials | None = None, serving: bool = True
                  ) -> tuple[int, health.HealthServicer]:
    """Bind ``server`` (its services already added) to ``host:port`` (TLS with
    ``credentials``), add the gRPC health service, start, and report ``service_name`` SERVING
    (NOT_SERVING with ``serving=False``: the caller sets it once it is ready).
    Returns (the bound port, the health servicer); OSError if the address cannot be bound."""
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_secure_port(address, credentials) if credentials is not None \
            else server.add_insecure_port(address)
    except RuntimeError:  # grpcio's way of saying the bind failed
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {address}: the port is in use, or the address is not "
                      "one of this host's")
    server.start()
    set_serving(health_servicer, service_name, serving)
    return bound, health_servicer


def set_serving(health_servicer: health.HealthServicer, service_name: str, serving: bool) -> None:
    """Report SERVING (or NOT_SERVING) for ``service_name`` and for the server as a whole."""
    status = health_pb2.HealthCheckResponse.SERVING if serving \
        else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", service_name):
        health_servicer.set(name, status)

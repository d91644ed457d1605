"""One shard in another process: its gRPC control plane and its data plane, behind the
backend protocol ``ShardedClient`` talks to (``ams.client.backend``).

Every call has a deadline and follows the client's one retry rule (``ams.client.retry``).
Pulls and pushes go over pooled data connections (``ams.dataplane.connection``); a connection
that fails is closed, never pooled again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ams.api import shard_pb2 as pb
from ams.api import shard_pb2_grpc as pb_grpc
from ams.client.retry import Retry
from ams.dataplane.connection import DataConnection
from ams.dataplane.shm import SharedArena
from ams.errors import AmsError, InvalidArgument, ShardRestarted, Unavailable
from ams.limits import (
    EXPECT_INCARNATION_KEY,
    GRPC_OPTIONS,
    INCARNATION_KEY,
    PIECE_BYTES,
    PIPELINE_WINDOW,
    SHARD_SERVICE_NAME,
    SHARED_PIECE_BYTES,
)
from ams.shard.neighbor_lists import check_lists
from ams.shard.spec import TableSpec
from ams.wire import codec
from ams.wire.frames import FrameError
from ams.wire.pieces import PushPieces

log = logging.getLogger(__name__)

# Calls that move a shard's whole tables (Snapshot, Restore) or a request's worth of lists
# (SetNeighbors) get the client's timeout plus a second for each of these bytes: a rate well
# below what a snapshot's write or restore (LMDB and SHA-256 over the table's bytes) keeps up
# on a busy host, so that only a shard that is stopped or stuck runs into the deadline, which
# stays under an hour for a shard of up to about 50 GiB.
BULK_BYTES_PER_S = 16 << 20
# Retries of a call after its first attempt, all within its one deadline: their pauses
# (ams.client.retry) add up to about a second, which rides out a dropped connection or a busy
# shard; a shard that stays away longer fails the call (the trainer then rolls back).
RETRIES = 4
# Seconds ``connect`` waits for each shard's first data connection (it only sizes the first
# call's pieces): a shard that is slow to answer is left to that call, not waited for.
DATA_CONNECT_TIMEOUT_S = 5.0


class RemoteShard:
    """One shard over gRPC, its pulls and pushes over its data plane (``ams.dataplane``).

    Once ``incarnation`` is known (``connect`` learns it at first contact, ``learn_incarnation``
    again), every call expects that process of the shard (metadata ``xcls-expect-incarnation``,
    and the HELLO of each data connection): a restarted shard refuses it untouched, and a reply
    from another incarnation is not accepted; both raise ShardRestarted.
    """

    def __init__(self, address: str, *, token: str | None = None, tls_ca: bytes | None = None,
                 timeout: float = 60.0, arena: SharedArena | None = None) -> None:
        self.address = address
        self.arena = arena  # the client's shared buffer, offered on each data connection
        self.timeout = timeout
        self.retry = Retry(timeout, RETRIES)
        self.incarnation: str | None = None  # the process this client expects; None: any
        if tls_ca is not None:
            self.channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_ca),
                                               options=GRPC_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self.stub = pb_grpc.ShardStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.token, self.tls_ca = token, tls_ca
        self.host = address.rsplit(":", 1)[0].strip("[]")
        self.data_port: int | None = None  # learned from Stats with the incarnation
        self._idle: list[DataConnection] = []  # pooled data-plane connections
        self._idle_lock = threading.Lock()

    # ---- the control plane -------------------------------------------------------------

    def _call(self, method: str, request: object, *, timeout: float | None = None,
              expect: bool = True) -> object:
        """``method`` of the shard service, retried by the client's rule within ``timeout``
        (default: the client's); ``expect``: the reply must come from ``incarnation``."""
        where = f"shard {self.address} {method}"
        metadata = self.metadata
        if expect and self.incarnation:
            metadata = (*metadata, (EXPECT_INCARNATION_KEY, self.incarnation))
        for attempt in self.retry.attempts(where, timeout):
            with attempt:
                reply, call = getattr(self.stub, method).with_call(
                    request, timeout=attempt.remaining(), metadata=metadata)
                if expect:
                    self._check_incarnation(call)
                return reply
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _check_incarnation(self, call: grpc.Call) -> None:
        """ShardRestarted when the reply comes from a process other than the expected one."""
        got = dict(call.trailing_metadata() or ()).get(INCARNATION_KEY)
        if self.incarnation and got and got != self.incarnation:
            raise ShardRestarted(f"the reply comes from incarnation {got}, this client "
                                 f"expected {self.incarnation}")

    def learn_incarnation(self) -> str:
        """Ask the shard which process serves it now, and expect that one from here on."""
        reply = self._call("Stats", pb.StatsRequest(), expect=False)
        self.incarnation = reply.incarnation or None
        self.data_port = reply.data_port or None
        self._drop_connections()
        return reply.incarnation

    def wait_ready(self, timeout: float) -> None:
        """Return once the shard's health says SERVING (a shard restoring its snapshot is up
        but NOT_SERVING); Unavailable after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise Unavailable(f"shard {self.address} not reachable within {timeout:.0f}s") from None
        health_check = health_pb2_grpc.HealthStub(self.channel).Check
        request = health_pb2.HealthCheckRequest(service=SHARD_SERVICE_NAME)
        while True:
            remaining = deadline - time.monotonic()
            try:
                # short checks: a shard that restarts or stalls is asked again until the end
                status = health_check(request, timeout=min(max(remaining, 0.1), 1.0)).status
            except grpc.RpcError:
                status = None
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            if remaining <= 0:
                raise Unavailable(f"shard {self.address} not serving within {timeout:.0f}s "
                                  "(still restoring its snapshot?)")
            time.sleep(min(0.1, remaining))

    def create_table(self, spec: TableSpec) -> bool:
        reply = self._call("CreateTable", pb.CreateTableRequest(spec=codec.spec_to_wire(spec)))
        return reply.created

    def table_specs(self) -> dict[str, TableSpec]:
        reply = self._call("Stats", pb.StatsRequest())
        return {t.spec.name: codec.spec_from_wire(t.spec) for t in reply.tables}

    def snapshot(self, step: int, timeout: float | None = None) -> str:
        """``timeout``: the call's, in seconds (None: sized by the shard's tables,
        ``_bulk_deadline``)."""
        deadline = self._bulk_deadline(timeout)
        return self._call("Snapshot", pb.SnapshotRequest(step=step),
                          timeout=deadline - time.monotonic()).path

    def restore(self, step: int | None, timeout: float | None = None) -> tuple[int, str]:
        """``timeout``: as ``snapshot``'s."""
        deadline = self._bulk_deadline(timeout)
        reply = self._call("Restore", pb.RestoreRequest(step=-1 if step is None else step),
                           timeout=deadline - time.monotonic())
        return reply.step, reply.path

    def _bulk_timeout(self, nbytes: int) -> float:
        """The timeout of a call that moves ``nbytes``: the client's, and a second more for
        every ``BULK_BYTES_PER_S``."""
        return self.timeout + nbytes / BULK_BYTES_PER_S

    def _bulk_deadline(self, timeout: float | None) -> float:
        """When a snapshot or restore starting now must have ended: ``timeout`` from now, or
        the ``_bulk_timeout`` of the shard's tables as it holds them now (asked of it within
        the same deadline; a restore into tables not created yet is sized by those that
        are, so a caller that restores before creating them gives ``timeout``)."""
        started = time.monotonic()
        if timeout is not None:
            return started + timeout
        reply = self._call("Stats", pb.StatsRequest())
        held = sum(t.row_bytes + t.state_bytes + t.graph_bytes for t in reply.tables)
        return started + self._bulk_timeout(held)

    def stats(self) -> dict:
        reply = self._call("Stats", pb.StatsRequest())
        tables = {}
        for t in reply.tables:
            tables[t.spec.name] = {
                "owned_rows": t.owned_rows, "row_bytes": t.row_bytes,
                "state_bytes": t.state_bytes, "pulls": t.pulls, "pushes": t.pushes,
                "rows_pulled": t.rows_pulled, "rows_pushed": t.rows_pushed,
                "graph_version": t.graph_version, "graph_step": t.graph_step,
                "graph_k": t.graph_k, "graph_bytes": t.graph_bytes,
            }
        return {"address": self.address, "shard_id": reply.shard_id,
                "num_shards": reply.num_shards, "last_snapshot_step": reply.last_snapshot_step,
                "incarnation": reply.incarnation, "storage": reply.storage,
                "data_port": reply.data_port, "tables": tables}

    def neighbors(self, table: str, ids: torch.Tensor
                  ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The shard's lists as it keeps them (``ShardStore.neighbors``), checked."""
        request = pb.NeighborsRequest(table=table)
        codec.encode(ids, request.ids)
        reply = self._call("Neighbors", request)
        offsets = codec.decode_optional(reply.offsets, "offsets", dtype=torch.int64, ndim=1)
        neighbors = codec.decode(reply.neighbors, "neighbors")
        try:
            check_lists(offsets, neighbors, ids.numel())
        except ValueError as e:
            raise InvalidArgument(f"Neighbors reply of {self.address}: {e}") from None
        return offsets, neighbors

    def set_neighbors(self, table: str, ids: torch.Tensor, offsets: torch.Tensor | None,
                      neighbors: torch.Tensor, version: int, step: int,
                      replace_all: bool) -> int:
        request = pb.SetNeighborsRequest(table=table, graph_version=version, graph_step=step,
                                         replace_all=replace_all)
        codec.encode(ids, request.ids)
        if offsets is not None:  # CSR; fixed-width lists go (n, k) without offsets
            codec.encode(offsets, request.offsets)
        codec.encode(neighbors, request.neighbors)
        return self._call("SetNeighbors", request,
                          timeout=self._bulk_timeout(request.ByteSize())).graph_version

    def take_touched(self, table: str, max_ids: int | None) -> torch.Tensor:
        """``ShardStore.take_touched``. Retried like the other calls: a retry after a lost
        reply finds those ids forgotten, and their lists wait for the next full build."""
        reply = self._call("TakeTouched", pb.TakeTouchedRequest(table=table,
                                                                max_ids=max_ids or 0))
        return codec.decode(reply.ids, "ids", dtype=torch.int64, ndim=1)

    # ---- the data plane ----------------------------------------------------------------

    # Bytes of rows one pull or push piece carries: set by each new data connection, larger
    # when it maps the client's shared buffer, whose rows do not cross the socket.
    piece_bytes = PIECE_BYTES

    def pull(self, table: str, pieces: Sequence[torch.Tensor],
             into: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        """Rows of the ids of every piece (int64 (n_i,), owned here) into ``into`` = (out,
        positions), the pieces pipelined on one data connection (``DataConnection.pull``)."""
        for attempt in self.retry.attempts(f"shard {self.address} Pull"):
            with attempt, self._data_connection(attempt.deadline) as conn:
                conn.pull(table, pieces, into, PIPELINE_WINDOW, attempt.deadline)

    def push(self, table: str, pieces: PushPieces, lr: float, client_id: str,
             decay_clock: float | None) -> list[bool]:
        """Apply each piece, pipelined on one data connection; whether each was applied now
        (False: its sequence was applied before). A retry after a lost connection resends
        every piece: those applied already are recognised by their sequence and skipped."""
        for attempt in self.retry.attempts(f"shard {self.address} Push"):
            with attempt, self._data_connection(attempt.deadline) as conn:
                return conn.push(table, pieces, lr, client_id, decay_clock, PIPELINE_WINDOW,
                                 attempt.deadline)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def scan(self, table: str, block_rows: int | None
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The shard's rows block by block over the data plane (each block a retried call)."""
        start = 0
        while True:
            ids, rows = self._scan_block(table, start, block_rows)
            if not ids.numel():
                return
            yield ids, rows
            start += ids.numel()

    def _scan_block(self, table: str, start: int, block_rows: int | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        for attempt in self.retry.attempts(f"shard {self.address} Scan"):
            with attempt, self._data_connection(attempt.deadline) as conn:
                return conn.scan_block(table, start, block_rows, attempt.deadline)
        raise AssertionError("unreachable: the last attempt returns or raises")

    @contextmanager
    def _data_connection(self, deadline: float) -> Iterator[DataConnection]:
        """A pooled data connection, or a new one, for one attempt: pooled again after it if
        the shard's answers kept it in step (success, or a typed refusal), closed otherwise."""
        conn = self._idle_connection()
        if conn is None:
            try:
                conn = self._new_connection(deadline)
            except OSError:
                self.data_port = None  # ask again: a restarted shard has another port
                raise
        try:
            yield conn
        except FrameError:  # a reply this client cannot read: the stream is lost
            conn.close()
            raise
        except AmsError:  # the shard's answer; the connection is still in step
            self._pool(conn)
            raise
        except OSError:  # TLS errors and timeouts included
            conn.close()
            self.data_port = None  # ask again: a restarted shard has another port
            raise
        except BaseException:  # the connection's state is unknown: not used again
            conn.close()
            raise
        self._pool(conn)

    def _idle_connection(self) -> DataConnection | None:
        with self._idle_lock:
            return self._idle.pop() if self._idle else None

    def _new_connection(self, deadline: float) -> DataConnection:
        """A greeted connection (the data port asked of Stats first when unknown);
        ShardRestarted when the shard is no longer the expected process."""
        if self.data_port is None:
            reply = self._call("Stats", pb.StatsRequest(), expect=False,
                               timeout=max(0.1, deadline - time.monotonic()))
            if self.incarnation and reply.incarnation != self.incarnation:
                raise ShardRestarted.refusal(
                    f"shard {reply.shard_id} of {reply.num_shards} at {self.address}",
                    reply.incarnation, self.incarnation)
            if not reply.data_port:
                raise Unavailable(f"shard {self.address} serves no data plane")
            self.data_port = reply.data_port
        # the HELLO expects this client's incarnation: another process refuses it (ABORTED)
        conn = DataConnection(self.host, self.data_port, token=self.token, tls_ca=self.tls_ca,
                              expect_incarnation=self.incarnation,
                              timeout=max(0.1, deadline - time.monotonic()), arena=self.arena)
        self.piece_bytes = SHARED_PIECE_BYTES if conn.shared is not None else PIECE_BYTES
        return conn

    def open_data_connection(self) -> None:
        """Open a data connection and pool it, so that whether it maps the client's shared
        buffer sizes the pieces of the first call too. Where it cannot be opened now (within
        ``DATA_CONNECT_TIMEOUT_S``), the first call's retries and typed errors deal with it."""
        try:
            timeout = min(DATA_CONNECT_TIMEOUT_S, self.timeout)
            conn = self._new_connection(time.monotonic() + timeout)
        except (AmsError, OSError) as e:
            log.debug("data_connection_deferred shard=%s error=%s", self.address, e)
            return
        self._pool(conn)

    def _pool(self, conn: DataConnection) -> None:
        if not conn.lost:
            with self._idle_lock:
                self._idle.append(conn)

    def _drop_connections(self) -> None:
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def close(self) -> None:
        self._drop_connections()
        self.channel.close()

"""The AMS client API: one object over all shards, local or remote.

``ShardedClient`` deduplicates ids, routes them with ``ams.sharding``, fans out to the shards in
parallel, splits requests that would exceed the message limit and reassembles replies in
request order. It talks to each shard through a ``ShardBackend``: ``RemoteShard`` (gRPC, here)
or ``LocalShard`` (a ``ShardStore`` in process, ``ams.client.local``), so the embedded
default and the cluster run the same code.
"""

from __future__ import annotations

import functools
import logging
import random
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Protocol, TypeVar

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ams import sharding
from ams.alloc import keep_large_buffers
from ams.api import shard_pb2 as pb
from ams.api import shard_pb2_grpc as pb_grpc
from ams.cluster.lease import parse_address
from ams.dataplane.server import DataConnection
from ams.dataplane.shm import MIN_SHARED_BYTES, SharedArena
from ams.dtypes import parse_row_dtype
from ams.errors import (
    AmsError,
    InvalidArgument,
    ShardRestarted,
    TableNotFound,
    Unavailable,
    error_from_code,
)
from ams.shard.neighbor_lists import check_lists, id_dtype, list_lengths, lists_to_dense
from ams.shard.store import TableSpec
from ams.wire import codec
from ams.wire.frames import FrameError
from ams.wire.limits import (
    EXPECT_INCARNATION_KEY,
    GRPC_OPTIONS,
    INCARNATION_KEY,
    MAX_REPLY_PAYLOAD_BYTES,
    PIECE_BYTES,
    PIPELINE_WINDOW,
    REQUEST_BYTES,
    SHARD_SERVICE_NAME,
    SHARED_PIECE_BYTES,
)
from ams.wire.pieces import PushPieces, ascending_unique, piece_sizes
from ams.wire.status import error_from_rpc

log = logging.getLogger(__name__)

T = TypeVar("T")


class ShardBackend(Protocol):
    """What the client needs from one shard; ids are always owned by that shard."""

    def create_table(self, spec: TableSpec) -> bool: ...
    def table_specs(self) -> dict[str, TableSpec]: ...
    piece_bytes: int
    """Bytes of rows one pull or push piece carries (``ShardedClient`` cuts the pieces)."""

    def pull(self, table: str, pieces: Sequence[torch.Tensor],
             into: tuple[torch.Tensor, torch.Tensor | None]) -> None: ...
    def push(self, table: str, pieces: PushPieces, lr: float, client_id: str,
             decay_clock: float | None) -> list[bool]: ...
    def scan(self, table: str, block_rows: int | None
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...
    def snapshot(self, step: int) -> str: ...
    def restore(self, step: int | None) -> tuple[int, str]: ...
    def stats(self) -> dict: ...
    def neighbors(self, table: str, ids: torch.Tensor
                  ) -> tuple[torch.Tensor | None, torch.Tensor]: ...
    def set_neighbors(self, table: str, ids: torch.Tensor, offsets: torch.Tensor | None,
                      neighbors: torch.Tensor, version: int, step: int,
                      replace_all: bool) -> int: ...
    def take_touched(self, table: str, max_ids: int | None) -> torch.Tensor: ...
    def close(self) -> None: ...


# ---- the gRPC backend --------------------------------------------------------------------

_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class RemoteShard:
    """One shard over gRPC, its pulls and pushes over its data plane (``ams.dataplane.server``).
    Every call has a deadline; idempotent calls retry on UNAVAILABLE and on a lost data
    connection.

    Pushes are idempotent too: they carry (client id, sequence) and the shard applies each
    sequence once, so a retried push after a lost reply is safe.

    Once ``incarnation`` is known (``connect`` learns it at first contact, ``learn_incarnation``
    again), every call expects that process of the shard (metadata ``xcls-expect-incarnation``):
    a restarted shard refuses it untouched, and a reply from another incarnation is not
    accepted; both raise ShardRestarted.
    """

    def __init__(self, address: str, *, token: str | None = None, tls_ca: bytes | None = None,
                 timeout: float = 60.0, retries: int = 4,
                 arena: SharedArena | None = None) -> None:
        self.address = address
        self.arena = arena  # the client's shared buffer, offered on each data connection
        self.timeout = timeout
        self.retries = retries
        self.incarnation: str | None = None  # the process this client expects; None: any
        options = GRPC_OPTIONS
        if tls_ca is not None:
            self.channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_ca),
                                               options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = pb_grpc.ShardStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.token, self.tls_ca = token, tls_ca
        self.host = address.rsplit(":", 1)[0].strip("[]")
        self.data_port: int | None = None  # learned from Stats with the incarnation
        self._idle: list[DataConnection] = []  # pooled data-plane connections
        self._idle_lock = threading.Lock()

    def _call_metadata(self, expect: bool) -> tuple[tuple[str, str], ...]:
        if expect and self.incarnation:
            return (*self.metadata, (EXPECT_INCARNATION_KEY, self.incarnation))
        return self.metadata

    def _check_incarnation(self, call: grpc.Call, method: str) -> None:
        """ShardRestarted when the reply comes from a process other than the expected one."""
        got = dict(call.trailing_metadata() or ()).get(INCARNATION_KEY)
        if self.incarnation and got and got != self.incarnation:
            raise ShardRestarted(f"shard {self.address} {method}: the reply comes from "
                                 f"incarnation {got}, this client expected {self.incarnation}")

    def _call(self, name: str, request: object, *, retry: bool = True,
              timeout: float | None = None, expect: bool = True) -> object:
        method = getattr(self.stub, name)
        attempts = self.retries + 1 if retry else 1
        for attempt in range(attempts):
            try:
                reply, call = method.with_call(request, timeout=timeout or self.timeout,
                                               metadata=self._call_metadata(expect))
            except grpc.RpcError as e:
                if e.code() in _RETRYABLE and attempt + 1 < attempts:
                    delay = min(2.0, 0.05 * 2**attempt) * (0.5 + random.random())
                    log.debug("rpc_retry shard=%s method=%s code=%s delay=%.2f", self.address,
                              name, e.code().name, delay)
                    time.sleep(delay)
                    continue
                raise error_from_rpc(e, f"shard {self.address}", name) from None
            if expect:
                self._check_incarnation(call, name)
            return reply
        raise AssertionError("unreachable")

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

    # Bytes of rows a piece carries: set by each new data connection, larger when it maps the
    # client's shared buffer (SHARED_PIECE_BYTES) than when rows cross the socket.
    piece_bytes = PIECE_BYTES

    def pull(self, table: str, pieces: Sequence[torch.Tensor],
             into: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        """Rows of the ids of every piece (int64 (n_i,), owned here) into ``into`` = (out,
        positions), the pieces pipelined on one data connection (``DataConnection.pull``)."""
        self._data_call("Pull", lambda conn, deadline: conn.pull(
            table, pieces, PIPELINE_WINDOW, deadline, into))

    def push(self, table: str, pieces: PushPieces, lr: float, client_id: str,
             decay_clock: float | None) -> list[bool]:
        """Apply each piece, pipelined on one data connection; whether each was applied now
        (False: its sequence was applied before). A retry after a lost connection resends
        every piece: those applied already are recognised by their sequence and skipped."""
        return self._data_call("Push", lambda conn, deadline: conn.push(
            table, pieces, lr, client_id, decay_clock, PIPELINE_WINDOW, deadline))

    def _data_call(self, method: str, work: Callable[[DataConnection, float], T]) -> T:
        """``work(connection, deadline)`` on a pooled data connection, retried like ``_call``
        when the connection is lost or the shard is not serving yet; the shard's refusals
        raise their typed errors."""
        deadline = time.monotonic() + self.timeout
        where = f"shard {self.address} {method}"
        for attempt in range(self.retries + 1):
            conn = None
            try:
                conn = self._connection(deadline)
                result = work(conn, deadline)
            except FrameError as e:  # a reply this client cannot read: the stream is lost
                self._discard(conn)
                raise InvalidArgument(f"{where}: {e}") from None
            except AmsError as e:  # the shard's answer; the connection is still in step
                self._release(conn)
                if e.code != "UNAVAILABLE" or attempt == self.retries:
                    raise error_from_code(e.code, f"{where}: {e}") from None
                failure: AmsError = e
            except (OSError, ssl.SSLError) as e:  # TimeoutError included
                self._discard(conn)
                failure = error_from_code(
                    "DEADLINE_EXCEEDED" if isinstance(e, TimeoutError) else "UNAVAILABLE",
                    f"{where}: {e or type(e).__name__}")
                if attempt == self.retries or time.monotonic() >= deadline:
                    raise failure from None
                self.data_port = None  # ask again: a restarted shard has another port
            except BaseException:  # the connection's state is unknown: not used again
                self._discard(conn)
                raise
            else:
                self._release(conn)
                return result
            delay = min(2.0, 0.05 * 2**attempt) * (0.5 + random.random())
            log.debug("data_retry shard=%s method=%s error=%s delay=%.2f", self.address,
                      method, failure, delay)
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        raise AssertionError("unreachable")

    def _connection(self, deadline: float) -> DataConnection:
        """A pooled data connection, or a new one (the data port asked of Stats first when
        unknown); ShardRestarted when the shard is no longer the expected process."""
        with self._idle_lock:
            if self._idle:
                return self._idle.pop()
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
                              timeout=max(0.1, deadline - time.monotonic()),
                              arena=self.arena)
        self.piece_bytes = SHARED_PIECE_BYTES if conn.shared is not None else PIECE_BYTES
        return conn

    def open_data_connection(self, timeout: float = 5.0) -> None:
        """Open a data connection and pool it, so that whether it maps the client's shared
        buffer sizes the pieces of the first call too. Where it cannot be opened now, the
        first call's retries and typed errors deal with it."""
        try:
            conn = self._connection(time.monotonic() + min(timeout, self.timeout))
        except (AmsError, OSError, ssl.SSLError) as e:
            log.debug("data_connection_deferred shard=%s error=%s", self.address, e)
            return
        self._release(conn)

    def _release(self, conn: DataConnection | None) -> None:
        if conn is not None and not conn.lost:
            with self._idle_lock:
                self._idle.append(conn)

    @staticmethod
    def _discard(conn: DataConnection | None) -> None:
        if conn is not None:
            conn.close()

    def _drop_connections(self) -> None:
        with self._idle_lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def scan(self, table: str, block_rows: int | None
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The shard's rows block by block over the data plane (each block a retried call)."""
        start = 0
        while True:
            ids, rows = self._data_call("Scan", lambda conn, deadline, start=start:
                                        conn.scan_block(table, start, block_rows, deadline))
            if not ids.numel():
                return
            yield ids, rows
            start += ids.numel()

    def snapshot(self, step: int) -> str:
        return self._call("Snapshot", pb.SnapshotRequest(step=step), timeout=3600).path

    def restore(self, step: int | None) -> tuple[int, str]:
        reply = self._call("Restore", pb.RestoreRequest(step=-1 if step is None else step),
                           timeout=3600)
        return reply.step, reply.path

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
        return self._call("SetNeighbors", request, timeout=600).graph_version

    def take_touched(self, table: str, max_ids: int | None) -> torch.Tensor:
        """``ShardStore.take_touched``. Retried like the other calls: a retry after a lost
        reply finds those ids forgotten, and their lists wait for the next full build."""
        reply = self._call("TakeTouched", pb.TakeTouchedRequest(table=table,
                                                                max_ids=max_ids or 0))
        return codec.decode(reply.ids, "ids", dtype=torch.int64, ndim=1)

    def close(self) -> None:
        self._drop_connections()
        self.channel.close()


# ---- the client over all shards ------------------------------------------------------------


def check_ids(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` as the int64 CPU tensor of shape (n,) every client call takes; InvalidArgument
    when it is not an integer tensor of shape (n,)."""
    # most calls first, in the fewest questions to torch: each costs more than it seems on a
    # 1-row pull, whose caches the rest of the program has just cooled
    if isinstance(ids, torch.Tensor) and ids.dtype == torch.int64 and ids.dim() == 1 \
            and ids.is_cpu:
        return ids
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point() \
            or ids.is_complex() or ids.dtype == torch.bool:
        got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids)
        raise InvalidArgument(f"ids: need an integer tensor of shape (n,), got {got}")
    return ids.to(device="cpu", dtype=torch.int64)


def _fenced(method: Callable[..., T]) -> Callable[..., T]:
    """A ``ShardedClient`` call that touches rows, graphs or snapshots: refused while the
    client is invalidated, and one that meets a restarted shard invalidates the client (the
    shards no longer hold one step of the model, so no call may go on as if they did)."""

    @functools.wraps(method)
    def fenced(self: ShardedClient, *args: object, **kwargs: object) -> T:
        self._raise_if_invalid()
        try:
            return method(self, *args, **kwargs)
        except ShardRestarted as e:
            self.invalidate(str(e))
            raise

    return fenced


class ShardedClient:
    """The AMS client API over ``shards[i]`` = shard i of ``len(shards)``.

    Thread-safe: the trainer's prefetch thread pulls while the main thread pushes.

    Restarts: each remote shard's incarnation is learned at ``connect``; once a call meets a
    restarted shard, or ``invalidate`` is called, every row, graph and snapshot call raises
    ShardRestarted until ``relearn_incarnations``, which follows a coordinated rollback::

        client.relearn_incarnations()   # accept the shards' processes as they are now
        client.restore(step)            # then put all of them at one checkpoint's step
    """

    # Pieces pipeline rows that travel: a shard gathers one while the client takes the one
    # before. Rows a shard writes straight into a result in the shared buffer do not travel,
    # and each request costs a round trip, so such a pull asks each shard for up to this many
    # bytes of rows at once (benchmarks/bench_pieces.py).
    direct_pull_bytes = REQUEST_BYTES

    def __init__(self, shards: Sequence[ShardBackend], arena: SharedArena | None = None
                 ) -> None:
        """``arena``: the shared buffer the remote shards' data connections offer (the
        client closes it); large pulls return tensors in it."""
        if not shards:
            raise InvalidArgument("a client needs at least one shard")
        # Pulls and pushes, in-process or on the wire, move reply-sized buffers, and a
        # training process that holds a client frees megabytes of activations every step:
        # with glibc's defaults each would be a fresh mmap, faulted in and unmapped again
        # (benchmarks/RESULTS.md, "Demo").
        keep_large_buffers()
        self.shards = list(shards)
        self.num_shards = len(self.shards)
        self.arena = arena
        self.client_id = uuid.uuid4().hex
        self._sequence = 0
        self._sequence_lock = threading.Lock()
        self._specs: dict[str, TableSpec] = {}
        self._invalid_lock = threading.Lock()
        self._invalid_reason: str | None = None
        self._invalidations = 0  # lets relearn_incarnations keep an invalidate made during it
        self._pool = ThreadPoolExecutor(max_workers=self.num_shards,
                                        thread_name_prefix="ams-fanout") \
            if self.num_shards > 1 else None

    # ---- plumbing ---------------------------------------------------------------------

    def _fan_out(self, work: Callable[[int], T]) -> list[T]:
        """Run ``work(shard)`` for every shard, in parallel; once all have ended, re-raise the
        failure of the first shard that failed. The calling thread does shard 0's work itself
        rather than wait idle: one thread hand-off fewer on every call."""
        if self._pool is None:
            return [work(0)]
        futures = [self._pool.submit(work, s) for s in range(1, self.num_shards)]
        try:
            first = work(0)
        finally:
            wait(futures)
        return [first] + [f.result() for f in futures]

    def _raise_if_invalid(self) -> None:
        reason = self._invalid_reason
        if reason is not None:
            raise ShardRestarted(reason)

    def _fenced_blocks(self, blocks: Iterator[T]) -> Iterator[T]:
        """``blocks``, fenced like a ``_fenced`` call."""
        self._raise_if_invalid()
        try:
            yield from blocks
        except ShardRestarted as e:
            self.invalidate(str(e))
            raise

    def _next_sequences(self, count: int) -> int:
        """The first of ``count`` push sequences of this client, never handed out before."""
        with self._sequence_lock:
            first = self._sequence + 1
            self._sequence += count
            return first

    def spec(self, name: str) -> TableSpec:
        """The spec of table ``name`` (asked of shard 0 once, then remembered)."""
        spec = self._specs.get(name)
        if spec is None:
            self._specs.update(self.shards[0].table_specs())
            spec = self._specs.get(name)
            if spec is None:
                raise TableNotFound(f"unknown table {name!r}; create it first")
        return spec

    # ---- tables -----------------------------------------------------------------------

    @_fenced
    def create_table(self, name: str, num_rows: int, dim: int, dtype: str = "float32",
                     state_dtype: str | None = None, momentum: float = 0.9,
                     weight_decay: float = 5e-4, seed: int = 0, init_std: float = 0.01) -> bool:
        """Create a table on every shard (idempotent for an identical spec).

        Rows start as Normal(0, init_std), a function of (seed, class id) only. Returns True
        if any shard created it now.
        """
        spec = TableSpec(name=name, num_rows=num_rows, dim=dim, dtype=parse_row_dtype(dtype),
                         state_dtype=parse_row_dtype(state_dtype or dtype, "state_dtype"),
                         momentum=momentum, weight_decay=weight_decay, seed=seed,
                         init_std=init_std)
        created = self._fan_out(lambda s: self.shards[s].create_table(spec))
        self._specs[name] = spec
        return any(created)

    # ---- rows -------------------------------------------------------------------------

    @_fenced
    def pull(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` in request order. ids: int (n,), repeats allowed -> (n, dim) in the
        table's dtype (CPU)."""
        ids = check_ids(ids)
        spec = self.spec(name)
        parts = sharding.split_by_shard(ids, self.num_shards) if self.num_shards > 1 \
            else None
        rows = self._new_rows(ids.numel(), spec)
        direct = self.arena is not None and self.arena.offset_of(rows) is not None
        self._pull_into(name, ids, parts, spec, rows, direct)
        if direct and self.arena.abandoned(rows):
            # a connection was lost and the pull retried on another: the lost one's shard may
            # still write this region after the caller has the rows, so they are pulled again
            # into this process's own memory (the region is never reused)
            log.warning("pull_repeated_off_shared_buffer table=%s rows=%d", name, ids.numel())
            rows = torch.empty((ids.numel(), spec.dim), dtype=spec.dtype)
            self._pull_into(name, ids, parts, spec, rows, False)
        return rows

    def _pull_into(self, name: str, ids: torch.Tensor, parts: list[torch.Tensor] | None,
                   spec: TableSpec, rows: torch.Tensor, direct: bool) -> None:
        """``pull``'s rows of ``ids`` into ``rows`` (its result); ``parts``: each shard's
        positions in ``ids`` (None: one shard); ``direct``: ``rows`` lie in the shared buffer.

        Each row moves once: each shard writes its rows to their places in the result (in the
        shared buffer, which the result then is), or they are received or scattered there. A
        repeated id is asked for again rather than looked for: the callers' ids are unique
        (the active classes), and finding repeats costs a sort on every pull."""
        row_bytes = spec.dim * spec.dtype.itemsize

        def pieces(s: int, wanted: torch.Tensor) -> list[torch.Tensor]:
            most = self.direct_pull_bytes if direct else self.shards[s].piece_bytes
            if wanted.numel() * row_bytes <= most:
                return [wanted]
            return list(wanted.split(piece_sizes(wanted.numel(), most // row_bytes)))

        if parts is None:
            self.shards[0].pull(name, pieces(0, ids), (rows, None))
            return

        def work(s: int) -> None:
            if parts[s].numel():
                # numpy's indexing: this runs on the fan-out threads, whose torch kernels
                # would share torch's intra-op pool
                wanted = torch.from_numpy(ids.numpy()[parts[s].numpy()])
                self.shards[s].pull(name, pieces(s, wanted), (rows, parts[s]))

        self._fan_out(work)

    @_fenced
    def push(self, name: str, ids: torch.Tensor, grads: torch.Tensor, lr: float,
             decay_clock: float | None = None) -> None:
        """Apply ``grads`` to the rows of ``ids`` with sparse momentum SGD on the shards.

        ids: int (n,), repeats summed; grads: float (n, dim); lr: float >= 0;
        decay_clock: the step's weight-decay clock (``ams.shard.optim``; None: rows that sat out
        steps do not catch up on their decay).
        """
        ids = check_ids(ids)
        spec = self.spec(name)
        if not isinstance(grads, torch.Tensor) or tuple(grads.shape) != (ids.numel(), spec.dim):
            got = tuple(grads.shape) if isinstance(grads, torch.Tensor) else type(grads)
            raise InvalidArgument(f"grads: shape {got}, need ({ids.numel()}, {spec.dim})")
        grads = grads.detach().to(device="cpu", dtype=torch.float32).contiguous()
        # Each shard gets its ids once and ascending (its fast path), sorted on its own
        # fan-out thread (``ascending_unique``).
        parts = sharding.split_by_shard(ids, self.num_shards) if self.num_shards > 1 \
            else [None]

        def work(s: int) -> None:
            keys, values, source = ascending_unique(ids, grads, parts[s])
            if keys.numel():
                sizes = piece_sizes(keys.numel(), self.shards[s].piece_bytes // (spec.dim * 4))
                pieces = PushPieces(keys, values, source, sizes, self._next_sequences(len(sizes)))
                self.shards[s].push(name, pieces, float(lr), self.client_id, decay_clock)

        self._fan_out(work)

    def scan(self, name: str, block_rows: int | None = None
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """All rows of a table as blocks (ids int64 (b,), rows (b, dim)), shard by shard;
        ``block_rows`` None: the most rows a reply holds, up to 65536."""
        return self._fenced_blocks(block for shard in self.shards
                                   for block in shard.scan(name, block_rows))

    def scan_shard(self, name: str, shard: int, block_rows: int | None = None
                   ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The blocks of one shard (ids ascending)."""
        return self._fenced_blocks(self.shards[shard].scan(name, block_rows))

    # ---- neighbor lists ----------------------------------------------------------------

    @_fenced
    def neighbors(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Neighbor ids of each class in rank order, the class itself first.

        ids: int (n,) -> int64 (n, k), k the longest list; shorter lists are padded with -1.
        """
        ids = check_ids(ids)
        self.spec(name)
        unique, inverse = torch.unique(ids, return_inverse=True)
        parts = sharding.split_by_shard(unique, self.num_shards)

        def work(s: int) -> tuple[torch.Tensor | None, torch.Tensor] | None:
            if parts[s].numel() == 0:
                return None
            return self.shards[s].neighbors(name, unique[parts[s]])

        replies = self._fan_out(work)
        width = max((int(list_lengths(*r).max()) for r in replies if r is not None), default=0)
        out = torch.full((unique.numel(), width), -1, dtype=torch.int64)
        for s, reply in enumerate(replies):
            if reply is not None:
                out[parts[s]] = lists_to_dense(*reply, width)
        return out[inverse]

    @_fenced
    def set_neighbors(self, name: str, ids: torch.Tensor, neighbors: torch.Tensor, *,
                      version: int, step: int, replace_all: bool) -> None:
        """Write neighbor lists back to the shards that own the classes.

        ids: int64 (n,) unique; neighbors: int64 (n, k) in rank order (-1 pads a short list).
        ``replace_all``: ids cover the whole table and start graph ``version``.
        Lists travel as compact as the shards keep them: int32 ids in tables of fewer than
        2**31 classes, and fixed width (no offsets) where no list is padded.
        """
        ids = check_ids(ids)
        parts = sharding.split_by_shard(ids, self.num_shards)
        small = torch.iinfo(torch.int32)
        # Narrowing is exact when every value fits; the shards check the ids' range either way.
        if neighbors.dtype == torch.int64 and neighbors.numel() \
                and id_dtype(self.spec(name).num_rows) == torch.int32 \
                and small.min <= int(neighbors.min()) and int(neighbors.max()) <= small.max:
            neighbors = neighbors.to(torch.int32)

        step_rows = max(1, REQUEST_BYTES // (8 * (neighbors.shape[1] + 2)))

        def work(s: int) -> None:
            for start in range(0, parts[s].numel(), step_rows):
                chunk = parts[s][start:start + step_rows]
                sub = neighbors[chunk]
                valid = sub >= 0
                if bool(valid.all()):
                    self.shards[s].set_neighbors(name, ids[chunk], None, sub, version, step,
                                                 replace_all)
                    continue
                offsets = torch.zeros(sub.shape[0] + 1, dtype=torch.int64)
                torch.cumsum(valid.sum(dim=1), 0, out=offsets[1:])
                self.shards[s].set_neighbors(name, ids[chunk], offsets, sub[valid], version,
                                             step, replace_all)

        self._fan_out(work)

    @_fenced
    def take_touched(self, name: str, shards: Sequence[int] | None = None) -> torch.Tensor:
        """The classes pushes changed since they were last taken, int64 (m,) ascending, and
        the shards forget them (``ShardStore.take_touched``); ``shards``: ask only these
        (default: all). A shard answers at most one reply's worth per call; it is asked again
        until an answer comes back short."""
        self.spec(name)
        asked = range(self.num_shards) if shards is None else shards
        per_call = MAX_REPLY_PAYLOAD_BYTES // 8

        def work(s: int) -> torch.Tensor:
            if s not in asked:
                return torch.empty(0, dtype=torch.int64)
            parts = [self.shards[s].take_touched(name, per_call)]
            while parts[-1].numel() == per_call:
                parts.append(self.shards[s].take_touched(name, per_call))
            return torch.cat(parts)

        return torch.cat(self._fan_out(work)).sort().values

    # ---- snapshots and stats ------------------------------------------------------------

    @_fenced
    def snapshot(self, step: int) -> list[str]:
        """Every shard writes its piece of snapshot ``step``; returns the pieces' paths."""
        return self._fan_out(lambda s: self.shards[s].snapshot(step))

    @_fenced
    def restore(self, step: int | None = None) -> int:
        """Every shard loads its part of snapshot ``step`` (None: newest complete one)."""
        got = self._fan_out(lambda s: self.shards[s].restore(step))
        steps = {s for s, _ in got}
        if len(steps) != 1:
            raise AmsError(f"shards restored different steps {sorted(steps)}")
        self._specs.clear()
        return steps.pop()

    def stats(self) -> list[dict]:
        """One dict per shard: shard id, storage kind, tables with sizes, counters and graph
        version."""
        return self._fan_out(lambda s: self.shards[s].stats())

    # ---- incarnations -------------------------------------------------------------------

    def invalidate(self, reason: str) -> None:
        """From now on every row, graph and snapshot call raises ShardRestarted(``reason``),
        until ``relearn_incarnations``. Thread-safe: a watcher thread that learns that a shard
        restarted calls it; the first reason stays."""
        with self._invalid_lock:
            self._invalidations += 1
            if self._invalid_reason is None:
                self._invalid_reason = reason
                log.warning("client_invalidated reason=%s", reason)

    def relearn_incarnations(self) -> None:
        """Expect every shard's current process from now on and lift ``invalidate`` (unless it
        was called again meanwhile). Call it just before ``restore`` puts the shards back at
        one checkpoint's step, never to carry on past a restart."""
        with self._invalid_lock:
            seen = self._invalidations
        self._fan_out(self._learn_incarnation)
        with self._invalid_lock:
            if self._invalidations == seen:
                self._invalid_reason = None
        self._specs.clear()

    def _learn_incarnation(self, s: int) -> None:
        shard = self.shards[s]
        if isinstance(shard, RemoteShard):  # an in-process shard cannot restart on its own
            shard.learn_incarnation()

    def _new_rows(self, num_rows: int, spec: TableSpec) -> torch.Tensor:
        """An uninitialized (num_rows, dim) tensor of the table's row dtype for a pull's
        result: in the shared buffer where there is one, the rows take at least
        ``MIN_SHARED_BYTES`` and a region is free, else in the process's memory."""
        if self.arena is not None \
                and num_rows * spec.dim * spec.dtype.itemsize >= MIN_SHARED_BYTES:
            rows = self.arena.result(num_rows, spec.dim, spec.dtype)
            if rows is not None:
                return rows
        return torch.empty((num_rows, spec.dim), dtype=spec.dtype)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for shard in self.shards:
            shard.close()
        if self.arena is not None:
            self.arena.close()

    def __enter__(self) -> ShardedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(addresses: Sequence[str] | str | None = None, *, local_shards: int | None = None,
            data_dir: str | Path | None = None, token: str | None = None,
            tls_ca: bytes | None = None, timeout: float = 60.0,
            ready_timeout: float = 30.0, keep_snapshots: int = 3, storage: str = "memory",
            storage_dir: str | Path | None = None, shared_memory: bool = True) -> ShardedClient:
    """Connect to an AMS: gRPC shards at ``addresses`` (shard i at ``addresses[i]``), or
    ``local_shards`` in-process shards (the embedded default; ``data_dir`` for snapshots,
    of which they keep the ``keep_snapshots`` newest complete steps, 0: all; remote shards
    prune by their own ``--keep-snapshots``). ``storage``, ``storage_dir``: where in-process
    shards keep their tables (``ams.shard.store.ShardStore``: "memory", or "mmap" files under
    ``storage_dir``, reopened by the next client there once ``close`` closed them); remote
    shards choose theirs with ``--storage``. ``shared_memory``: rows to and from a shard on
    this host bypass the socket through a buffer both map (``ams.dataplane.shm``; never with TLS);
    False: always in the frames."""
    if (addresses is None) == (local_shards is None):
        raise InvalidArgument("give either addresses=[...] or local_shards=N")
    if local_shards is not None:
        from ams.client.local import LocalShard

        if not isinstance(local_shards, int) or local_shards < 1:
            raise InvalidArgument(f"local_shards={local_shards!r} must be an integer >= 1")
        root = Path(data_dir) if data_dir is not None else None
        local: list[LocalShard] = []
        try:
            for s in range(local_shards):
                local.append(LocalShard(s, local_shards, root, keep_snapshots, storage,
                                        storage_dir))
        except AmsError:
            for shard in local:  # let a later client open their storage dirs
                shard.close()
            raise
        return ShardedClient(local)
    if storage != "memory" or storage_dir is not None:
        raise InvalidArgument("storage and storage_dir are for local_shards; remote shards "
                              "choose theirs with 'xcls serve shard --storage'")
    if isinstance(addresses, str):
        addresses = [a for a in addresses.split(",") if a]
    if not addresses:
        raise InvalidArgument("addresses: need at least one host:port")
    for address in addresses:  # a typo fails now, not after the wait for the shards
        parse_address(address)
    return join_shards(list(addresses), token=token, tls_ca=tls_ca, timeout=timeout,
                       ready_timeout=ready_timeout, shared_memory=shared_memory)


def join_shards(shards: Sequence[str | ShardBackend], *, token: str | None = None,
                tls_ca: bytes | None = None, timeout: float = 60.0,
                ready_timeout: float = 30.0, shared_memory: bool = True) -> ShardedClient:
    """A client over ``shards[i]`` = shard i: a ``host:port`` of a shard server, or a shard
    held in this process (``ams.client.local.LocalShard``), as in collective mode, where each worker
    holds its own slice and reaches the others' over gRPC. The remote ones must be serving
    as shard i of ``len(shards)``; their incarnations are learned now."""
    remote = any(isinstance(s, str) for s in shards)
    # one buffer for all shards: each writes its rows of a pull straight into the result
    arena = SharedArena.create() if remote and shared_memory and tls_ca is None else None
    backends = [RemoteShard(s, token=token, tls_ca=tls_ca, timeout=timeout, arena=arena)
                if isinstance(s, str) else s for s in shards]
    client = ShardedClient(backends, arena)

    def first_contact(i: int) -> dict | None:
        backend = backends[i]
        if not isinstance(backend, RemoteShard):
            return None
        backend.wait_ready(ready_timeout)
        return backend.stats()

    try:
        layout = client._fan_out(first_contact)
    except AmsError:
        client.close()
        raise
    for i, info in enumerate(layout):
        if info is None:
            continue
        if info["shard_id"] != i or info["num_shards"] != len(backends):
            client.close()
            raise InvalidArgument(
                f"addresses[{i}]={shards[i]} is shard {info['shard_id']} of "
                f"{info['num_shards']}, expected shard {i} of {len(backends)}: list the shards "
                "in order, all of them")
        # first contact: from now on every call expects this process of the shard
        backends[i].incarnation = info["incarnation"] or None
        backends[i].data_port = info["data_port"] or None
    client._fan_out(lambda i: backends[i].open_data_connection()
                    if isinstance(backends[i], RemoteShard) else None)
    return client

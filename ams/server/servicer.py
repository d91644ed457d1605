"""The shard's gRPC servicer: decode -> call the store -> encode, one method per RPC of
``proto/ams/api/shard.proto``. All validation lives in ``ShardStore`` and ``ams.wire.codec``;
a failure becomes a gRPC status with the store's message, and the store is untouched."""

from __future__ import annotations

from pathlib import Path

import grpc
import torch

from ams.api import shard_pb2 as pb
from ams.api import shard_pb2_grpc as pb_grpc
from ams.errors import FailedPrecondition
from ams.shard import restore, snapshot
from ams.shard.store import ShardStore
from ams.wire import codec
from ams.wire.status import rpc_method


class ShardServicer(pb_grpc.ShardServicer):
    """Serves one ``ShardStore``. ``data_dir``: where snapshots go (None: snapshots refused);
    ``keep_snapshots``: newest complete steps kept after each snapshot (0: all);
    ``data_port``: the port of the shard's data plane (``ams.dataplane.server``), which Stats
    tells clients. ``last_snapshot_step``, what Stats reports: the step of the newest snapshot
    or restore, or the one the store was restored from before serving
    (``RunningServer.mark_ready``); -1 until then."""

    def __init__(self, store: ShardStore, data_dir: Path | None = None,
                 keep_snapshots: int = 0, data_port: int = 0) -> None:
        self.store = store
        self.data_port = data_port
        self.data_dir = data_dir
        self.keep_snapshots = keep_snapshots
        self.last_snapshot_step = -1

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
        got, path = restore.restore_into(self.store, self._data_dir(), step)
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

"""What a shard answers to one request of its data plane: the store's pull, push or scan,
and the rows that go into or come out of a shared buffer (proto/ams/api/frames.md).

``check_body`` is what the server asks of a request before it receives its ids and rows, from
its header and meta alone, so that a body that cannot fit its table is refused before any
memory is allocated for it; ``answer`` applies a request received whole. Both raise the typed
``ams.errors`` the server sends back as ERROR frames.
"""

from __future__ import annotations

import torch

from ams.dataplane.shm import SharedBuffer
from ams.dataplane.sockets import Frame
from ams.errors import InvalidArgument
from ams.shard import rowcopy
from ams.shard.checks import check_grads_shape
from ams.shard.store import ShardStore
from ams.wire import frames
from ams.wire.frames import Header, Kind


def check_body(store: ShardStore, header: Header, meta: dict) -> None:
    """A PUSH's gradients, as its header announces them, must be float rows as wide as the
    table its ``meta`` names (``ams.shard.checks.check_grads``). Ids need no table: their
    number is bounded by ``frames.check_request``."""
    if header.kind == Kind.PUSH:
        spec = store.table(frames.meta_field(meta, "table", str)).spec
        check_grads_shape(header.dtype, (header.num_rows, header.dim), header.num_ids, spec)


def answer(store: ShardStore, frame: Frame, shared: SharedBuffer | None
           ) -> tuple[Kind, dict]:
    """Apply one PULL, PUSH or SCAN to ``store``: (the answer's kind, the keyword arguments
    of its ``sockets.send_frame``). ``shared``: the connection's shared buffer, for frames
    whose rows are there."""
    table = frames.meta_field(frame.meta, "table", str)
    if frame.header.shared and shared is None:
        raise InvalidArgument("frame: rows in a shared buffer, but this connection has none "
                              "(its HELLO offered none, or it was refused)")
    if frame.header.kind == Kind.PULL:
        if frame.header.shared:
            rows = _pull_into_shared(store, table, frame, shared)
        else:
            rows = store.pull(table, frame.ids)
        return Kind.ROWS, {"rows": rows, "shared": frame.header.shared}
    if frame.header.kind == Kind.SCAN:
        ids, rows = store.scan_block(
            table, frames.meta_field(frame.meta, "start", int),
            frames.meta_field(frame.meta, "rows", int, required=False))
        return Kind.ROWS, {"ids": ids, "rows": rows}
    if frame.header.shared:
        frame.rows = shared.rows(frames.meta_field(frame.meta, "offset", int),
                                 frame.header.dtype, frame.header.num_rows, frame.header.dim)
    return Kind.PUSHED, {"meta": {"applied": _push(store, table, frame)}}


def _pull_into_shared(store: ShardStore, table: str, frame: Frame, shared: SharedBuffer
                      ) -> torch.Tensor:
    """A shared PULL: its rows written to the region of "bytes" at "offset" of the shared
    buffer, in order from its start, or row j at row positions[j] of it; the rows returned
    (for the answer's shape). Nothing is written when it is refused."""
    spec = store.table(table).spec
    offset = frames.meta_field(frame.meta, "offset", int)
    room = frames.meta_field(frame.meta, "bytes", int)
    shared.check_offset(offset, spec.dtype)
    if room < 0 or not shared.fits(offset, room):
        raise InvalidArgument(f"frame meta: {room} bytes at offset {offset} are not in the "
                              f"{shared.capacity}-byte shared buffer")
    region_rows = room // (spec.dim * spec.dtype.itemsize)
    n = frame.ids.numel()
    if frame.positions is None:
        if n > region_rows:
            raise InvalidArgument(f"frame: {n} rows of {spec.dim} x {spec.dtype} do not fit "
                                  f"in the {room} bytes at offset {offset}")
        return store.pull(table, frame.ids, shared.rows(offset, spec.dtype, n, spec.dim))
    if n:
        lo, hi = rowcopy.bounds(frame.positions)
        if lo < 0 or hi >= region_rows:
            raise InvalidArgument(f"frame: position {lo if lo < 0 else hi} is outside the "
                                  f"{region_rows} rows at offset {offset}")
    rows = store.pull(table, frame.ids)
    rowcopy.scatter(shared.rows(offset, spec.dtype, region_rows, spec.dim), frame.positions,
                    rows)
    return rows


def _push(store: ShardStore, table: str, frame: Frame) -> bool:
    meta = frame.meta
    lr = frames.meta_field(meta, "lr", (int, float))
    client_id = frames.meta_field(meta, "client_id", str)
    sequence = frames.meta_field(meta, "sequence", int)
    clock = frames.meta_field(meta, "decay_clock", (int, float), required=False)
    return store.push(table, frame.ids, frame.rows, lr, client_id, sequence, clock)

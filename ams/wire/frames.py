"""The AMS data plane's binary frame: a fixed header, a small JSON meta, then raw ids and rows.

Pulls and pushes move their ids, rows and gradients in these frames over a TCP connection
beside the shard's gRPC port (``ams.dataplane.server``), never through protobuf. The layout is
specified in ``proto/ams/api/frames.md``; this module is its only implementation, pure (no
sockets), so that both ends and the tests share it.
"""

from __future__ import annotations

import json
import math
import struct
from enum import IntEnum
from typing import NamedTuple

import torch

from ams.dtypes import torch_dtype, wire_dtype
from ams.errors import InvalidArgument, RequestTooLarge, shorten
from ams.jsontext import parse_json
from ams.limits import MAX_MESSAGE_BYTES

MAGIC = b"XAMS"
VERSION = 1
# magic, version, kind, dtype, flags, meta bytes, dim, ids, rows, body bytes
HEADER = struct.Struct("<4sBBBBIIQQQ")
MAX_META_BYTES = 64 << 10
# One frame's body may be as large as a gRPC message may be (ams.limits).
MAX_BODY_BYTES = MAX_MESSAGE_BYTES


class Kind(IntEnum):
    """What a frame is. Requests go client -> shard; each is answered by one frame, in order."""

    HELLO = 1    # first request on a connection: meta {"token"?, "expect_incarnation"?}
    WELCOME = 2  # its answer: meta {"incarnation", "shard_id", "num_shards"}
    PULL = 3     # meta {"table"}; n ids
    ROWS = 4     # answer to PULL: n rows (n, dim) in the table's row dtype, request order
    PUSH = 5     # meta {"table", "lr", "client_id", "sequence", "decay_clock"?};
    #              n ids and n gradient rows (n, dim)
    PUSHED = 6   # answer to PUSH: meta {"applied": bool}
    ERROR = 7    # answer to any request: meta {"code": gRPC status name, "message"}
    SCAN = 8     # meta {"table", "start", "rows"?}: a block of the shard's rows in id order,
    #              answered by ROWS with the block's ids


REQUEST_KINDS = frozenset({Kind.HELLO, Kind.PULL, Kind.PUSH, Kind.SCAN})


# A header's flags. SHARED: the rows are not in the body but in the connection's shared buffer
# (``ams.dataplane.shm``) at the meta's "offset"; on a PULL, where the answer's rows are asked for.
# POSITIONS (a shared PULL only): the ids are followed by as many int64 positions, and the row of
# ids[j] goes to row positions[j] of the region at "offset", not to row j.
SHARED_FLAG = 0x01
POSITIONS_FLAG = 0x02
KNOWN_FLAGS = SHARED_FLAG | POSITIONS_FLAG


# Kinds that may carry the shared flag: the requests and the answer that move rows.
SHARED_KINDS = frozenset({Kind.PULL, Kind.PUSH, Kind.ROWS})


class Header(NamedTuple):
    """A parsed, checked frame header; the body that follows holds ``meta_bytes`` of JSON,
    ``num_ids`` int64 ids (and as many int64 positions where ``positions``) and ``num_rows``
    rows of ``dim`` values of ``dtype``, unless ``shared``: then the rows are in the
    connection's shared buffer, not in the body."""

    kind: Kind
    dtype: torch.dtype | None
    meta_bytes: int
    dim: int
    num_ids: int
    num_rows: int
    shared: bool = False
    positions: bool = False

    @property
    def ids_bytes(self) -> int:
        """The ids' bytes, with the positions' that follow them."""
        return 8 * self.num_ids * (2 if self.positions else 1)

    @property
    def rows_bytes(self) -> int:
        if self.dtype is None:
            return 0
        return self.num_rows * self.dim * self.dtype.itemsize

    @property
    def body_bytes(self) -> int:
        return self.meta_bytes + self.ids_bytes + (0 if self.shared else self.rows_bytes)


class FrameError(InvalidArgument):
    """A frame that cannot be read: after it, the connection's framing is lost and the shard
    answers with an ERROR frame and closes the connection."""


def pack_header(kind: Kind, meta: bytes, *, num_ids: int = 0,
                rows: torch.Tensor | None = None, shared: bool = False,
                positions: bool = False) -> bytes:
    """The header of a frame whose body is ``meta``, ``num_ids`` ids (and as many positions
    where ``positions``), then ``rows`` ((n, dim) of a wire dtype, or None); ``shared``: the
    rows are in the shared buffer and the body ends after the ids."""
    if rows is None:
        dtype, dim, num_rows, rows_bytes = 0, 0, 0, 0
    else:
        dtype, (num_rows, dim) = wire_dtype(rows.dtype), rows.shape
        rows_bytes = 0 if shared else rows.numel() * rows.element_size()
    body = len(meta) + 8 * num_ids * (2 if positions else 1) + rows_bytes
    flags = (SHARED_FLAG if shared else 0) | (POSITIONS_FLAG if positions else 0)
    return HEADER.pack(MAGIC, VERSION, kind, dtype, flags, len(meta), dim, num_ids, num_rows,
                       body)


def parse_header(raw: bytes | bytearray | memoryview) -> Header:
    """Check and parse ``HEADER.size`` bytes; ``FrameError`` for anything but a well-formed
    header of this version whose lengths agree, ``RequestTooLarge`` for a body over the
    limit."""
    magic, version, kind, dtype, flags, meta_bytes, dim, num_ids, num_rows, body = \
        HEADER.unpack(raw)
    if magic != MAGIC:
        raise FrameError(f"frame: magic {shorten(bytes(magic))}, not {MAGIC!r} (is this an "
                         "xcls shard's data port?)")
    if version != VERSION:
        raise FrameError(f"frame: version {version}; this shard speaks version {VERSION}")
    try:
        kind = Kind(kind)
    except ValueError:
        raise FrameError(f"frame: unknown kind {kind}") from None
    if flags & ~KNOWN_FLAGS:
        raise FrameError(f"frame: flags {flags:#x}; version {VERSION} defines only "
                         f"{SHARED_FLAG:#x} (shared rows) and {POSITIONS_FLAG:#x} (positions)")
    shared, positions = bool(flags & SHARED_FLAG), bool(flags & POSITIONS_FLAG)
    if shared and kind not in SHARED_KINDS:
        raise FrameError(f"frame: a {kind.name} cannot have its rows in a shared buffer")
    if positions and (kind != Kind.PULL or not shared):
        raise FrameError(f"frame: only a PULL with shared rows has positions, not "
                         f"a{' shared' if shared else ''} {kind.name}")
    if meta_bytes > MAX_META_BYTES:
        raise FrameError(f"frame: {meta_bytes} bytes of meta, the limit is {MAX_META_BYTES}")
    if body > MAX_BODY_BYTES:
        raise RequestTooLarge(f"frame: a body of {body} bytes, the limit is {MAX_BODY_BYTES}; "
                              "split the request")
    row_dtype = torch_dtype(dtype, "frame.dtype") if dtype else None
    if row_dtype is None and (num_rows or dim):
        raise FrameError(f"frame: {num_rows} rows of width {dim} without a dtype")
    header = Header(kind, row_dtype, meta_bytes, dim, num_ids, num_rows, shared, positions)
    if header.body_bytes != body:
        rows = "shared rows" if shared else "rows"
        ids = f"{num_ids} ids{' with positions' if positions else ''}"
        raise FrameError(f"frame: body_bytes {body}, but {meta_bytes} bytes of meta, "
                         f"{ids} and {num_rows} {rows} of {dim} x {row_dtype} make "
                         f"{header.body_bytes}")
    return header


def encode_meta(meta: dict) -> bytes:
    """A frame's meta: compact JSON, UTF-8."""
    return json.dumps(meta, separators=(",", ":")).encode()


def decode_meta(raw: bytes | bytearray | memoryview) -> dict:
    """The JSON object of a frame's meta; ``FrameError`` for anything else."""
    if not raw:
        return {}
    try:  # UTF-8 as the format says
        meta = parse_json(bytes(raw).decode())
    except ValueError as e:  # invalid UTF-8 included
        raise FrameError(f"frame meta: not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise FrameError(f"frame meta: a JSON object is required, got {type(meta).__name__}")
    return meta


def meta_field(meta: dict, key: str, kind: type | tuple[type, ...], *,
               required: bool = True) -> object:
    """``meta[key]``, checked to be of ``kind`` (bool is no number here); InvalidArgument
    naming the field otherwise."""
    if key not in meta:
        if required:
            raise InvalidArgument(f"frame meta: {key!r} is required")
        return None
    value = meta[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise InvalidArgument(f"frame meta: {key!r} must be {names}, got {shorten(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgument(f"frame meta: {key!r} must be finite, got {value}")
    return value


def check_request(header: Header, max_ids: int) -> None:
    """What a shard requires of a request's header before it reads the body: a request kind,
    and ids and rows that fit its kind (PUSH: as many gradient rows as ids)."""
    if header.kind not in REQUEST_KINDS:
        raise FrameError(f"frame: kind {header.kind.name} is an answer, not a request")
    if header.num_ids > max_ids:
        raise RequestTooLarge(f"frame: {header.num_ids} ids in one request, the limit is "
                              f"{max_ids}; split the request")
    if header.kind == Kind.PUSH:
        if header.num_rows != header.num_ids:
            raise InvalidArgument(f"frame: a push of {header.num_ids} ids carries "
                                  f"{header.num_rows} gradient rows")
    elif header.num_rows or header.dim:
        raise InvalidArgument(f"frame: a {header.kind.name} request carries no rows")
    if header.kind in (Kind.HELLO, Kind.SCAN) and header.num_ids:
        raise InvalidArgument(f"frame: a {header.kind.name} carries no ids")

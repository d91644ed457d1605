"""Tensor <-> wire ``Tensor`` message: dtype, shape and raw little-endian bytes.

Decoding does not copy: the tensor views the message's bytes (read-only; callers that keep the
data copy it as part of their own work, e.g. the store's index_put).
"""

from __future__ import annotations

import math
import sys
import warnings

import torch

from ams.api import shard_pb2 as pb
from ams.dtypes import torch_dtype, wire_dtype
from ams.errors import InvalidArgument, shorten
from ams.shard.store import TableSpec

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("ams.wire.codec assumes a little-endian host")


def encode(tensor: torch.Tensor, out: pb.Tensor | None = None) -> pb.Tensor:
    """Fill (or make) a wire ``Tensor`` from a CPU tensor of a wire dtype."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    msg = pb.Tensor() if out is None else out
    msg.dtype = wire_dtype(t.dtype)
    msg.shape[:] = list(t.shape)
    # numpy has no bfloat16: move its bits as int16, the bytes are the same.
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    msg.data = raw.numpy().tobytes()
    return msg


def decode(msg: pb.Tensor, field: str, *, dtype: torch.dtype | None = None,
           ndim: int | None = None) -> torch.Tensor:
    """Wire ``Tensor`` -> tensor, validated.

    ``dtype``/``ndim``: what the caller requires; a mismatch, a negative dimension or a byte
    length that disagrees with the shape raises ``InvalidArgument`` naming ``field``.
    """
    got = torch_dtype(msg.dtype, field=f"{field}.dtype")
    if dtype is not None and got != dtype:
        raise InvalidArgument(f"{field}: dtype {got} where {dtype} is required")
    shape = list(msg.shape)
    if ndim is not None and len(shape) != ndim:
        raise InvalidArgument(
            f"{field}: shape {shorten(shape)} has {len(shape)} dims, {ndim} required")
    if any(s < 0 for s in shape):
        raise InvalidArgument(f"{field}: negative dimension in shape {shorten(shape)}")
    itemsize = torch.empty((), dtype=got).element_size()
    # with a zero among them the other dimensions can be anything, and torch's strides of
    # such a shape overflow int64
    if math.prod(max(s, 1) for s in shape) * itemsize >= 2**63:
        raise InvalidArgument(f"{field}: shape {shorten(shape)} of {got} is too large for a "
                              "tensor")
    expected = math.prod(shape) * itemsize
    if len(msg.data) != expected:
        raise InvalidArgument(
            f"{field}: {len(msg.data)} bytes where shape {shorten(shape)} of {got} needs "
            f"{expected}")
    if expected == 0:
        return torch.empty(shape, dtype=got)
    with warnings.catch_warnings():
        # The view is read-only by construction; nothing writes through it.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(msg.data, dtype=got)
    return flat.view(shape)


def decode_optional(msg: pb.Tensor, field: str, *, dtype: torch.dtype | None = None,
                    ndim: int | None = None) -> torch.Tensor | None:
    """``decode``, or None for a field left unset or empty (no dtype, shape or data)."""
    if msg.ByteSize() == 0:
        return None
    return decode(msg, field, dtype=dtype, ndim=ndim)


def spec_from_wire(msg: pb.TableSpec) -> TableSpec:
    """Wire spec -> validated ``TableSpec`` (state dtype defaults to the row dtype)."""
    dtype = torch_dtype(msg.dtype, "spec.dtype")
    state = torch_dtype(msg.state_dtype, "spec.state_dtype") if msg.state_dtype else dtype
    return TableSpec(name=msg.name, num_rows=msg.num_rows, dim=msg.dim, dtype=dtype,
                     state_dtype=state, momentum=msg.momentum, weight_decay=msg.weight_decay,
                     seed=msg.seed, init_std=msg.init_std)


def spec_to_wire(spec: TableSpec) -> pb.TableSpec:
    return pb.TableSpec(name=spec.name, num_rows=spec.num_rows, dim=spec.dim,
                        dtype=wire_dtype(spec.dtype),
                        state_dtype=wire_dtype(spec.state_dtype), momentum=spec.momentum,
                        weight_decay=spec.weight_decay, seed=spec.seed, init_std=spec.init_std)

"""Wire codec: round trips for every dtype, and hostile messages rejected with the field named."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ams.api import shard_pb2 as pb
from ams.errors import InvalidArgument
from ams.wire import codec


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32])
@pytest.mark.parametrize("shape", [(0,), (5,), (3, 4), (0, 7)])
def test_round_trip(dtype, shape):
    t = (torch.randn(shape) * 100).to(dtype)
    back = codec.decode(pb.Tensor.FromString(codec.encode(t).SerializeToString()), "x")
    assert back.dtype == dtype and tuple(back.shape) == shape
    assert torch.equal(back, t)


def test_little_endian_bytes():
    msg = codec.encode(torch.tensor([1, 258], dtype=torch.int64))
    assert msg.data == (1).to_bytes(8, "little") + (258).to_bytes(8, "little")
    msg = codec.encode(torch.tensor([1, -2], dtype=torch.int32))
    assert msg.dtype == pb.INT32
    assert msg.data == (1).to_bytes(4, "little") + (-2).to_bytes(4, "little", signed=True)


def test_decode_optional_reads_unset_or_empty_as_none():
    request = pb.SetNeighborsRequest()
    assert codec.decode_optional(request.offsets, "offsets") is None
    request.offsets.CopyFrom(pb.Tensor())  # set, but empty
    assert codec.decode_optional(request.offsets, "offsets") is None
    codec.encode(torch.tensor([0, 2]), request.offsets)
    assert codec.decode_optional(request.offsets, "offsets").tolist() == [0, 2]
    request.offsets.CopyFrom(pb.Tensor(shape=[1], data=b"\0" * 8))  # no dtype: refused
    with pytest.raises(InvalidArgument, match="offsets.dtype"):
        codec.decode_optional(request.offsets, "offsets")


@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=50))
def test_int64_round_trip_property(values):
    t = torch.tensor(values, dtype=torch.int64)
    assert torch.equal(codec.decode(codec.encode(t), "ids"), t)


@pytest.mark.parametrize("msg,match", [
    (pb.Tensor(dtype=pb.FLOAT32, shape=[2], data=b"\0" * 7), "7 bytes where shape"),
    (pb.Tensor(dtype=pb.FLOAT32, shape=[-1], data=b""), "negative dimension"),
    (pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, shape=[1], data=b"\0" * 4), "dtype"),
    (pb.Tensor(dtype=99, shape=[1], data=b"\0" * 4), "unknown"),
    (pb.Tensor(dtype=pb.FLOAT32, shape=[2**40, 2**40], data=b""), "too large"),
    # no elements, yet strides past int64
    (pb.Tensor(dtype=pb.INT32, shape=[0, 2**40, 2**40], data=b""), "too large"),
])
def test_hostile_messages(msg, match):
    with pytest.raises(InvalidArgument, match=match) as info:
        codec.decode(msg, "grads")
    assert "grads" in str(info.value)


def test_required_dtype_and_ndim():
    msg = codec.encode(torch.zeros(3, dtype=torch.float32))
    with pytest.raises(InvalidArgument, match="int64 is required"):
        codec.decode(msg, "ids", dtype=torch.int64)
    with pytest.raises(InvalidArgument, match="2 required"):
        codec.decode(msg, "grads", ndim=2)

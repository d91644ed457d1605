"""The dtypes a table may hold, by the names users write in configs and API calls."""

from __future__ import annotations

from enum import StrEnum

import torch

from ams.errors import InvalidArgument


class RowDtype(StrEnum):
    """How a table stores its rows (and, by default, their optimizer state)."""

    FLOAT32 = "float32"  # full precision: 4 bytes per value, the reference
    FLOAT16 = "float16"  # half the memory and wire bytes; the head computes in float32
    BFLOAT16 = "bfloat16"  # float32's range at float16's size, fewer mantissa bits


ROW_DTYPES: dict[str, torch.dtype] = {
    RowDtype.FLOAT32: torch.float32,
    RowDtype.FLOAT16: torch.float16,
    RowDtype.BFLOAT16: torch.bfloat16,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: str(k) for k, v in ROW_DTYPES.items()}


def parse_row_dtype(value: str | torch.dtype, field: str = "dtype") -> torch.dtype:
    """``"float16"`` or ``torch.float16`` -> ``torch.float16``; anything else is an error."""
    if isinstance(value, torch.dtype):
        if value in DTYPE_NAMES:
            return value
    elif value in ROW_DTYPES:
        return ROW_DTYPES[value]
    raise InvalidArgument(f"{field}={value!r} is not one of {[str(d) for d in RowDtype]}")


# The numbers of shard.proto's DType enum, which are also the dtype byte of a data-plane frame
# (proto/ams/api/frames.md); tests/test_proto_stubs.py checks that the two agree.
WIRE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int64: 4,
    torch.int32: 5,
}
_FROM_WIRE: dict[int, torch.dtype] = {v: k for k, v in WIRE_CODES.items()}


def wire_dtype(dtype: torch.dtype) -> int:
    """torch dtype -> its wire code (``DType`` enum value)."""
    try:
        return WIRE_CODES[dtype]
    except KeyError:
        raise InvalidArgument(f"dtype {dtype} cannot travel on the wire") from None


def torch_dtype(value: int, field: str = "dtype") -> torch.dtype:
    """Wire code -> torch dtype; unknown or unspecified is an error naming the field."""
    try:
        return _FROM_WIRE[value]
    except KeyError:
        raise InvalidArgument(f"{field}: unknown or unspecified dtype {value}") from None

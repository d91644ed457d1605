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

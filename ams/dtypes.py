"""The dtypes a table may hold, by the names users write in configs and API calls."""

from __future__ import annotations

import torch

from ams.errors import InvalidArgument

ROW_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in ROW_DTYPES.items()}


def parse_row_dtype(value: str | torch.dtype, field: str = "dtype") -> torch.dtype:
    """``"float16"`` or ``torch.float16`` -> ``torch.float16``; anything else is an error."""
    if isinstance(value, torch.dtype):
        if value in DTYPE_NAMES:
            return value
    elif value in ROW_DTYPES:
        return ROW_DTYPES[value]
    raise InvalidArgument(f"{field}={value!r} is not one of {sorted(ROW_DTYPES)}")

"""What a table is: its name, classes, row width, dtypes, optimizer settings and initial rows,
checked when it is made, so that every shard and every snapshot agree on one spec."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from ams import sharding
from ams.dtypes import DTYPE_NAMES, parse_row_dtype
from ams.errors import InvalidArgument, shorten
from ams.limits import MAX_DIM
from ams.shard.optim import MAX_RATE
from ams.shard.rowinit import MAX_ABS_NORMAL

MAX_TABLE_NAME = 128
_FLOAT_MAX = sys.float_info.max


@dataclass(frozen=True)
class TableSpec:
    """What a table is. ``num_rows`` is the global class count (ids 0..num_rows-1)."""

    name: str
    num_rows: int
    dim: int
    dtype: torch.dtype = torch.float32
    state_dtype: torch.dtype = torch.float32
    momentum: float = 0.9
    weight_decay: float = 5e-4
    seed: int = 0
    init_std: float = 0.01

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > MAX_TABLE_NAME \
                or not self.name.isprintable() or "/" in self.name:
            raise InvalidArgument(f"table name {shorten(self.name)}: need 1..{MAX_TABLE_NAME} "
                                  "printable characters, no '/'")
        if not isinstance(self.num_rows, int) or not 0 < self.num_rows < sharding.MAX_ROWS:
            raise InvalidArgument(
                f"num_rows={shorten(self.num_rows)} must be an integer in [1, 2**62)")
        if not isinstance(self.dim, int) or not 0 < self.dim <= MAX_DIM:
            raise InvalidArgument(f"dim={shorten(self.dim)} must be an integer in [1, {MAX_DIM}]")
        object.__setattr__(self, "dtype", parse_row_dtype(self.dtype, "dtype"))
        object.__setattr__(self, "state_dtype", parse_row_dtype(self.state_dtype, "state_dtype"))
        nonnegative("momentum", self.momentum)
        nonnegative("weight_decay", self.weight_decay, MAX_RATE)
        nonnegative("init_std", self.init_std)
        if self.momentum >= 1:
            raise InvalidArgument(f"momentum={self.momentum} must be < 1")
        # a larger std would fill the new table with infinities
        max_std = float(torch.finfo(self.dtype).max) / MAX_ABS_NORMAL
        if self.init_std > max_std:
            raise InvalidArgument(f"init_std={self.init_std:g} overflows {DTYPE_NAMES[self.dtype]} "
                                  f"rows: must be at most {max_std:.6g}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise InvalidArgument(f"seed={shorten(self.seed)} must be an integer in [0, 2**63)")

    @property
    def state_width(self) -> int:
        """Columns of the optimizer state: ``dim`` with momentum, 0 without (plain SGD keeps
        no state, which halves a float32 table's memory)."""
        return self.dim if self.momentum else 0

    def describe(self) -> dict:
        """JSON-able form (dtype names), used by snapshots and stats."""
        return {
            "name": self.name, "num_rows": self.num_rows, "dim": self.dim,
            "dtype": DTYPE_NAMES[self.dtype], "state_dtype": DTYPE_NAMES[self.state_dtype],
            "momentum": self.momentum, "weight_decay": self.weight_decay, "seed": self.seed,
            "init_std": self.init_std,
        }

    @classmethod
    def from_description(cls, d: dict) -> TableSpec:
        return cls(**d)

    @property
    def bytes_per_row(self) -> int:
        """Memory one row takes with its state and decay clock."""
        return self.dim * self.dtype.itemsize + self.state_width * self.state_dtype.itemsize + 8

    def bytes_per_shard(self, num_shards: int) -> int:
        """Memory the largest part of this table takes on one of ``num_shards`` shards: rows,
        state and decay clocks."""
        return sharding.owned_count(self.num_rows, 0, num_shards) * self.bytes_per_row


def nonnegative(name: str, value: object, high: float = _FLOAT_MAX) -> float:
    """``value`` as a float in [0, ``high``], else ``InvalidArgument``. Compares before it
    converts: a JSON integer may be far past float64 (and int64, which torch would make it)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 <= value <= high:
        bound = "a finite number >= 0" if high == _FLOAT_MAX else f"a number in [0, {high:.6g}]"
        raise InvalidArgument(f"{name}={shorten(value)} must be {bound}")
    return float(value)

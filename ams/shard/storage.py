"""Where one shard's table tensors live: in memory, or in files mapped into the process.

A shard keeps three tensors per table (``ams.shard.store``): rows (slots, dim) of the row dtype,
optimizer state (slots, state_width) of the state dtype, and each row's decay clock, float64
(slots,). ``StorageKind.MEMORY`` keeps them in RAM, one slot per row: row p in slot p
(``MemoryStorage``, here). ``StorageKind.MMAP`` keeps them in files mapped shared, so that a
shard's part of a table may exceed the machine's memory (``ams.shard.mapped``). Pure: no gRPC.
"""

from __future__ import annotations

import mmap
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Protocol

import torch

from ams import sharding
from ams.alloc import zeros_on_huge_pages
from ams.errors import RequestTooLarge, shorten
from ams.shard.slots import RowSlots

# what the errors of a table too large for its storage advise
TOO_LARGE_ADVICE = "use more shards, fewer rows or a smaller dtype"


class StorageKind(StrEnum):
    MEMORY = "memory"  # tensors in RAM: a shard's part of a table must fit the machine's memory
    MMAP = "mmap"  # files under a storage dir, mapped shared and paged in and out by the OS


class TableLayout(Protocol):
    """What storage reads of a table spec (``ams.shard.store.TableSpec``)."""

    name: str
    num_rows: int
    dim: int
    dtype: torch.dtype
    state_dtype: torch.dtype

    @property
    def state_width(self) -> int: ...

    def describe(self) -> dict: ...

    def bytes_per_shard(self, num_shards: int) -> int: ...


@dataclass
class MappedFiles:
    """Where an mmap table's tensors are mapped from: ``home``, its directory (a staging
    directory until installed), and the maps, kept to flush them."""

    home: Path
    maps: list[mmap.mmap] = field(default_factory=list)

    def flush(self) -> None:
        """Write every dirty page to the files and wait until it is written (msync)."""
        for m in self.maps:
            m.flush()


@dataclass
class TableTensors:
    """One shard's part of a table: rows (slots, dim) of the row dtype, state (slots,
    state_width) of the state dtype, row_clock float64 (slots,); ``files``: where they are
    mapped from (None: in memory); ``slots``: the slot of each row (None: row p in slot p,
    and slots == owned rows)."""

    rows: torch.Tensor
    state: torch.Tensor
    row_clock: torch.Tensor
    files: MappedFiles | None = None
    slots: RowSlots | None = None

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """Slots of local ``positions`` (int64 (m,)): int64 (m,)."""
        return positions if self.slots is None else self.slots.lookup(positions)


@dataclass
class ReopenedTable:
    """A closed table found again by ``Storage.reopen``: its spec and push dedupe state as the
    caller's parsers made them, its tensors and its decay clock."""

    spec: TableLayout
    tensors: TableTensors
    clock: float
    dedupe: object


class Storage(ABC):
    """Makes, installs, copies and keeps one shard's table tensors. The store calls
    ``install`` under its tables lock and ``copy`` and ``close_table`` under the table's;
    ``stage`` and ``discard`` work on files of their own and need no lock."""

    kind: StorageKind

    def __init__(self, shard_id: int, num_shards: int) -> None:
        self.shard_id, self.num_shards = shard_id, num_shards

    def owned(self, spec: TableLayout) -> int:
        return sharding.owned_count(spec.num_rows, self.shard_id, self.num_shards)

    def capacity(self, spec: TableLayout) -> int:
        """Slots of this shard's tensors of ``spec``: one per owned row."""
        return self.owned(spec)

    def shapes(self, spec: TableLayout, slots: int | None = None
               ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """(shape, dtype) of each of this shard's tensors of ``spec``, in ``TENSORS`` order,
        with ``slots`` rows (None: ``capacity(spec)``)."""
        slots = self.capacity(spec) if slots is None else slots
        return {"rows": ((slots, spec.dim), spec.dtype),
                "state": ((slots, spec.state_width), spec.state_dtype),
                "row_clock": ((slots,), torch.float64)}

    @abstractmethod
    def stage(self, spec: TableLayout) -> TableTensors:
        """Zero tensors for this shard's part of ``spec``, not yet any live table's;
        ``RequestTooLarge`` (``StorageFull`` for files) when they cannot be had."""

    @abstractmethod
    def install(self, spec: TableLayout, staged: TableTensors) -> TableTensors:
        """Make ``staged`` (from ``stage``) the live tensors of ``spec.name``, replacing any
        live table of that name; returns them."""

    @abstractmethod
    def discard(self, staged: TableTensors) -> None:
        """Drop staged tensors that will not be installed."""

    @abstractmethod
    def copy(self, tensors: TableTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of (rows, state, row_clock) at this instant (for a snapshot to write)."""

    @abstractmethod
    def scratch(self, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` (its values unset) for data that no restart
        keeps (``what`` names it in errors): a table's neighbor lists, a snapshot's copy."""

    @abstractmethod
    def kept(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """``tensor``, made elsewhere, where ``scratch`` would have put it: itself, or a
        copy in a scratch tensor."""

    @abstractmethod
    def read_ahead(self, tensor: torch.Tensor, positions: torch.Tensor) -> None:
        """Start reading the rows ``positions`` (int64 (m,)) of a ``scratch`` tensor where
        some are not in memory."""

    @abstractmethod
    def close_table(self, spec: TableLayout, tensors: TableTensors, clock: float,
                    dedupe: list) -> None:
        """Keep a live table for a later store: its tensors, decay clock and push dedupe
        state (``PushDedupe.to_json``)."""

    @abstractmethod
    def reopen(self, parse_spec: Callable[[dict], TableLayout],
               parse_dedupe: Callable[[object], object]) -> list[ReopenedTable]:
        """The tables a previous store closed here, reopened (they are live from now on);
        ``parse_spec`` and ``parse_dedupe`` turn their stored descriptions into objects."""

    @abstractmethod
    def close(self) -> None:
        """Let another store use this storage."""


class MemoryStorage(Storage):
    """Tensors in RAM; nothing outlives the process."""

    kind = StorageKind.MEMORY

    def stage(self, spec: TableLayout) -> TableTensors:
        needed = spec.bytes_per_shard(self.num_shards)
        advice = f"{TOO_LARGE_ADVICE}, or storage='mmap'"
        physical = _physical_memory_bytes()
        # Past physical memory an allocation may still succeed (overcommit) and the process
        # be killed while the rows are filled in; refuse it before it starts.
        if physical is not None and needed > physical:
            raise RequestTooLarge(
                f"table {shorten(spec.name)} needs {needed} bytes on each of {self.num_shards} "
                f"shards, more than this machine's {physical} bytes of memory; {advice}")
        try:
            tensors = [zeros_on_huge_pages(shape, dtype) for shape, dtype in
                       self.shapes(spec).values()]
        # torch raises RuntimeError when malloc fails; an anonymous map, OSError or, past the
        # address space, OverflowError
        except (RuntimeError, MemoryError, OSError, OverflowError) as e:
            raise RequestTooLarge(
                f"table {shorten(spec.name)} needs {needed} bytes on each of {self.num_shards} "
                f"shards and this shard cannot allocate them ({shorten(str(e))}); "
                f"{advice}") from None
        return TableTensors(*tensors)

    def install(self, spec: TableLayout, staged: TableTensors) -> TableTensors:
        return staged

    def discard(self, staged: TableTensors) -> None:
        """Nothing to do: the tensors go with their last reference."""

    def copy(self, tensors: TableTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tensors.rows.clone(), tensors.state.clone(), tensors.row_clock.clone()

    def scratch(self, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def kept(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        return tensor

    def read_ahead(self, tensor: torch.Tensor, positions: torch.Tensor) -> None:
        """Nothing to read: RAM."""

    def close_table(self, spec: TableLayout, tensors: TableTensors, clock: float,
                    dedupe: list) -> None:
        """Nothing to keep: memory tables end with the process."""

    def reopen(self, parse_spec: Callable[[dict], TableLayout],
               parse_dedupe: Callable[[object], object]) -> list[ReopenedTable]:
        return []

    def close(self) -> None:
        """Nothing to release."""


def _physical_memory_bytes() -> int | None:
    """The machine's memory, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None

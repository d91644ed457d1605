"""Where one shard's table tensors live: in memory, or in files mapped into the process.

A shard keeps three tensors per table (``ams.shard.store``): rows (slots, dim) of the row dtype,
optimizer state (slots, state_width) of the state dtype, and each row's decay clock, float64
(slots,). ``StorageKind.MEMORY`` keeps them in RAM, one slot per row: row p in slot p.
``StorageKind.MMAP`` keeps them in files mapped shared, so pushes write the files and the OS
pages rows in and out: a shard's part of a table may exceed the machine's memory. An mmap
table has spare slots and a slot map (``ams.shard.slots.RowSlots``): each push moves the rows it
updates into free slots next to each other, so that it dirties few pages. Its layout, in a
storage dir the shards may share::

    STORAGE_DIR/shard-00000-of-00002/      one directory per shard (``sharding.piece_name``)
        .lock                              held (flock) by the store that uses it
        fc/                                one per table (``table_dir_name``)
            rows.bin state.bin row_clock.bin   each tensor's bytes by slot, row-major, native
                                           order
            slots.bin                      once closed: each row's slot, int32 (or int64 past
                                           2**31 slots), in position order
            table.json                     spec, shard layout, slot count, "closed"; once
                                           closed also the decay clock, the slots' cursor and
                                           the push dedupe state

Files are preallocated (``posix_fallocate``), so a full disk, a quota or a file-size limit
fails when a table is made, with ``StorageFull``, not later as SIGBUS on a page's first write.
A new table, created or restored, is built in a hidden directory beside the live ones and
renamed into place once complete: a failure leaves no half-made files and the live table as
it was. ``close_table`` flushes the maps (msync) and marks the table closed; a store opening
the directory again reopens closed tables and discards the others, whose files may hold a
half-applied push (the process died; a snapshot is the recovery). Copies for snapshots go to
scratch files unlinked as soon as they are mapped: no RAM copy of the table, their disk space
returns when the copy is dropped, and a crash leaves none behind. Pure: no gRPC.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import hashlib
import json
import logging
import math
import mmap
import os
import re
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ams import sharding
from ams.alloc import libc_function, zeros_on_huge_pages
from ams.errors import InvalidArgument, RequestTooLarge, StorageError, StorageFull, shorten
from ams.jsontext import parse_json
from ams.shard import rowcopy
from ams.shard.slots import RowSlots, slot_capacity, slot_dtype

log = logging.getLogger(__name__)

# the layout of a table's directory: 2 has slots (format 1 tables, one slot per row in
# position order and no slots.bin, are read)
TABLE_FORMAT = 2
TABLE_FORMATS = (1, 2)
TABLE_JSON = "table.json"
TENSORS = ("rows", "state", "row_clock")  # each in <name>.bin
SLOTS_FILE = "slots.bin"
LOCK_FILE = ".lock"
# What a store makes beside its live tables: tables being built, tables being replaced,
# scratch copies. Hidden names, so no table's directory can take one; a store removes the
# leftovers of a process that died when it opens the directory.
_STAGE, _OLD, _SCRATCH = ".stage-", ".old-", ".scratch-"
# Table names used as directory names as they are; any other name goes by its hash.
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DISK_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "over the disk quota",
              errno.EFBIG: "over the process's file-size limit (ulimit -f)"}
_ADVICE = "use more shards, fewer rows or a smaller dtype"


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
    # False: never read a request's pages ahead (prefetch_rows); the baseline bench_scale
    # measures the read-ahead against
    read_ahead: bool = True

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


def table_dir_name(name: str) -> str:
    """The directory of table ``name`` in a shard's storage dir: the name itself when it is a
    plain file name, else ``~`` and a hash of it (table names may hold any printable
    character)."""
    if _PLAIN_NAME.match(name):
        return name
    return "~" + hashlib.sha256(name.encode()).hexdigest()[:32]


def open_storage(kind: str, storage_dir: str | Path | None, shard_id: int,
                 num_shards: int) -> Storage:
    """The storage of shard ``shard_id`` of ``num_shards``: ``kind`` "memory" (which keeps
    no files and ignores ``storage_dir``) or "mmap" (needs ``storage_dir``; ``StorageError``
    when it cannot be used or another store uses it). ``InvalidArgument`` for anything
    else."""
    try:
        kind = StorageKind(kind)
    except ValueError:
        raise InvalidArgument(f"storage={shorten(kind)}: need one of "
                              f"{', '.join(repr(k.value) for k in StorageKind)}") from None
    if kind == StorageKind.MEMORY:
        return MemoryStorage(shard_id, num_shards)
    if storage_dir is None:
        raise InvalidArgument("storage='mmap' needs a storage_dir for the table files")
    return MmapStorage(Path(storage_dir), shard_id, num_shards)


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
        advice = f"{_ADVICE}, or storage='mmap'"
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


class MmapStorage(Storage):
    """Tensors in files under ``storage_dir``/``piece_name``, mapped shared (see the module
    docstring for the layout). Holds the piece directory's lock from construction to
    ``close``."""

    kind = StorageKind.MMAP

    def __init__(self, storage_dir: Path, shard_id: int, num_shards: int) -> None:
        super().__init__(shard_id, num_shards)
        self.root = storage_dir / sharding.piece_name(shard_id, num_shards)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock = open(self.root / LOCK_FILE, "ab")  # held, and flocked, until close
        except OSError as e:
            raise StorageError(f"{self.root}: cannot keep table files here ({e.strerror})"
                               ) from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise StorageError(f"{self.root} is in use by another shard store (another "
                               "process, or a store of this one not closed); stop it first "
                               "or give this shard another storage dir") from None
        for p in self.root.iterdir():  # nothing of ours is in progress: we hold the lock
            if p.name.startswith((_STAGE, _OLD, _SCRATCH)):
                _remove(p)

    def capacity(self, spec: TableLayout) -> int:
        """Slots of this shard's files of ``spec``: its rows and spare slots
        (``ams.shard.slots``)."""
        return slot_capacity(self.owned(spec))

    def _doc(self, spec: TableLayout, slots: int, closed: bool) -> dict:
        """table.json of a table of ``slots`` slots (a table reopened from an older format
        keeps the slots its files have)."""
        return {"format": TABLE_FORMAT, "spec": spec.describe(), "shard_id": self.shard_id,
                "num_shards": self.num_shards, "owned_rows": self.owned(spec),
                "slots": slots, "closed": closed}

    def stage(self, spec: TableLayout) -> TableTensors:
        what = f"table {shorten(spec.name)}"
        shapes = self.shapes(spec)
        needed = sum(_nbytes(shape, dtype) for shape, dtype in shapes.values())
        free = shutil.disk_usage(self.root).free
        if needed > free:
            raise StorageFull(f"{what} needs {needed} bytes of files under {self.root}, and "
                              f"only {free} bytes are free there; free disk space or {_ADVICE}")
        home = self.root / f"{_STAGE}{uuid.uuid4().hex[:12]}"
        try:
            home.mkdir()
            files = MappedFiles(home)
            tensors = [_map_new(home / f"{name}.bin", shape, dtype, files, what)
                       for name, (shape, dtype) in shapes.items()]
            _write_json(home / TABLE_JSON, self._doc(spec, self.capacity(spec), closed=False),
                        what)
        except OSError as e:
            _remove(home)
            raise StorageError(f"{what}: cannot make its files in {self.root} "
                               f"({e.strerror or e})") from None
        except BaseException:
            _remove(home)
            raise
        return TableTensors(*tensors, files=files,
                            slots=RowSlots.identity(self.owned(spec), self.capacity(spec)))

    def install(self, spec: TableLayout, staged: TableTensors) -> TableTensors:
        files = staged.files
        if files is None or files.home.parent != self.root \
                or not files.home.name.startswith(_STAGE):
            raise InvalidArgument(f"table {shorten(spec.name)}: the tensors to install were "
                                  "not staged by this storage")
        final = self.root / table_dir_name(spec.name)
        old = self.root / f"{_OLD}{uuid.uuid4().hex[:12]}"
        try:
            if final.exists():
                final.rename(old)
            files.home.rename(final)
        except OSError as e:
            if old.exists() and not final.exists():
                old.rename(final)
            raise StorageError(f"table {shorten(spec.name)}: cannot put {files.home} in place "
                               f"of {final} ({e.strerror or e})") from None
        files.home = final
        fsync_path(self.root)
        # The replaced table's maps stay valid while its tensors are referenced (a push in
        # flight finishes on them); its files go now.
        _remove(old)
        return staged

    def discard(self, staged: TableTensors) -> None:
        home = staged.files.home if staged.files is not None else None
        if home is not None and home.parent == self.root and home.name.startswith(_STAGE):
            _remove(home)  # only ever a staging directory, never a live table's

    def copy(self, tensors: TableTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """File-backed copies, in position order, in scratch files of this shard's
        directory, unlinked once mapped; ``StorageFull`` when the disk cannot hold them. Rows
        are gathered from their slots a block at a time: no RAM copy of the table."""
        owned = tensors.slots.owned  # every mmap table has its slots (stage, reopen)
        sources = [getattr(tensors, name) for name in TENSORS]
        out = [self.scratch((owned, *src.shape[1:]), src.dtype, "a snapshot's copy")
               for src in sources]
        for start in range(0, owned, COPY_BLOCK_ROWS):
            stop = min(start + COPY_BLOCK_ROWS, owned)
            positions = torch.arange(start, stop)
            prefetch_rows(tensors, positions)
            at = tensors.at(positions)
            for src, copy in zip(sources, out, strict=True):
                if copy.numel():  # straight into the copy's file pages: no RAM temporary
                    rowcopy.gather(src.view(src.shape[0], -1), at,
                                   out=copy[start:stop].view(stop - start, -1))
        return out[0], out[1], out[2]

    def scratch(self, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
        """In a scratch file of this shard's directory, unlinked once mapped: its pages are
        the page cache's, which the kernel writes out to the disk when the rows need the
        memory, and the disk space returns when the tensor goes (a crash leaves no file
        behind). ``StorageFull`` when the disk cannot hold it."""
        path = self.root / f"{_SCRATCH}{uuid.uuid4().hex[:12]}.bin"
        try:
            return _map_new(path, shape, dtype, None, what)
        finally:
            path.unlink(missing_ok=True)

    def kept(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        return self.scratch(tuple(tensor.shape), tensor.dtype, what).copy_(tensor)

    def read_ahead(self, tensor: torch.Tensor, positions: torch.Tensor) -> None:
        if positions.numel() == 0 or tensor.numel() == 0:
            return
        pages = _pages_of(tensor, positions)
        if not _all_resident(tensor, pages):
            advise_will_need(tensor, pages)

    def close_table(self, spec: TableLayout, tensors: TableTensors, clock: float,
                    dedupe: list) -> None:
        """The maps are flushed and the slot map written before ``table.json`` says
        closed: a crash in between leaves a table that is not closed, discarded."""
        files = tensors.files
        what = f"table {shorten(spec.name)}"
        files.flush()
        slots = tensors.slots
        _write_file(files.home / SLOTS_FILE, slots.slot_of.tobytes(), what)
        doc = {**self._doc(spec, slots.capacity, closed=True), "decay_clock": clock,
               "push_dedupe": dedupe, "cursor": slots.cursor}
        _write_json(files.home / TABLE_JSON, doc, what)

    def reopen(self, parse_spec: Callable[[dict], TableLayout],
               parse_dedupe: Callable[[object], object]) -> list[ReopenedTable]:
        """Every table directory is checked before anything changes: a damaged or foreign
        one raises ``StorageError`` and nothing is deleted. Then tables not closed are
        discarded (a warning each) and the closed ones mapped and marked open."""
        closed, unclosed = [], []
        for home in sorted(p for p in self.root.iterdir()
                           if p.is_dir() and not p.name.startswith(".")):
            doc, spec = self._check(home, parse_spec)
            if doc["closed"]:
                closed.append((home, spec, self._check_closed(home, doc, spec, parse_dedupe)))
            else:
                unclosed.append((home, spec))
        for home, spec in unclosed:
            log.warning("table_discarded table=%s path=%s reason=not_closed: the process "
                        "stopped without closing it, its files may hold a half-applied push; "
                        "restore a snapshot", spec.name, home)
            _remove(home)
        out = []
        for home, spec, (clock, dedupe, slots) in closed:
            files = MappedFiles(home)
            tensors = [_map_existing(home / f"{name}.bin", shape, dtype, files)
                       for name, (shape, dtype) in self.shapes(spec, slots.capacity).items()]
            _write_json(home / TABLE_JSON, self._doc(spec, slots.capacity, closed=False),
                        f"table {shorten(spec.name)}")
            out.append(ReopenedTable(spec, TableTensors(*tensors, files=files, slots=slots),
                                     clock, dedupe))
            log.info("table_reopened table=%s path=%s rows=%d", spec.name, home,
                     self.owned(spec))
        return out

    def _check(self, home: Path, parse_spec: Callable[[dict], TableLayout]
               ) -> tuple[dict, TableLayout]:
        """table.json of ``home``: readable, of this format, this shard and this table."""
        where = home / TABLE_JSON
        fix = _fix(home)
        try:
            doc = parse_json(where.read_text())
        except (OSError, ValueError) as e:
            raise StorageError(f"{where}: unreadable ({e}); {fix}") from None
        try:
            if not isinstance(doc, dict) or doc.get("format") not in TABLE_FORMATS:
                got = doc.get("format") if isinstance(doc, dict) else doc
                raise ValueError(f"format {shorten(got)}, need one of "
                                 f"{', '.join(map(str, TABLE_FORMATS))}")
            spec = parse_spec(doc["spec"])
            layout = (doc["shard_id"], doc["num_shards"])
            if not isinstance(doc["closed"], bool):
                raise ValueError(f"closed {shorten(doc['closed'])}")
        except (KeyError, TypeError, ValueError) as e:
            raise StorageError(f"{where}: malformed ({type(e).__name__}: {shorten(str(e))}); "
                               f"{fix}") from None
        if layout != (self.shard_id, self.num_shards):
            raise StorageError(f"{where} belongs to shard {shorten(layout[0])} of "
                               f"{shorten(layout[1])}, this is shard {self.shard_id} of "
                               f"{self.num_shards}; {fix}")
        if home.name != table_dir_name(spec.name):
            raise StorageError(f"{where} describes table {shorten(spec.name)}, not the "
                               f"table of directory {home.name}; {fix}")
        return doc, spec

    def _check_closed(self, home: Path, doc: dict, spec: TableLayout,
                      parse_dedupe: Callable[[object], object]
                      ) -> tuple[float, object, RowSlots]:
        """A closed table's files have their tensors' sizes; its clock, push dedupe state
        and slot map parse. Returns (clock, dedupe, slots)."""
        fix = _fix(home)
        where = home / TABLE_JSON
        owned = self.owned(spec)
        try:
            clock = doc["decay_clock"]
            if isinstance(clock, bool) or not isinstance(clock, (int, float)) \
                    or not math.isfinite(clock) or clock < 0:
                raise ValueError(f"decay_clock {shorten(clock)}")
            dedupe = parse_dedupe(doc["push_dedupe"])
            # format 1: no spare slots, row p in slot p
            capacity, cursor = (doc["slots"], doc["cursor"]) if doc["format"] > 1 \
                else (owned, owned)
            for key, value in (("slots", capacity), ("cursor", cursor)):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{key} {shorten(value)}")
            if capacity < owned:
                raise ValueError(f"slots {capacity}, fewer than the {owned} rows")
        except (KeyError, TypeError, ValueError) as e:
            raise StorageError(f"{where}: malformed ({type(e).__name__}: {shorten(str(e))}); "
                               f"{fix}") from None
        sizes = {f"{name}.bin": _nbytes(shape, dtype)
                 for name, (shape, dtype) in self.shapes(spec, capacity).items()}
        if doc["format"] > 1:
            sizes[SLOTS_FILE] = owned * slot_dtype(capacity).itemsize
        for name, want in sizes.items():
            path = home / name
            try:
                size = path.stat().st_size
            except OSError as e:
                raise StorageError(f"{path}: missing ({e.strerror}); {fix}") from None
            if size != want:
                raise StorageError(f"{path}: {size} bytes, table {shorten(spec.name)} needs "
                                   f"{want} (truncated or damaged); {fix}")
        if doc["format"] == 1:
            return float(clock), dedupe, RowSlots.identity(owned, capacity)
        try:
            slot_of = np.fromfile(home / SLOTS_FILE, dtype=slot_dtype(capacity))
            return float(clock), dedupe, RowSlots(slot_of, capacity, cursor)
        except (OSError, ValueError) as e:
            raise StorageError(f"{home / SLOTS_FILE}: damaged ({shorten(str(e))}); {fix}"
                               ) from None

    def close(self) -> None:
        self._lock.close()


def _fix(home: Path) -> str:
    return f"remove {home} and restore a snapshot"


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _map_new(path: Path, shape: tuple[int, ...], dtype: torch.dtype,
             files: MappedFiles | None, what: str) -> torch.Tensor:
    """A new file at ``path`` holding a zero tensor of ``shape`` and ``dtype``, preallocated
    and mapped shared (the map kept in ``files`` when given, to flush it); ``StorageFull``
    when the disk or a limit refuses its bytes. An empty tensor stays in memory: there is
    nothing to map. The map lives as long as the tensor."""
    nbytes = _nbytes(shape, dtype)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            if nbytes == 0:
                return torch.zeros(shape, dtype=dtype)
            os.posix_fallocate(fd, 0, nbytes)
            m = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno in _DISK_FULL:
            raise StorageFull(f"{what}: {path} cannot get its {nbytes} bytes "
                              f"({_DISK_FULL[e.errno]}); free disk space, raise the limit or "
                              f"{_ADVICE}") from None
        raise
    _random_access(m)
    if files is not None:
        files.maps.append(m)
    return torch.frombuffer(m, dtype=dtype).view(shape)


def _map_existing(path: Path, shape: tuple[int, ...], dtype: torch.dtype,
                  files: MappedFiles) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` in the (size-checked) file at ``path``, mapped
    shared into ``files``."""
    nbytes = _nbytes(shape, dtype)
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    fd = os.open(path, os.O_RDWR)
    try:
        m = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    _random_access(m)
    files.maps.append(m)
    return torch.frombuffer(m, dtype=dtype).view(shape)


def _random_access(m: mmap.mmap) -> None:
    """Tell the kernel the map is read row by row at random (pulls and pushes of scattered
    ids): a page fault then reads its page, not the read-around window of up to 32 pages,
    which on a table larger than RAM would evict useful rows for neighbours nobody asked for."""
    if hasattr(mmap, "MADV_RANDOM"):
        m.madvise(mmap.MADV_RANDOM)


# rows per block when an mmap table's rows are gathered from their slots into a copy
COPY_BLOCK_ROWS = 1 << 16


def prefetch_rows(tensors: TableTensors, positions: torch.Tensor) -> None:
    """Ask the kernel to start reading the pages that hold rows ``positions`` (int64 (m,)) of
    an mmap table, all at once (madvise WILLNEED), before they are copied. A copy that faults
    its pages in one after another waits for one disk read at a time; started together, the
    reads overlap (benchmarks/RESULTS.md, "Scale").

    Only when some of them are not in memory: a few of the request's row pages are looked up
    first (mincore), and where all are resident, as on a table the page cache holds, nothing
    more is asked (the calls would cost more than the copy). The page cache is the host's,
    so this also reads ahead where several shards together outgrow it though each one alone
    would fit."""
    if (tensors.files is None or not tensors.files.read_ahead or positions.numel() == 0
            or tensors.rows.numel() == 0 or libc_function("madvise") is None):
        return
    at = tensors.at(positions)
    row_pages = _pages_of(tensors.rows, at)
    if _all_resident(tensors.rows, row_pages):
        return
    for tensor in (tensors.rows, tensors.state, tensors.row_clock):
        if tensor.numel() == 0:
            continue
        advise_will_need(tensor, row_pages if tensor is tensors.rows
                         else _pages_of(tensor, at))


def prefetch_slots_ahead(tensors: TableTensors, count: int) -> None:
    """Ask the kernel to start reading the pages of the slots a push of ``count`` rows will
    most likely move its rows into (``RowSlots.span_ahead``): one run of pages per tensor,
    which the kernel reads in large requests, where a write into a page missing from memory
    would read it alone (the maps are read at random, ``_random_access``)."""
    if (tensors.files is None or not tensors.files.read_ahead or tensors.slots is None
            or count == 0):
        return
    start, stop = tensors.slots.span_ahead(count)
    for tensor in (tensors.rows, tensors.state, tensors.row_clock):
        if tensor.numel() and stop > start:
            row_bytes = tensor.stride(0) * tensor.element_size()
            advise_will_need(tensor, torch.arange(start * row_bytes // mmap.PAGESIZE,
                                                  (stop * row_bytes - 1) // mmap.PAGESIZE + 1))


def advise_will_need(tensor: torch.Tensor, pages: torch.Tensor) -> None:
    """madvise(WILLNEED) on ``pages`` (int64 (p,) page numbers within ``tensor``'s mapping,
    which must be page aligned, as a mapped table's tensors are), one range per run of
    consecutive pages in that order: the kernel starts reading them and returns. A no-op
    where there is no glibc."""
    if pages.numel() == 0:
        return
    breaks = torch.nonzero(pages[1:] != pages[:-1] + 1).view(-1) + 1
    firsts = torch.cat([pages[:1], pages[breaks]])
    lasts = torch.cat([pages[breaks - 1], pages[-1:]])
    starts = (firsts * mmap.PAGESIZE).numpy().astype(np.uint64) + np.uint64(tensor.data_ptr())
    advise_ranges(starts, ((lasts - firsts + 1) * mmap.PAGESIZE).numpy().astype(np.uint64),
                  mmap.MADV_WILLNEED)


# ranges one process_madvise(2) call takes at most (the kernel's UIO_MAXIOV)
_IOV_MAX = 1024
# pids whose process_madvise(2) failed: they use one madvise(2) a range from then on
_no_process_madvise: set[int] = set()


def advise_ranges(starts: np.ndarray, lengths: np.ndarray, advice: int) -> None:
    """madvise(``advice``) on the ranges [starts[i], starts[i] + lengths[i]) of this process
    (uint64 (r,) each, page aligned): one process_madvise(2) call per ``_IOV_MAX`` ranges
    where the kernel takes it (5.10 and later), else one madvise(2) a range. A pull's
    read-ahead asks for hundreds of scattered pages, and a call from Python for each costs
    more CPU than the kernel spends on the resident ones. A no-op where there is no glibc."""
    pid = os.getpid()
    done = 0 if pid in _no_process_madvise else _process_madvise(pid, starts, lengths, advice)
    madvise = libc_function("madvise")
    if madvise is None:
        return
    for start, length in zip(starts[done:].tolist(), lengths[done:].tolist(), strict=True):
        madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice)


def _process_madvise(pid: int, starts: np.ndarray, lengths: np.ndarray, advice: int) -> int:
    """Ask for the ranges (as ``advise_ranges``) by process_madvise(2) with this process's
    own pidfd; returns how many of them, in order, were asked for. Fewer than all when the
    kernel refuses (too old, or not allowed): ``pid`` then asks one range at a time."""
    process_madvise = _process_madvise_function()
    pidfd = _own_pidfd(pid)
    if process_madvise is None or pidfd is None:
        _no_process_madvise.add(pid)
        return 0
    iovecs = np.stack([starts, lengths], axis=1)  # struct iovec {base, len} each, (r, 2)
    for first in range(0, len(iovecs), _IOV_MAX):
        part = iovecs[first:first + _IOV_MAX]
        if process_madvise(pidfd, ctypes.c_void_p(part.ctypes.data),
                           ctypes.c_size_t(len(part)), advice, 0) < 0:
            log.debug("process_madvise refused (errno %d): madvise one range at a time",
                      ctypes.get_errno())
            _no_process_madvise.add(pid)
            return first
    return len(iovecs)


@functools.cache
def _process_madvise_function() -> Callable[..., int] | None:
    """glibc's process_madvise, returning ssize_t, or None where there is none."""
    function = libc_function("process_madvise")
    if function is not None:
        function.restype = ctypes.c_ssize_t
    return function


@functools.cache
def _own_pidfd(pid: int) -> int | None:
    """A pidfd of this process (``pid``, so that a forked child opens its own), or None
    where the kernel has no pidfd_open(2)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


# pages of a request looked up before its read-ahead: if the page cache lacks a share p of
# the table, all of them are found resident with probability (1 - p)^8
_RESIDENCY_PROBES = 8


def _pages_of(tensor: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 (p,) ascending: the pages of ``tensor``'s mapping that rows ``positions`` touch."""
    row_bytes = tensor.stride(0) * tensor.element_size()
    first = positions * row_bytes // mmap.PAGESIZE
    last = (positions * row_bytes + row_bytes - 1) // mmap.PAGESIZE
    return torch.unique(torch.cat([first, last]))


def _all_resident(tensor: torch.Tensor, pages: torch.Tensor) -> bool:
    """Whether up to ``_RESIDENCY_PROBES`` of ``pages`` (int64 (p,) of ``tensor``'s
    mapping), spread over them, are all in memory (mincore). False where mincore is
    missing or fails: the read-ahead is then always asked for."""
    mincore = libc_function("mincore")
    if mincore is None:
        return False
    # evenly spaced over the request, never the same page twice (steps are at least 1 apart)
    picks = pages[torch.linspace(0, pages.numel() - 1, min(_RESIDENCY_PROBES, pages.numel()))
                  .round().long()]
    status = ctypes.c_ubyte()
    base = tensor.data_ptr()
    for page in picks.tolist():
        if mincore(ctypes.c_void_p(base + page * mmap.PAGESIZE), mmap.PAGESIZE,
                   ctypes.byref(status)) != 0 or not status.value & 1:
            return False
    return True


def resident_pages(tensor: torch.Tensor) -> torch.Tensor:
    """bool (pages,): which pages of ``tensor``'s mapping (page aligned, as a mapped table's
    tensors are) are in memory, by one mincore(2) over the whole mapping. OSError where
    mincore is missing or fails."""
    mincore = libc_function("mincore")
    if mincore is None:
        raise OSError(errno.ENOSYS, "mincore: no glibc")
    nbytes = tensor.numel() * tensor.element_size()
    status = (ctypes.c_ubyte * -(-nbytes // mmap.PAGESIZE))()
    if mincore(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(nbytes), status) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return torch.frombuffer(status, dtype=torch.uint8).bitwise_and(1).bool()


def _write_json(path: Path, doc: dict, what: str) -> None:
    """Replace ``path`` with ``doc`` whole (``_write_file``)."""
    _write_file(path, json.dumps(doc, separators=(",", ":")).encode(), what)


def _write_file(path: Path, data: bytes, what: str) -> None:
    """Replace ``path`` with ``data`` whole (temporary file, fsync, rename, fsync of the
    directory), so a crash leaves the old or the new one."""
    tmp = path.with_name(f"{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno in _DISK_FULL:
            raise StorageFull(f"{what}: {path} cannot be written ({_DISK_FULL[e.errno]})"
                              ) from None
        raise StorageError(f"{what}: {path} cannot be written ({e.strerror or e})") from None


def fsync_path(path: Path) -> None:
    """fsync a file or directory by path (a directory's fsync makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _physical_memory_bytes() -> int | None:
    """The machine's memory, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None

"""A shard's tables in files mapped into the process (``StorageKind.MMAP``): pushes write the
files and the OS pages rows in and out, so a shard's part of a table may exceed the machine's
memory. An mmap table has spare slots and a slot map (``ams.shard.slots.RowSlots``): each push moves
the rows it updates into free slots next to each other, so that it dirties few pages. Its layout, in
a storage dir the shards may share::

    STORAGE_DIR/shard-00000-of-00002/      one directory per shard (``sharding.piece_name``)
        .lock                              held (flock) by the store that uses it
        fc/                                one per table (``table_dir_name``)
            rows.bin state.bin row_clock.bin   each tensor's bytes by slot, row-major, native
                                           order
            slots.bin                      once closed: each row's slot, int32 (or int64 past
                                           2**31 slots), in position order
            table.json                     spec, shard layout, slot count, "closed"; once
                                           closed also the decay clock, the slots' cursor,
                                           the push dedupe state and a checksum of each
                                           file above (``ams.shard.table_sums``)

Files are preallocated (``posix_fallocate``), so a full disk, a quota or a file-size limit
fails when a table is made, with ``StorageFull``, not later as SIGBUS on a page's first write.
A new table, created or restored, is built in a hidden directory beside the live ones and
renamed into place once complete: a failure leaves no half-made files and the live table as
it was. ``close_table`` flushes the maps (msync) and marks the table closed; a store opening
the directory again reopens closed tables, once their files match the checksums recorded at
close, and discards the others, whose files may hold a half-applied push (the process died; a
snapshot is the recovery). Copies for snapshots go to
scratch files unlinked as soon as they are mapped: no RAM copy of the table, their disk space
returns when the copy is dropped, and a crash leaves none behind. Pure: no gRPC.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import math
import mmap
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from ams import sharding
from ams.errors import InvalidArgument, StorageError, StorageFull, shorten
from ams.jsontext import parse_json
from ams.shard import rowcopy
from ams.shard.page_advice import advise_will_need, all_resident, pages_of, prefetch_rows
from ams.shard.slots import RowSlots, slot_capacity, slot_dtype
from ams.shard.storage import (
    TOO_LARGE_ADVICE,
    MappedFiles,
    ReopenedTable,
    Storage,
    StorageKind,
    TableLayout,
    TableTensors,
)
from ams.shard.table_sums import SUMS_KEY, check_sums, file_sums

log = logging.getLogger(__name__)

# the layout of a table's directory (2: with spare slots and the slot map)
TABLE_FORMAT = 2
TABLE_JSON = "table.json"
TENSORS = ("rows", "state", "row_clock")  # each in <name>.bin
SLOTS_FILE = "slots.bin"
# the files whose checksums a closed table records
SUMMED_FILES = (*(f"{name}.bin" for name in TENSORS), SLOTS_FILE)
LOCK_FILE = ".lock"
# What a store makes beside its live tables: tables being built, tables being replaced,
# scratch copies. Hidden names, so no table's directory can take one; a store removes the
# leftovers of a process that died when it opens the directory.
_STAGE, _OLD, _SCRATCH = ".stage-", ".old-", ".scratch-"
# Table names used as directory names as they are; any other name goes by its hash.
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DISK_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "over the disk quota",
              errno.EFBIG: "over the process's file-size limit (ulimit -f)"}


def table_dir_name(name: str) -> str:
    """The directory of table ``name`` in a shard's storage dir: the name itself when it is a
    plain file name, else ``~`` and a hash of it (table names may hold any printable
    character)."""
    if _PLAIN_NAME.match(name):
        return name
    return "~" + hashlib.sha256(name.encode()).hexdigest()[:32]


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
        """table.json of a table of ``slots`` slots."""
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
                              f"only {free} bytes are free there; free disk space or "
                              f"{TOO_LARGE_ADVICE}")
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
        pages = pages_of(tensor, positions)
        if not all_resident(tensor, pages):
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
        try:
            sums = file_sums(files.home, SUMMED_FILES)
        except OSError as e:
            raise StorageError(f"{what}: its files in {files.home} cannot be read back "
                               f"({e.strerror or e})") from None
        doc = {**self._doc(spec, slots.capacity, closed=True), "decay_clock": clock,
               "push_dedupe": dedupe, "cursor": slots.cursor, SUMS_KEY: sums}
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
            if not isinstance(doc, dict) or doc.get("format") != TABLE_FORMAT:
                got = doc.get("format") if isinstance(doc, dict) else doc
                raise ValueError(f"format {shorten(got)}, need {TABLE_FORMAT}")
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
        """A closed table's files have their tensors' sizes and the checksums recorded at
        close; its clock, push dedupe state and slot map parse. Returns (clock, dedupe,
        slots)."""
        fix = _fix(home)
        where = home / TABLE_JSON
        owned = self.owned(spec)
        try:
            clock = doc["decay_clock"]
            if isinstance(clock, bool) or not isinstance(clock, (int, float)) \
                    or not math.isfinite(clock) or clock < 0:
                raise ValueError(f"decay_clock {shorten(clock)}")
            dedupe = parse_dedupe(doc["push_dedupe"])
            capacity, cursor = doc["slots"], doc["cursor"]
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
        if SUMS_KEY in doc:
            try:
                check_sums(home, doc[SUMS_KEY], SUMMED_FILES, fix)
            except OSError as e:
                raise StorageError(f"{home}: unreadable ({e.strerror or e}); {fix}") from None
        else:
            log.warning("table_unverified table=%s path=%s reason=no_checksums: closed by a "
                        "version that recorded none; its files are trusted as they are",
                        spec.name, home)
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
                              f"{TOO_LARGE_ADVICE}") from None
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

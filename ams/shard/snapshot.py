"""LMDB snapshots of a shard's tables (rows, momentum, decay clocks, neighbor lists and the
push dedupe state).

Layout under a data dir shared by the shards of a cluster::

    DATA/snapshots/step-000000000100/shard-00000-of-00002/
        data.mdb          the tensors, as LMDB values
        manifest.json     format version, step, table specs, owned id rule, the size and
                          SHA-256 of every data file, and a SHA-256 over every stored value
        manifest.sha256   the SHA-256 of manifest.json (``sha256sum -c`` reads it)

A piece is written under a temporary name, fsynced, and renamed into place, so a piece either
exists whole or not at all; a write that fails removes its temporary, and the step directory
when nothing else is in it, so a failed snapshot leaves no trace. A piece written again for
its step replaces the old one through a rename aside (``_move_in``), so a crash at any moment
leaves the old piece or the new one to restore. Restore checks, in this
order and before it installs anything: the manifest's checksum, the manifest's fields, every
data file's size and checksum (before LMDB maps the file: a truncated file would kill the
process with SIGBUS), then every value as it loads (``ams.shard.manifest``,
``ams.shard.restore``). A step with a missing (``IncompleteStep``), partial or corrupt piece
is skipped for an older one. A snapshot of S shards restores into any S' shards: each
restoring shard reads the rows it owns from every piece. ``prune_snapshots`` removes old steps
and leftovers of interrupted writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Collection
from pathlib import Path

import lmdb
import torch

from ams.errors import RequestTooLarge, SnapshotError, StorageError, shorten
from ams.shard.dedupe import MAX_CLIENT_ID, PUSH_DEDUPE_CLIENTS, PUSH_DEDUPE_WINDOW
from ams.shard.manifest import (
    CHUNK_BYTES,
    DATA_FILE,
    DTYPE_NAMES,
    FORMAT_VERSION,
    MANIFEST,
    MANIFEST_SUM,
    file_digest,
    is_int,
    load_manifest,
)
from ams.shard.mapped import fsync_path
from ams.shard.store import ShardStore
from ams.shard.table import TableCopy
from ams.sharding import piece_name

log = logging.getLogger(__name__)

COMMIT_BYTES = 256 << 20  # written values held in memory before LMDB commits them
# a piece's step directory is made again at most this often when other shards' failed writes
# remove it, empty, under this one (each time, another write failed at that very moment)
_MAKE_TMP_TRIES = 3
# Step numbers are zero-padded to 12 digits so that names sort; larger steps grow wider.
_STEP_RE = re.compile(r"^step-(\d{12,})$")
PIECE_RE = re.compile(r"^shard-(\d{5})-of-(\d{5})$")
# A piece being replaced by a new write of its step waits under this prefix (``_move_in``).
ASIDE = ".old-"
# The JSON of a full dedupe state: every client id, and every sequence as up to 20 digits.
_DEDUPE_BYTES = PUSH_DEDUPE_CLIENTS * (PUSH_DEDUPE_WINDOW * 22 + 6 * MAX_CLIENT_ID + 16)
# One writer or pruner at a time per piece identity (data dir, shard, shard count) in this
# process, so a pruner never takes a write in progress for the leftover of a dead one.
_PIECE_LOCKS: dict[tuple[str, int, int], threading.Lock] = {}
_PIECE_LOCKS_GUARD = threading.Lock()


class IncompleteStep(SnapshotError):
    """A step some shards wrote no piece of: their snapshot failed or a crash interrupted it,
    or they are still writing it. Not damage: an older step is the one to restore."""


def step_dir(data_dir: Path, step: int) -> Path:
    return Path(data_dir) / "snapshots" / f"step-{step:012d}"


def _piece_lock(data_dir: Path, shard_id: int, num_shards: int) -> threading.Lock:
    key = (str(Path(data_dir).resolve()), shard_id, num_shards)
    with _PIECE_LOCKS_GUARD:
        return _PIECE_LOCKS.setdefault(key, threading.Lock())


# ---- writing ----------------------------------------------------------------------------


class _BatchedWriter:
    """Puts into an LMDB environment, committed every ``COMMIT_BYTES``. LMDB keeps a write
    transaction's dirty pages in memory until it commits, so one transaction for a 6 GB
    piece would hold 6 GB; the piece is atomic anyway (written under a temporary name and
    renamed whole), so committing in batches loses nothing."""

    def __init__(self, env: lmdb.Environment) -> None:
        self.env = env
        self.txn = env.begin(write=True)
        self.pending = 0

    def put(self, key: bytes, value: memoryview) -> None:
        self.txn.put(key, value)
        self.pending += len(value)
        if self.pending >= COMMIT_BYTES:
            self.txn.commit()
            self.txn = self.env.begin(write=True)
            self.pending = 0

    def commit(self) -> None:
        self.txn.commit()

    def abort(self) -> None:
        try:
            self.txn.abort()
        except lmdb.Error:
            pass  # the transaction already failed (a commit that hit a full disk)


def _put_tensor(txn: _BatchedWriter, key: str, tensor: torch.Tensor, digest: hashlib._Hash
                ) -> dict:
    """Store a tensor as CHUNK_BYTES values ``key/000000..``; return its description."""
    flat = tensor.contiguous().reshape(-1)
    raw = flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat
    data = memoryview(raw.numpy()).cast("B")
    chunks = 0
    for start in range(0, len(data), CHUNK_BYTES):
        value = data[start:start + CHUNK_BYTES]
        digest.update(value)
        txn.put(f"{key}/{chunks:06d}".encode(), value)
        chunks += 1
    return {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape), "chunks": chunks}


def _put_table(txn: _BatchedWriter, copy: TableCopy, digest: hashlib._Hash) -> dict:
    """Store one table's copy; return its manifest entry."""
    name = copy.spec.name
    dedupe = json.dumps(copy.dedupe, separators=(",", ":")).encode()
    entry: dict = {
        "spec": copy.spec.describe(),
        "owned_rows": copy.rows.shape[0],
        "id_rule": "id % num_shards == shard_id, local position id // num_shards",
        "rows": _put_tensor(txn, f"{name}/rows", copy.rows, digest),
        "state": _put_tensor(txn, f"{name}/state", copy.state, digest),
        "row_clock": _put_tensor(txn, f"{name}/row_clock", copy.row_clock, digest),
        "push_dedupe": _put_tensor(txn, f"{name}/push_dedupe",
                                   torch.frombuffer(bytearray(dedupe), dtype=torch.uint8),
                                   digest),
        "decay_clock": copy.clock,
        "graph": None,
    }
    if copy.graph is not None:
        offsets, neighbors, version, step, k = copy.graph
        graph = entry["graph"] = {"version": version, "step": step, "k": k,
                                  "layout": "fixed" if offsets is None else "csr",
                                  "id_dtype": DTYPE_NAMES[neighbors.dtype]}
        # Readers hash values in this order: offsets (CSR only), then neighbors.
        if offsets is not None:
            graph["offsets"] = _put_tensor(txn, f"{name}/graph_offsets", offsets, digest)
        graph["neighbors"] = _put_tensor(txn, f"{name}/graph_neighbors", neighbors, digest)
    return entry


def _map_size(store: ShardStore) -> int:
    """LMDB's map size for a piece of ``store``, which LMDB needs up front (its 10 MiB default
    would fail on any real table). An upper bound with room for a graph that grows while the
    piece is written; the file itself only grows as far as the data."""
    payload = sum(t.rows.nbytes + t.state.nbytes + t.row_clock.nbytes
                  + (t.graph.nbytes() if t.graph else 0) + _DEDUPE_BYTES
                  for t in list(store.tables.values()))
    return int(payload * 1.25) + (64 << 20)


def write_snapshot(store: ShardStore, data_dir: Path, step: int) -> Path:
    """Write this shard's piece of snapshot ``step``; return the piece's directory.

    Each table is copied at one instant under its lock (``ShardStore.copy_table``: rows,
    state, clocks, graph and push dedupe state agree) and written after the lock is released,
    so pushes and pulls wait only for a memory copy (mmap tables: a copy into scratch
    files). Holds one table's copy at a time. ``SnapshotError`` when the piece cannot be
    written (a full disk, a file-size limit): nothing of it is left, the tables are as
    they were.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise SnapshotError(f"step={shorten(step)} must be an integer >= 0")
    final = step_dir(data_dir, step) / piece_name(store.shard_id, store.num_shards)
    with _piece_lock(data_dir, store.shard_id, store.num_shards):
        tmp = None
        try:
            tmp = _new_tmp(final)
            manifest = _write_data(store, tmp, step)
            _seal(tmp, manifest)
            _move_in(tmp, final)
        except (OSError, lmdb.Error, RequestTooLarge, StorageError) as e:
            # a full disk, a file-size limit, no room for an mmap table's scratch copy
            _drop_write(tmp, final.parent)
            raise SnapshotError(
                f"{final}: snapshot step {step} not written ({type(e).__name__}: "
                f"{shorten(str(e), 300)}; a full disk or a file-size limit?); nothing of it "
                "was kept, the tables serve on unchanged and older snapshots stay") from e
        except BaseException:
            _drop_write(tmp, final.parent)
            raise
        # the renames, and the step directory and snapshots/ made for this write, survive a
        # power loss once their parents are synced
        for parent in (final.parent, final.parent.parent, Path(data_dir)):
            fsync_path(parent)
        shutil.rmtree(_aside(final), ignore_errors=True)
    log.info("snapshot_written step=%d path=%s bytes=%d", step, final,
             manifest["files"][DATA_FILE]["size"])
    return final


def _aside(piece: Path) -> Path:
    """Where ``piece`` waits while a new write of its step replaces it."""
    return piece.parent / f"{ASIDE}{piece.name}"


def _move_in(tmp: Path, final: Path) -> None:
    """Rename the written piece ``tmp`` to ``final``. A directory cannot be renamed over a
    full one, so a piece already there (a snapshot of the same step again) is first renamed
    aside and removed only once the new one is in: a crash between the two renames leaves
    the old piece aside, which restore reads in its place (``pieces_of``) and the next prune
    renames back (``_remove_leftover_writes``)."""
    aside = _aside(final)
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)  # a crash after its replacement came in
        os.rename(final, aside)
    os.rename(tmp, final)


def _new_tmp(final: Path) -> Path:
    """A new directory to write ``final``'s piece in, beside it, its step directory made too.
    Another shard removes that directory when its own write fails and leaves it empty; were
    that to happen between the two, the step directory is made again."""
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    for attempt in range(1, _MAKE_TMP_TRIES + 1):
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.mkdir()
            break
        except FileNotFoundError:
            if attempt == _MAKE_TMP_TRIES:
                raise
    return tmp


def _drop_write(tmp: Path | None, step_path: Path) -> None:
    """Remove a failed write's temporary directory, and its step directory if that leaves it
    empty (no other shard's piece or write in it): a step directory without pieces would make
    every later restore report a snapshot that never existed."""
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_if_empty(step_path)


def _remove_if_empty(step_path: Path) -> bool:
    """Remove ``step_path`` if it is empty; whether this call removed it (False too when
    another shard did first)."""
    try:
        step_path.rmdir()
    except OSError:
        return False  # other shards' pieces (or their writes) are in it, or it is gone
    return True


def _write_data(store: ShardStore, tmp: Path, step: int) -> dict:
    """Write every table into a new LMDB at ``tmp``; return the manifest without files."""
    digest = hashlib.sha256()
    manifest: dict = {
        "format_version": FORMAT_VERSION, "step": step, "shard_id": store.shard_id,
        "num_shards": store.num_shards, "created": time.time(), "tables": {},
    }
    env = lmdb.open(str(tmp), map_size=_map_size(store), subdir=True, metasync=True,
                    sync=True)
    try:
        writer = _BatchedWriter(env)
        try:
            for name in sorted(store.tables):
                manifest["tables"][name] = _put_table(writer, store.copy_table(name), digest)
        except BaseException:
            writer.abort()
            raise
        writer.commit()
        env.sync(True)
    finally:
        env.close()
    manifest["checksum"] = "sha256:" + digest.hexdigest()
    return manifest


def _seal(tmp: Path, manifest: dict) -> None:
    """Record the data file's size and checksum in the manifest, write the manifest and its
    own checksum, and fsync the piece."""
    # Readers open the LMDB without its lock file; dropping it leaves one data file to check.
    (tmp / "lock.mdb").unlink(missing_ok=True)
    data = tmp / DATA_FILE
    manifest["files"] = {DATA_FILE: {"size": data.stat().st_size,
                                     "sha256": file_digest(data)}}
    text = json.dumps(manifest, indent=1).encode()
    (tmp / MANIFEST).write_bytes(text)
    (tmp / MANIFEST_SUM).write_text(f"{hashlib.sha256(text).hexdigest()}  {MANIFEST}\n")
    for f in tmp.iterdir():
        fsync_path(f)
    fsync_path(tmp)


def list_steps(data_dir: Path) -> list[int]:
    """Steps with a snapshot directory, newest first (complete or not)."""
    root = Path(data_dir) / "snapshots"
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if (m := _STEP_RE.match(p.name))
             and p.name == f"step-{int(m.group(1)):012d}"]
    return sorted(steps, reverse=True)


def piece_match(path: Path) -> re.Match | None:
    """``PIECE_RE``'s match of a piece's name, in place or set aside (``ASIDE``)."""
    return PIECE_RE.match(path.name.removeprefix(ASIDE))


def pieces_of(step_path: Path) -> list[Path]:
    """Every piece of the step at ``step_path``, one per shard of the count that wrote it;
    ``IncompleteStep`` when a shard wrote none. A piece set aside for a new write of the step
    stands for its shard when the new one never came in (a crash between the renames)."""
    if not step_path.is_dir():
        raise SnapshotError(f"{step_path} does not exist")
    entries = list(step_path.iterdir())
    found = {p.name: p for p in entries if PIECE_RE.match(p.name)}
    for p in entries:
        if p.name.startswith(ASIDE) and piece_match(p):
            found.setdefault(p.name.removeprefix(ASIDE), p)
    pieces = [found[name] for name in sorted(found)]
    if not pieces:
        writes = sum(p.name.startswith(".tmp-") for p in entries)
        raise IncompleteStep(f"{step_path}: no shard wrote its piece" + (
            f" ({writes} being written, or left by a crash)" if writes else
            " (the snapshot failed)"))
    totals = {int(piece_match(p).group(2)) for p in pieces}
    if len(totals) != 1:
        raise SnapshotError(f"{step_path}: pieces of different shard counts {sorted(totals)}")
    total = totals.pop()
    have = {int(piece_match(p).group(1)) for p in pieces}
    missing = sorted(set(range(total)) - have)
    if missing:
        raise IncompleteStep(f"{step_path}: shards {shorten(missing)} of {total} wrote no piece "
                             "(their snapshot failed or was interrupted, or is being written)")
    return pieces


# ---- pruning ----------------------------------------------------------------------------


def prune_snapshots(data_dir: Path, shard_id: int, num_shards: int, keep: int, *,
                    protect: Collection[int] = ()) -> list[Path]:
    """Remove this shard's share of old snapshots; return the paths removed.

    Keeps the ``keep`` newest complete steps (every piece present, every manifest intact)
    and every step newer than the newest complete one (other shards may still be writing
    it), and any step in ``protect``. From every older step, complete or not, it removes the
    pieces this shard answers for (``shard-i-of-M`` with i mod ``num_shards`` ==
    ``shard_id``, so pieces of an earlier shard count go too), then the step directory once
    it is empty. It also removes this shard's ``.tmp-`` directories left by interrupted
    writes, and puts back or removes its pieces left aside (``_remove_leftover_writes``).
    ``keep=0`` keeps every step. With no complete step at all nothing is removed.
    """
    if not is_int(keep) or keep < 0:
        raise ValueError(f"keep={shorten(keep)} must be an integer >= 0")
    root = Path(data_dir) / "snapshots"
    if not root.is_dir():
        return []
    with _piece_lock(data_dir, shard_id, num_shards):
        removed = _remove_leftover_writes(root, piece_name(shard_id, num_shards))
        if keep == 0:
            return removed
        steps = list_steps(data_dir)
        complete = [s for s in steps if _is_complete(step_dir(data_dir, s))]
        if not complete:  # every step may still be in progress
            return removed
        oldest_kept = complete[min(keep, len(complete)) - 1]
        for s in steps:
            if s < oldest_kept and s not in protect:
                removed += _remove_pieces(step_dir(data_dir, s), shard_id, num_shards)
    if removed:
        log.info("snapshots_pruned shard=%d/%d removed=%d keep=%d", shard_id, num_shards,
                 len(removed), keep)
    return removed


def prune_after_snapshot(data_dir: Path, shard_id: int, num_shards: int, keep: int,
                         written: int) -> None:
    """``prune_snapshots`` right after this shard wrote step ``written`` (``keep=0``: keep
    all); a failure to remove old pieces is logged, the snapshot just written stands."""
    if not keep:
        return
    try:
        prune_snapshots(data_dir, shard_id, num_shards, keep, protect=(written,))
    except OSError as e:
        log.warning("snapshot_prune_failed shard=%d/%d error=%r", shard_id, num_shards, str(e))


def _is_complete(step_path: Path) -> bool:
    try:
        for piece in pieces_of(step_path):
            load_manifest(piece)
    except (SnapshotError, FileNotFoundError):  # gone: the other shards pruned it meanwhile
        return False
    return True


def _remove_leftover_writes(root: Path, piece: str) -> list[Path]:
    """This piece's ``.tmp-`` directories in every step: no write of ours is in progress
    while the caller holds the piece lock, so each is the leftover of an interrupted one.
    A piece set aside (``ASIDE``) is removed where its replacement came in, and renamed back
    where a crash kept it out."""
    removed = []
    for step_path in root.iterdir():
        if not _STEP_RE.match(step_path.name) or not step_path.is_dir():
            continue
        aside = step_path / f"{ASIDE}{piece}"
        if aside.is_dir():
            if (step_path / piece).exists():
                shutil.rmtree(aside, ignore_errors=True)
                removed.append(aside)
            else:
                os.rename(aside, step_path / piece)
                fsync_path(step_path)
        leftovers = list(step_path.glob(f".tmp-{piece}-*"))
        for tmp in leftovers:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
        if leftovers and _remove_if_empty(step_path):  # the step was only that write
            removed.append(step_path)
    return removed


def _remove_pieces(step_path: Path, shard_id: int, num_shards: int) -> list[Path]:
    """Remove the pieces of an old step this shard answers for, and the step directory once
    nothing is left in it."""
    removed = []
    try:
        entries = list(step_path.iterdir())
    except FileNotFoundError:  # the other shards removed their pieces and the directory first
        return removed
    for p in entries:
        m = piece_match(p)
        if m and int(m.group(1)) % num_shards == shard_id:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if _remove_if_empty(step_path):
        removed.append(step_path)
    return removed

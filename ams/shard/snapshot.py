"""LMDB snapshots of a shard's tables (rows, momentum, decay clocks, neighbor lists and the
push dedupe state).

Layout under a data dir shared by the shards of a cluster::

    DATA/snapshots/step-000000000100/shard-00000-of-00002/
        data.mdb          the tensors, as LMDB values
        manifest.json     format version, step, table specs, owned id rule, the size and
                          SHA-256 of every data file, and a SHA-256 over every stored value
        manifest.sha256   the SHA-256 of manifest.json (``sha256sum -c`` reads it)

A piece is written under a temporary name, fsynced, and renamed into place, so a piece either
exists whole or not at all. Restore checks, in this order and before it installs anything: the
manifest's checksum, the manifest's fields, every data file's size and checksum (before LMDB
maps the file: a truncated file would kill the process with SIGBUS), then every value as it
loads. A step with a missing, partial or corrupt piece is skipped for an older one. A snapshot
of S shards restores into any S' shards: each restoring shard reads the rows it owns from every
piece. ``prune_snapshots`` removes old steps and leftovers of interrupted writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
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

from ams import sharding
from ams.alloc import release_free_memory
from ams.dtypes import ROW_DTYPES
from ams.errors import AmsError, RequestTooLarge, SnapshotError, StorageError, shorten
from ams.jsontext import parse_json
from ams.shard.neighbor_lists import INT32_CLASSES, NeighborTable
from ams.shard.storage import TableTensors, fsync_path
from ams.shard.store import (
    MAX_CLIENT_ID,
    PUSH_DEDUPE_CLIENTS,
    PUSH_DEDUPE_WINDOW,
    PushDedupe,
    ShardStore,
    TableCopy,
    TableSpec,
)
from ams.sharding import piece_name

log = logging.getLogger(__name__)

# 3: checksummed manifest and files, push dedupe state; 4: the graph as compact as the store
# keeps it (fixed width without offsets, int32 ids), its layout and id dtype in the manifest.
FORMAT_VERSION = 4
# Format 3 differs only in its graph (always int64 CSR); it is read and converted on load.
READ_FORMATS = (3, FORMAT_VERSION)
CHUNK_BYTES = 4 << 20  # values this size keep LMDB's per-value page overhead negligible
COMMIT_BYTES = 256 << 20  # written values held in memory before LMDB commits them
MANIFEST = "manifest.json"
MANIFEST_SUM = "manifest.sha256"
DATA_FILE = "data.mdb"
# Step numbers are zero-padded to 12 digits so that names sort; larger steps grow wider.
_STEP_RE = re.compile(r"^step-(\d{12,})$")
_PIECE_RE = re.compile(r"^shard-(\d{5})-of-(\d{5})$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_DTYPES = {**ROW_DTYPES, "int64": torch.int64, "int32": torch.int32, "float64": torch.float64,
           "uint8": torch.uint8}
_NAMES = {v: k for k, v in _DTYPES.items()}
# The JSON of a full dedupe state: every client id, and every sequence as up to 20 digits.
_DEDUPE_BYTES = PUSH_DEDUPE_CLIENTS * (PUSH_DEDUPE_WINDOW * 22 + 6 * MAX_CLIENT_ID + 16)
# py-lmdb refuses a second open of one path in a process: in-process shards restoring in
# parallel (the embedded AMS) all read the same pieces, so they take turns.
_READ_LOCK = threading.Lock()
# One writer or pruner at a time per piece identity (data dir, shard, shard count) in this
# process, so a pruner never takes a write in progress for the leftover of a dead one.
_PIECE_LOCKS: dict[tuple[str, int, int], threading.Lock] = {}
_PIECE_LOCKS_GUARD = threading.Lock()


def step_dir(data_dir: Path, step: int) -> Path:
    return Path(data_dir) / "snapshots" / f"step-{step:012d}"


def _piece_lock(data_dir: Path, shard_id: int, num_shards: int) -> threading.Lock:
    key = (str(Path(data_dir).resolve()), shard_id, num_shards)
    with _PIECE_LOCKS_GUARD:
        return _PIECE_LOCKS.setdefault(key, threading.Lock())


def _file_digest(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes, read in blocks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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
    return {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape), "chunks": chunks}


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
                                  "id_dtype": _NAMES[neighbors.dtype]}
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
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        try:
            manifest = _write_data(store, tmp, step)
            _seal(tmp, manifest)
        except (OSError, lmdb.Error, RequestTooLarge, StorageError) as e:
            # a full disk, a file-size limit, no room for an mmap table's scratch copy
            shutil.rmtree(tmp, ignore_errors=True)
            raise SnapshotError(
                f"{final}: snapshot step {step} not written ({type(e).__name__}: "
                f"{shorten(str(e), 300)}; a full disk or a file-size limit?); nothing of it "
                "was kept, the tables serve on unchanged and older snapshots stay") from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists():  # a snapshot of the same step again: replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_path(final.parent)
    log.info("snapshot_written step=%d path=%s bytes=%d", step, final,
             manifest["files"][DATA_FILE]["size"])
    return final


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
                                     "sha256": _file_digest(data)}}
    text = json.dumps(manifest, indent=1).encode()
    (tmp / MANIFEST).write_bytes(text)
    (tmp / MANIFEST_SUM).write_text(f"{hashlib.sha256(text).hexdigest()}  {MANIFEST}\n")
    for f in tmp.iterdir():
        fsync_path(f)
    fsync_path(tmp)


# ---- checking a piece -------------------------------------------------------------------


def load_manifest(path: Path) -> dict:
    """The manifest of the piece at ``path``, checked against ``manifest.sha256`` first and
    then field by field; ``SnapshotError`` when it is missing, damaged or malformed."""
    try:
        raw = (path / MANIFEST).read_bytes()
        recorded = (path / MANIFEST_SUM).read_text().split()
    except (OSError, ValueError) as e:
        raise SnapshotError(f"{path}: manifest unreadable ({e}); the piece is incomplete") from e
    if not recorded or recorded[0] != hashlib.sha256(raw).hexdigest():
        raise SnapshotError(f"{path}: manifest unreadable: its SHA-256 does not match "
                            f"{MANIFEST_SUM} (edited or damaged)")
    try:
        manifest = parse_json(raw)
    except ValueError as e:
        raise SnapshotError(f"{path}: manifest unreadable ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format_version") not in READ_FORMATS:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise SnapshotError(f"{path}: format_version {shorten(version)}, this build reads "
                            f"{' and '.join(map(str, READ_FORMATS))}")
    try:
        if manifest["format_version"] == 3:
            _describe_format_3_graphs(manifest)
        _check_manifest(manifest)
    except (KeyError, TypeError, ValueError, AmsError) as e:
        raise SnapshotError(f"{path}: malformed manifest ({type(e).__name__}: "
                            f"{shorten(str(e))})") from e
    return manifest


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_manifest(m: dict) -> None:
    """Every field restore reads is present, typed and consistent; ValueError (or KeyError,
    TypeError, InvalidArgument from the spec) otherwise."""
    for key in ("step", "shard_id", "num_shards"):
        _require(_is_int(m[key]) and m[key] >= 0, f"{key} {shorten(m[key])}")
    _require(m["shard_id"] < m["num_shards"], "shard_id must be < num_shards")
    _require(isinstance(m["checksum"], str), "checksum")
    files = m["files"]
    _require(isinstance(files, dict) and DATA_FILE in files, f"files must list {DATA_FILE}")
    for name, f in files.items():
        _require(name in (DATA_FILE,), f"file {shorten(name)} is not part of a piece")
        _require(_is_int(f["size"]) and f["size"] >= 0, f"{name}: size")
        _require(isinstance(f["sha256"], str) and bool(_SHA256_RE.match(f["sha256"])),
                 f"{name}: sha256")
    _require(isinstance(m["tables"], dict), "tables")
    stored = 0
    for name, entry in m["tables"].items():
        stored += _check_table_entry(name, entry, m["shard_id"], m["num_shards"])
    _require(stored <= files[DATA_FILE]["size"],
             f"the tables need {stored} bytes, more than {DATA_FILE} holds")


def _check_table_entry(name: str, entry: dict, shard_id: int, num_shards: int) -> int:
    """Check one table's manifest entry; return the bytes its tensors take."""
    spec = TableSpec.from_description(entry["spec"])
    _require(spec.name == name, f"table {shorten(name)} holds the spec of {shorten(spec.name)}")
    owned = sharding.owned_count(spec.num_rows, shard_id, num_shards)
    _require(entry["owned_rows"] == owned, f"table {shorten(name)}: owned_rows")
    clock = entry["decay_clock"]
    _require(isinstance(clock, (int, float)) and not isinstance(clock, bool)
             and math.isfinite(clock) and clock >= 0, f"table {shorten(name)}: decay_clock "
             f"{shorten(clock)}")
    nbytes = (_check_desc(entry["rows"], spec.dtype, [owned, spec.dim])
              + _check_desc(entry["state"], spec.state_dtype, [owned, spec.state_width])
              + _check_desc(entry["row_clock"], torch.float64, [owned])
              + _check_desc(entry["push_dedupe"], torch.uint8, None))
    graph = entry["graph"]
    if graph is not None:
        for key in ("version", "step", "k"):
            _require(_is_int(graph[key]) and graph[key] >= 0, f"graph {key}")
        ids = _DTYPES.get(graph["id_dtype"])
        _require(ids == torch.int64 or (ids == torch.int32 and spec.num_rows < INT32_CLASSES),
                 f"graph id_dtype {shorten(graph['id_dtype'])} for {spec.num_rows} classes")
        if graph["layout"] == "fixed":
            _require("offsets" not in graph, "graph: fixed-width lists have no offsets")
            nbytes += _check_desc(graph["neighbors"], ids, [owned, graph["k"]])
        else:
            _require(graph["layout"] == "csr", f"graph layout {shorten(graph['layout'])}")
            nbytes += _check_desc(graph["offsets"], torch.int64, [owned + 1])
            nbytes += _check_desc(graph["neighbors"], ids, None)
    return nbytes


def _describe_format_3_graphs(manifest: dict) -> None:
    """Describe a format-3 manifest's graphs in format 4's terms: int64 CSR, the only layout
    format 3 wrote. The stored values are read as they are and converted on load."""
    tables = manifest["tables"]
    _require(isinstance(tables, dict), "tables")
    for entry in tables.values():
        graph = entry["graph"]
        if graph is not None:
            _require(isinstance(graph, dict), "graph")
            graph.update(layout="csr", id_dtype="int64")


def _check_desc(desc: dict, dtype: torch.dtype, shape: list[int] | None) -> int:
    """A tensor description holds ``dtype``, ``shape`` (None: any 1-D shape) and the number
    of chunks that size takes; returns its bytes."""
    _require(desc["dtype"] == _NAMES[dtype], f"dtype {shorten(desc['dtype'])}, "
             f"need {_NAMES[dtype]}")
    got = desc["shape"]
    _require(isinstance(got, list) and all(_is_int(s) and s >= 0 for s in got),
             f"shape {shorten(got)}")
    _require(got == shape if shape is not None else len(got) == 1,
             f"shape {shorten(got)}, need {shape if shape is not None else '1-D'}")
    nbytes = math.prod(got) * torch.empty((), dtype=dtype).element_size()
    _require(desc["chunks"] == -(-nbytes // CHUNK_BYTES), f"chunks {shorten(desc['chunks'])}")
    return nbytes


def verify_files(path: Path, manifest: dict) -> None:
    """Every data file of the piece has the size and SHA-256 its (checked) manifest records;
    ``SnapshotError`` otherwise. Run before LMDB maps a file."""
    for name, want in manifest["files"].items():
        try:
            size = (path / name).stat().st_size
        except OSError as e:
            raise SnapshotError(f"{path}: {name} is missing ({e.strerror})") from e
        if size != want["size"]:
            raise SnapshotError(f"{path}: {name} has {size} bytes where the manifest records "
                                f"{want['size']} (truncated or damaged)")
        if _file_digest(path / name) != want["sha256"]:
            raise SnapshotError(f"{path}: {name} checksum mismatch, the data is corrupt")


# ---- reading ----------------------------------------------------------------------------


def _get_tensor(txn: lmdb.Transaction, key: str, desc: dict, digest: hashlib._Hash,
                where: Path) -> torch.Tensor:
    dtype = _DTYPES[desc["dtype"]]
    shape = [int(s) for s in desc["shape"]]
    buf = bytearray()
    for i in range(int(desc["chunks"])):
        value = txn.get(f"{key}/{i:06d}".encode())
        if value is None:
            raise SnapshotError(f"{where}: value {key}/{i:06d} is missing (partial snapshot)")
        digest.update(value)
        buf += value
    expected = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if len(buf) != expected:
        raise SnapshotError(f"{where}: {key} has {len(buf)} bytes, shape {shape} needs {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    wire = torch.int16 if dtype == torch.bfloat16 else dtype
    t = torch.frombuffer(buf, dtype=wire).view(shape)
    return t.view(dtype) if dtype == torch.bfloat16 else t


def read_piece(path: Path, load: bool = True) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """Verify one piece and load it whole: (manifest, {table: {rows, state, row_clock,
    push_dedupe (uint8 JSON bytes), [graph_offsets (CSR only), graph_neighbors (owned, k)
    fixed width or 1-D CSR, int32 or int64 as the manifest's graph says]}}). ``load=False``
    verifies the manifest and the files' sizes and checksums (streamed from disk) and
    returns no tensors."""
    manifest = load_manifest(path)
    expected = (f"step-{manifest['step']:012d}",
                piece_name(manifest["shard_id"], manifest["num_shards"]))
    if (path.parent.name, path.name) != expected:
        raise SnapshotError(f"{path}: the manifest describes {'/'.join(expected)}")
    verify_files(path, manifest)
    if not load:
        return manifest, {}
    with _READ_LOCK:
        return manifest, _read_tensors(path, manifest)


def _read_tensors(path: Path, manifest: dict) -> dict[str, dict[str, torch.Tensor]]:
    digest = hashlib.sha256()
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    try:
        env = lmdb.open(str(path), readonly=True, lock=False, subdir=True)
    except lmdb.Error as e:
        raise SnapshotError(f"{path}: LMDB cannot be opened ({e})") from e
    try:
        with env.begin() as txn:
            for name, entry in manifest["tables"].items():
                got = {key: _get_tensor(txn, f"{name}/{key}", entry[key], digest, path)
                       for key in ("rows", "state", "row_clock", "push_dedupe")}
                graph = entry["graph"]
                if graph is not None:
                    # the order they were hashed in: offsets (CSR only), neighbors
                    for key in ("offsets", "neighbors"):
                        if key in graph:
                            got[f"graph_{key}"] = _get_tensor(
                                txn, f"{name}/graph_{key}", graph[key], digest, path)
                tensors[name] = got
    except lmdb.Error as e:
        raise SnapshotError(f"{path}: malformed snapshot ({type(e).__name__}: {e})") from e
    finally:
        env.close()
    if "sha256:" + digest.hexdigest() != manifest["checksum"]:
        raise SnapshotError(f"{path}: checksum mismatch, the data is corrupt")
    return tensors


def list_steps(data_dir: Path) -> list[int]:
    """Steps with a snapshot directory, newest first (complete or not)."""
    root = Path(data_dir) / "snapshots"
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if (m := _STEP_RE.match(p.name))
             and p.name == f"step-{int(m.group(1)):012d}"]
    return sorted(steps, reverse=True)


def _pieces_of(step_path: Path) -> list[Path]:
    if not step_path.is_dir():
        raise SnapshotError(f"{step_path} does not exist")
    pieces = sorted(p for p in step_path.iterdir() if _PIECE_RE.match(p.name))
    if not pieces:
        raise SnapshotError(f"{step_path}: no shard pieces")
    totals = {int(_PIECE_RE.match(p.name).group(2)) for p in pieces}
    if len(totals) != 1:
        raise SnapshotError(f"{step_path}: pieces of different shard counts {sorted(totals)}")
    total = totals.pop()
    have = {int(_PIECE_RE.match(p.name).group(1)) for p in pieces}
    missing = sorted(set(range(total)) - have)
    if missing:
        raise SnapshotError(f"{step_path}: pieces for shards {missing} of {total} are missing")
    return pieces


def restore_into(store: ShardStore, data_dir: Path, step: int | None = None) -> tuple[int, Path]:
    """Replace the store's tables with its part of a snapshot; return (step, path).

    Every piece of the step is verified before any table is replaced, so a damaged snapshot
    leaves the live tables as they were. The push dedupe state is replaced with the tables'
    (a retry of a push the restored rows lack applies again). ``step=None``: the newest
    complete snapshot; a partial or corrupt one is logged and skipped for an older one.
    Raises ``SnapshotError`` when no usable snapshot exists.
    """
    candidates = list_steps(data_dir) if step is None else [step]
    if not candidates:
        raise SnapshotError(f"no snapshots under {Path(data_dir) / 'snapshots'}")
    problems = []
    for s in candidates:
        path = step_dir(data_dir, s)
        try:
            tables = _assemble(store, _pieces_of(path))
        except SnapshotError as e:
            fallback = "; trying an older step" if step is None and s != candidates[-1] else ""
            log.warning("snapshot_skipped step=%d reason=%r%s", s, str(e), fallback)
            problems.append(str(e))
            continue
        for i, (spec, tensors, clock, graph, dedupe) in enumerate(tables):
            try:
                store.install_table(spec, tensors, clock, graph, dedupe)
            except BaseException:
                for rest in tables[i + 1:]:
                    store.storage.discard(rest[1])
                raise
        release_free_memory()  # the pieces read would stay resident otherwise
        log.info("snapshot_restored step=%d path=%s tables=%d", s, path, len(tables))
        return s, path
    raise SnapshotError("no usable snapshot: " + "; ".join(problems))


RestoredTable = tuple[TableSpec, TableTensors, float, NeighborTable | None, PushDedupe]


def _assemble(store: ShardStore, pieces: list[Path]) -> list[RestoredTable]:
    """This shard's rows, state, decay clocks, graph and push dedupe state of every table,
    gathered from all pieces into tensors staged by the store's storage (for mmap, files
    beside the live tables'), which are discarded when the pieces fail. The table's clock
    is the newest of the pieces' clocks."""
    out: dict[str, dict] = {}
    try:
        return _gather_pieces(store, pieces, out)
    except BaseException:
        for acc in out.values():
            store.storage.discard(acc["staged"])
        raise


def _shares_rows(old_shard: int, old_count: int, shard: int, count: int) -> bool:
    """Whether piece ``old_shard`` of ``old_count`` holds any id that shard ``shard`` of
    ``count`` owns: some id is both old_shard mod old_count and shard mod count exactly when
    gcd(old_count, count) divides old_shard - shard (Chinese remainder theorem)."""
    return (old_shard - shard) % math.gcd(old_count, count) == 0


def _gather_pieces(store: ShardStore, pieces: list[Path], out: dict[str, dict]
                   ) -> list[RestoredTable]:
    """``_assemble``, with its accumulators in ``out``."""
    for path in pieces:
        # Every piece is verified, so all shards agree on whether a step is usable; only the
        # pieces that hold rows of ours are loaded (with S == S' that is one piece of S).
        old_shard, old_count = (int(g) for g in _PIECE_RE.match(path.name).groups())
        mine = _shares_rows(old_shard, old_count, store.shard_id, store.num_shards)
        manifest, tensors = read_piece(path, load=mine)
        if not mine:
            continue
        try:
            _gather_piece(store, manifest, tensors, out)
        except (SnapshotError, RequestTooLarge, StorageError):
            raise  # the storage's trouble is no fault of the snapshot
        except (KeyError, TypeError, ValueError, IndexError, AmsError) as e:
            raise SnapshotError(f"{path}: malformed snapshot ({type(e).__name__}: "
                                f"{shorten(str(e))})") from e
    result = []
    for name, acc in out.items():
        if not bool(acc["filled"].all()):
            raise SnapshotError(f"table {shorten(name)}: the pieces do not cover every row")
        graph = None
        meta = acc["graph_meta"]
        if meta and acc["graph_parts"]:
            graph = NeighborTable.from_parts(acc["graph_parts"], acc["owned"],
                                             num_classes=acc["spec"].num_rows, k=meta["k"])
            graph.version, graph.step = meta["version"], meta["step"]
        result.append((acc["spec"], acc["staged"], acc["clock"], graph, acc["dedupe"]))
    return result


def _gather_piece(store: ShardStore, manifest: dict, tensors: dict, out: dict) -> None:
    """Copy the rows of one piece that ``store`` owns into the accumulators ``out``."""
    me, count = store.shard_id, store.num_shards
    old_shard, old_count = manifest["shard_id"], manifest["num_shards"]
    for name, entry in manifest["tables"].items():
        spec = TableSpec.from_description(entry["spec"])
        acc = out.get(name)
        if acc is None:
            staged = store.storage.stage(spec)
            owned = store.storage.owned(spec)
            # staged rows are in position order: row p in slot p (``ams.shard.slots``)
            acc = out[name] = {
                "spec": spec, "staged": staged, "clock": 0.0, "owned": owned,
                "filled": torch.zeros(owned, dtype=torch.bool),
                "graph_parts": [], "graph_meta": entry["graph"], "dedupe": PushDedupe(),
            }
        if acc["spec"] != spec:
            raise SnapshotError(f"table {shorten(name)}: spec differs between pieces")
        got = tensors[name]
        old_ids = sharding.owned_ids(spec.num_rows, old_shard, old_count)
        mine = sharding.shard_of(old_ids, count) == me
        new_pos = sharding.local_index(old_ids[mine], count)
        staged = acc["staged"]
        staged.rows[new_pos] = got["rows"][mine]
        staged.state[new_pos] = got["state"][mine]
        staged.row_clock[new_pos] = got["row_clock"][mine]
        acc["clock"] = max(acc["clock"], float(entry["decay_clock"]))
        acc["filled"][new_pos] = True
        if bool(mine.any()):  # a piece's pushes matter where its rows do
            acc["dedupe"].merge(_dedupe_of(got["push_dedupe"]))
        if "graph_neighbors" in got:
            # either layout, either id dtype (format 3: int64 CSR), into the table's own
            old_graph = NeighborTable(got.get("graph_offsets"), got["graph_neighbors"],
                                      num_classes=spec.num_rows, k=entry["graph"]["k"])
            offsets, nbrs = old_graph.lookup(torch.nonzero(mine).reshape(-1))
            acc["graph_parts"].append((new_pos, offsets, nbrs))


def _dedupe_of(raw: torch.Tensor) -> PushDedupe:
    """The push dedupe state from its stored JSON bytes (uint8 (m,))."""
    return PushDedupe.from_json(json.loads(bytes(raw.numpy())) if raw.numel() else [])


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
    writes. ``keep=0`` keeps every step. With no complete step at all nothing is removed.
    """
    if not _is_int(keep) or keep < 0:
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
        for piece in _pieces_of(step_path):
            load_manifest(piece)
    except (SnapshotError, FileNotFoundError):  # gone: the other shards pruned it meanwhile
        return False
    return True


def _remove_leftover_writes(root: Path, piece: str) -> list[Path]:
    """This piece's ``.tmp-`` directories in every step: no write of ours is in progress
    while the caller holds the piece lock, so each is the leftover of an interrupted one."""
    removed = []
    for step_path in root.iterdir():
        if not _STEP_RE.match(step_path.name) or not step_path.is_dir():
            continue
        for tmp in step_path.glob(f".tmp-{piece}-*"):
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
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
        m = _PIECE_RE.match(p.name)
        if m and int(m.group(1)) % num_shards == shard_id:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    try:
        step_path.rmdir()
        removed.append(step_path)
    except OSError:
        pass  # other shards' pieces (or their leftovers) are still in it
    return removed

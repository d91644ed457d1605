"""LMDB snapshots of a shard's tables (rows, momentum, decay clocks, neighbor lists).

Layout under a data dir shared by the shards of a cluster::

    DATA/snapshots/step-000000000100/shard-00000-of-00002/{data.mdb, manifest.json}

A piece is written under a temporary name, fsynced, and renamed into place, so a piece either
exists whole or not at all. ``manifest.json`` holds the format version, step, table specs,
owned id rule and a SHA-256 over every stored value; restore checks it while loading and falls
back to an older step when a piece is missing, partial or corrupt. A snapshot of S shards
restores into any S' shards: each restoring shard reads the rows it owns from every piece.
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
from dataclasses import dataclass
from pathlib import Path

import lmdb
import torch

from ams import sharding
from ams.dtypes import DTYPE_NAMES, ROW_DTYPES
from ams.errors import SnapshotError
from ams.graph.csr import NeighborTable
from ams.store import ShardStore, TableSpec

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: each table carries its weight-decay clocks
CHUNK_BYTES = 4 << 20  # values this size keep LMDB's per-value page overhead negligible
_STEP_RE = re.compile(r"^step-(\d{12})$")
_PIECE_RE = re.compile(r"^shard-(\d{5})-of-(\d{5})$")
_DTYPES = {**ROW_DTYPES, "int64": torch.int64, "float64": torch.float64}
_NAMES = {**DTYPE_NAMES, torch.int64: "int64", torch.float64: "float64"}
# py-lmdb refuses a second open of one path in a process: in-process shards restoring in
# parallel (the embedded AMS) all read the same pieces, so they take turns.
_READ_LOCK = threading.Lock()


def step_dir(data_dir: Path, step: int) -> Path:
    return Path(data_dir) / "snapshots" / f"step-{step:012d}"


def piece_name(shard_id: int, num_shards: int) -> str:
    return f"shard-{shard_id:05d}-of-{num_shards:05d}"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- writing ----------------------------------------------------------------------------


def _put_tensor(txn: lmdb.Transaction, key: str, tensor: torch.Tensor, digest: hashlib._Hash
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


def write_snapshot(store: ShardStore, data_dir: Path, step: int) -> Path:
    """Write this shard's piece of snapshot ``step``; return the piece's directory.

    Each table is copied under its lock, so the piece is a consistent cut of every table.
    """
    if step < 0:
        raise SnapshotError(f"step={step} must be >= 0")
    final = step_dir(data_dir, step) / piece_name(store.shard_id, store.num_shards)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tables = list(store.tables.values())
    payload = sum(t.rows.numel() * t.rows.element_size() + t.state.numel() * t.state.element_size()
                  + t.row_clock.numel() * 8 + (t.graph.nbytes() if t.graph else 0)
                  for t in tables)
    # LMDB needs its map size up front; its 10 MiB default would fail on any real table.
    map_size = int(payload * 1.1) + (64 << 20)
    digest = hashlib.sha256()
    manifest: dict = {
        "format_version": FORMAT_VERSION, "step": step, "shard_id": store.shard_id,
        "num_shards": store.num_shards, "created": time.time(), "tables": {},
    }
    env = lmdb.open(str(tmp), map_size=map_size, subdir=True, metasync=True, sync=True)
    try:
        with env.begin(write=True) as txn:
            for t in tables:
                with t.lock:
                    entry: dict = {
                        "spec": t.spec.describe(),
                        "owned_rows": t.rows.shape[0],
                        "id_rule": "id % num_shards == shard_id, local position id // num_shards",
                        "rows": _put_tensor(txn, f"{t.spec.name}/rows", t.rows, digest),
                        "state": _put_tensor(txn, f"{t.spec.name}/state", t.state, digest),
                        "row_clock": _put_tensor(txn, f"{t.spec.name}/row_clock", t.row_clock,
                                                 digest),
                        "decay_clock": t.clock,
                        "graph": None,
                    }
                    if t.graph is not None:
                        entry["graph"] = {
                            "version": t.graph.version, "step": t.graph.step, "k": t.graph.k,
                            "offsets": _put_tensor(txn, f"{t.spec.name}/graph_offsets",
                                                   t.graph.offsets, digest),
                            "neighbors": _put_tensor(txn, f"{t.spec.name}/graph_neighbors",
                                                     t.graph.neighbors, digest),
                        }
                manifest["tables"][t.spec.name] = entry
        env.sync(True)
    finally:
        env.close()
    manifest["checksum"] = "sha256:" + digest.hexdigest()
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for f in tmp.iterdir():
        _fsync_path(f)
    _fsync_path(tmp)
    if final.exists():  # a snapshot of the same step again: replace it whole
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_path(final.parent)
    log.info("snapshot_written step=%d path=%s bytes=%d", step, final, payload)
    return final


# ---- reading ----------------------------------------------------------------------------


@dataclass
class Piece:
    """One shard's piece of a snapshot, opened for reading and verified while it is read."""

    path: Path
    manifest: dict
    env: lmdb.Environment

    @property
    def shard_id(self) -> int:
        return self.manifest["shard_id"]

    @property
    def num_shards(self) -> int:
        return self.manifest["num_shards"]


def _get_tensor(txn: lmdb.Transaction, key: str, desc: dict, digest: hashlib._Hash,
                where: Path) -> torch.Tensor:
    dtype = _DTYPES.get(desc.get("dtype"))
    if dtype is None:
        raise SnapshotError(f"{where}: {key} has unknown dtype {desc.get('dtype')!r}")
    shape = [int(s) for s in desc["shape"]]
    buf = bytearray()
    for i in range(int(desc["chunks"])):
        value = txn.get(f"{key}/{i:06d}".encode())
        if value is None:
            raise SnapshotError(f"{where}: value {key}/{i:06d} is missing (partial snapshot)")
        digest.update(value)
        buf += value
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = itemsize
    for s in shape:
        expected *= s
    if len(buf) != expected:
        raise SnapshotError(f"{where}: {key} has {len(buf)} bytes, shape {shape} needs {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    wire = torch.int16 if dtype == torch.bfloat16 else dtype
    t = torch.frombuffer(buf, dtype=wire).view(shape)
    return t.view(dtype) if dtype == torch.bfloat16 else t


def read_piece(path: Path) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    """Load one piece whole and verify it:
    (manifest, {table: {rows, state, row_clock, [graph_*]}})."""
    manifest_path = path / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        raise SnapshotError(f"{path}: manifest unreadable ({e}); the piece is incomplete") from e
    if manifest.get("format_version") != FORMAT_VERSION:
        raise SnapshotError(
            f"{path}: format_version {manifest.get('format_version')!r}, this build reads "
            f"{FORMAT_VERSION}")
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
                got = {
                    "rows": _get_tensor(txn, f"{name}/rows", entry["rows"], digest, path),
                    "state": _get_tensor(txn, f"{name}/state", entry["state"], digest, path),
                    "row_clock": _get_tensor(txn, f"{name}/row_clock", entry["row_clock"],
                                             digest, path),
                }
                clock = float(entry["decay_clock"])  # read again by _assemble
                if not math.isfinite(clock) or clock < 0:
                    raise ValueError(f"table {name!r}: decay_clock {entry['decay_clock']!r}")
                if entry.get("graph"):
                    g = entry["graph"]
                    got["graph_offsets"] = _get_tensor(
                        txn, f"{name}/graph_offsets", g["offsets"], digest, path)
                    got["graph_neighbors"] = _get_tensor(
                        txn, f"{name}/graph_neighbors", g["neighbors"], digest, path)
                tensors[name] = got
    except (KeyError, TypeError, ValueError, lmdb.Error) as e:
        raise SnapshotError(f"{path}: malformed snapshot ({type(e).__name__}: {e})") from e
    finally:
        env.close()
    if "sha256:" + digest.hexdigest() != manifest.get("checksum"):
        raise SnapshotError(f"{path}: checksum mismatch, the data is corrupt")
    return tensors


def list_steps(data_dir: Path) -> list[int]:
    """Steps with a snapshot directory, newest first (complete or not)."""
    root = Path(data_dir) / "snapshots"
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if (m := _STEP_RE.match(p.name))]
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

    ``step=None``: the newest complete snapshot; a partial or corrupt one is reported and
    skipped. Raises ``SnapshotError`` when no usable snapshot exists.
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
            log.warning("snapshot_skipped step=%d reason=%r", s, str(e))
            problems.append(str(e))
            continue
        for spec, rows, state, row_clock, clock, graph in tables:
            store.install_table(spec, rows, state, row_clock, clock, graph)
        log.info("snapshot_restored step=%d path=%s tables=%d", s, path, len(tables))
        return s, path
    raise SnapshotError("no usable snapshot: " + "; ".join(problems))


def _assemble(store: ShardStore, pieces: list[Path]) -> list[tuple[
        TableSpec, torch.Tensor, torch.Tensor, torch.Tensor, float, NeighborTable | None]]:
    """This shard's rows, state, decay clocks and graph of every table, gathered from all
    pieces. The table's clock is the newest of the pieces' clocks."""
    me, count = store.shard_id, store.num_shards
    out: dict[str, dict] = {}
    for path in pieces:
        manifest, tensors = read_piece(path)
        old_shard, old_count = manifest["shard_id"], manifest["num_shards"]
        for name, entry in manifest["tables"].items():
            spec = TableSpec.from_description(entry["spec"])
            n_new = sharding.owned_count(spec.num_rows, me, count)
            acc = out.setdefault(name, {
                "spec": spec,
                "rows": torch.empty((n_new, spec.dim), dtype=spec.dtype),
                "state": torch.empty((n_new, spec.state_width), dtype=spec.state_dtype),
                "row_clock": torch.empty(n_new, dtype=torch.float64), "clock": 0.0,
                "filled": torch.zeros(n_new, dtype=torch.bool),
                "graph_parts": [], "graph_meta": entry.get("graph"),
            })
            if acc["spec"] != spec:
                raise SnapshotError(f"{path}: table {name!r} spec differs between pieces")
            old_ids = sharding.owned_ids(spec.num_rows, old_shard, old_count)
            if tensors[name]["rows"].shape[0] != old_ids.numel():
                raise SnapshotError(f"{path}: table {name!r} has the wrong number of rows")
            mine = sharding.shard_of(old_ids, count) == me
            new_pos = sharding.local_index(old_ids[mine], count)
            acc["rows"][new_pos] = tensors[name]["rows"][mine]
            acc["state"][new_pos] = tensors[name]["state"][mine]
            acc["row_clock"][new_pos] = tensors[name]["row_clock"][mine]
            acc["clock"] = max(acc["clock"], float(entry["decay_clock"]))
            acc["filled"][new_pos] = True
            if "graph_offsets" in tensors[name]:
                old_graph = NeighborTable.from_csr(
                    torch.arange(old_ids.numel()), tensors[name]["graph_offsets"],
                    tensors[name]["graph_neighbors"], old_ids.numel())
                offsets, nbrs = old_graph.lookup(torch.nonzero(mine).reshape(-1))
                acc["graph_parts"].append((new_pos, offsets, nbrs))
    result = []
    for name, acc in out.items():
        if not bool(acc["filled"].all()):
            raise SnapshotError(f"table {name!r}: the pieces do not cover every row")
        graph = None
        meta = acc["graph_meta"]
        if meta and acc["graph_parts"]:
            graph = NeighborTable.from_parts(acc["graph_parts"], acc["rows"].shape[0])
            graph.version, graph.step = meta["version"], meta["step"]
        result.append((acc["spec"], acc["rows"], acc["state"], acc["row_clock"], acc["clock"],
                       graph))
    return result


"""A snapshot piece's manifest and files: what is recorded, and the checks a piece passes
before LMDB opens a file or any table is replaced (``ams.shard.snapshot`` has the layout).

The manifest holds the format version, step, shard layout, table specs with every tensor's
dtype, shape and chunk count, the size and SHA-256 of the data file, and a SHA-256 over every
stored value; ``manifest.sha256`` holds the manifest's own SHA-256.
"""

from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path

import torch

from ams import sharding
from ams.dtypes import ROW_DTYPES
from ams.errors import AmsError, SnapshotError, shorten
from ams.jsontext import parse_json
from ams.shard.neighbor_lists import INT32_CLASSES
from ams.shard.spec import TableSpec

# 4: checksummed manifest and files, push dedupe state, the graph as compact as the store keeps
# it (fixed width without offsets, int32 ids), its layout and id dtype in the manifest.
FORMAT_VERSION = 4
CHUNK_BYTES = 4 << 20  # values this size keep LMDB's per-value page overhead negligible
MANIFEST = "manifest.json"
MANIFEST_SUM = "manifest.sha256"
DATA_FILE = "data.mdb"
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
DTYPES = {**ROW_DTYPES, "int64": torch.int64, "int32": torch.int32, "float64": torch.float64,
          "uint8": torch.uint8}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def file_digest(path: Path) -> str:
    """SHA-256 (hex) of a file's bytes, read in blocks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise SnapshotError(f"{path}: format_version {shorten(version)}, this build reads "
                            f"{FORMAT_VERSION}")
    try:
        _check_manifest(manifest)
    except (KeyError, TypeError, ValueError, AmsError) as e:
        raise SnapshotError(f"{path}: malformed manifest ({type(e).__name__}: "
                            f"{shorten(str(e))})") from e
    return manifest


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_manifest(m: dict) -> None:
    """Every field restore reads is present, typed and consistent; ValueError (or KeyError,
    TypeError, InvalidArgument from the spec) otherwise."""
    for key in ("step", "shard_id", "num_shards"):
        _require(is_int(m[key]) and m[key] >= 0, f"{key} {shorten(m[key])}")
    _require(m["shard_id"] < m["num_shards"], "shard_id must be < num_shards")
    _require(isinstance(m["checksum"], str), "checksum")
    files = m["files"]
    _require(isinstance(files, dict) and DATA_FILE in files, f"files must list {DATA_FILE}")
    for name, f in files.items():
        _require(name in (DATA_FILE,), f"file {shorten(name)} is not part of a piece")
        _require(is_int(f["size"]) and f["size"] >= 0, f"{name}: size")
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
            _require(is_int(graph[key]) and graph[key] >= 0, f"graph {key}")
        ids = DTYPES.get(graph["id_dtype"])
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


def _check_desc(desc: dict, dtype: torch.dtype, shape: list[int] | None) -> int:
    """A tensor description holds ``dtype``, ``shape`` (None: any 1-D shape) and the number
    of chunks that size takes; returns its bytes."""
    _require(desc["dtype"] == DTYPE_NAMES[dtype], f"dtype {shorten(desc['dtype'])}, "
             f"need {DTYPE_NAMES[dtype]}")
    got = desc["shape"]
    _require(isinstance(got, list) and all(is_int(s) and s >= 0 for s in got),
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
        if file_digest(path / name) != want["sha256"]:
            raise SnapshotError(f"{path}: {name} checksum mismatch, the data is corrupt")

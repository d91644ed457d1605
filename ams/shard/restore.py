"""Restoring a shard from a snapshot: every piece of a step verified before any table is
replaced, the rows this shard owns gathered from every piece (a snapshot of S shards restores
into any S'), and an older step tried where a newer one is partial or corrupt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
from pathlib import Path

import lmdb
import torch

from ams import sharding
from ams.alloc import release_free_memory
from ams.errors import AmsError, RequestTooLarge, SnapshotError, StorageError, shorten
from ams.shard.dedupe import PushDedupe
from ams.shard.manifest import DTYPES, load_manifest, verify_files
from ams.shard.neighbor_lists import NeighborTable
from ams.shard.snapshot import (
    ASIDE,
    IncompleteStep,
    list_steps,
    piece_match,
    pieces_of,
    step_dir,
)
from ams.shard.spec import TableSpec
from ams.shard.storage import TableTensors
from ams.shard.store import ShardStore
from ams.sharding import piece_name

log = logging.getLogger(__name__)

# py-lmdb refuses a second open of one path in a process: in-process shards restoring in
# parallel (the embedded AMS) all read the same pieces, so they take turns.
_READ_LOCK = threading.Lock()


def _get_tensor(txn: lmdb.Transaction, key: str, desc: dict, digest: hashlib._Hash,
                where: Path) -> torch.Tensor:
    dtype = DTYPES[desc["dtype"]]
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
    if (path.parent.name, path.name.removeprefix(ASIDE)) != expected:
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


def restore_into(store: ShardStore, data_dir: Path, step: int | None = None) -> tuple[int, Path]:
    """Replace the store's tables with its part of a snapshot; return (step, path).

    Every piece of the step is verified before any table is replaced, so a damaged snapshot
    leaves the live tables as they were. The push dedupe state is replaced with the tables'
    (a retry of a push the restored rows lack applies again). ``step=None``: the newest
    complete snapshot; each newer step is logged with what is wrong with it, incomplete
    (``snapshot_incomplete``: a shard wrote no piece) or damaged (``snapshot_skipped``), and
    skipped for an older one. Raises ``SnapshotError`` when no usable snapshot exists.
    """
    candidates = list_steps(data_dir) if step is None else [step]
    if not candidates:
        raise SnapshotError(f"no snapshots under {Path(data_dir) / 'snapshots'}")
    problems = []
    for s in candidates:
        path = step_dir(data_dir, s)
        try:
            tables = _assemble(store, pieces_of(path))
        except SnapshotError as e:
            what = "incomplete" if isinstance(e, IncompleteStep) else "skipped"
            fallback = "; trying an older step" if step is None and s != candidates[-1] else ""
            log.warning("snapshot_%s step=%d reason=%r%s", what, s, str(e), fallback)
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
        old_shard, old_count = (int(g) for g in piece_match(path).groups())
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
    for name, acc in out.items():
        if not bool(acc["filled"].all()):
            raise SnapshotError(f"table {shorten(name)}: the pieces do not cover every row")
    result = []
    for name, acc in out.items():
        try:
            graph = _graph_of(name, acc)
        except (KeyError, TypeError, ValueError, IndexError, AmsError) as e:
            raise SnapshotError(f"table {shorten(name)}: malformed graph in the snapshot "
                                f"({type(e).__name__}: {shorten(str(e))})") from e
        result.append((acc["spec"], acc["staged"], acc["clock"], graph, acc["dedupe"]))
    return result


def _graph_of(name: str, acc: dict) -> NeighborTable | None:
    """The table's graph from the lists of the pieces it took rows from, or None unless they
    all carry lists of one version and k. Each shard writes its piece at its own moment, so a
    graph build can fall between them: some pieces then hold no lists or an older version.
    The graph is derived from the rows, and a table restored without one is built again
    before the next training step (``workers.trainer``: ``graph_on_every_shard``)."""
    graphs: list[tuple[str, dict | None]] = acc["graphs"]
    kinds = {None if g is None else (g["version"], g["k"]) for _, g in graphs}
    if len(kinds) != 1 or None in kinds:
        if kinds - {None}:  # some lists are lost: say whose
            found = ",".join(f"{piece}:" + ("none" if g is None else f"{g['version']}/k{g['k']}")
                             for piece, g in graphs)
            log.warning("snapshot_graph_dropped table=%s step=%d versions=%s reason=%r",
                        shorten(name), acc["step"], found,
                        "the pieces hold no graph or graphs of different versions; the table "
                        "is restored without one, and the next graph build makes it")
        return None
    version, k = kinds.pop()
    graph = NeighborTable.from_parts(acc["graph_parts"], acc["owned"],
                                     num_classes=acc["spec"].num_rows, k=k)
    # a refresh keeps the version and moves the step on the shards it wrote to
    graph.version, graph.step = version, max(g["step"] for _, g in graphs)
    return graph


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
                "graph_parts": [], "graphs": [], "dedupe": PushDedupe(),
                "step": manifest["step"],
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
        if not (bool(mine.any()) or acc["owned"] == 0):
            continue  # none of our rows here: its graph, or none, is no concern of ours
        acc["graphs"].append((piece_name(old_shard, old_count), entry["graph"]))
        if "graph_neighbors" in got:
            # either layout, either id dtype, into the table's own
            old_graph = NeighborTable(got.get("graph_offsets"), got["graph_neighbors"],
                                      num_classes=spec.num_rows, k=entry["graph"]["k"])
            offsets, nbrs = old_graph.lookup(torch.nonzero(mine).reshape(-1))
            acc["graph_parts"].append((new_pos, offsets, nbrs))


def _dedupe_of(raw: torch.Tensor) -> PushDedupe:
    """The push dedupe state from its stored JSON bytes (uint8 (m,))."""
    return PushDedupe.from_json(json.loads(bytes(raw.numpy())) if raw.numel() else [])

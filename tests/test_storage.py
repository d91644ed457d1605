"""mmap storage (ams.shard.mapped): tables kept across close and reopen, a table not closed
discarded, damaged or foreign files refused with nothing deleted, a full disk or file-size limit
refused with nothing left behind, restores that swap files only when they succeed, snapshot
copies kept out of RAM. The store and snapshot suites also run whole on mmap."""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import ams
from ams.errors import InvalidArgument, SnapshotError, StorageError, TableNotFound
from ams.shard import restore, snapshot
from ams.shard.mapped import SUMMED_FILES, TABLE_JSON, table_dir_name
from ams.shard.page_advice import resident_pages
from ams.shard.slots import slot_capacity
from ams.shard.spec import TableSpec
from ams.shard.store import ShardStore
from ams.shard.table_sums import SUMS_KEY, file_sums
from tests.conftest import in_position_order, wait_until

N, D = 103, 6
LR, WD = 0.1, 0.05


def spec(name="fc", dtype="float32") -> TableSpec:
    return TableSpec(name=name, num_rows=N, dim=D, dtype=dtype, state_dtype=dtype, seed=1,
                     momentum=0.9, weight_decay=WD)


def mmap_store(root, shard_id=0, num_shards=1) -> ShardStore:
    return ShardStore(shard_id, num_shards, storage="mmap", storage_dir=root)


def drive(store, steps, first_sequence=0, seed=0, name="fc") -> None:
    """Clocked pushes of client "w" (sequences from ``first_sequence``), the same for any
    store of the same shard layout."""
    mine = torch.arange(store.shard_id, N, store.num_shards)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        ids = mine[torch.randint(0, mine.numel(), (20,), generator=g)]
        clock = -(first_sequence + step) * math.log1p(-LR * WD)
        assert store.push(name, ids, torch.randn(20, D, generator=g), LR, "w",
                          first_sequence + step, decay_clock=clock)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def same_table(a: ShardStore, b: ShardStore, name="fc") -> bool:
    """Bit-identical rows, momentum, decay clocks, clock and push dedupe state."""
    ta, tb = a.table(name), b.table(name)
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(
        in_position_order(a, name), in_position_order(b, name), strict=True)) \
        and ta.clock == tb.clock and ta.dedupe.to_json() == tb.dedupe.to_json()


def listing(root) -> dict[str, int]:
    """Every path under ``root`` and its size."""
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))}


# ---- close and reopen ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tables_survive_close_and_reopen_exactly(tmp_path, dtype):
    memory = ShardStore(1, 3)
    mapped = mmap_store(tmp_path, 1, 3)
    odd_name = "class rows ü/x".replace("/", "")  # not a plain file name: goes by its hash
    for store in (memory, mapped):
        for name in ("fc", odd_name):
            store.create_table(spec(name, dtype))
            drive(store, 4, name=name)
    mapped.close()
    piece = tmp_path / "shard-00001-of-00003"
    assert sorted(p.name for p in piece.iterdir()) == sorted(
        [".lock", "fc", table_dir_name(odd_name)])
    assert json.loads((piece / "fc" / TABLE_JSON).read_text())["closed"] is True

    reopened = mmap_store(tmp_path, 1, 3)
    assert reopened.stats()["storage"] == "mmap" and memory.stats()["storage"] == "memory"
    # marked open again at once: were the process to die now, the next store discards it
    assert json.loads((piece / "fc" / TABLE_JSON).read_text())["closed"] is False
    for name in ("fc", odd_name):
        assert reopened.table(name).spec == spec(name, dtype)
        assert same_table(memory, reopened, name)
    # the dedupe state came back: a retried push applies nowhere twice
    assert not reopened.push("fc", torch.tensor([1]), torch.ones(1, D), LR, "w", 3)
    drive(memory, 3, first_sequence=4)
    drive(reopened, 3, first_sequence=4)
    assert same_table(memory, reopened)
    reopened.close()


def test_closed_store_is_empty(tmp_path):
    store = mmap_store(tmp_path)
    store.create_table(spec())
    store.close()
    store.close()  # a second close does nothing
    assert store.tables == {}
    with pytest.raises(TableNotFound):
        store.push("fc", torch.tensor([1]), torch.ones(1, D), LR)


UNCLOSED = textwrap.dedent("""
    import os, sys, torch
    from ams.shard.spec import TableSpec
    from ams.shard.store import ShardStore
    store = ShardStore(0, 1, storage="mmap", storage_dir=sys.argv[1])
    store.create_table(TableSpec(name="fc", num_rows=103, dim=6))
    store.push("fc", torch.tensor([1, 2]), torch.ones(2, 6), 0.1)
    os._exit(0)  # the process dies: the store is never closed
""")


def test_table_not_closed_is_discarded_with_a_warning(tmp_path, caplog):
    subprocess.run([sys.executable, "-c", UNCLOSED, str(tmp_path)], check=True)
    assert (tmp_path / "shard-00000-of-00001" / "fc" / "rows.bin").exists()
    with caplog.at_level(logging.WARNING, logger="ams.shard.mapped"):
        store = mmap_store(tmp_path)
    assert store.tables == {}
    assert any("table_discarded table=fc" in r.getMessage() and "restore a snapshot"
               in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "shard-00000-of-00001" / "fc").exists()
    assert store.create_table(spec())  # the name is free again
    store.close()


# ---- damaged or foreign files ---------------------------------------------------------------


def _truncate(piece, name="rows.bin"):
    path = piece / "fc" / name
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 8)
    return path


def _grow(piece):
    path = piece / "fc" / "state.bin"
    with open(path, "ab") as f:
        f.write(b"\0" * 8)
    return path


def _delete(piece):
    path = piece / "fc" / "row_clock.bin"
    path.unlink()
    return path


def _other_table(piece):
    shutil.copytree(piece / "fc", piece / "fd")  # its table.json describes fc
    return piece / "fd" / TABLE_JSON


def _garbage_json(piece, text="{"):
    path = piece / "fc" / TABLE_JSON
    path.write_text(text)
    return path


def _bad_clock(piece):
    path = piece / "fc" / TABLE_JSON
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "decay_clock": -1.0}))
    return path


def _repeated_slot(piece):
    path = piece / "fc" / "slots.bin"
    slots = np.fromfile(path, dtype=np.int32)
    slots[1] = slots[0]  # two rows in one slot: one of them would be lost
    slots.tofile(path)
    return path


def _nan_row(piece):
    path = piece / "fc" / "rows.bin"
    rows = np.memmap(path, dtype=np.float32, mode="r+")
    rows[D:2 * D] = np.nan  # the row in slot 1
    rows.flush()
    del rows
    return path


def _flipped_bit(piece, name="state.bin"):
    path = piece / "fc" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10
    path.write_bytes(bytes(data))
    return path


def _edit_json(piece, **fields):
    path = piece / "fc" / TABLE_JSON
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return path


def _resealed(piece, damage):
    """``damage`` done, and table.json's checksums made to match it."""
    bad = damage(piece)
    _edit_json(piece, **{SUMS_KEY: file_sums(piece / "fc", SUMMED_FILES)})
    return bad


def _unknown_format(piece):
    path = piece / "fc" / TABLE_JSON
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "format": 3}))
    return path


DAMAGE = {
    "truncated rows.bin": (_truncate, "truncated or damaged"),
    "truncated slots.bin": (lambda piece: _truncate(piece, "slots.bin"), "truncated or damaged"),
    "NaN in rows.bin": (_nan_row, "its checksum is not the one its table recorded"),
    "a flipped bit in state.bin": (_flipped_bit, "changed or damaged since"),
    "repeated slot in slots.bin": (_repeated_slot, "its checksum is not the one"),
    "repeated slot behind matching checksums": (lambda piece: _resealed(piece, _repeated_slot),
                                                "two rows share a slot"),
    "checksum of a file missing": (lambda piece: _edit_json(piece, **{SUMS_KEY: {
        "rows.bin": "0" * 64}}), f"malformed \\({SUMS_KEY}"),
    "format of a newer version": (_unknown_format, "format 3, need 2"),
    "grown state.bin": (_grow, "truncated or damaged"),
    "missing row_clock.bin": (_delete, "missing"),
    "another table's table.json": (_other_table, "describes table 'fc', not the table of"),
    "garbage table.json": (_garbage_json, "unreadable"),
    "table.json nested too deep": (lambda piece: _garbage_json(piece, "[" * 100_000),
                                   "unreadable"),
    "negative decay clock": (_bad_clock, "malformed"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_or_foreign_files_are_refused_and_kept(tmp_path, damage):
    store = mmap_store(tmp_path)
    store.create_table(spec())
    drive(store, 2)
    store.close()
    piece = tmp_path / "shard-00000-of-00001"
    make, needle = DAMAGE[damage]
    bad = make(piece)
    before = listing(tmp_path)
    with pytest.raises(StorageError, match=needle) as info:
        mmap_store(tmp_path)
    message = str(info.value)
    assert str(bad) in message and "restore a snapshot" in message and "\n" not in message
    assert listing(tmp_path) == before  # nothing deleted, nothing made
    with pytest.raises(StorageError, match=needle):  # the lock was let go: refused again
        mmap_store(tmp_path)


def test_a_table_closed_without_checksums_is_reopened_with_a_warning(tmp_path, caplog):
    memory = ShardStore()
    mapped = mmap_store(tmp_path)
    for store in (memory, mapped):
        store.create_table(spec())
        drive(store, 3)
    mapped.close()
    piece = tmp_path / "shard-00000-of-00001"
    doc = json.loads((piece / "fc" / TABLE_JSON).read_text())
    assert sorted(doc[SUMS_KEY]) == sorted(["rows.bin", "state.bin", "row_clock.bin",
                                            "slots.bin"])
    del doc[SUMS_KEY]  # as a version before the checksums closed it
    (piece / "fc" / TABLE_JSON).write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="ams.shard.mapped"):
        reopened = mmap_store(tmp_path)
    assert f"table_unverified table=fc path={piece / 'fc'} reason=no_checksums" in caplog.text
    assert same_table(memory, reopened)
    reopened.close()  # closed again, with its checksums
    assert SUMS_KEY in json.loads((piece / "fc" / TABLE_JSON).read_text())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ams.shard.mapped"):
        mmap_store(tmp_path).close()
    assert "table_unverified" not in caplog.text


def test_a_shard_refuses_a_damaged_table_in_one_line(tmp_path):
    store = ShardStore(0, 1, storage="mmap", storage_dir=tmp_path / "tables")
    store.create_table(spec())
    drive(store, 2)
    store.close()
    bad = _nan_row(tmp_path / "tables" / "shard-00000-of-00001")
    out = subprocess.run([sys.executable, "-m", "xcls", "serve", "shard", "--shard-id", "0",
                          "--num-shards", "1", "--storage", "mmap", "--data-dir", str(tmp_path),
                          "--port-file", str(tmp_path / "port")],
                         capture_output=True, text=True, timeout=120)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert errors == [f"error: --storage mmap: {bad}: its checksum is not the one its table "
                      "recorded when it was closed (changed or damaged since); remove "
                      f"{bad.parent} and restore a snapshot"]
    assert not (tmp_path / "port").exists()


def resident_in(path: Path) -> torch.Tensor:
    """bool (pages,): which pages of the file at ``path`` are in the page cache."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:
        pages = torch.frombuffer(m, dtype=torch.uint8)
        resident = resident_pages(pages).clone()
        del pages  # before the map closes
    return resident


def test_checking_a_table_leaves_the_page_cache_as_it_found_it(tmp_path):
    """The checksums read every file at close and at reopen; the pages that were not in the
    page cache before are not after, and those that were stay: a table larger than memory
    keeps its rows in use in the cache."""
    store = ShardStore(0, 1, storage="mmap", storage_dir=tmp_path)
    store.create_table(TableSpec(name="big", num_rows=50_000, dim=64, seed=1))
    store.close()
    rows = tmp_path / "shard-00000-of-00001" / "big" / "rows.bin"
    fd = os.open(rows, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead still under way
        os.pread(fd, 1 << 20, 0)  # the first 256 pages
    finally:
        os.close(fd)
    before = resident_in(rows)
    if not before[:256].all() or before[256:].any():
        pytest.skip("this kernel keeps the pages (POSIX_FADV_DONTNEED)")
    store = ShardStore(0, 1, storage="mmap", storage_dir=tmp_path)  # reads every page
    assert torch.equal(resident_pages(store.table("big").rows), before)
    store.close()
    assert torch.equal(resident_in(rows), before)


def test_files_of_another_shard_layout_are_refused(tmp_path):
    store = mmap_store(tmp_path, 0, 1)
    store.create_table(spec())
    store.close()
    # the directory of shard 0 of 1 put where shard 0 of 2 keeps its tables
    (tmp_path / "shard-00000-of-00001").rename(tmp_path / "shard-00000-of-00002")
    before = listing(tmp_path)
    with pytest.raises(StorageError, match="belongs to shard 0 of 1, this is shard 0 of 2"):
        mmap_store(tmp_path, 0, 2)
    assert listing(tmp_path) == before


def test_storage_dir_in_use_and_bad_arguments(tmp_path):
    store = mmap_store(tmp_path)
    with pytest.raises(StorageError, match="in use by another shard store"):
        mmap_store(tmp_path)
    assert mmap_store(tmp_path, 0, 2).tables == {}  # another shard: another directory
    store.close()
    mmap_store(tmp_path).close()
    with pytest.raises(InvalidArgument, match="storage='disk': need one of 'memory', 'mmap'"):
        ShardStore(storage="disk")
    with pytest.raises(InvalidArgument, match="needs a storage_dir"):
        ShardStore(storage="mmap")
    with pytest.raises(InvalidArgument, match="for local_shards"):
        ams.connect(["127.0.0.1:1"], storage="mmap")


# ---- restore -------------------------------------------------------------------------------


def full_rows(client) -> torch.Tensor:
    return client.pull("fc", torch.arange(N))


def test_restore_swaps_the_files_only_when_it_succeeds(tmp_path):
    tables = tmp_path / "tables"
    client = ams.connect(local_shards=2, data_dir=tmp_path, storage="mmap", storage_dir=tables,
                         keep_snapshots=0)
    client.create_table("fc", num_rows=N, dim=D, seed=1, weight_decay=WD)
    for s, shard in enumerate(client.shards):
        drive(shard.store, 2, seed=s)
    client.snapshot(step=1)
    at_step_1 = full_rows(client)
    client.push("fc", torch.arange(N), torch.ones(N, D), lr=0.5)
    client.snapshot(step=2)
    client.push("fc", torch.arange(N), torch.ones(N, D), lr=0.5)
    live = full_rows(client)
    data = snapshot.step_dir(tmp_path, 2) / snapshot.piece_name(1, 2) / "data.mdb"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    files = {p: p.read_bytes() for p in tables.rglob("*.bin")}

    with pytest.raises(SnapshotError, match="checksum mismatch"):
        client.restore(step=2)
    assert {p: p.read_bytes() for p in tables.rglob("*.bin")} == files  # live files as were
    assert sorted(p.name for p in (tables / "shard-00000-of-00002").iterdir()) == [".lock", "fc"]
    assert torch.equal(full_rows(client), live)

    assert client.restore(step=1) == 1
    assert torch.equal(full_rows(client), at_step_1)
    for piece in tables.iterdir():  # the restored files replaced the live ones
        assert sorted(p.name for p in piece.iterdir()) == [".lock", "fc"]
    client.close()
    again = ams.connect(local_shards=2, storage="mmap", storage_dir=tables)
    assert torch.equal(full_rows(again), at_step_1)
    again.close()


# ---- a full disk or a file-size limit ------------------------------------------------------

# Each table file of "fc" (1.6 MB with its spare slots) fits under the limit, its snapshot
# (2.7 MB) does not, nor the rows of "huge" (8 MB).
FSIZE_LIMIT = 2_000_000
BIG_ROWS, BIG_DIM = 20_000, 16
LIMITED = textwrap.dedent("""
    import json, resource, sys, torch
    import ams
    from ams.errors import RequestTooLarge, SnapshotError
    data_dir, limit = sys.argv[1], int(sys.argv[2])
    client = ams.connect(local_shards=1, data_dir=data_dir, storage="mmap",
                         storage_dir=data_dir + "/tables")  # reopens fc
    before = client.pull("fc", torch.arange(20_000))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(
        resource.RLIMIT_FSIZE)[1]))  # python ignores SIGXFSZ: writes past it fail with EFBIG
    out = {}
    try:
        client.create_table("huge", num_rows=100_000, dim=16)
    except RequestTooLarge as e:
        out["create"] = [type(e).__name__, str(e)]
    try:
        client.snapshot(step=2)
    except SnapshotError as e:
        out["snapshot"] = str(e)
    out["serves"] = torch.equal(client.pull("fc", torch.arange(20_000)), before)
    client.push("fc", torch.tensor([7]), torch.ones(1, 16), lr=0.5)
    out["row_7"] = client.pull("fc", torch.tensor([7]))[0].tolist()
    client.close()
    print(json.dumps(out))
""")


def test_file_size_limit_refuses_a_table_and_a_snapshot_and_keeps_the_rest(tmp_path):
    client = ams.connect(local_shards=1, data_dir=tmp_path, storage="mmap",
                         storage_dir=tmp_path / "tables")
    client.create_table("fc", num_rows=BIG_ROWS, dim=BIG_DIM, seed=2, momentum=0.9,
                        weight_decay=0.0)
    client.push("fc", torch.tensor([3]), torch.ones(1, BIG_DIM), lr=0.5)
    client.snapshot(step=1)
    at_step_1 = client.pull("fc", torch.arange(BIG_ROWS))
    client.close()

    done = subprocess.run([sys.executable, "-c", LIMITED, str(tmp_path), str(FSIZE_LIMIT)],
                          capture_output=True, text=True, check=True)
    out = json.loads(done.stdout)
    kind, message = out["create"]
    assert kind == "StorageFull"  # a RequestTooLarge, as a remote caller sees it
    assert "table 'huge'" in message and str(slot_capacity(100_000) * 16 * 4) in message \
        and "file-size limit" in message and "rows.bin" in message
    assert "snapshot step 2 not written" in out["snapshot"]
    assert out["serves"]  # and it took the push below

    reopened = ams.connect(local_shards=1, data_dir=tmp_path, storage="mmap",
                           storage_dir=tmp_path / "tables")
    assert list(reopened.shards[0].store.tables) == ["fc"]  # no trace of "huge"
    piece = tmp_path / "tables" / "shard-00000-of-00001"
    assert sorted(p.name for p in piece.iterdir()) == [".lock", "fc"]
    # the first push of g = 1 at lr 0.5 moves a row by exactly -0.5 (momentum starts at 0)
    expected = at_step_1[7].double() - 0.5
    torch.testing.assert_close(torch.tensor(out["row_7"], dtype=torch.float64), expected,
                               rtol=0, atol=1e-7)
    assert reopened.pull("fc", torch.tensor([7]))[0].tolist() == out["row_7"]
    assert not (snapshot.step_dir(tmp_path, 2) / snapshot.piece_name(0, 1)).exists()
    assert reopened.restore() == 1  # the previous snapshot still restores
    assert torch.equal(reopened.pull("fc", torch.arange(BIG_ROWS)), at_step_1)
    reopened.close()


# ---- snapshot copies out of RAM ------------------------------------------------------------


def anonymous_rss() -> int:
    """Bytes of this process's anonymous resident memory (file pages are the OS's to drop)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    pytest.skip("no RssAnon in /proc/self/status")


def test_snapshot_of_mmap_table_copies_into_scratch_files_not_ram(tmp_path, monkeypatch):
    store = mmap_store(tmp_path / "tables")
    big = TableSpec(name="fc", num_rows=200_000, dim=128, momentum=0.0)  # 102 MB of rows
    store.create_table(big)
    table_bytes = store.table("fc").rows.nbytes
    before = anonymous_rss()
    held = []
    put = snapshot._put_table

    def put_and_measure(txn, copy, digest):
        held.append(anonymous_rss() - before)  # the table's copy is held now
        assert torch.equal(copy.rows[-5:], store.pull("fc", torch.arange(199_995, 200_000)))
        return put(txn, copy, digest)

    monkeypatch.setattr(snapshot, "_put_table", put_and_measure)
    snapshot.write_snapshot(store, tmp_path, step=1)
    assert held and held[0] < table_bytes // 4
    piece = tmp_path / "tables" / "shard-00000-of-00001"
    assert sorted(p.name for p in piece.iterdir()) == [".lock", "fc"]  # scratch files gone
    store.close()


def test_embedded_run_keeps_its_tables_in_out_dir(tmp_path):
    from xcls.config import load_config
    from xcls.run import connect_ams

    cfg = load_config(None, ["ams.storage=mmap", "ams.local_shards=2"])
    client = connect_ams(cfg, tmp_path, None)
    client.create_table("fc", num_rows=N, dim=D)
    assert [s["storage"] for s in client.stats()] == ["mmap", "mmap"]
    assert (tmp_path / "ams" / "tables" / "shard-00001-of-00002" / "fc" / "rows.bin").is_file()
    client.close()  # what the exit of the process does
    again = connect_ams(cfg, tmp_path, None)  # reopens the tables
    assert [list(shard.store.tables) for shard in again.shards] == [["fc"], ["fc"]]
    again.close()


def test_initial_rows_are_written_into_the_files_block_by_block(tmp_path, monkeypatch):
    """Each 7-row block of the files holds the documented draw of its own class ids: the
    float64 reference of tests/test_rowinit.py, at the scale and tolerance it is checked at
    there (std 0.5; float32 uniforms make a draw with u1 rounded to 1 exactly 0)."""
    import ams.shard.table
    from ams.shard.rowinit import initial_rows
    from tests.test_rowinit import python_initial_rows

    monkeypatch.setattr(ams.shard.table, "INIT_BLOCK_ROWS", 7)  # 34 rows: 5 blocks, 1 short
    store = mmap_store(tmp_path, 2, 3)
    store.create_table(TableSpec(name="fc", num_rows=N, dim=D, seed=1, init_std=0.5))
    # shard 2 of 3 owns ids 2, 5, ..., 101 (id % 3 == 2), position p holding id 2 + 3p
    want = python_initial_rows(list(range(2, N, 3)), D, seed=1, std=0.5)
    torch.testing.assert_close(in_position_order(store)[0].double(), want, rtol=1e-4, atol=2e-4)
    store.close()
    with pytest.raises(ValueError, match="out:"):
        initial_rows(torch.arange(4), D, 1, 0.01, out=torch.empty(4, D + 1))


def reopened_out_of_memory(tmp_path) -> ShardStore:
    """An mmap store holding table "big" (50,000 x 64 float32 rows: 3,125 pages), closed,
    its files dropped from the page cache (POSIX_FADV_DONTNEED) and opened again, so that
    none of its rows are in memory; skips where the kernel keeps the pages."""
    store = ShardStore(0, 1, storage="mmap", storage_dir=tmp_path)
    store.create_table(TableSpec(name="big", num_rows=50_000, dim=64, seed=1))
    store.close()
    for path in tmp_path.rglob("*.bin"):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    store = ShardStore(0, 1, storage="mmap", storage_dir=tmp_path)
    if resident_pages(store.table("big").rows).any():
        store.close()
        pytest.skip("this kernel keeps the pages (POSIX_FADV_DONTNEED)")
    return store


READ_POSITIONS = torch.tensor([5_000, 7_777, 20_000, 49_999])
READ_PAGES = torch.unique(READ_POSITIONS * 64 * 4 // 4096)  # of the rows (256 bytes each)


@pytest.mark.parametrize("call", ["process_madvise", "madvise"])
def test_rows_missing_from_memory_are_read_ahead_together(tmp_path, monkeypatch, call):
    import ams.shard.page_advice as page_advice
    from ams.shard.page_advice import prefetch_rows

    # the pids that ask one range at a time: none, or this process
    refused = set() if call == "process_madvise" else {os.getpid()}
    monkeypatch.setattr(page_advice, "_no_process_madvise", refused)
    store = reopened_out_of_memory(tmp_path)
    table = store.table("big")
    time.sleep(0.2)
    assert not resident_pages(table.rows)[READ_PAGES].any()  # nothing reads them unasked
    prefetch_rows(table.tensors, READ_POSITIONS)
    wait_until(lambda: resident_pages(table.rows)[READ_PAGES].all(), "the pages to be read", 5)
    # those pages only: no read-around window of neighbours nobody asked for
    assert resident_pages(table.rows).sum() <= READ_PAGES.numel() + 16
    store.close()
    if call == "process_madvise" and refused:
        pytest.skip("this kernel refuses process_madvise: the pages came by madvise")


def test_rows_in_memory_are_not_asked_for_again(tmp_path, monkeypatch):
    import ams.shard.page_advice as page_advice

    store = reopened_out_of_memory(tmp_path)
    real = page_advice.advise_ranges
    asked: list[int] = []

    def counting(starts, lengths, advice):
        asked.extend([advice] * len(starts))
        real(starts, lengths, advice)

    monkeypatch.setattr(page_advice, "advise_ranges", counting)
    store.pull("big", READ_POSITIONS)
    # one range per page: the rows' 4, the momentum's 4 (same width) and the decay
    # clocks' (8 bytes a row)
    clock_pages = torch.unique(READ_POSITIONS * 8 // 4096).numel()
    assert asked == [page_advice.mmap.MADV_WILLNEED] * (2 * READ_PAGES.numel() + clock_pages)
    asked.clear()
    store.pull("big", READ_POSITIONS)  # its pages are in memory now
    assert asked == []
    store.close()


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file behind the mapping that holds ``tensor``'s first byte (/proc/self/maps), or
    None for anonymous memory."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, _perms, _offset, _dev, inode, *path = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            return path[0] if path and inode != "0" else None
    return None


def test_an_mmap_table_keeps_its_graph_lists_in_a_scratch_file(tmp_path):
    store = mmap_store(tmp_path / "tables")
    store.create_table(spec())
    ids = torch.arange(N)
    lists = torch.stack([(ids + j) % N for j in range(3)], dim=1)

    def in_scratch_file() -> bool:
        path = mapped_file(store.table("fc").graph.neighbors)
        return path is not None and ".scratch-" in path and path.endswith("(deleted)")

    # a full graph in two fixed-width parts, then a refresh of two lists
    store.set_neighbors("fc", ids[:50], None, lists[:50], version=1, step=0, replace_all=True)
    store.set_neighbors("fc", ids[50:], None, lists[50:], version=1, step=0, replace_all=True)
    assert in_scratch_file()
    assert torch.equal(store.neighbors("fc", ids)[1].long(), lists)
    refreshed = lists.clone()
    refreshed[[4, 9]] = torch.tensor([[4, 0, 1], [9, 2, 3]])
    store.set_neighbors("fc", torch.tensor([4, 9]), None, refreshed[[4, 9]], version=1, step=1,
                        replace_all=False)
    assert in_scratch_file()
    assert torch.equal(store.neighbors("fc", ids)[1].long(), refreshed)
    # a full graph sent as CSR lists of k entries each, assembled from its parts
    offsets = torch.arange(0, 3 * N + 1, 3)
    store.set_neighbors("fc", ids, offsets, lists.reshape(-1), version=2, step=2,
                        replace_all=True)
    assert in_scratch_file()
    assert torch.equal(store.neighbors("fc", ids)[1].long(), lists)
    # restored from a snapshot
    snapshot.write_snapshot(store, tmp_path, step=2)
    restore.restore_into(store, tmp_path)
    assert in_scratch_file()
    assert torch.equal(store.neighbors("fc", ids)[1].long(), lists)
    store.close()
    # memory storage keeps them in RAM
    memory = ShardStore(0, 1)
    memory.create_table(spec())
    memory.set_neighbors("fc", ids, None, lists, version=1, step=0, replace_all=True)
    assert mapped_file(memory.table("fc").graph.neighbors) is None

"""Feature cache backends against references: real Redis (conftest), real LMDB, no mocks."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import textwrap
import time

import lmdb
import numpy as np
import pytest
import torch

from bridge import redis_util
from bridge.codec import (
    FEATURE_HEADER,
    FEATURE_MAGIC,
    decode_feature_header,
    encode_features,
    entry_nbytes,
)
from bridge.errors import CorruptEntryError
from bridge.lmdb_cache import LmdbFeatureCache, footprint
from bridge.memory_cache import MemoryFeatureCache
from bridge.redis_cache import RedisFeatureCache

DIM = 16


class FakeClock:
    """Wall clock a test moves by hand (freshness checks without sleeping)."""

    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def feats(ids: np.ndarray, version: int, dim: int = DIM) -> np.ndarray:
    """Deterministic features: any reader can recompute what a writer stored for (id, version)."""
    base = np.arange(dim, dtype=np.float64)[None, :] / dim
    return (np.asarray(ids, np.float64)[:, None] % 97) * 0.01 + base + version * 0.5


def as_fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


@pytest.fixture(params=["memory", "lmdb", "redis"])
def any_cache(request, tmp_path, redis_server):
    """A factory for each backend with the same freshness settings."""
    made = []

    def make(clock=time.time, ttl_s=60.0):
        kind = request.param
        if kind == "memory":
            cache = MemoryFeatureCache(DIM, 1 << 20, ttl_s, clock)
        elif kind == "lmdb":
            cache = LmdbFeatureCache(tmp_path / f"lmdb{len(made)}", DIM, 1 << 20, ttl_s, clock)
        else:
            cache = RedisFeatureCache(redis_server.client(), DIM, f"t{os.getpid()}x{len(made)}"
                                      f"x{request.node.name.replace(':', '_')}", ttl_s,
                                      clock=clock)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        if isinstance(cache, LmdbFeatureCache):
            cache.close()


# --- codec -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_codec_round_trip_and_header(dtype):
    rows = np.random.default_rng(0).standard_normal((5, DIM))
    blobs = encode_features(rows, version=7, timestamp=123.5, dtype=dtype)
    assert all(len(b) == entry_nbytes(DIM, dtype) for b in blobs)
    assert decode_feature_header(blobs[2], DIM, dtype) == (7, 123.5)
    payload = np.frombuffer(blobs[2][FEATURE_HEADER.size:], dtype=dtype)
    np.testing.assert_array_equal(payload, rows[2].astype(dtype))


def test_codec_rejects_garbage():
    good = encode_features(np.ones((1, DIM)), 1, 1.0, "float16")[0]
    bad_magic = b"NOPE" + good[4:]
    with pytest.raises(CorruptEntryError, match="magic"):
        decode_feature_header(bad_magic, DIM, "float16")
    with pytest.raises(CorruptEntryError, match="bytes"):
        decode_feature_header(good[:-1], DIM, "float16")
    f32 = encode_features(np.ones((1, DIM // 2)), 1, 1.0, "float32")[0]  # same length as good
    assert len(f32) == len(good)
    with pytest.raises(CorruptEntryError, match="dtype"):
        decode_feature_header(f32, DIM, "float16")
    wrong_dim = FEATURE_HEADER.pack(FEATURE_MAGIC, 1, DIM + 1, 1, 1.0) + good[FEATURE_HEADER.size:]
    with pytest.raises(CorruptEntryError, match="dim"):
        decode_feature_header(wrong_dim, DIM, "float16")
    for stamp in (float("nan"), float("inf")):
        no_time = FEATURE_HEADER.pack(FEATURE_MAGIC, 1, DIM, 1, stamp) + good[FEATURE_HEADER.size:]
        with pytest.raises(CorruptEntryError, match="timestamp"):
            decode_feature_header(no_time, DIM, "float16")


# --- every backend ---------------------------------------------------------------------------


def test_round_trip_hits_and_misses(any_cache):
    cache = any_cache()
    ids = np.array([5, 9, 1_000_000_007, 42], dtype=np.int64)
    cache.put(torch.from_numpy(ids[:3]), torch.from_numpy(feats(ids[:3], 3)).float(), version=3)
    out, hit = cache.get(ids)
    assert out.dtype == torch.float32 and out.shape == (4, DIM) and hit.dtype == torch.bool
    assert hit.tolist() == [True, True, True, False]
    np.testing.assert_array_equal(out[:3].numpy(), as_fp16(feats(ids[:3], 3)))
    assert not out[3].any()
    m = cache.metrics
    assert (m.hits, m.misses, m.puts, m.corrupt) == (3, 1, 3, 0)
    assert m.bytes_read == 3 * entry_nbytes(DIM, "float16") == m.bytes_written


def test_ttl_checked_on_read(any_cache):
    clock = FakeClock()
    cache = any_cache(clock=clock, ttl_s=10.0)
    cache.put(np.arange(4), feats(np.arange(4), 0), 0)
    clock.t += 5
    cache.put(np.array([2]), feats(np.array([2]), 1), 1)  # overwrite: fresh timestamp
    clock.t += 6  # ids 0,1,3 are 11 s old (backend may still hold them), id 2 is 6 s old
    out, hit = cache.get(np.arange(4))
    assert hit.tolist() == [False, False, True, False]
    np.testing.assert_array_equal(out[2].numpy(), as_fp16(feats(np.array([2]), 1))[0])
    assert not out[[0, 1, 3]].any()
    assert cache.metrics.expired == 3


def test_an_entry_stamped_past_the_ttl_ahead_is_not_fresh(any_cache):
    """A writer whose clock runs far ahead (or a damaged stamp) must not make an entry that
    never expires; within a ttl of skew it is served."""
    clock = FakeClock()
    cache = any_cache(clock=clock, ttl_s=10.0)
    clock.t += 1000
    cache.put(np.array([1]), feats(np.array([1]), 0), 0)
    clock.t -= 995
    cache.put(np.array([2]), feats(np.array([2]), 0), 0)
    clock.t -= 5  # id 1 is stamped 1000 s ahead of now, id 2 5 s ahead
    _, hit = cache.get(np.array([1, 2]))
    assert hit.tolist() == [False, True]
    assert cache.metrics.expired == 1


def test_bad_input_is_refused(any_cache):
    cache = any_cache()
    with pytest.raises(ValueError, match="features"):
        cache.put(np.arange(3), np.zeros((3, DIM + 1)), 0)
    with pytest.raises(ValueError, match="ids"):
        cache.get(np.zeros((2, 2), dtype=np.int64))


# --- memory ----------------------------------------------------------------------------------


def test_memory_lru_bound():
    size = entry_nbytes(DIM, "float16")
    cache = MemoryFeatureCache(DIM, max_bytes=10 * size)
    cache.put(np.arange(10), feats(np.arange(10), 0), 0)
    cache.get(np.array([0]))  # touch 0: 1 becomes the least recently used
    cache.put(np.arange(10, 13), feats(np.arange(10, 13), 0), 0)
    assert cache.nbytes <= 10 * size and len(cache) == 10
    _, hit = cache.get(np.arange(13))
    assert hit.tolist() == [True, False, False, False] + [True] * 9
    assert cache.metrics.evictions == 3


# --- Redis -----------------------------------------------------------------------------------


def test_redis_every_put_sets_a_fresh_ex(redis_server):
    """Bounds from the time measured around each call, so a stalled host cannot fail it."""
    client = redis_server.client()
    cache = RedisFeatureCache(client, DIM, "ttlfresh", ttl_s=3.0)
    key = cache.key(7)

    def put_and_check_fresh(version: int) -> float:
        began = time.monotonic()
        cache.put(np.array([7]), feats(np.array([7]), version), version)
        left = client.pttl(key)
        assert 3000 - 1000 * (time.monotonic() - began) - 10 <= left <= 3000
        return began

    put_and_check_fresh(0)
    time.sleep(1.5)
    assert client.pttl(key) <= 1500
    overwritten = put_and_check_fresh(1)  # the overwrite restarted the expiry
    time.sleep(1.5)
    out, hit = cache.get(np.array([7]))
    if time.monotonic() - overwritten < 2.9:  # before the fresh expiry: still there
        assert hit.all()
        np.testing.assert_array_equal(out[0].numpy(), as_fp16(feats(np.array([7]), 1))[0])
    time.sleep(max(0.0, overwritten + 3.2 - time.monotonic()))
    assert client.exists(key) == 0  # Redis expired it by itself
    assert not cache.get(np.array([7]))[1].any()


def test_redis_prefix_isolates_jobs(redis_server):
    a = RedisFeatureCache(redis_server.client(), DIM, "jobA", ttl_s=60)
    b = RedisFeatureCache(redis_server.client(), DIM, "jobB", ttl_s=60)
    a.put(np.array([1]), feats(np.array([1]), 0), 0)
    assert a.get(np.array([1]))[1].all() and not b.get(np.array([1]))[1].any()


def test_redis_garbage_is_rejected_not_returned(redis_server):
    client = redis_server.client()
    cache = RedisFeatureCache(client, DIM, "garbage", ttl_s=60)
    ids = np.arange(6)
    cache.put(ids, feats(ids, 0), 0)
    good = client.get(cache.key(0))
    nan = encode_features(np.full((1, DIM), np.nan), 0, time.time(), "float16")[0]
    client.set(cache.key(1), b"not a feature")
    client.set(cache.key(2), good[:-2])
    client.set(cache.key(3), b"NOPE" + good[4:])
    client.set(cache.key(4), encode_features(np.ones((1, DIM)), 0, time.time(), "float32")[0])
    client.set(cache.key(5), nan)
    out, hit = cache.get(ids)
    assert hit.tolist() == [True] + [False] * 5
    assert not out[1:].any() and torch.isfinite(out).all()
    assert cache.metrics.corrupt == 5


def test_redis_maxmemory_allkeys_lru_evicts_quietly(own_redis):
    client = own_redis.client()
    client.config_set("maxmemory", str(2 << 20))
    client.config_set("maxmemory-policy", "allkeys-lru")
    dim = 512
    cache = RedisFeatureCache(client, dim, "lru", ttl_s=600)
    batch = 512  # ~0.5 MiB per put; 40 puts write ~10x maxmemory
    for step in range(40):
        ids = np.arange(step * batch, (step + 1) * batch)
        cache.put(ids, feats(ids, step, dim), step)
    assert cache.metrics.dropped_puts == 0
    assert client.info("stats")["evicted_keys"] > 0
    assert client.info("memory")["used_memory"] <= (2 << 20) * 1.2
    out, hit = cache.get(np.arange(40 * batch))
    assert 0 < hit.sum() < 40 * batch
    assert not hit[:batch].any()  # the first writes are long gone
    newest = np.arange(39 * batch, 40 * batch)
    hits = hit[39 * batch:].numpy()
    assert hits.any()
    np.testing.assert_array_equal(out[39 * batch:][hits].numpy(),
                                  as_fp16(feats(newest, 39, dim))[hits])


def test_redis_killed_mid_run_misses_then_recovers(own_redis, caplog, monkeypatch):
    monkeypatch.setattr(redis_util, "SOCKET_TIMEOUT_S", 0.3)
    monkeypatch.setattr(redis_util, "RETRY_AFTER_S", 0.2)
    cache = RedisFeatureCache(own_redis.client(), DIM, "crash", ttl_s=60)
    ids = np.arange(32)
    cache.put(ids, feats(ids, 0), 0)
    assert cache.get(ids)[1].all()
    own_redis.kill()
    for _ in range(3):  # the first call fails over, later ones short-circuit
        out, hit = cache.get(ids)
        assert not hit.any() and not out.any()
        cache.put(ids, feats(ids, 1), 1)  # dropped, no exception
    assert cache.metrics.unavailable == 3 * 32 and cache.metrics.dropped_puts == 3 * 32
    assert sum("redis_unavailable" in r.getMessage() for r in caplog.records) == 1
    own_redis.start()  # same port, empty (no persistence)
    time.sleep(0.25)
    assert not cache.get(ids)[1].any()  # reachable again, the data died with the server
    cache.put(ids, feats(ids, 2), 2)
    out, hit = cache.get(ids)
    assert hit.all()
    np.testing.assert_array_equal(out.numpy(), as_fp16(feats(ids, 2)))


# --- LMDB ------------------------------------------------------------------------------------


def lmdb_entries(path, db: bytes) -> dict[bytes, bytes]:
    """Every (key, value) of the named database ``db`` of the LMDB cache at ``path`` (layout:
    the bridge.lmdb_cache docstring), read with the lmdb package itself, read-only. Close the
    cache first: py-lmdb opens a path once per process (a closed cache reopens on next use)."""
    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=3)
    try:
        handle = env.open_db(db, create=False)
        with env.begin(db=handle) as txn:
            return dict(txn.cursor())
    finally:
        env.close()


def stored_features(path) -> dict[int, bytes]:
    """The feature entries of the LMDB cache at ``path`` by sample id: database ``feat``, keys
    8-byte big-endian ids."""
    return {struct.unpack(">q", key)[0]: blob for key, blob in lmdb_entries(path, b"feat").items()}


@pytest.mark.parametrize("max_bytes, mib", [
    (64 << 20, 3 * 64 + 8),               # 3x the bound plus 8 MiB, a whole number of MiB
    ((64 << 20) + 1000, 3 * 64 + 8 + 1),  # 3,000 bytes over: rounded up to the next MiB
    (1 << 20, 3 + 8),                     # 11 MiB: near, but not, LMDB's default of 10 MiB
])
def test_lmdb_map_size_follows_the_bound(tmp_path, max_bytes, mib):
    """The data file's ceiling (LMDB's map size) is the documented 3x the byte bound plus
    8 MiB, MiB-aligned (rounded up, so never under 3x + 8 MiB), read back from the file."""
    cache = LmdbFeatureCache(tmp_path / "c", DIM, max_bytes=max_bytes)
    cache.put(np.arange(3), feats(np.arange(3), 0), 0)  # a commit writes the map size down
    cache.close()
    # map_size=0: take the map size the environment was written with, not py-lmdb's default
    env = lmdb.open(str(tmp_path / "c"), readonly=True, lock=False, max_dbs=3, map_size=0)
    try:
        assert env.info()["map_size"] == mib << 20
    finally:
        env.close()


def test_lmdb_persists_across_reopen(tmp_path):
    ids = np.arange(100)
    cache = LmdbFeatureCache(tmp_path / "c", DIM, max_bytes=1 << 20)
    cache.put(ids, feats(ids, 4), 4)
    cache.close()
    again = LmdbFeatureCache(tmp_path / "c", DIM, max_bytes=1 << 20)
    out, hit = again.get(ids)
    assert hit.all()
    np.testing.assert_array_equal(out.numpy(), as_fp16(feats(ids, 4)))
    again.close()


OPEN_CACHE = """
import sys
import numpy as np
from bridge.errors import BridgeError
from bridge.lmdb_cache import LmdbFeatureCache
try:
    LmdbFeatureCache(sys.argv[1], int(sys.argv[2]), max_bytes=1 << 20).get(np.arange(3))
except BridgeError as e:
    print(e)
"""


def test_lmdb_cache_cut_short_is_one_error_not_a_bus_error(tmp_path):
    ids = np.arange(200)
    cache = LmdbFeatureCache(tmp_path / "c", DIM, max_bytes=1 << 20)
    cache.put(ids, feats(ids, 0), 0)
    cache.close()
    data = tmp_path / "c" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)
    # in a process of its own: without the check, the read kills the process with SIGBUS
    out = subprocess.run([sys.executable, "-c", OPEN_CACHE, str(tmp_path / "c"), str(DIM)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"gear feature cache: {data}: truncated")
    assert out.stdout.strip().endswith(f"delete {tmp_path / 'c'} and the cache starts empty")


def test_lmdb_garbage_is_rejected_not_returned(tmp_path):
    cache = LmdbFeatureCache(tmp_path / "c", DIM, max_bytes=1 << 20)
    cache.put(np.arange(3), feats(np.arange(3), 0), 0)
    cache.close()
    env = lmdb.open(str(tmp_path / "c"), max_dbs=3)
    db = env.open_db(b"feat")
    with env.begin(write=True, db=db) as txn:
        txn.put(struct.pack(">q", 1), b"\x00" * 7)
        txn.put(struct.pack(">q", 2), b"XCF1" + b"\xff" * (entry_nbytes(DIM, "float16") - 4))
    env.close()
    cache = LmdbFeatureCache(tmp_path / "c", DIM, max_bytes=1 << 20)
    out, hit = cache.get(np.arange(3))
    assert hit.tolist() == [True, False, False] and not out[1:].any()
    assert cache.metrics.corrupt == 2
    cache.put(np.array([1, 2]), feats(np.array([1, 2]), 1), 1)  # the recompute overwrites it
    assert cache.get(np.arange(3))[1].all()
    cache.close()


def test_lmdb_bounded_under_churn_and_swept(tmp_path):
    clock = FakeClock()
    dim = 128
    bound = 256 << 10
    cache = LmdbFeatureCache(tmp_path / "c", dim, max_bytes=bound, ttl_s=100.0, clock=clock)
    per_entry = footprint(entry_nbytes(dim, "float16"))
    written = 0
    for step in range(200):  # 200 x 256 entries x 284 B = ~55x the bound
        ids = np.arange(step * 256, (step + 1) * 256)
        cache.put(ids, feats(ids, step, dim), step)
        written += 256 * entry_nbytes(dim, "float16")
        clock.t += 0.01
        assert cache.nbytes <= bound
    assert written > 50 * bound
    assert len(cache) * per_entry == cache.nbytes
    file_size = os.path.getsize(tmp_path / "c" / "data.mdb")
    assert file_size <= cache.map_size <= 3 * bound + (9 << 20)
    out, hit = cache.get(np.arange(200 * 256))
    assert not hit[:256].any() and hit[-256:].all()  # oldest evicted, newest kept
    np.testing.assert_array_equal(out[-256:].numpy(),
                                  as_fp16(feats(np.arange(199 * 256, 200 * 256), 199, dim)))
    # Expired entries are deleted by the next write, not just hidden.
    clock.t += 101
    cache.put(np.array([10**9]), feats(np.array([10**9]), 500, dim), 500)
    assert len(cache) == 1 and cache.nbytes == per_entry
    cache.close()


WRITER = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, sys.argv[2])
    from bridge.lmdb_cache import LmdbFeatureCache
    from tests.test_bridge_cache import feats
    cache = LmdbFeatureCache(sys.argv[1], 64, max_bytes=512 << 10)
    step = 0
    while True:
        ids = np.arange(step * 128, (step + 1) * 128) % 5000
        cache.put(ids, feats(ids, step, 64), step)
        if step == 20:
            print("ready", flush=True)
        step += 1
""")


def test_lmdb_survives_writer_sigkill(tmp_path):
    path = tmp_path / "c"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for round_ in range(2):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), repo],
                                stdout=subprocess.PIPE, cwd=repo)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.05 * round_)  # kill at different points of a transaction
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    cache = LmdbFeatureCache(path, 64, max_bytes=512 << 10)
    ids = np.arange(5000)
    out, hit = cache.get(ids)
    assert hit.sum() > 0 and cache.metrics.corrupt == 0
    assert cache.nbytes <= 512 << 10
    cache.close()
    # Every entry in the file is a hit (no TTL), and every hit is exactly what some committed
    # put wrote: feats(id, version) for the version its stored header names.
    stored = stored_features(path)
    assert sorted(stored) == ids[hit.numpy()].tolist()
    versions = [decode_feature_header(stored[i], 64, cache.dtype)[0] for i in sorted(stored)]
    ref = as_fp16(np.stack([feats(np.array([i]), v, 64)[0]
                            for i, v in zip(sorted(stored), versions, strict=True)]))
    np.testing.assert_array_equal(out[hit].numpy(), ref)
    cache.put(ids[:10], feats(ids[:10], 999, 64), 999)  # and it takes writes again (reopened)
    assert cache.get(ids[:10])[1].all()
    cache.close()


def test_drop_newer_than_forgets_a_discarded_timeline(any_cache):
    clock = FakeClock()
    cache = any_cache(clock)
    ids = np.arange(30)
    for v in range(5):  # ids 6v..6v+5 written by backbone v
        cache.put(ids[6 * v:6 * v + 6], feats(ids[6 * v:6 * v + 6], v), v)
    assert cache.drop_newer_than(2) == 12
    out, hit = cache.get(ids)
    np.testing.assert_array_equal(hit.numpy(), ids < 18)
    np.testing.assert_array_equal(out[:18].numpy(),
                                  as_fp16(np.concatenate([feats(ids[6 * v:6 * v + 6], v)
                                                          for v in range(3)])))
    assert cache.drop_newer_than(-1) == 18
    assert not cache.get(ids)[1].any()
    cache.put(ids[:3], feats(ids[:3], 7), 7)  # the cache keeps working afterwards
    assert cache.get(ids[:3])[1].all()


def test_drop_newer_than_removes_undecodable_entries(tmp_path, redis_server):
    cache = RedisFeatureCache(redis_server.client(), DIM, "dropgarbage", 60.0)
    cache.put(np.arange(4), feats(np.arange(4), 1), 1)
    cache.client.set(cache.key(9), b"garbage")
    cache.client.set(b"dropgarbageX:f:1", b"another job's key")  # a prefix sharing the start
    assert cache.drop_newer_than(5) == 1
    assert cache.client.get(cache.key(9)) is None
    assert cache.client.get(b"dropgarbageX:f:1") is not None
    assert cache.get(np.arange(4))[1].all()


def test_lmdb_drop_newer_than_keeps_the_byte_account(tmp_path):
    cache = LmdbFeatureCache(tmp_path / "c", 64, 1 << 20, ttl_s=60.0)
    for v in range(4):
        cache.put(np.arange(100 * v, 100 * v + 100), feats(np.arange(100), v, 64), v)
    before = cache.nbytes
    assert cache.drop_newer_than(1) == 200
    assert cache.nbytes == before // 2 and len(cache) == 200
    cache.close()
    # versions 0 and 1 wrote ids 0..199: those entries stay, and the time index (keys: write
    # time in us, 8 bytes BE, then the id) lost the dropped ids too
    assert sorted(stored_features(tmp_path / "c")) == list(range(200))
    index = lmdb_entries(tmp_path / "c", b"bytime")
    assert sorted(struct.unpack(">Qq", key)[1] for key in index) == list(range(200))


def test_memory_checkpoint_state_restores_entries_exactly():
    clock = FakeClock()
    a = MemoryFeatureCache(DIM, 40 * entry_nbytes(DIM, "float16"), ttl_s=60.0, clock=clock)
    for v in range(6):  # ids 10v..10v+9 by backbone v; the bound evicts ids 0..19
        a.put(np.arange(10 * v, 10 * v + 10), feats(np.arange(10 * v, 10 * v + 10), v), v)
    a.get(np.arange(25, 30))  # touched: now most recently used
    state = a.checkpoint_state()
    assert state["ids"].tolist() == [*range(20, 25), *range(30, 60), *range(25, 30)]
    b = MemoryFeatureCache(DIM, a.max_bytes, ttl_s=60.0, clock=clock)
    b.put(np.arange(3), feats(np.arange(3), 9), 9)  # replaced by the restore
    b.restore_checkpoint_state(state, 5)
    ids = np.arange(60)
    out, hit = b.get(ids)
    np.testing.assert_array_equal(hit.numpy(), ids >= 20)
    np.testing.assert_array_equal(out[20:].numpy(), as_fp16(np.concatenate(
        [feats(np.arange(10 * v, 10 * v + 10), v) for v in range(2, 6)])))
    # the LRU order came along: the next eviction takes the same ids from both
    for cache in (a, b):
        cache.put(np.arange(100, 105), feats(np.arange(100, 105), 9), 9)
    assert torch.equal(a.get(ids)[1], b.get(ids)[1])
    # entries keep their write times, so they expire as they would have
    clock.t += 61
    assert not b.get(ids[20:])[1].any()
    with pytest.raises(ValueError, match="uint8"):
        b.restore_checkpoint_state({"ids": np.arange(2), "entries": np.zeros((2, 3), np.uint8)}, 0)


def test_memory_fresh_restore_empties_the_cache():
    cache = MemoryFeatureCache(DIM, 1 << 20, ttl_s=60.0)
    cache.put(np.arange(5), feats(np.arange(5), 0), 0)
    cache.restore_checkpoint_state(None, -1)
    assert len(cache) == 0 and cache.nbytes == 0


@pytest.mark.parametrize("kind", ["lmdb", "redis"])
def test_shared_cache_checkpoint_state_rolls_back_where_it_lives(kind, tmp_path, redis_server):
    prefix = f"ckpt{os.getpid()}"

    def make() -> LmdbFeatureCache | RedisFeatureCache:
        if kind == "lmdb":
            return LmdbFeatureCache(tmp_path / "cache", DIM, 1 << 20, ttl_s=60.0)
        return RedisFeatureCache(redis_server.client(), DIM, prefix, 60.0)

    ids = np.arange(40)
    crashed = make()
    for v in range(2):  # ids 10v..10v+9 by backbone v, before the checkpoint of version 1
        crashed.put(ids[10 * v:10 * v + 10], feats(ids[10 * v:10 * v + 10], v), v)
    state = crashed.checkpoint_state()
    assert state is None  # the entries stay where they live
    for v in range(2, 4):  # after it, by weights the resumed run never has
        crashed.put(ids[10 * v:10 * v + 10], feats(ids[10 * v:10 * v + 10], v), v)
    if kind == "lmdb":
        crashed.close()

    resumed = make()
    resumed.restore_checkpoint_state(state, 1)
    out, hit = resumed.get(ids)
    np.testing.assert_array_equal(hit.numpy(), ids < 20)
    np.testing.assert_array_equal(out[:20].numpy(), as_fp16(np.concatenate(
        [feats(ids[10 * v:10 * v + 10], v) for v in range(2)])))
    assert _stored_ids(resumed) == list(range(20))  # the newer entries are gone, not stale
    resumed.restore_checkpoint_state(None, -1)  # a fresh run of the same job starts empty
    assert not resumed.get(ids)[1].any() and _stored_ids(resumed) == []
    if kind == "lmdb":
        resumed.close()


def _stored_ids(cache: LmdbFeatureCache | RedisFeatureCache) -> list[int]:
    """The sample ids with an entry where the cache keeps them: read from the LMDB directory
    (the cache closed first; it reopens on next use), or the job's Redis keys."""
    if isinstance(cache, LmdbFeatureCache):
        cache.close()
        return sorted(stored_features(cache.path))
    keys = cache.client.scan_iter(match=f"{cache.prefix}:f:*".encode())
    return sorted(int(key.rsplit(b":", 1)[1]) for key in keys)

"""Gradient accumulators against a float64 numpy reference; the Redis ones on a real server."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from bridge import redis_accumulator, redis_util
from bridge.accumulator import MemoryGradientAccumulator, apply_key
from bridge.codec import GradEntry, decode_record, encode_grad_entry
from bridge.errors import BridgeError
from bridge.redis_accumulator import (
    RedisGradientAccumulator,
    RedisGradientConsumer,
    dead_letter_key,
    stream_key,
)

DIM = 8


class Reference:
    """The specification in float64: per sample, every m-th gradient closes a window whose mean
    is emitted with the newest version in it."""

    def __init__(self, m: int) -> None:
        self.m = m
        self.window: dict[int, list[tuple[np.ndarray, int]]] = {}
        self.emitted: dict[tuple[int, int], tuple[np.ndarray, int]] = {}  # (id, seq) -> mean, v
        self.seq: dict[int, int] = {}

    def add(self, ids: np.ndarray, grads: np.ndarray, version: int) -> None:
        # One call folds repeated ids together before the count check, as the accumulators do.
        for i in np.unique(ids).tolist():
            window = self.window.setdefault(i, [])
            window += [(g.astype(np.float64), version) for g in grads[ids == i]]
            if len(window) >= self.m:
                mean = np.mean([g for g, _ in window], axis=0)
                seq = self.seq.get(i, 0)
                self.emitted[(i, seq)] = (mean, max(v for _, v in window))
                self.seq[i] = seq + 1
                self.window[i] = []


def drive(acc, ref: Reference, steps: int, seed: int, first_version: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for step in range(steps):
        ids = rng.integers(0, 12, size=10)
        grads = rng.standard_normal((10, DIM)).astype(np.float32)
        version = first_version + step // 3
        acc.add(torch.from_numpy(ids), torch.from_numpy(grads), version=version)
        ref.add(ids, grads, version)


def collect(reader, applied: dict, max_items: int = 7) -> None:
    """Drain ``reader`` the way a slow gear would: read, apply (record), ack."""
    while True:
        batch = reader.read(max_items=max_items)
        if len(batch) == 0:
            return
        assert batch.grads.dtype == torch.float32 and batch.grads.shape == (len(batch), DIM)
        for i, g, v, h in zip(batch.ids.tolist(), batch.grads, batch.versions.tolist(),
                              batch.handles, strict=True):
            assert h.key not in applied, "applied twice"
            applied[h.key] = (i, g.numpy().copy(), v)
        reader.ack(batch)


def check_against(ref: Reference, applied: dict) -> None:
    expected = {apply_key(i, v, seq): (i, mean, v) for (i, seq), (mean, v) in ref.emitted.items()}
    assert applied.keys() == expected.keys()
    for key, (i, grad, v) in applied.items():
        ri, mean, rv = expected[key]
        assert (i, v) == (ri, rv)
        np.testing.assert_allclose(grad, mean, rtol=1e-5, atol=1e-6)


# --- in memory -------------------------------------------------------------------------------


def test_memory_means_match_float64_reference():
    acc, ref, applied = MemoryGradientAccumulator(DIM, m=3), Reference(3), {}
    drive(acc, ref, steps=40, seed=0)
    collect(acc, applied)
    assert len(ref.emitted) > 20
    check_against(ref, applied)
    assert acc.metrics.added == 400 and acc.metrics.applied == len(applied)


def test_memory_rejects_non_finite_and_bad_shapes():
    acc = MemoryGradientAccumulator(DIM, m=2)
    bad = np.zeros((2, DIM), np.float32)
    bad[1, 3] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        acc.add(np.array([1, 2]), bad, 0)
    with pytest.raises(ValueError, match="grads"):
        acc.add(np.array([1, 2]), np.zeros((2, DIM + 1)), 0)
    assert acc.pending() == 0


def test_memory_read_blocks_until_ready():
    acc = MemoryGradientAccumulator(DIM, m=1)
    assert len(acc.read(block_ms=20)) == 0
    acc.add(np.array([4]), np.ones((1, DIM)), 2)
    batch = acc.read(block_ms=1000)
    assert batch.ids.tolist() == [4] and batch.versions.tolist() == [2]


# --- Redis -----------------------------------------------------------------------------------


def test_redis_two_fast_workers_match_reference(redis_server):
    prefix = "acc_ref"
    workers = [RedisGradientAccumulator(redis_server.client(), DIM, 3, prefix) for _ in range(2)]
    ref = Reference(3)
    rng = np.random.default_rng(1)
    for step in range(40):  # alternate workers: one sample's gradients come from both
        ids = rng.integers(0, 12, size=10)
        grads = rng.standard_normal((10, DIM)).astype(np.float32)
        workers[step % 2].add(ids, grads, version=step // 3)
        ref.add(ids, grads, step // 3)
    consumer = RedisGradientConsumer(redis_server.client(), DIM, prefix, consumer="slow0")
    applied: dict = {}
    collect(consumer, applied)
    check_against(ref, applied)
    client = redis_server.client()
    assert client.xlen(stream_key(prefix)) == 0  # acked entries are deleted
    assert client.xpending(stream_key(prefix), "slow_gear")["pending"] == 0


def test_redis_dead_consumer_entries_redelivered_and_applied_once(redis_server):
    prefix = "acc_claim"
    client = redis_server.client()
    acc = RedisGradientAccumulator(client, DIM, 2, prefix)
    ref = Reference(2)
    ids = np.arange(10)
    for version in range(2):
        grads = np.random.default_rng(version).standard_normal((10, DIM))
        acc.add(ids, grads, version)
        ref.add(ids, grads, version)
    dying = RedisGradientConsumer(client, DIM, prefix, consumer="dies", min_idle_ms=500)
    survivor = RedisGradientConsumer(client, DIM, prefix, consumer="lives", min_idle_ms=500)
    taken = dying.read(max_items=6)  # ... and the process dies before ack
    assert len(taken) == 6
    applied: dict = {}
    collect(survivor, applied)  # at least the 4 nobody holds (the 6 once idle for 0.5 s)
    free = {apply_key(i, v, seq) for (i, seq), (_, v) in ref.emitted.items()}
    assert free - {h.key for h in taken.handles} <= applied.keys()
    # A mean sent twice (a fast worker's EXEC whose reply was lost, then retried).
    first = taken.handles[0]
    i, v, seq = (int(x) for x in first.key.split(b":"))
    dup = GradEntry(i, v, seq, 2, taken.grads[0].numpy())
    client.xadd(stream_key(prefix), encode_grad_entry(dup))
    time.sleep(0.6)
    collect(survivor, applied)
    assert survivor.metrics.claimed == 6
    check_against(ref, applied)  # all 10 means, each once
    assert survivor.metrics.duplicates == 1
    assert dying.ack(taken) == 0  # the dead one's late ack changes nothing
    assert client.xpending(stream_key(prefix), "slow_gear")["pending"] == 0


@pytest.mark.parametrize("mutate, message", [
    (lambda f: {**f, b"grad": f[b"grad"][:-4]}, "payload"),
    (lambda f: {**f, b"dtype": b"int8"}, "dtype"),
    (lambda f: {**f, b"dtype": b"float16"}, "payload"),
    (lambda f: {k: v for k, v in f.items() if k != b"id"}, "field"),
    (lambda f: {**f, b"dim": b"9"}, "dim"),
    (lambda f: {**f, b"grad": np.full(DIM, np.inf, np.float32).tobytes()}, "non-finite"),
    (lambda f: {**f, b"id": str(2**70).encode()}, "outside [0, 2**63)"),
    (lambda f: {**f, b"id": b"-5"}, "outside [0, 2**63)"),
    (lambda f: {**f, b"version": b"-1"}, "version -1"),
], ids=["short", "int8", "float16", "no_id", "dim", "inf", "id_past_int64", "id_negative",
        "version_negative"])
def test_redis_malformed_entry_dead_lettered_never_applied(redis_server, request, mutate,
                                                           message):
    prefix = f"acc_bad_{request.node.callspec.id}"
    client = redis_server.client()
    consumer = RedisGradientConsumer(client, DIM, prefix, consumer="c")
    consumer.read()  # creates the group
    good = encode_grad_entry(GradEntry(5, 1, 0, 2, np.ones(DIM, np.float32)))
    client.xadd(stream_key(prefix), mutate(good))
    client.xadd(stream_key(prefix), good)
    batch = consumer.read(max_items=10)
    assert batch.ids.tolist() == [5]
    np.testing.assert_array_equal(batch.grads.numpy(), np.ones((1, DIM), np.float32))
    consumer.ack(batch)
    dead = client.xrange(dead_letter_key(prefix))
    assert len(dead) == 1 and message in dead[0][1][b"error"].decode()
    assert consumer.metrics.corrupt == 1
    assert client.xpending(stream_key(prefix), "slow_gear")["pending"] == 0


def test_redis_corrupt_record_starts_sample_over(redis_server):
    client = redis_server.client()
    acc = RedisGradientAccumulator(client, DIM, 2, "acc_rec")
    acc.add(np.array([3]), np.full((1, DIM), 100.0), 0)
    client.set(acc.record_key(3), b"garbage")
    acc.add(np.array([3, 3]), np.stack([np.full(DIM, 1.0), np.full(DIM, 2.0)]), 1)
    batch = RedisGradientConsumer(client, DIM, "acc_rec", consumer="c").read()
    np.testing.assert_allclose(batch.grads.numpy(), np.full((1, DIM), 1.5))  # no 100 in it
    assert acc.metrics.corrupt == 1


def outage_pair(own_redis, monkeypatch, prefix: str, *, m: int, retry_after_s: float,
                fallback_samples: int):
    """(client, accumulator of ``m``, consumer "c") of job ``prefix`` on a Redis the test
    kills: short socket timeouts, the guards' retry wait and the fallback's bound set."""
    monkeypatch.setattr(redis_util, "SOCKET_TIMEOUT_S", 0.3)
    monkeypatch.setattr(redis_util, "RETRY_AFTER_S", retry_after_s)
    monkeypatch.setattr(redis_accumulator, "FALLBACK_SAMPLES", fallback_samples)
    client = own_redis.client()
    return (client, RedisGradientAccumulator(client, DIM, m, prefix),
            RedisGradientConsumer(client, DIM, prefix, consumer="c"))


def test_redis_down_drops_and_recovers(own_redis, monkeypatch):
    client, acc, consumer = outage_pair(own_redis, monkeypatch, "acc_down", m=1,
                                        retry_after_s=0.2, fallback_samples=0)
    assert acc.add(np.array([1]), np.ones((1, DIM)), 0) == 1
    own_redis.kill()
    assert acc.add(np.array([2]), np.ones((1, DIM)), 0) == 0
    assert len(consumer.read(block_ms=50)) == 0
    assert acc.metrics.dropped == 1 and acc.metrics.fallback == 0  # no fallback: dropped
    assert acc.metrics.outages == 1
    own_redis.start()
    time.sleep(0.25)
    assert acc.add(np.array([3]), np.ones((1, DIM)), 0) == 1
    assert consumer.read().ids.tolist() == [3]
    # Blocking longer than the 0.3 s socket timeout is read in slices, not taken for a failure.
    assert len(consumer.read(block_ms=700)) == 0 and consumer.guard.usable()


def test_redis_down_trains_from_the_fallback_and_moves_its_windows_back(own_redis,
                                                                        monkeypatch):
    # retry at once: every add tries Redis, so where each gradient goes does not hang on time
    client, acc, consumer = outage_pair(own_redis, monkeypatch, "acc_fb", m=2,
                                        retry_after_s=0.0, fallback_samples=3)
    rng = np.random.default_rng(7)
    g = {name: rng.standard_normal((1, DIM)).astype(np.float32)
         for name in ("5a", "5b", "6a", "6b", "7a", "7b", "8a", "9a")}
    own_redis.kill()
    assert acc.add(np.array([5]), g["5a"], 0) == 0
    assert acc.add(np.array([5]), g["5b"], 1) == 1  # m=2 reached in the fallback
    assert len(consumer.read()) == 0
    ready = acc.fallback.read()  # as the in-process slow gear does after every step
    assert ready.ids.tolist() == [5]
    np.testing.assert_allclose(ready.grads.numpy(), (g["5a"].astype(np.float64) + g["5b"]) / 2,
                               rtol=1e-6)
    acc.fallback.ack(ready)
    for i in (6, 7, 8, 9):  # 5's mean was taken; 6, 7, 8 fill the 3 places, 9 finds none
        assert acc.add(np.array([i]), g[f"{i}a"], 2) == 0
    assert (acc.metrics.fallback, acc.metrics.dropped, acc.metrics.outages) == (5, 1, 1)

    own_redis.start()
    assert acc.add(np.array([6]), g["6b"], 3) == 1  # with the fallback's window of 6: m reached
    assert acc.metrics.outages == 1 and acc.metrics.outage_s > 0
    assert acc.fallback.pending() == 0 and len(acc.fallback.read()) == 0
    batch = consumer.read()
    assert batch.ids.tolist() == [6]
    np.testing.assert_allclose(batch.grads.numpy(), (g["6a"].astype(np.float64) + g["6b"]) / 2,
                               rtol=1e-6)
    for i in (7, 8):  # the other open windows went to Redis as they were
        rec = decode_record(client.get(acc.record_key(i)), DIM)
        assert rec.count == 1
        np.testing.assert_array_equal(rec.sum, g[f"{i}a"][0])
    assert client.get(acc.record_key(9)) is None
    acc.add(np.array([7]), g["7b"], 4)
    np.testing.assert_allclose(consumer.read().grads.numpy(),
                               (g["7a"].astype(np.float64) + g["7b"]) / 2, rtol=1e-6)
    assert acc.metrics.fallback == 5  # nothing more went to the fallback once Redis was back


def test_redis_down_keeps_an_external_slow_gears_means_until_redis_is_back(own_redis,
                                                                           monkeypatch):
    # no slow gear reads the fallback here: its means wait, within a bound of 4 held samples
    client, acc, consumer = outage_pair(own_redis, monkeypatch, "acc_ext", m=2,
                                        retry_after_s=0.0, fallback_samples=4)
    rng = np.random.default_rng(11)
    g = {name: rng.standard_normal((1, DIM)).astype(np.float32)
         for name in ("5a", "5b", "5c", "5d", "6a", "6b", "7a", "8a")}
    own_redis.kill()
    for name in ("5a", "5b", "5c", "5d"):  # two means of sample 5, both queued
        acc.add(np.array([5]), g[name], 1)
    acc.add(np.array([6]), g["6a"], 2)
    acc.add(np.array([7]), g["7a"], 2)  # 2 means + 2 windows: the bound is reached
    acc.add(np.array([8]), g["8a"], 2)
    assert (acc.metrics.fallback, acc.metrics.dropped) == (6, 1)

    own_redis.start()
    # this add reaches Redis, ends the outage, and everything the fallback held moves there
    assert acc.add(np.array([6]), g["6b"], 3) == 3
    batch = consumer.read()
    assert batch.ids.tolist() == [5, 5, 6]
    expected = [(g[a].astype(np.float64) + g[b]) / 2
                for a, b in (("5a", "5b"), ("5c", "5d"), ("6a", "6b"))]
    np.testing.assert_allclose(batch.grads.numpy(), np.concatenate(expected), rtol=1e-6)
    assert batch.versions.tolist() == [1, 1, 3]
    assert len({h.key for h in batch.handles}) == 3  # two means of 5, two apply-once keys
    assert consumer.ack(batch) == 3
    rec = decode_record(client.get(acc.record_key(7)), DIM)
    assert rec.count == 1
    np.testing.assert_array_equal(rec.sum, g["7a"][0])
    assert client.get(acc.record_key(8)) is None
    assert len(acc.fallback.read()) == 0 and acc.fallback.pending() == 0


def test_consumer_joins_the_new_stream_after_the_gradient_state_is_discarded(own_redis,
                                                                             monkeypatch):
    monkeypatch.setattr(redis_util, "SOCKET_TIMEOUT_S", 0.3)
    client = own_redis.client()
    acc = RedisGradientAccumulator(client, DIM, 1, "acc_gone")
    consumer = RedisGradientConsumer(client, DIM, "acc_gone", consumer="c")
    acc.add(np.array([1]), np.ones((1, DIM)), 0)
    assert consumer.read().ids.tolist() == [1]  # group created, entry pending (not acked)
    acc.discard_all()  # a trainer started over: the stream and its group are gone
    acc.add(np.array([2]), np.full((1, DIM), 2.0), 5)
    batch = consumer.read()
    assert batch.ids.tolist() == [2] and batch.versions.tolist() == [5]
    assert consumer.guard.usable() and consumer.metrics.outages == 0


def test_memory_checkpoint_state_holds_what_was_added_and_resumes_exactly():
    first, ref, applied = MemoryGradientAccumulator(DIM, 3), Reference(3), {}
    drive(first, ref, 20, seed=5)
    taken = first.read(max_items=4)  # 4 means applied before the checkpoint; the rest queued
    for i, g, v, h in zip(taken.ids.tolist(), taken.grads, taken.versions.tolist(),
                          taken.handles, strict=True):
        applied[h.key] = (i, g.numpy().copy(), v)
    first.ack(taken)
    state = first.checkpoint_state()

    # the partial sums are the gradients of each sample's open window
    open_ids = sorted(i for i, window in ref.window.items() if window)
    partial = state["counts"] > 0
    assert state["ids"][partial].tolist() == open_ids
    assert state["counts"][partial].tolist() == [len(ref.window[i]) for i in open_ids]
    np.testing.assert_allclose(state["sums"][partial],
                               [np.sum([g for g, _ in ref.window[i]], axis=0) for i in open_ids],
                               rtol=1e-5, atol=1e-5)
    assert state["seqs"].tolist() == [ref.seq.get(i, 0) for i in state["ids"].tolist()]
    # the queue holds the reference's means not yet read, in order
    queued = list(ref.emitted.items())[4:]
    ready_ids, ready_means, ready_versions, ready_seqs = state["ready"]
    assert ready_ids.tolist() == [i for (i, _), _ in queued]
    assert ready_seqs.tolist() == [seq for (_, seq), _ in queued]
    assert ready_versions.tolist() == [v for _, (_, v) in queued]
    np.testing.assert_allclose(ready_means, [mean for _, (mean, _) in queued],
                               rtol=1e-5, atol=1e-6)

    # restored elsewhere, the accumulator goes on as the reference does
    resumed = MemoryGradientAccumulator(DIM, 3)
    resumed.add(np.array([0]), np.ones((1, DIM)), 0)  # replaced by the restore
    resumed.restore_checkpoint_state(state, 6)
    drive(resumed, ref, 20, seed=6, first_version=7)
    collect(resumed, applied)
    assert len(applied) > 20
    check_against(ref, applied)
    with pytest.raises(ValueError, match="width"):
        MemoryGradientAccumulator(DIM + 1, 3).restore_checkpoint_state(state, 6)


def test_memory_fresh_restore_empties_the_accumulator():
    acc = MemoryGradientAccumulator(DIM, 2)
    drive(acc, Reference(2), 10, seed=3)
    acc.restore_checkpoint_state(None, -1)
    assert acc.pending() == 0 and len(acc.read()) == 0


def test_redis_restore_forgets_the_job_only(redis_server):
    client = redis_server.client()
    acc = RedisGradientAccumulator(client, DIM, 2, "discard")
    other = RedisGradientAccumulator(client, DIM, 1, "discardX")
    ref = Reference(2)
    drive(acc, ref, 10, seed=1)
    drive(other, Reference(1), 3, seed=1)
    consumer = RedisGradientConsumer(client, DIM, "discard")
    collect(consumer, {})  # applied keys exist now
    drive(acc, ref, 10, seed=2, first_version=4)  # partial sums and queued means too
    assert client.xlen(stream_key("discard")) > 0
    for i, window in ref.window.items():  # the partial sums in Redis are the reference's
        rec = decode_record(client.get(acc.record_key(i)), DIM)
        assert rec.count == len(window)
        if window:
            np.testing.assert_allclose(rec.sum, np.sum([g for g, _ in window], axis=0),
                                       rtol=1e-5, atol=1e-5)

    assert acc.checkpoint_state() is None  # the state lives in Redis, not in checkpoints
    acc.restore_checkpoint_state(None, 3)
    assert not list(client.scan_iter(match=b"discard:*"))
    assert client.xlen(stream_key("discardX")) > 0
    # a new consumer starts over: the same means are fresh, not duplicates
    ref, applied = Reference(2), {}
    drive(acc, ref, 10, seed=1)
    collect(RedisGradientConsumer(client, DIM, "discard"), applied)
    check_against(ref, applied)


def test_redis_restore_refuses_to_start_without_redis(own_redis, monkeypatch):
    monkeypatch.setattr(redis_util, "SOCKET_TIMEOUT_S", 0.3)
    acc = RedisGradientAccumulator(own_redis.client(), DIM, 2, "norestore")
    own_redis.kill()
    with pytest.raises(BridgeError, match="gradient state"):
        acc.restore_checkpoint_state(None, -1)

"""Gradient accumulation across processes and hosts, over Redis.

Fast gear (any number of workers): :class:`RedisGradientAccumulator.add` keeps per-sample records
``{prefix}:acc:{id}`` (float32 sum, count, newest version, means emitted; see
:func:`bridge.codec.encode_record`). It updates them optimistically: WATCH the batch's keys, read
them, then in one MULTI write the new records and XADD every mean that reached ``m`` gradients to
the stream ``{prefix}:grads``. The reset of a record and the XADD of its mean commit together, so a
fast worker dying mid-add loses or duplicates nothing; a concurrent add to the same sample makes
EXEC fail and the add retries. The MULTI also writes the add's own token ``{prefix}:added:{uuid}``,
which each try watches and reads first: a try that Redis applied but whose answer was lost (which
redis-py reports as a failed EXEC) is found by the retry, which then adds nothing.

Slow gear (any number of workers, one consumer group): :class:`RedisGradientConsumer.read` first
takes over entries that another consumer was given but did not ack for ``min_idle_ms`` (XAUTOCLAIM:
that consumer died), then reads new ones (XREADGROUP), so delivery is at-least-once. Each mean is
applied once per key (sample id, version, seq) (:func:`bridge.accumulator.apply_key`): ``ack`` sets
``{prefix}:applied:{key}`` (SET NX EX) and XACKs + XDELs in one MULTI, and ``read`` acks and skips
entries whose key is already set (a re-sent or re-delivered mean). A consumer that dies after its
backward step but before ``ack`` is the one case that applies a mean twice; an apply that is
atomic with the model step would need the key in the checkpoint.

Malformed stream entries are acked into the dead-letter stream ``{prefix}:grads:dead`` with the
error text and never returned. Redis down: ``add`` hands the gradients to its bounded in-process
fallback (an in-process slow gear drains its ready means, so the backbone keeps training; for an
external slow gear they wait there) and, once Redis answers, moves what the fallback still holds,
queued means and open windows, to Redis; only gradients past the fallback's bound are dropped.
``read`` returns an empty batch (after waiting ``block_ms``); both log rate-limited warnings and
count the outage; nothing raises.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid

import numpy as np
import redis
import torch

from bridge.accumulator import (
    EntryHandle,
    GradientBatch,
    MemoryGradientAccumulator,
    apply_key,
    combine_by_id,
    empty_batch,
)
from bridge.codec import (
    AccumRecord,
    GradEntry,
    decode_grad_entry,
    decode_record,
    encode_grad_entry,
    encode_record,
)
from bridge.errors import BridgeError, MalformedGradientError
from bridge.metrics import AccumulatorMetrics
from bridge.ratelimit import RateLimitedLog
from bridge.redis_util import RedisGuard, glob_escape

log = logging.getLogger(__name__)

# Samples with an open window the fallback holds during an outage (about dim * 4 bytes each):
# 65536 of d=512 are 128 MiB, which a trainer's host affords, and 256 steps of 256 samples.
# 0: no fallback.
FALLBACK_SAMPLES = 65_536
# The consumer group of every slow worker of a job (each mean goes to one of them). The group
# lives in Redis with the stream and `xcls gear slow --help` names it: its name never changes.
GROUP = "slow_gear"
# A sample not seen for a day loses its partial sum (refreshed on every add): it bounds the
# memory of samples that left the data set, and an epoch of any job here is shorter.
RECORD_TTL_S = 86_400
# The stream's approximate cap (XADD MAXLEN ~), reached only when every slow worker is gone;
# entries trimmed unread are lost.
STREAM_MAXLEN = 1_000_000
# Optimistic retries of an add whose samples another worker touched meanwhile.
MAX_ATTEMPTS = 8
# How long an add's token outlives it: its retries follow it within seconds, and a job that
# adds every step keeps only a minute of tokens (one small key per add).
ADD_TOKEN_TTL_S = 60
# How long an applied mean's key is remembered so that a redelivered one is not applied twice:
# far past the longest a claimed entry waits (min_idle_ms).
APPLIED_TTL_S = 86_400


def stream_key(prefix: str) -> bytes:
    """The stream of ready means of job ``prefix``."""
    return f"{prefix}:grads".encode()


def dead_letter_key(prefix: str) -> bytes:
    """Where malformed stream entries go, with an ``error`` field."""
    return f"{prefix}:grads:dead".encode()


def applied_prefix(prefix: str) -> bytes:
    """Where the consumers of job ``prefix`` remember applied keys (``{prefix}:applied:{key}``)."""
    return f"{prefix}:applied:".encode()


class AddOutcomeUnknown(redis.RedisError):
    """Redis stopped answering after a try of an add whose answer may have been lost: the add
    may be applied, or may not."""


class RedisGradientAccumulator:
    """Fast-gear side: ``add`` gradients, XADD means that reached ``m``.

    Args:
        client: redis-py client (:func:`bridge.redis_util.make_client`).
        dim: gradient width.
        m: gradients per mean.
        prefix: job name; all keys start with it.

    While Redis cannot be reached, gradients go to ``self.fallback``, an in-process
    :class:`~bridge.accumulator.MemoryGradientAccumulator` with the same ``m`` holding at most
    ``FALLBACK_SAMPLES`` open windows and queued means together (read when the accumulator is
    made); an in-process slow gear reads its ready means as they come. When Redis answers
    again, the means still queued (an external slow gear's, which cannot reach them) and the
    open windows move to Redis, so nothing the fallback took is lost. ``FALLBACK_SAMPLES`` 0:
    no fallback (``self.fallback`` None), gradients are dropped while Redis is down.

    The fallback is an accumulator of the kind the in-process slow gear already reads, so the
    backbone keeps training at the same ``m`` with no new code path in the gear; applying each
    gradient at once instead would change what a backbone step averages during an outage.
    """

    def __init__(self, client: redis.Redis, dim: int, m: int, prefix: str) -> None:
        if dim <= 0 or m <= 0:
            raise ValueError(f"dim and m must be positive, got dim={dim} m={m}")
        self.client = client
        self.dim = dim
        self.m = m
        self.prefix = prefix
        self.stream = stream_key(prefix)
        self.metrics = AccumulatorMetrics()
        self.guard = RedisGuard(f"grad_accumulator:{prefix}")
        self._warn = RateLimitedLog(log)
        self.fallback = MemoryGradientAccumulator(dim, m, FALLBACK_SAMPLES) \
            if FALLBACK_SAMPLES else None

    def record_key(self, sample_id: int) -> bytes:
        return f"{self.prefix}:acc:{sample_id}".encode()

    def discard_all(self) -> int:
        """Forget the job's gradient state: partial sums, the stream of ready means (its
        consumer group goes with it and is recreated by the next read) and the applied keys.
        Returns how many keys went. Raises redis.RedisError if Redis cannot be reached."""
        deleted = 0
        for pattern in (glob_escape(self.prefix) + b":acc:*",
                        glob_escape(self.prefix) + b":applied:*",
                        glob_escape(self.prefix) + b":added:*"):
            keys = list(self.client.scan_iter(match=pattern, count=1000))
            for start in range(0, len(keys), 1000):
                deleted += self.client.delete(*keys[start:start + 1000])
        return deleted + self.client.delete(self.stream)

    def checkpoint_state(self) -> None:
        """None: the job's gradient state lives in Redis (see
        :meth:`restore_checkpoint_state`)."""
        return None

    def restore_checkpoint_state(self, state: dict | None, version: int) -> None:
        """Start or resume the job with no gradient state (:meth:`discard_all`): means queued
        by a discarded run would otherwise be applied, and its applied keys would make the
        resumed run's identical keys look like duplicates. Only the process that owns the slow
        gear may call it; an external slow gear owns that state itself. ``state`` is None and
        ``version`` unused: nothing of it can be rolled back to a checkpoint.

        Raises BridgeError if Redis cannot be reached: starting on a discarded run's state is
        worse than not starting. The fallback starts empty too."""
        if self.fallback is not None:
            self.fallback.restore_checkpoint_state(None, version)
        try:
            self.discard_all()
        except redis.RedisError as e:
            raise BridgeError(f"cannot discard the job's gradient state in Redis ({e}); it "
                              f"would mix a discarded run into this one") from e

    def add(self, ids: np.ndarray | torch.Tensor, grads: np.ndarray | torch.Tensor,
            version: int) -> int:
        """Add dL/dX ``grads`` (n, dim) float of samples ``ids`` (n,) int64 computed on features
        of backbone ``version``. Returns how many means were queued, in Redis or, while it is
        down, in the fallback (0 when dropped)."""
        uniq, sums, counts = combine_by_id(ids, grads, self.dim)
        n = int(counts.sum())
        if uniq.shape[0] == 0:
            return 0
        if not self.guard.usable():
            return self._to_fallback(ids, grads, version, n)
        try:
            emitted = self._add_with_retries(uniq, sums, counts,
                                             np.full(uniq.shape, int(version), np.int64))
        except AddOutcomeUnknown as e:
            # Redis may still apply the try whose answer was lost: the fallback's copy would
            # count these gradients twice, so they are dropped (counted once at most)
            self._failed("add", e)
            self.metrics.dropped += n
            self._warn.warn("grad_add_dropped", reason="outcome_unknown", n=n)
            return 0
        except redis.RedisError as e:
            self._failed("add", e)
            return self._to_fallback(ids, grads, version, n)
        if emitted is None:
            self._warn.warn("grad_add_dropped", reason="contention", attempts=MAX_ATTEMPTS,
                            n=n)
            self.metrics.dropped += n
            return 0
        self.metrics.added += n
        self.metrics.emitted += emitted
        return emitted + self._answered()

    def _add_with_retries(self, uniq: np.ndarray, sums: np.ndarray, counts: np.ndarray,
                          versions: np.ndarray) -> int | None:
        """Fold per-sample sums into Redis; the means queued, or None when other workers kept
        touching the same samples for ``MAX_ATTEMPTS`` tries. Raises redis.RedisError, or
        AddOutcomeUnknown when Redis stopped answering after a try that it may have applied."""
        keys = [self.record_key(i) for i in uniq.tolist()]
        token = f"{self.prefix}:added:{uuid.uuid4().hex}".encode()
        refused = False  # a try ended in WatchError: maybe applied, its answer lost
        for _ in range(MAX_ATTEMPTS):
            try:
                emitted = self._try_add(keys, token, uniq, sums, counts, versions)
            except redis.WatchError:
                refused = True
                continue
            except redis.RedisError as e:
                if refused:  # the next try could not ask the token
                    raise AddOutcomeUnknown(str(e)) from e
                raise
            self.metrics.bytes += emitted * self.dim * 4
            return emitted
        return None

    def _failed(self, op: str, err: Exception) -> None:
        if self.guard.failed(op, err):
            self.metrics.outages += 1

    def _answered(self) -> int:
        """Redis answered: if that ends an outage, count its length and move what the fallback
        holds to Redis. Returns the means that move queued."""
        seconds = self.guard.ok()
        if seconds is None:
            return 0
        self.metrics.outage_s += seconds
        return self._move_fallback() if self.fallback is not None else 0

    def _to_fallback(self, ids: np.ndarray | torch.Tensor, grads: np.ndarray | torch.Tensor,
                     version: int, n: int) -> int:
        if self.fallback is None:
            self.metrics.dropped += n
            self._warn.warn("grad_dropped", who=self.guard.name, reason="redis_down", n=n,
                            dropped=self.metrics.dropped, down_s=f"{self.guard.down_for():.1f}")
            return 0
        refused_before = self.fallback.metrics.dropped
        emitted = self.fallback.add(ids, grads, version)
        refused = self.fallback.metrics.dropped - refused_before
        self.metrics.fallback += n - refused
        self.metrics.dropped += refused
        self._warn.warn("grad_fallback", who=self.guard.name, n=n, fallback=self.metrics.fallback,
                        dropped=self.metrics.dropped, down_s=f"{self.guard.down_for():.1f}")
        return emitted

    def _move_fallback(self) -> int:
        """Queued means first, each as a window of ``m`` gradients (a sample with an open
        window in Redis folds it in), in rounds so that one round names a sample once; then
        the open windows. Returns the means queued in Redis."""
        ids, means, versions = self.fallback.take_ready()
        rounds = np.zeros(ids.shape[0], dtype=np.int64)
        seen: dict[int, int] = {}
        for n, i in enumerate(ids.tolist()):
            rounds[n] = seen.get(i, 0)
            seen[i] = rounds[n] + 1
        parts = [(ids[rounds == r], means[rounds == r].astype(np.float64) * self.m,
                  np.full(int((rounds == r).sum()), self.m, np.int64), versions[rounds == r])
                 for r in range(int(rounds.max()) + 1 if rounds.size else 0)]
        parts.append(self.fallback.take_partial_sums())
        emitted, reachable = 0, True
        for what, (part_ids, sums, counts, part_versions) in zip(
                ["means"] * (len(parts) - 1) + ["windows"], parts, strict=True):
            n = int(counts.sum())
            if not n:
                continue
            queued = None
            if reachable:
                try:
                    queued = self._add_with_retries(part_ids, sums, counts, part_versions)
                except redis.RedisError as e:
                    self._failed("add", e)
                    reachable = False  # gone again: what is left is dropped, not retried
            if queued is None:
                self.metrics.dropped += n
                self._warn.warn("grad_fallback_dropped", who=self.guard.name, part=what, n=n)
                continue
            emitted += queued
            log.info("grad_fallback_moved who=%s part=%s samples=%d grads=%d emitted=%d",
                     self.guard.name, what, part_ids.shape[0], n, queued)
        self.metrics.emitted += emitted
        return emitted

    def _try_add(self, keys: list[bytes], token: bytes, uniq: np.ndarray, sums: np.ndarray,
                 counts: np.ndarray, versions: np.ndarray) -> int:
        """One attempt; the means it queued. WatchError when it was not applied, or when its
        answer was lost: redis-py reports a connection lost or timed out during a watched
        transaction as WatchError, though Redis may have applied it. So the transaction also
        writes ``token`` (the add's own key, holding what it queued), which every attempt
        watches and reads first: a retry of an add that was applied finds it and adds nothing."""
        with self.client.pipeline(transaction=True) as pipe:
            pipe.watch(token, *keys)
            applied = pipe.get(token)
            if applied is not None:
                return int(applied)
            olds = pipe.mget(keys)
            pipe.multi()
            emitted = 0
            for key, i, total, count, version, old in zip(
                    keys, uniq.tolist(), sums, counts.tolist(), versions.tolist(), olds,
                    strict=True):
                rec = self._decode(key, old)
                total = rec.sum.astype(np.float64) + total
                count += rec.count
                newest = max(rec.version, version)
                if count >= self.m:
                    mean = (total / count).astype(np.float32)
                    entry = GradEntry(i, newest, rec.seq, count, mean)
                    pipe.xadd(self.stream, encode_grad_entry(entry),
                              maxlen=STREAM_MAXLEN, approximate=True)
                    rec = AccumRecord(0, newest, rec.seq + 1, np.zeros(self.dim, np.float32))
                    emitted += 1
                else:
                    rec = AccumRecord(count, newest, rec.seq, total.astype(np.float32))
                pipe.set(key, encode_record(rec), ex=RECORD_TTL_S)
            pipe.set(token, str(emitted).encode(), ex=ADD_TOKEN_TTL_S)
            pipe.execute()
        return emitted

    def _decode(self, key: bytes, blob: bytes | None) -> AccumRecord:
        fresh = AccumRecord(0, -(2**62), 0, np.zeros(self.dim, np.float32))
        if blob is None:
            return fresh
        try:
            return decode_record(blob, self.dim)
        except MalformedGradientError as e:
            # A garbage partial sum must not reach the backbone: start the sample over.
            self.metrics.corrupt += 1
            self._warn.warn("grad_record_corrupt", key=key.decode(), error=repr(str(e)))
            return fresh


class RedisGradientConsumer:
    """Slow-gear side: ``read`` ready means, apply them, ``ack``.

    Args:
        client: redis-py client (:func:`bridge.redis_util.make_client`).
        dim: gradient width; entries of another width are malformed.
        prefix: job name (as given to the accumulator).
        consumer: this worker's name in the job's group, ``GROUP`` (default host-pid).
        min_idle_ms: an entry delivered but not acked for this long is taken over (its consumer
            is presumed dead); must exceed the longest apply.
    """

    def __init__(self, client: redis.Redis, dim: int, prefix: str,
                 consumer: str | None = None, min_idle_ms: int = 60_000) -> None:
        self.client = client
        self.dim = dim
        self.prefix = prefix
        self.group = GROUP
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.min_idle_ms = min_idle_ms
        self.stream = stream_key(prefix)
        self.dead = dead_letter_key(prefix)
        self.metrics = AccumulatorMetrics()
        self.guard = RedisGuard(f"grad_consumer:{prefix}")
        self._warn = RateLimitedLog(log)
        self._claim_cursor = b"0-0"
        self._group_ready = False
        # A blocking XREADGROUP longer than the socket timeout would look like a dead server:
        # block in slices shorter than it.
        timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
        self._block_slice_ms = max(1, int(timeout * 500)) if timeout else None

    def applied_key(self, key: bytes) -> bytes:
        return applied_prefix(self.prefix) + key

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)
            log.info("grad_group_created stream=%s group=%s", self.stream.decode(), self.group)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_ready = True

    def read(self, max_items: int = 256, block_ms: int = 0) -> GradientBatch:
        """Up to ``max_items`` mean gradients: first entries abandoned by dead consumers, then
        new ones, waiting up to ``block_ms`` when there are none. Returns a
        :class:`bridge.accumulator.GradientBatch` (empty if Redis is down)."""
        if not self.guard.usable():
            time.sleep(block_ms / 1000)
            return empty_batch(self.dim)
        try:
            try:
                raw = self._read_raw(max_items, block_ms)
            except redis.ResponseError as e:
                if "NOGROUP" not in str(e) and "UNBLOCKED" not in str(e):
                    raise
                # The job's gradient state was discarded (a trainer started or rolled back),
                # and the stream's group with it (a blocked read is told UNBLOCKED): join the
                # new stream.
                self._group_ready, self._claim_cursor = False, b"0-0"
                raw = self._read_raw(max_items, block_ms)
            batch = self._decode_batch(raw)
        except redis.RedisError as e:
            self.guard.failed("read", e)
            # A dead Redis restarted empty has lost the group too; recreate it next time.
            self._group_ready = False
            return empty_batch(self.dim)
        self.guard.ok()
        return batch

    def _read_raw(self, max_items: int, block_ms: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
        self._ensure_group()
        raw = self._claim(max_items)
        if len(raw) < max_items:
            raw += self._read_new(max_items - len(raw), 0 if raw else block_ms)
        return raw

    def _claim(self, count: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
        cursor, entries, *_ = self.client.xautoclaim(
            self.stream, self.group, self.consumer, self.min_idle_ms,
            start_id=self._claim_cursor, count=count)
        self._claim_cursor = cursor
        # Entries trimmed from the stream come back with no fields; Redis drops them from the
        # pending list itself.
        entries = [(eid, fields) for eid, fields in entries if fields]
        if entries:
            self.metrics.claimed += len(entries)
            log.info("grad_entries_claimed consumer=%s count=%d", self.consumer, len(entries))
        return entries

    def _read_new(self, count: int, block_ms: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
        deadline = time.monotonic() + block_ms / 1000
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            block = None
            if block_ms > 0 and left_ms > 0:
                block = min(left_ms, self._block_slice_ms or left_ms)
            reply = self.client.xreadgroup(self.group, self.consumer, {self.stream: ">"},
                                           count=count, block=block)
            if reply:
                return list(reply[0][1])
            if block is None:
                return []

    def _decode_batch(self, raw: list[tuple[bytes, dict[bytes, bytes]]]) -> GradientBatch:
        good: list[tuple[bytes, bytes, GradEntry]] = []
        dead: list[tuple[bytes, dict[bytes, bytes], str]] = []
        for eid, fields in raw:
            try:
                entry = decode_grad_entry(fields, self.dim)
            except MalformedGradientError as e:
                dead.append((eid, fields, str(e)))
                continue
            good.append((eid, apply_key(entry.sample_id, entry.version, entry.seq), entry))
        if dead:
            self._dead_letter(dead)
        # Drop keys applied before, and repeats inside this batch (a mean sent twice).
        flags = self.client.mget([self.applied_key(k) for _, k, _ in good]) if good else []
        seen: set[bytes] = set()
        fresh: list[tuple[bytes, bytes, GradEntry]] = []
        dupes: list[bytes] = []
        for (eid, key, entry), flag in zip(good, flags, strict=True):
            if flag is not None or key in seen:
                dupes.append(eid)
            else:
                seen.add(key)
                fresh.append((eid, key, entry))
        if dupes:
            self._ack_ids(dupes)
            self.metrics.duplicates += len(dupes)
        if not fresh:
            return empty_batch(self.dim)
        self.metrics.delivered += len(fresh)
        self.metrics.bytes += len(fresh) * self.dim * 4
        return GradientBatch(
            torch.tensor([e.sample_id for _, _, e in fresh], dtype=torch.int64),
            torch.from_numpy(np.stack([e.grad for _, _, e in fresh])),
            torch.tensor([e.version for _, _, e in fresh], dtype=torch.int64),
            [EntryHandle(eid, key) for eid, key, _ in fresh])

    def _dead_letter(self, dead: list[tuple[bytes, dict[bytes, bytes], str]]) -> None:
        with self.client.pipeline(transaction=True) as pipe:
            for eid, fields, error in dead:
                pipe.xadd(self.dead, {**fields, b"error": error.encode(), b"source_id": eid})
            pipe.xack(self.stream, self.group, *[eid for eid, _, _ in dead])
            pipe.xdel(self.stream, *[eid for eid, _, _ in dead])
            pipe.execute()
        self.metrics.corrupt += len(dead)
        self._warn.warn("grad_entry_dead_lettered", stream=self.dead.decode(), count=len(dead),
                        error=repr(dead[0][2]))

    def _ack_ids(self, eids: list[bytes]) -> None:
        with self.client.pipeline(transaction=True) as pipe:
            pipe.xack(self.stream, self.group, *eids)
            pipe.xdel(self.stream, *eids)
            pipe.execute()

    def ack(self, batch: GradientBatch) -> int:
        """Mark ``batch`` applied (its keys remembered, its entries acked and deleted). Returns
        how many keys were newly marked. If Redis is down the entries stay pending and will be
        re-delivered after ``min_idle_ms``."""
        if not batch.handles:
            return 0
        try:
            with self.client.pipeline(transaction=True) as pipe:
                for h in batch.handles:
                    pipe.set(self.applied_key(h.key), b"1", nx=True, ex=APPLIED_TTL_S)
                eids = [h.entry_id for h in batch.handles]
                pipe.xack(self.stream, self.group, *eids)
                pipe.xdel(self.stream, *eids)
                results = pipe.execute()
        except redis.RedisError as e:
            self.guard.failed("ack", e)
            return 0
        newly = sum(1 for r in results[:len(batch.handles)] if r)
        self.metrics.applied += newly
        self.metrics.duplicates += len(batch.handles) - newly
        return newly

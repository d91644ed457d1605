"""The AMS client API: one object over all shards, local or remote.

``ShardedClient`` routes ids with ``ams.sharding``, fans out to the shards in parallel, cuts
requests into pieces that fit the message limit and reassembles replies in request order (a
pull asks for a repeated id again; a push sums a repeated id's gradients). It talks to each
shard through a ``ShardBackend`` (``ams.client.backend``): ``RemoteShard`` or ``LocalShard``,
so the embedded default and the cluster run the same code.

    client = ams.connect(["127.0.0.1:7001", "127.0.0.1:7002"])   # or local_shards=2
    client.create_table("fc", num_rows=1_000_000, dim=128, momentum=0.0)
    rows = client.pull("fc", ids)                # (n, 128) float32, in the order of ids
    ...                                          # the head's forward and backward
    client.push("fc", ids, row_grads, lr=1.0)    # the shards apply the update to those rows
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import TypeVar

import torch

from ams import sharding
from ams.alloc import keep_large_buffers
from ams.client.backend import ShardBackend, check_ids
from ams.dataplane.shm import MIN_SHARED_BYTES, SharedArena
from ams.dtypes import parse_row_dtype
from ams.errors import AmsError, InvalidArgument, ShardRestarted, TableNotFound
from ams.limits import MAX_IDS_PER_REQUEST, MAX_REPLY_PAYLOAD_BYTES, REQUEST_BYTES
from ams.shard.checks import check_finite_grads, check_in_table
from ams.shard.neighbor_lists import id_dtype, list_lengths, lists_to_dense
from ams.shard.rowcopy import ascending_unique
from ams.shard.spec import TableSpec
from ams.wire.pieces import PushPieces, piece_sizes

log = logging.getLogger(__name__)

T = TypeVar("T")


class ShardedClient:
    """The AMS client API over ``shards[i]`` = shard i of ``len(shards)``.

    Thread-safe: the trainer's prefetch thread pulls while the main thread pushes.

    Restarts: each remote shard's incarnation is learned at ``connect``; once a call meets a
    restarted shard, or ``invalidate`` is called, every row, graph and snapshot call raises
    ShardRestarted until ``relearn_incarnations``, which follows a coordinated rollback::

        client.relearn_incarnations()   # accept the shards' processes as they are now
        client.restore(step)            # then put all of them at one checkpoint's step
    """

    def __init__(self, shards: Sequence[ShardBackend], arena: SharedArena | None = None
                 ) -> None:
        """``arena``: the shared buffer the remote shards' data connections offer (the
        client closes it); large pulls return tensors in it."""
        if not shards:
            raise InvalidArgument("a client needs at least one shard")
        # Pulls and pushes, in-process or on the wire, move reply-sized buffers, and a
        # training process that holds a client frees megabytes of activations every step:
        # with glibc's defaults each would be a fresh mmap, faulted in and unmapped again
        # (docs/decisions.md, "Large buffers stay in the process's heap").
        keep_large_buffers()
        self.shards = list(shards)
        self.num_shards = len(self.shards)
        self.arena = arena
        self.client_id = uuid.uuid4().hex
        self._sequence = 0
        self._sequence_lock = threading.Lock()
        self._specs: dict[str, TableSpec] = {}
        self._invalid_lock = threading.Lock()
        self._invalid_reason: str | None = None
        self._invalidations = 0  # lets relearn_incarnations keep an invalidate made during it
        self._pool = ThreadPoolExecutor(max_workers=self.num_shards,
                                        thread_name_prefix="ams-fanout") \
            if self.num_shards > 1 else None

    # ---- plumbing ---------------------------------------------------------------------

    def _fan_out(self, work: Callable[..., T], *args: object) -> list[T]:
        """Run ``work(shard, *args)`` for every shard, in parallel; once all have ended,
        re-raise the failure of the first shard that failed. The calling thread does shard 0's
        work itself rather than wait idle."""
        if self._pool is None:
            return [work(0, *args)]
        futures = [self._pool.submit(work, s, *args) for s in range(1, self.num_shards)]
        try:
            first = work(0, *args)
        finally:
            wait(futures)
        return [first] + [f.result() for f in futures]

    @contextmanager
    def _fence(self) -> Iterator[None]:
        """Around a call that touches rows, graphs or snapshots: refused while the client is
        invalidated, and one that meets a restarted shard invalidates the client (the shards
        no longer hold one step of the model, so no call may go on as if they did)."""
        self._raise_if_invalid()
        try:
            yield
        except ShardRestarted as e:
            self.invalidate(str(e))
            raise

    def _raise_if_invalid(self) -> None:
        reason = self._invalid_reason
        if reason is not None:
            raise ShardRestarted(reason)

    def _fenced_blocks(self, blocks: Iterator[T]) -> Iterator[T]:
        """``blocks``, fenced like the other calls (``_fence``)."""
        with self._fence():
            yield from blocks

    def _next_sequences(self, count: int) -> int:
        """The first of ``count`` push sequences of this client, never handed out before."""
        with self._sequence_lock:
            first = self._sequence + 1
            self._sequence += count
            return first

    def spec(self, name: str) -> TableSpec:
        """The spec of table ``name`` (asked of shard 0 once, then remembered)."""
        spec = self._specs.get(name)
        if spec is None:
            self._specs.update(self.shards[0].table_specs())
            spec = self._specs.get(name)
            if spec is None:
                raise TableNotFound(f"unknown table {name!r}; create it first")
        return spec

    # ---- tables -----------------------------------------------------------------------

    def create_table(self, name: str, num_rows: int, dim: int, dtype: str = "float32",
                     state_dtype: str | None = None, momentum: float = 0.9,
                     weight_decay: float = 5e-4, seed: int = 0, init_std: float = 0.01) -> bool:
        """Create a table on every shard (idempotent for an identical spec).

        Rows start as Normal(0, init_std), a function of (seed, class id) only. Returns True
        if any shard created it now.
        """
        with self._fence():
            spec = TableSpec(name=name, num_rows=num_rows, dim=dim, dtype=parse_row_dtype(dtype),
                             state_dtype=parse_row_dtype(state_dtype or dtype, "state_dtype"),
                             momentum=momentum, weight_decay=weight_decay, seed=seed,
                             init_std=init_std)
            created = self._fan_out(lambda s: self.shards[s].create_table(spec))
            self._specs[name] = spec
            return any(created)

    # ---- rows -------------------------------------------------------------------------

    def pull(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` in request order. ids: int (n,), repeats allowed (a repeated id is
        asked for again) -> (n, dim) in the table's dtype (CPU)."""
        with self._fence():
            ids = check_ids(ids)
            spec = self.spec(name)
            parts = self._split_by_shard(ids)
            rows = self._new_rows(ids.numel(), spec)
            in_arena = self.arena is not None and self.arena.offset_of(rows) is not None
            self._fan_out(self._pull_from_shard, name, ids, parts, rows, in_arena)
            if in_arena and self.arena.abandoned(rows):
                # a connection was lost and the pull retried on another: the lost one's shard
                # may still write this region after the caller has the rows, so they are
                # pulled again into this process's own memory (the region is never reused)
                log.warning("pull_repeated_off_shared_buffer table=%s rows=%d", name,
                            ids.numel())
                rows = torch.empty((ids.numel(), spec.dim), dtype=spec.dtype)
                self._fan_out(self._pull_from_shard, name, ids, parts, rows, False)
            return rows

    def _pull_from_shard(self, s: int, name: str, ids: torch.Tensor,
                         parts: list[torch.Tensor] | None, rows: torch.Tensor,
                         in_arena: bool) -> None:
        """Shard ``s``'s rows of ``ids`` into the result ``rows`` (n, dim): its ids are
        ``ids[parts[s]]`` and its rows go to ``rows[parts[s]]`` (``parts`` None: one shard,
        all of them, in order). Each row moves once: the shard writes its rows to their places
        in the result where it lies in the shared buffer (``in_arena``), or they are received
        or scattered there."""
        wanted = ids if parts is None else ids[parts[s]]
        if not wanted.numel():
            return
        shard = self.shards[s]
        # Rows that travel are pipelined in pieces: a shard gathers one while the client takes
        # the one before. Rows a shard writes straight into the result do not travel, and each
        # request costs a round trip, so such a pull asks for up to a request's bytes at once.
        most = REQUEST_BYTES if in_arena else shard.piece_bytes
        per_piece = min(MAX_IDS_PER_REQUEST, most // (rows.shape[1] * rows.element_size()))
        pieces = [wanted] if wanted.numel() <= per_piece \
            else list(wanted.split(piece_sizes(wanted.numel(), per_piece)))
        shard.pull(name, pieces, (rows, None if parts is None else parts[s]))

    def push(self, name: str, ids: torch.Tensor, grads: torch.Tensor, lr: float,
             decay_clock: float | None = None) -> None:
        """Apply ``grads`` to the rows of ``ids`` with sparse momentum SGD on the shards.

        ids: int (n,), repeats summed; grads: float (n, dim); lr: float >= 0;
        decay_clock: the step's weight-decay clock (``ams.shard.optim``; None: rows that sat
        out steps do not catch up on their decay), sent to every shard, those that own none
        of ``ids`` too.
        """
        with self._fence():
            ids = check_ids(ids)
            spec = self.spec(name)
            if not isinstance(grads, torch.Tensor) \
                    or tuple(grads.shape) != (ids.numel(), spec.dim):
                got = tuple(grads.shape) if isinstance(grads, torch.Tensor) else type(grads)
                raise InvalidArgument(f"grads: shape {got}, need ({ids.numel()}, {spec.dim})")
            grads = grads.detach().to(device="cpu", dtype=torch.float32).contiguous()
            # refused here, before any shard applies its part, rather than by one shard
            # after the others applied theirs
            check_in_table(ids, spec)
            check_finite_grads(grads)
            self._fan_out(self._push_to_shard, name, ids, grads, self._split_by_shard(ids),
                          float(lr), decay_clock)

    def _push_to_shard(self, s: int, name: str, ids: torch.Tensor, grads: torch.Tensor,
                       parts: list[torch.Tensor] | None, lr: float,
                       decay_clock: float | None) -> None:
        """Shard ``s``'s part of a push: its ids (``ids[parts[s]]``; ``parts`` None: all)
        once each and ascending (its fast path, sorted on this fan-out thread so that the
        shards' sorts overlap), cut into pieces that each carry a sequence of this client."""
        keys, values, source = ascending_unique(ids, grads, None if parts is None else parts[s])
        if not keys.numel() and decay_clock is None:
            return
        # A shard with none of the step's rows still takes the step's clock (an empty piece):
        # its resting rows owe that step's decay to every pull and scan until its next push.
        sizes = piece_sizes(keys.numel(), min(MAX_IDS_PER_REQUEST,
                                              self.shards[s].piece_bytes // (grads.shape[1] * 4)))
        pieces = PushPieces(keys, values, source, sizes, self._next_sequences(len(sizes)))
        self.shards[s].push(name, pieces, lr, self.client_id, decay_clock)

    def _split_by_shard(self, ids: torch.Tensor) -> list[torch.Tensor] | None:
        """Each shard's positions in ``ids`` (``ams.sharding.split_by_shard``); None with one
        shard, which takes them all in order."""
        return sharding.split_by_shard(ids, self.num_shards) if self.num_shards > 1 else None

    def scan(self, name: str, block_rows: int | None = None
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """All rows of a table as blocks (ids int64 (b,), rows (b, dim)), shard by shard;
        ``block_rows`` None: the most rows a reply holds, up to 65536."""
        return self._fenced_blocks(block for shard in self.shards
                                   for block in shard.scan(name, block_rows))

    def scan_shard(self, name: str, shard: int, block_rows: int | None = None
                   ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The blocks of one shard (ids ascending)."""
        return self._fenced_blocks(self.shards[shard].scan(name, block_rows))

    # ---- neighbor lists ----------------------------------------------------------------

    def neighbors(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Neighbor ids of each class in rank order, the class itself first.

        ids: int (n,) -> int64 (n, k), k the longest list; shorter lists are padded with -1.
        """
        with self._fence():
            ids = check_ids(ids)
            self.spec(name)
            unique, inverse = torch.unique(ids, return_inverse=True)
            parts = sharding.split_by_shard(unique, self.num_shards)

            def work(s: int) -> tuple[torch.Tensor | None, torch.Tensor] | None:
                if parts[s].numel() == 0:
                    return None
                return self.shards[s].neighbors(name, unique[parts[s]])

            replies = self._fan_out(work)
            width = max((int(list_lengths(*r).max()) for r in replies if r is not None), default=0)
            out = torch.full((unique.numel(), width), -1, dtype=torch.int64)
            for s, reply in enumerate(replies):
                if reply is not None:
                    out[parts[s]] = lists_to_dense(*reply, width)
            return out[inverse]

    def set_neighbors(self, name: str, ids: torch.Tensor, neighbors: torch.Tensor, *,
                      version: int, step: int, replace_all: bool) -> None:
        """Write neighbor lists back to the shards that own the classes.

        ids: int64 (n,) unique; neighbors: int64 (n, k) in rank order (-1 pads a short list).
        ``replace_all``: ids cover the whole table and start graph ``version``.
        Lists travel as compact as the shards keep them: int32 ids in tables of fewer than
        2**31 classes, and fixed width (no offsets) where no list is padded.
        """
        with self._fence():
            ids = check_ids(ids)
            parts = sharding.split_by_shard(ids, self.num_shards)
            small = torch.iinfo(torch.int32)
            # Narrowing is exact when every value fits; the shards check the ids' range either way.
            if neighbors.dtype == torch.int64 and neighbors.numel() \
                    and id_dtype(self.spec(name).num_rows) == torch.int32 \
                    and small.min <= int(neighbors.min()) and int(neighbors.max()) <= small.max:
                neighbors = neighbors.to(torch.int32)

            step_rows = max(1, min(MAX_IDS_PER_REQUEST,
                                   REQUEST_BYTES // (8 * (neighbors.shape[1] + 2))))

            def work(s: int) -> None:
                for start in range(0, parts[s].numel(), step_rows):
                    chunk = parts[s][start:start + step_rows]
                    sub = neighbors[chunk]
                    valid = sub >= 0
                    if bool(valid.all()):
                        self.shards[s].set_neighbors(name, ids[chunk], None, sub, version, step,
                                                     replace_all)
                        continue
                    offsets = torch.zeros(sub.shape[0] + 1, dtype=torch.int64)
                    torch.cumsum(valid.sum(dim=1), 0, out=offsets[1:])
                    self.shards[s].set_neighbors(name, ids[chunk], offsets, sub[valid], version,
                                                 step, replace_all)

            self._fan_out(work)

    def take_touched(self, name: str, shards: Sequence[int] | None = None) -> torch.Tensor:
        """The classes pushes changed since they were last taken, int64 (m,) ascending, and
        the shards forget them (``ShardStore.take_touched``); ``shards``: ask only these
        (default: all). A shard answers at most one reply's worth per call; it is asked again
        until an answer comes back short."""
        with self._fence():
            self.spec(name)
            asked = range(self.num_shards) if shards is None else shards
            per_call = MAX_REPLY_PAYLOAD_BYTES // 8

            def work(s: int) -> torch.Tensor:
                if s not in asked:
                    return torch.empty(0, dtype=torch.int64)
                parts = [self.shards[s].take_touched(name, per_call)]
                while parts[-1].numel() == per_call:
                    parts.append(self.shards[s].take_touched(name, per_call))
                return torch.cat(parts)

            return torch.cat(self._fan_out(work)).sort().values

    # ---- snapshots and stats ------------------------------------------------------------

    def snapshot(self, step: int, timeout: float | None = None) -> list[str]:
        """Every shard writes its piece of snapshot ``step``; returns the pieces' paths.

        ``timeout``: seconds each remote shard has. None: the client's timeout plus a
        second for every ``ams.client.remote.BULK_BYTES_PER_S`` bytes of the tables the shard
        holds, so that a stopped shard fails the call in about the client's timeout where
        the tables are small, and in minutes, not hours, where they are large."""
        with self._fence():
            return self._fan_out(lambda s: self.shards[s].snapshot(step, timeout))

    def restore(self, step: int | None = None, timeout: float | None = None) -> int:
        """Every shard loads its part of snapshot ``step`` (None: newest complete one).
        ``timeout``: as ``snapshot``'s, sized by the tables the shard holds now: a caller that
        restores before it created them gives ``timeout`` for the snapshot's size."""
        with self._fence():
            got = self._fan_out(lambda s: self.shards[s].restore(step, timeout))
            steps = {s for s, _ in got}
            if len(steps) != 1:
                raise AmsError(f"shards restored different steps {sorted(steps)}")
            self._specs.clear()
            return steps.pop()

    def stats(self) -> list[dict]:
        """One dict per shard: shard id, storage kind, tables with sizes, counters and graph
        version."""
        return self._fan_out(lambda s: self.shards[s].stats())

    # ---- incarnations -------------------------------------------------------------------

    def invalidate(self, reason: str) -> None:
        """From now on every row, graph and snapshot call raises ShardRestarted(``reason``),
        until ``relearn_incarnations``. Thread-safe: a watcher thread that learns that a shard
        restarted calls it; the first reason stays."""
        with self._invalid_lock:
            self._invalidations += 1
            if self._invalid_reason is None:
                self._invalid_reason = reason
                log.warning("client_invalidated reason=%s", reason)

    def relearn_incarnations(self) -> None:
        """Expect every shard's current process from now on and lift ``invalidate`` (unless it
        was called again meanwhile). Call it just before ``restore`` puts the shards back at
        one checkpoint's step, never to carry on past a restart."""
        with self._invalid_lock:
            seen = self._invalidations
        self._fan_out(self._learn_incarnation)
        with self._invalid_lock:
            if self._invalidations == seen:
                self._invalid_reason = None
        self._specs.clear()

    def _learn_incarnation(self, s: int) -> None:
        self.shards[s].learn_incarnation()

    def _new_rows(self, num_rows: int, spec: TableSpec) -> torch.Tensor:
        """An uninitialized (num_rows, dim) tensor of the table's row dtype for a pull's
        result: in the shared buffer where there is one, the rows take at least
        ``MIN_SHARED_BYTES`` and a region is free, else in the process's memory."""
        if self.arena is not None \
                and num_rows * spec.dim * spec.dtype.itemsize >= MIN_SHARED_BYTES:
            rows = self.arena.result(num_rows, spec.dim, spec.dtype)
            if rows is not None:
                return rows
        return torch.empty((num_rows, spec.dim), dtype=spec.dtype)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for shard in self.shards:
            shard.close()
        if self.arena is not None:
            self.arena.close()

    def __enter__(self) -> ShardedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

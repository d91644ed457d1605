"""Build or refresh a table's neighbors graph through the public client API (local or gRPC
shards); callers pass the client: ``build_graph(client, table, k)``, or keep the graph of a
training run current with ``GraphUpdater``.

The pure searches are ``ams.graph``; this module only feeds them each shard's Scan stream and
writes each class's list back to the shard that owns it (SetNeighbors). Method ``exact``: a
table whose fp32 rows fit in ``IN_MEMORY_BUILD_BYTES``, built by one fp32 builder without a
resume directory (the embedded trainer's rebuilds, ``xcls graph build`` on a small table), is
gathered and searched symmetrically in memory; everything else takes the ring. Method ``ivf``
(``ams.graph.ivf``): one index of every shard's rows, then each home shard's rows searched
in it, and the lists of a seeded sample of classes checked against an exact search (the
recall logged and returned in the ``GraphBuildReport``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ams import sharding
from ams.client.backend import check_ids
from ams.client.sharded import ShardedClient
from ams.errors import InvalidArgument
from ams.graph import (
    GraphMethod,
    GraphRefresh,
    IvfIndex,
    assign_shards,
    build_shard_neighbors,
    knn,
    list_recall,
    refresh_neighbors,
    resolve_block_rows,
    resolve_device,
    resolve_low_precision,
    resolve_nlist,
    sample_ids,
)
from ams.graph.ivf import DEFAULT_NPROBE, TRAIN_ROWS_PER_LIST
from ams.shard.neighbor_lists import lists_to_dense

log = logging.getLogger(__name__)

# Tables whose fp32 rows fit in this are built in one process's memory (see build_graph).
IN_MEMORY_BUILD_BYTES = 1 << 30
# Classes whose IVF lists are checked against an exact search after each IVF build.
RECALL_QUERIES = 1000
# Classes one pass of a refresh recomputes: the pass holds their rows and running lists.
REFRESH_PASS_ROWS = 1 << 18


@dataclass(frozen=True)
class GraphBuildReport:
    """What one build or refresh wrote.

    version: the graph version in force after it; method: how the lists were found (a refresh
    is exact); full: every list (a build) or only some (a refresh); classes: lists written;
    seconds: wall time; recall: recall@k of ``sampled`` of the lists written against an
    exact search (``ams.graph.list_recall``), None where not measured (exact lists are
    exact by construction).
    """

    version: int
    method: GraphMethod
    full: bool
    classes: int
    seconds: float
    recall: float | None = None
    sampled: int = 0


def current_graph_version(client: ShardedClient, table: str) -> int:
    """The highest graph version any shard holds for ``table`` (0: none yet)."""
    return max(s["tables"][table]["graph_version"] for s in client.stats())


def graph_on_every_shard(client: ShardedClient, table: str) -> bool:
    """Whether every shard holds neighbor lists for ``table``. Not so when a shard restarted
    empty, or a snapshot was taken while one had none: a lookup there would fail, so the
    graph must be built again, in full."""
    return min(s["tables"][table]["graph_version"] for s in client.stats()) > 0


def build_graph(client: ShardedClient, table: str, k: int, *, step: int = 0,
                method: GraphMethod | str = GraphMethod.EXACT, nlist: int = 0,
                nprobe: int = DEFAULT_NPROBE, seed: int = 0, builders: int = 1,
                builder_index: int | None = None, version: int | None = None,
                device: str | None = None, resume_dir: Path | None = None,
                progress: bool = False) -> GraphBuildReport:
    """Top-k lists of every class of ``table`` (the class itself first), stored with the
    owning shards.

    ``method``: ``GraphMethod``; ``nlist``, ``nprobe``: the IVF index's lists (0: auto,
    ``ams.graph.resolve_nlist``) and the lists each query scans (after an IVF build the lists
    of ``RECALL_QUERIES`` classes are checked against an exact search); ``seed``: seeds the IVF
    training sample and those classes. ``device``: where to search (None: CUDA when
    available), which also sets the block rows and precision of the exact search
    (``ams.graph.resolve_block_rows``, ``resolve_low_precision``). ``resume_dir``: exact
    only. ``builders`` split the shards (``assign_shards``); this call runs builder
    ``builder_index`` only, or all of them one after the other when None. ``version``: the
    graph version to write (default: one above the current); builders running in separate
    processes must be given the same one.

    The built shards' touched classes (``ShardedClient.take_touched``) are taken first, so a
    push made while the build runs stays marked for the next refresh. Returns the report:
    the version written, and for ivf the recall measured.
    """
    spec = client.spec(table)
    try:
        method = GraphMethod(method)
    except ValueError:
        raise InvalidArgument(f"method={method!r} is not one of "
                              f"{', '.join(repr(str(m)) for m in GraphMethod)}") from None
    if not 0 < k <= spec.num_rows:
        raise InvalidArgument(f"k={k} must be in [1, num_rows={spec.num_rows}]")
    if builders < 1 or (builder_index is not None and not 0 <= builder_index < builders):
        raise InvalidArgument(f"builder_index={builder_index} must be in [0, builders={builders})")
    if method is GraphMethod.IVF:
        if resume_dir is not None:
            raise InvalidArgument("resume_dir applies to the exact method only")
        try:
            nlist = resolve_nlist(nlist, spec.num_rows)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        if nprobe < 1:
            raise InvalidArgument(f"nprobe={nprobe} must be >= 1")
    version = current_graph_version(client, table) + 1 if version is None else version
    plan = assign_shards(client.num_shards, builders)
    mine = plan if builder_index is None else [plan[builder_index]]
    homes = [home for home_shards in mine for home in home_shards]
    started = time.perf_counter()
    client.take_touched(table, homes)
    if method is GraphMethod.IVF:
        return _build_ivf(client, table, k, homes, version=version, step=step, nlist=nlist,
                          nprobe=nprobe, seed=seed, device=device, progress=progress,
                          started=started)
    dev = resolve_device(device)
    block_rows = resolve_block_rows(None, dev)
    if (builders == 1 and resume_dir is None and not resolve_low_precision(dev)
            and spec.num_rows * spec.dim * 4 <= IN_MEMORY_BUILD_BYTES):
        # One process builds everything in fp32 and the rows fit: hold them all and score each
        # pair of row blocks once for both blocks (ams.graph.symmetric_search), half the matmul
        # work of the ring, which streams every shard past every home shard. Same lists.
        blocks = list(client.scan(table, block_rows))
        ids = torch.cat([b[0] for b in blocks])
        rows = torch.cat([b[1] for b in blocks])
        del blocks
        neighbors, _ = knn(rows, k, block_size=block_rows, device=dev, ids=ids,
                           progress=progress)
        client.set_neighbors(table, ids, neighbors, version=version, step=step,
                             replace_all=True)
        seconds = time.perf_counter() - started
        log.info("graph_built table=%s k=%d version=%d step=%d rows=%d method=exact "
                 "in_memory=1 seconds=%.2f", table, k, version, step, ids.numel(), seconds)
        return GraphBuildReport(version, method, True, ids.numel(), seconds)
    classes = 0
    for home in homes:
        shard_resume = resume_dir / f"v{version}" if resume_dir is not None else None
        ids, neighbors, _ = build_shard_neighbors(
            home, client.num_shards, lambda s: client.scan_shard(table, s, block_rows), k,
            device=device, resume_dir=shard_resume, progress=progress)
        client.set_neighbors(table, ids, neighbors, version=version, step=step,
                             replace_all=True)
        classes += ids.numel()
    seconds = time.perf_counter() - started
    log.info("graph_built table=%s k=%d version=%d step=%d rows=%d method=exact shards=%d "
             "seconds=%.2f", table, k, version, step, classes, len(homes), seconds)
    return GraphBuildReport(version, method, True, classes, seconds)


def _build_ivf(client: ShardedClient, table: str, k: int, homes: Sequence[int], *,
               version: int, step: int, nlist: int, nprobe: int, seed: int,
               device: str | None, progress: bool, started: float
               ) -> GraphBuildReport:
    """``build_graph`` with method ivf (``nlist`` resolved): train on a seeded sample of rows,
    add every shard's rows block by block, search each home shard's rows and write their
    lists, then measure the recall of a sample of the lists written. Memory: the index and a
    Scan block."""
    spec = client.spec(table)
    index = IvfIndex(spec.dim, nlist, nprobe, device=device)
    index.train(client.pull(table, sample_ids(spec.num_rows, TRAIN_ROWS_PER_LIST * nlist,
                                              seed)), seed)
    # Scan blocks of the shards' default size: faiss works best on large batches.
    bar = tqdm(total=spec.num_rows, unit="row", desc="graph ivf add", disable=not progress)
    for shard in range(client.num_shards):
        for ids, rows in client.scan_shard(table, shard):
            index.add(ids, rows)
            bar.update(ids.numel())
    bar.close()
    classes = sum(sharding.owned_count(spec.num_rows, home, client.num_shards)
                  for home in homes)
    bar = tqdm(total=classes, unit="row", desc="graph ivf search", disable=not progress)
    for home in homes:
        for ids, rows in client.scan_shard(table, home):
            neighbors, _ = index.search(ids, rows, k)
            client.set_neighbors(table, ids, neighbors, version=version, step=step,
                                 replace_all=True)
            bar.update(ids.numel())
    bar.close()
    where, index_nprobe = index.device, index.nprobe
    del index  # the exact check below streams the rows again; the index is not needed
    recall, sampled = _sampled_recall(client, table, k, homes, RECALL_QUERIES, seed + 1,
                                     device=device)
    seconds = time.perf_counter() - started
    log.info("graph_built table=%s k=%d version=%d step=%d rows=%d method=ivf nlist=%d "
             "nprobe=%d device=%s recall_at_k=%s sampled=%d seconds=%.2f", table, k,
             version, step, classes, nlist, index_nprobe, where,
             "-" if recall is None else f"{recall:.4f}", sampled, seconds)
    return GraphBuildReport(version, GraphMethod.IVF, True, classes, seconds, recall, sampled)


def _sampled_recall(client: ShardedClient, table: str, k: int, shards: Sequence[int],
                   count: int, seed: int, device: str | None = None
                   ) -> tuple[float | None, int]:
    """Recall@k of the stored lists of a seeded sample of ``count`` classes owned by
    ``shards`` (all of them if fewer), against their exact k lists over all rows
    (``ams.graph.list_recall``; a list shorter than k misses the rest). Returns (recall,
    classes checked); (None, 0) when the shards own no class."""
    spec = client.spec(table)
    owned = torch.tensor([sharding.owned_count(spec.num_rows, s, client.num_shards)
                          for s in shards], dtype=torch.int64)
    total = int(owned.sum())
    if total == 0:
        return None, 0
    # The j-th class of the shards, in shard order: without listing every owned id.
    picks = sample_ids(total, count, seed)
    ends = owned.cumsum(0)
    which = torch.searchsorted(ends, picks, right=True)
    position = picks - (ends - owned)[which]
    ids = position * client.num_shards + torch.tensor(list(shards), dtype=torch.int64)[which]
    ids = ids.sort().values
    # the width of the lists asked for is their longest, which IVF's short lists may keep
    # below k
    found = lists_to_dense(None, client.neighbors(table, ids), k)
    exact, _ = refresh_neighbors(ids, client.pull(table, ids), client.scan(table), k,
                                 device=device)
    return list_recall(found, exact), ids.numel()


def refresh_graph(client: ShardedClient, table: str, class_ids: torch.Tensor, k: int, *,
                  step: int = 0, device: str | None = None) -> int:
    """Recompute the exact k lists of just ``class_ids`` (int64 (m,), m << N) against all
    rows, in place (k: the graph's, which a stored list may fall short of: IVF keeps what its
    probed lists held). Up to ``REFRESH_PASS_ROWS`` classes ride on one
    pass over the rows; each pass's lists are written before the next starts. Returns the
    graph version now in force."""
    version = current_graph_version(client, table)
    if version == 0:
        raise InvalidArgument(f"table {table!r} has no graph to refresh; build one first")
    ids = torch.unique(check_ids(class_ids))
    if ids.numel() == 0:
        return version
    started = time.perf_counter()
    for chunk in ids.split(REFRESH_PASS_ROWS):
        neighbors, _ = refresh_neighbors(chunk, client.pull(table, chunk), client.scan(table),
                                         k, device=device)
        client.set_neighbors(table, chunk, neighbors, version=version, step=step,
                             replace_all=False)
    log.info("graph_refreshed table=%s k=%d version=%d step=%d rows=%d seconds=%.2f", table, k,
             version, step, ids.numel(), time.perf_counter() - started)
    return version


class GraphUpdater:
    """Keeps the graph of a training run current: ``update(step)`` between steps.

    refresh ``full``: every update is a ``build_graph``. refresh ``touched``: an update after a
    full build takes the classes pushed since (``ShardedClient.take_touched``) and recomputes
    only their lists, exactly (``refresh_graph``). An untouched class keeps its list even where
    a touched class moved into or out of it, so every update after ``full_every`` refreshes
    is full again (0: never). An update is also full when the table has no graph, when it is
    this updater's first (a restore forgets which rows moved, and a resumed run makes a new
    updater), and when its touched classes would cost more than a build: a refresh of m
    classes scores m * N pairs, an exact build at least N^2 / 2, an IVF build
    N * (nlist + nprobe * N / nlist).

    Args: client, table, k: see ``build_graph``; method, nlist, nprobe, device, seed: passed
    to ``build_graph`` (device to ``refresh_graph`` too).
    """

    def __init__(self, client: ShardedClient, table: str, k: int, *,
                 method: GraphMethod | str = GraphMethod.EXACT,
                 refresh: GraphRefresh | str = GraphRefresh.FULL, full_every: int = 10,
                 nlist: int = 0, nprobe: int = DEFAULT_NPROBE, device: str | None = None,
                 seed: int = 0) -> None:
        try:
            self.method, self.refresh = GraphMethod(method), GraphRefresh(refresh)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        if full_every < 0:
            raise InvalidArgument(f"full_every={full_every} must be >= 0")
        self.client, self.table, self.k = client, table, k
        self.full_every, self.nlist, self.nprobe = full_every, nlist, nprobe
        self.device, self.seed = device, seed
        self._refreshes: int | None = None  # since the last full build; None: none built yet

    def update(self, step: int) -> GraphBuildReport:
        """Build or refresh the graph for the rows as they are at ``step``; returns what it
        wrote."""
        if self._refresh_due():
            started = time.perf_counter()
            touched = self.client.take_touched(self.table)
            if touched.numel() < self._break_even():
                version = refresh_graph(self.client, self.table, touched, self.k, step=step,
                                        device=self.device)
                self._refreshes += 1
                return GraphBuildReport(version, GraphMethod.EXACT, False, touched.numel(),
                                        time.perf_counter() - started)
            log.info("graph_refresh_skipped table=%s touched=%d reason=full_build_cheaper",
                     self.table, touched.numel())
        report = build_graph(self.client, self.table, self.k, step=step, method=self.method,
                             nlist=self.nlist, nprobe=self.nprobe, seed=self.seed,
                             device=self.device)
        self._refreshes = 0
        return report

    def _refresh_due(self) -> bool:
        return (self.refresh is GraphRefresh.TOUCHED and self._refreshes is not None
                and not (self.full_every and self._refreshes >= self.full_every)
                and graph_on_every_shard(self.client, self.table))

    def _break_even(self) -> float:
        """Touched classes whose refresh scores as many pairs as a full build."""
        n = self.client.spec(self.table).num_rows
        if self.method is GraphMethod.EXACT:
            return n / 2
        lists = resolve_nlist(self.nlist, n)
        return lists + min(self.nprobe, lists) * n / lists

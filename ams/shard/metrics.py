"""Prometheus metrics of a shard process (docs/architecture.md, "Metrics").

Two sources: ``record_call``, which both planes' servers call once per request (the gRPC
calls through ``ams.server.interceptors.RequestMetricsInterceptor``), and a collector that
reads the stores' own counters (``ShardStore.stats``) when Prometheus scrapes, so nothing is
counted twice. They live in this role's own registry, :data:`REGISTRY`, which ``xcls serve shard
--metrics-port`` serves: a worker that starts shard servers in process (collective mode) or
imports this module exports none of them.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ams.shard.store import ShardStore

REGISTRY = CollectorRegistry()

REQUEST_SECONDS = Histogram(
    "xcls_shard_request_seconds", "Time a shard takes to answer one call, refusals included",
    ["method"],
    # pulls and pushes of a step take milliseconds; snapshots, scans and graph writes minutes
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
             10.0, 30.0, 60.0, 300.0), registry=REGISTRY)
REQUEST_ERRORS = Counter(
    "xcls_shard_request_errors_total", "Calls answered with a status other than OK",
    ["method", "code"], registry=REGISTRY)
PUSH_REJECTIONS = Counter(
    "xcls_shard_push_rejections_total",
    "Pushes refused, by the gRPC status code name of the refusal (nothing was applied)",
    ["reason"], registry=REGISTRY)
SNAPSHOT_SECONDS = Histogram(
    "xcls_shard_snapshot_seconds", "Time to write this shard's part of a snapshot",
    buckets=(0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 180.0, 600.0, 1800.0, 3600.0), registry=REGISTRY)
RESTORES = Counter(
    "xcls_shard_restores_total", "Snapshots loaded into this shard (at start or by a Restore call)",
    registry=REGISTRY)
SNAPSHOT_AGE = Gauge(
    "xcls_shard_snapshot_age_seconds",
    "Seconds since this shard last wrote a snapshot (since it started, when it has written none)",
    registry=REGISTRY)

_last_snapshot = time.monotonic()
SNAPSHOT_AGE.set_function(lambda: time.monotonic() - _last_snapshot)


def record_snapshot(seconds: float) -> None:
    """Record a snapshot that took ``seconds`` and ended now."""
    global _last_snapshot
    SNAPSHOT_SECONDS.observe(seconds)
    _last_snapshot = time.monotonic()


def record_restore() -> None:
    """Record a snapshot loaded into the store (a call or ``--restore`` at start)."""
    RESTORES.inc()


@functools.cache
def _request_seconds(method: str) -> Histogram:
    """The histogram child of ``method``: a labels() lookup costs more than a 1-row pull."""
    return REQUEST_SECONDS.labels(method)


def record_call(method: str, seconds: float, code: str | None) -> None:
    """Record one finished call of the shard service; ``code``: its status code's name (None
    or "OK": it succeeded)."""
    _request_seconds(method).observe(seconds)
    if code is not None and code != "OK":
        REQUEST_ERRORS.labels(method, code).inc()
        if method == "Push":
            PUSH_REJECTIONS.labels(code).inc()
        return
    if method == "Snapshot":
        record_snapshot(seconds)
    elif method == "Restore":
        record_restore()


class StoreCollector(Collector):
    """The counters and sizes of the watched stores, read at scrape time, by table (stores of
    one process that share a table name are summed)."""

    def __init__(self) -> None:
        self._stores: weakref.WeakSet[ShardStore] = weakref.WeakSet()

    def watch(self, store: ShardStore) -> None:
        self._stores.add(store)

    def collect(self) -> Iterable[Metric]:
        counters = {key: CounterMetricFamily(f"xcls_shard_{key}", text, labels=["table"])
                    for key, text in (("rows_pulled", "Rows served by pulls"),
                                      ("rows_pushed", "Rows updated by applied pushes"),
                                      ("pulls", "Pull requests served"),
                                      ("pushes", "Pushes applied"))}
        gauges = {"owned_rows": GaugeMetricFamily("xcls_shard_owned_rows",
                                                  "Rows of the table this shard owns",
                                                  labels=["table"])}
        totals: dict[tuple[str, str], float] = {}
        for store in list(self._stores):
            for table, t in store.stats()["tables"].items():
                for key in (*counters, *gauges):
                    totals[key, table] = totals.get((key, table), 0) + t[key]
        for (key, table), value in sorted(totals.items()):
            (counters.get(key) or gauges[key]).add_metric([table], value)
        return [*counters.values(), *gauges.values()]


STORES = StoreCollector()
REGISTRY.register(STORES)


def watch_store(store: ShardStore) -> None:
    """Export ``store``'s counters and sizes (read when Prometheus scrapes)."""
    STORES.watch(store)

"""Prometheus metrics of a shard process (docs/architecture.md, "Metrics").

Two sources: a gRPC server interceptor that times every call of the shard service and counts
its refusals by status code, and a collector that reads the stores' own counters
(``ShardStore.stats``) when Prometheus scrapes, so nothing is counted twice. All metrics live in
the process-wide default registry; ``xcls serve shard --metrics-port`` serves it.

    interceptors.insert(0, instrument_store(store))  # first: it sees the refusals of the others
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import grpc
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ams.store import ShardStore

# Calls of the shard service only; health checks would drown the latencies that matter.
SHARD_METHOD_PREFIX = "/xcls.ams.Shard/"

REQUEST_SECONDS = Histogram(
    "xcls_shard_request_seconds", "Time a shard takes to answer one call, refusals included",
    ["method"],
    # pulls and pushes of a step take milliseconds; snapshots, scans and graph writes minutes
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
             10.0, 30.0, 60.0, 300.0))
REQUEST_ERRORS = Counter(
    "xcls_shard_request_errors_total", "Calls answered with a status other than OK",
    ["method", "code"])
PUSH_REJECTIONS = Counter(
    "xcls_shard_push_rejections_total",
    "Pushes refused, by the gRPC status code name of the refusal (nothing was applied)",
    ["reason"])
SNAPSHOT_SECONDS = Histogram(
    "xcls_shard_snapshot_seconds", "Time to write this shard's part of a snapshot",
    buckets=(0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 180.0, 600.0, 1800.0, 3600.0))
RESTORES = Counter(
    "xcls_shard_restores_total", "Snapshots loaded into this shard (at start or by a Restore call)")
SNAPSHOT_AGE = Gauge(
    "xcls_shard_snapshot_age_seconds",
    "Seconds since this shard last wrote a snapshot (since it started, when it has written none)")

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


def record_call(method: str, seconds: float, code: grpc.StatusCode | None) -> None:
    """Record one finished call of the shard service; ``code`` None means OK."""
    _request_seconds(method).observe(seconds)
    if code is not None and code != grpc.StatusCode.OK:
        REQUEST_ERRORS.labels(method, code.name).inc()
        if method == "Push":
            PUSH_REJECTIONS.labels(code.name).inc()
        return
    if method == "Snapshot":
        record_snapshot(seconds)
    elif method == "Restore":
        record_restore()


class RequestMetricsInterceptor(grpc.ServerInterceptor):
    """Times each call of the shard service and counts how it ended. Put it first among the
    server's interceptors: the handler it wraps is then whatever the others chose, so a call
    they refuse (authentication, a stale incarnation) is counted too."""

    def intercept_service(self, continuation: Callable, handler_call_details: object) -> object:
        handler = continuation(handler_call_details)
        name: str = handler_call_details.method
        if handler is None or not name.startswith(SHARD_METHOD_PREFIX):
            return handler
        method = name[len(SHARD_METHOD_PREFIX):]
        if handler.unary_unary is not None:  # every shard call is unary
            return handler._replace(unary_unary=_timed_unary(method, handler.unary_unary))
        return handler


def _outcome(context: grpc.ServicerContext, failed: bool) -> grpc.StatusCode | None:
    """The status a call ends with: the one it aborted or set, UNKNOWN for an escaped error."""
    code = context.code()
    if code is None and failed:
        return grpc.StatusCode.UNKNOWN
    return code


def _timed_unary(method: str, behavior: Callable) -> Callable:
    def timed(request: object, context: grpc.ServicerContext) -> object:
        started, failed = time.perf_counter(), True
        try:
            reply = behavior(request, context)
            failed = False
            return reply
        finally:
            record_call(method, time.perf_counter() - started, _outcome(context, failed))

    return timed


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


def instrument_store(store: ShardStore) -> RequestMetricsInterceptor:
    """Export ``store``'s counters and return the interceptor that times the calls serving it."""
    STORES.watch(store)
    return RequestMetricsInterceptor()

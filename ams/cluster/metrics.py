"""Prometheus metrics of the scheduler (docs/architecture.md, "Metrics"): the live leases by role
and the generation, read from the ``LeaseTable`` when Prometheus scrapes, and the lease
expiries, counted as the scheduler expires them. ``xcls serve scheduler --metrics-port``
serves them from this module's :data:`REGISTRY`.

    watch_lease_table(table)                    # once, where the table is made
    for lease in table.expire_due(now_ms):
        record_expiry(lease)
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ams.cluster.lease import Lease, LeaseTable, Role

# The scheduler's own registry: it exports these families and no other role's.
REGISTRY = CollectorRegistry()

LEASE_EXPIRIES = Counter(
    "xcls_scheduler_lease_expiries_total",
    "Leases the scheduler expired because they were not renewed in time (each moves the "
    "generation on)", ["role"], registry=REGISTRY)


def record_expiry(lease: Lease) -> None:
    """Count one lease the scheduler expired."""
    LEASE_EXPIRIES.labels(lease.role.value).inc()


class LeaseTableCollector(Collector):
    """Leases by role, the generation and the unheld shard slots of the watched table."""

    def __init__(self) -> None:
        self.table: LeaseTable | None = None

    def collect(self) -> Iterable[Metric]:
        table = self.table
        if table is None:
            return []
        leases = GaugeMetricFamily("xcls_scheduler_leases", "Live leases, by role",
                                   labels=["role"])
        held = [lease.role for lease in table.leases()]
        for role in Role:
            leases.add_metric([role.value], held.count(role))
        generation = GaugeMetricFamily(
            "xcls_scheduler_generation",
            "The scheduler's generation: moves on when a shard is lost or replaced or a "
            "worker hangs (workers then roll back)",
            value=table.generation)
        missing = GaugeMetricFamily("xcls_scheduler_shards_missing",
                                    "Shard slots no live lease holds",
                                    value=len(table.shard_map().missing()))
        return [leases, generation, missing]


LEASE_TABLE = LeaseTableCollector()
REGISTRY.register(LEASE_TABLE)


def watch_lease_table(table: LeaseTable) -> None:
    """Export ``table`` (the newest watched one; a process runs one scheduler)."""
    LEASE_TABLE.table = table

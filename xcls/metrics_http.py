"""``--metrics-port`` / ``--metrics-host``: serve a process's Prometheus metrics over HTTP.

Every role serves its own registry (``ams.shard.metrics.REGISTRY`` for a shard,
``ams.cluster.metrics.REGISTRY`` for the scheduler, ``workers.metrics.REGISTRY`` for a training or
slow-gear worker), with the process's own families (``process_*``, ``python_*``), at
``http://HOST:PORT/metrics`` from a daemon thread: a process exports its role's metrics only,
whatever modules it imported, so an alert on a shard's metric never fires on a worker. Port 0
(the default) serves nothing. Under torchrun each rank serves on the base port plus its local
rank (its rank on this host), so one ``--metrics-port`` gives a whole launch distinct ports.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger("xcls.metrics")

DEFAULT_HOST = "127.0.0.1"


def add_metrics_args(p: argparse.ArgumentParser, per_rank: bool = False) -> None:
    """Add ``--metrics-port`` and ``--metrics-host`` to a role's parser."""
    rank_note = "; under torchrun rank r on this host serves on PORT+r" if per_rank else ""
    p.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help=f"serve Prometheus metrics at http://HOST:PORT/metrics (0: off)"
                        f"{rank_note}")
    p.add_argument("--metrics-host", default=DEFAULT_HOST, metavar="HOST",
                   help="address the metrics endpoint binds (metrics carry no secrets, but "
                        "loopback stays the default)")


def local_rank() -> int:
    """This process's rank on its host under torchrun (0 in a plain process)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def serve_metrics(port: int, registry: CollectorRegistry, host: str = DEFAULT_HOST) -> int:
    """Serve ``registry`` (a role's) and the process's own metrics on ``host:port`` in a daemon
    thread; nothing when ``port`` is 0. Returns the port served (0: none). SystemExit with a
    one-line reason when the port is out of range or taken."""
    if port == 0:
        return 0
    if not 0 < port <= 65535:
        raise SystemExit(f"error: --metrics-port {port} must be in 1..65535 (0: off)")
    from prometheus_client import (
        CollectorRegistry,
        GCCollector,
        PlatformCollector,
        ProcessCollector,
        start_http_server,
    )

    served = CollectorRegistry()
    served.register(registry)
    for own in (ProcessCollector, PlatformCollector, GCCollector):
        own(registry=served)
    try:
        server, _thread = start_http_server(port, addr=host, registry=served)
    except OSError as e:
        raise SystemExit(f"error: cannot serve metrics on {host}:{port}: {e.strerror}") from None
    bound = server.server_address[1]
    log.info("metrics_serving url=http://%s:%d/metrics", host, bound)
    return bound


def serve_metrics_from_args(args: argparse.Namespace, registry: CollectorRegistry,
                            per_rank: bool = False) -> int:
    """``serve_metrics`` of ``registry`` for the parsed ``--metrics-port`` / ``--metrics-host``
    (plus the local rank with ``per_rank``)."""
    if not args.metrics_port:
        return 0
    return serve_metrics(args.metrics_port + (local_rank() if per_rank else 0), registry,
                         args.metrics_host)

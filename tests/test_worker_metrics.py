"""workers.metrics without a training run: slow-gear counters read at scrape time, publications
counted by the weight channel wrapper, and the HTTP endpoint of xcls.metrics_http."""

from __future__ import annotations

import socket
import urllib.request
from types import SimpleNamespace

import pytest
from torch import nn

from bridge.metrics import AccumulatorMetrics
from workers.gear import GearCounts
from workers.metrics import REGISTRY, CountedWeightChannel, watch_slow_gear
from xcls.metrics_http import serve_metrics


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class FlakyChannel:
    """Publishes every other call."""

    def __init__(self) -> None:
        self.calls = 0

    def publish(self, model: nn.Module, version: int, replaces: int | None = None) -> bool:
        self.calls += 1
        return self.calls % 2 == 1

    def load_into(self, model: nn.Module, newer_than: int) -> int | None:
        return None


def test_slow_gear_counters_are_read_when_scraped():
    slow = SimpleNamespace(counts=GearCounts(), version=0)
    stream = SimpleNamespace(metrics=AccumulatorMetrics())
    watch_slow_gear(slow, stream)
    slow.counts.slow_forwards, slow.counts.slow_steps, slow.counts.rejected = 40, 3, 2
    slow.version = 7
    stream.metrics.claimed = 5
    assert sample("xcls_slow_gear_samples_applied_total") == 40
    assert sample("xcls_slow_gear_batches_applied_total") == 3
    assert sample("xcls_slow_gear_samples_rejected_total") == 2
    assert sample("xcls_slow_gear_version") == 7
    assert sample("xcls_slow_gear_stream_claimed_total") == 5


def test_publications_counted_by_result():
    ok, failed = (sample("xcls_slow_gear_publications_total", result=r) for r in ("ok", "failed"))
    channel = CountedWeightChannel(FlakyChannel())
    assert [channel.publish(nn.Linear(2, 2), v) for v in (4, 5, 6)] == [True, False, True]
    assert sample("xcls_slow_gear_publications_total", result="ok") - ok == 2
    assert sample("xcls_slow_gear_publications_total", result="failed") - failed == 1
    assert sample("xcls_slow_gear_published_version") == 6


def test_metrics_endpoint_serves_the_registry():
    assert serve_metrics(0, REGISTRY) == 0  # off
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert serve_metrics(port, REGISTRY) == port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert b"xcls_trainer_steps_total" in reply.read()
    with pytest.raises(SystemExit, match="cannot serve metrics"):
        serve_metrics(port, REGISTRY)  # taken

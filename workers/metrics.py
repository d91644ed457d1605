"""Prometheus metrics of the training workers and the slow-gear workers (docs/architecture.md,
"Metrics").

Step phases are timed where the work happens: ``data`` and ``prepare`` on the prefetch thread
(``workers.prefetch`` carries them on the ``PreparedBatch``), the rest on the trainer's thread
with a :class:`StepClock`, and every phase is observed once per step, when the step ends::

    clock = StepClock(prepared.seconds)
    features = backbone(images); clock.lap("backbone")
    ...
    clock.lap("push")
    clock.record(steps_done, loss)

Counters that gear mode and the bridge already keep as plain ints (``GearCounts``,
``bridge.metrics.CacheMetrics`` and ``AccumulatorMetrics``, whatever fields they have) are read
at scrape time by :data:`SCRAPED` rather than counted twice. Everything lives in this role's
registry, :data:`REGISTRY`, which ``--metrics-port`` serves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from torch import nn

if TYPE_CHECKING:
    from bridge.protocols import GradientSource, WeightChannel
    from workers.gear import Gear, SlowGear

# The phases of one training step, in the order they happen.
PHASES = (
    "data",  # prefetch thread: waiting for the loader's batch
    "prepare",  # prefetch thread: select the active classes and pull their rows
    "wait",  # trainer thread: blocked until the prefetch thread is far enough ahead and the
    # previous step's push is applied
    "backbone",  # forward, backward and optimizer step (gear mode: cache lookup, misses, slow gear)
    "head",  # margin softmax forward and backward over the active rows
    "push",  # handing the row gradients to the row update's pusher thread
)

# This role's registry (``xcls train`` and ``xcls gear slow`` serve it): a worker exports its own
# families only, not those of the shard or scheduler modules it may import.
REGISTRY = CollectorRegistry()

PHASE_SECONDS = Histogram(
    "xcls_trainer_phase_seconds", "Time one training step spent in each phase", ["phase"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
             30.0), registry=REGISTRY)
STEPS = Counter("xcls_trainer_steps_total", "Training steps this process finished",
                registry=REGISTRY)
STEP = Gauge("xcls_trainer_step", "Global step reached (goes back when a run resumes earlier)",
             registry=REGISTRY)
LOSS = Gauge("xcls_trainer_loss", "Loss of the last step", registry=REGISTRY)
RESUMES = Counter("xcls_trainer_resumes_total", "Times this process resumed from a checkpoint",
                  registry=REGISTRY)

PUBLICATIONS = Counter(
    "xcls_slow_gear_publications_total",
    "Backbone weight publications of this slow-gear worker, by result (ok, failed)",
    ["result"], registry=REGISTRY)
PUBLISHED_VERSION = Gauge("xcls_slow_gear_published_version",
                          "Backbone version this worker last published", registry=REGISTRY)


class StepClock:
    """The phases of one step; ``seconds``: phases timed elsewhere (the prefetch thread)."""

    def __init__(self, seconds: Mapping[str, float] | None = None) -> None:
        self.seconds = dict(seconds or {})
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap (or the start) to ``phase``."""
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._mark
        self._mark = now

    def record(self, steps_done: int, loss: float) -> None:
        """The step ended: observe each phase once, count the step, set step and loss."""
        for phase, seconds in self.seconds.items():
            PHASE_SECONDS.labels(phase).observe(seconds)
        STEPS.inc()
        STEP.set(steps_done)
        LOSS.set(loss)


def record_resume() -> None:
    """This process continued from a checkpoint."""
    RESUMES.inc()


class ScrapedCounters(Collector):
    """Exports values kept elsewhere by reading them when Prometheus scrapes.

    Each source is a metric name prefix and a function returning ``{field: value}``; every
    field becomes ``<prefix>_<field>`` (``_total`` added to counters). Watching a prefix again
    replaces its source: a process trains one run at a time, and the newest is the one to see.
    """

    def __init__(self) -> None:
        self._sources: dict[tuple[str, bool], Callable[[], Mapping[str, float]]] = {}

    def watch(self, prefix: str, read: Callable[[], Mapping[str, float]], *,
              counter: bool = True) -> None:
        """Export ``read()`` under ``prefix``, as counters or (``counter=False``) gauges."""
        self._sources[prefix, counter] = read

    def collect(self) -> Iterable[Metric]:
        for (prefix, counter), read in list(self._sources.items()):
            for field, value in read().items():
                if isinstance(value, bool) or not isinstance(value, int | float):
                    continue  # a summary may carry text; only numbers are metrics
                family = CounterMetricFamily if counter else GaugeMetricFamily
                yield family(f"{prefix}_{field}", f"{field} ({prefix})", value=value)


SCRAPED = ScrapedCounters()
REGISTRY.register(SCRAPED)


def _hit_ratio(hits: int, misses: int) -> float:
    return hits / (hits + misses) if hits + misses else 0.0


def watch_gear(gear: Gear | None) -> None:
    """Export a trainer's gear mode: its work counters (``xcls_gear_*_total``), its feature
    cache's counters and hit ratio since start (``xcls_gear_cache_*``; ``unavailable``: ids
    answered as misses during a Redis outage), the accumulator's (``xcls_gear_accumulator_*``;
    ``dropped``: gradients lost to an outage), and the numbers of ``Gear.summary()``
    (``xcls_gear_summary_*``). Read at scrape time, so fields added later show up too."""
    if gear is None:
        return
    SCRAPED.watch("xcls_gear", lambda: asdict(gear.counts))
    SCRAPED.watch("xcls_gear_summary", gear.summary, counter=False)
    if gear.cache is not None:
        cache = gear.cache
        SCRAPED.watch("xcls_gear_cache", lambda: cache.metrics.as_dict())
        SCRAPED.watch("xcls_gear_cache", lambda: {"hit_ratio": _hit_ratio(
            cache.metrics.hits, cache.metrics.misses)}, counter=False)
    if hasattr(gear.accumulator, "metrics"):
        SCRAPED.watch("xcls_gear_accumulator", lambda: gear.accumulator.metrics.as_dict())


def watch_slow_gear(slow: SlowGear, stream: GradientSource) -> None:
    """Export a slow-gear worker: mean gradients applied and rejected, backbone steps and
    version (``xcls_slow_gear_*``), and its stream consumer's counters
    (``xcls_slow_gear_stream_*``, when ``stream`` keeps ``metrics``)."""
    SCRAPED.watch("xcls_slow_gear", lambda: {
        "samples_applied": slow.counts.slow_forwards,
        "samples_rejected": slow.counts.rejected,
        "batches_applied": slow.counts.slow_steps,
        "samples_stale": slow.counts.stale,
        "resets": slow.counts.resets})
    SCRAPED.watch("xcls_slow_gear", lambda: {"version": slow.version}, counter=False)
    if hasattr(stream, "metrics"):
        SCRAPED.watch("xcls_slow_gear_stream", lambda: stream.metrics.as_dict())


class CountedWeightChannel:
    """A :class:`bridge.protocols.WeightChannel` that counts its publications
    (``xcls_slow_gear_publications_total``) and the newest version published."""

    def __init__(self, channel: WeightChannel) -> None:
        self.channel = channel

    def publish(self, model: nn.Module, version: int, replaces: int | None = None) -> bool:
        ok = self.channel.publish(model, version, replaces)
        PUBLICATIONS.labels("ok" if ok else "failed").inc()
        if ok:
            PUBLISHED_VERSION.set(version)
        return ok

    def reset(self, model: nn.Module, version: int) -> int:
        return self.channel.reset(model, version)

    def published_version(self) -> int | None:
        return self.channel.published_version()

    def load_into(self, model: nn.Module, newer_than: int) -> int | None:
        return self.channel.load_into(model, newer_than)

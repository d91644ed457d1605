"""Prometheus metrics, scraped over HTTP from real shard, scheduler and training processes (each
exports its own role's families only) and read from the registry of an in-process training
run. Only counts are checked, never timings."""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Callable

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import ams
from ams import errors
from ams.cluster.lease import Role
from ams.cluster.scheduler import SchedulerClient
from tests.conftest import free_port, wait_until
from workers.metrics import PHASES, REGISTRY
from xcls.config import load_config
from xcls.run import build_run
from xcls.shards import spawn, stop

N, D = 1000, 16


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of http://127.0.0.1:PORT/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape_when(port: int, done: Callable[[dict[tuple[str, tuple], float]], bool], what: str,
                timeout: float = 30) -> dict[tuple[str, tuple], float]:
    """The first scrape of PORT for which ``done`` holds; fails, naming ``what`` (the counts
    waited for), after ``timeout`` seconds. The data plane counts a call once its answer has
    gone out, so a caller holding its answer may scrape a moment before the shard counted it."""
    def scraped_when_done() -> dict[tuple[str, tuple], float] | None:
        scraped = scrape(port)
        return scraped if done(scraped) else None

    return wait_until(scraped_when_done, what, timeout)


def xcls_families(m: dict[tuple[str, tuple], float]) -> set[str]:
    """The xcls metric prefixes a scrape holds: 'xcls_shard', 'xcls_trainer', ..."""
    return {"_".join(name.split("_")[:2]) for name, _ in m if name.startswith("xcls_")}


def test_shard_metrics_count_rows_calls_and_refusals(shard_cluster):
    port = free_port()
    (proc,) = shard_cluster(1, ["--metrics-port", str(port)])
    client = ams.connect([proc.address])
    client.create_table("fc", num_rows=N, dim=D, seed=4)
    g = torch.Generator().manual_seed(0)
    pulled, pulls = 0, 0
    for n in (10, 50, 200):
        client.pull("fc", torch.randperm(N, generator=g)[:n])  # distinct ids: one row each
        pulled, pulls = pulled + n, pulls + 1
    pushed, pushes = 0, 0
    for n in (7, 30):
        client.push("fc", torch.randperm(N, generator=g)[:n], torch.randn(n, D, generator=g),
                    lr=0.1)
        pushed, pushes = pushed + n, pushes + 1
    with pytest.raises(errors.InvalidArgument, match="would become non-finite"):
        # finite, so the client sends it; the row it makes is not, so the shard refuses it
        client.push("fc", torch.tensor([3]), torch.full((1, D), 3e38), lr=10.0)

    def calls(scraped: dict, method: str) -> float:
        return scraped.get(("xcls_shard_request_seconds_count", (("method", method),)), 0)

    m = scrape_when(port, lambda scraped: calls(scraped, "Pull") >= pulls
                    and calls(scraped, "Push") >= pushes + 1, "the calls' counts")
    assert xcls_families(m) == {"xcls_shard"}  # no worker's or scheduler's families
    assert m["process_cpu_seconds_total", ()] > 0  # the process's own, as every role has
    table = (("table", "fc"),)
    assert m["xcls_shard_rows_pulled_total", table] == pulled
    assert m["xcls_shard_pulls_total", table] == pulls
    assert m["xcls_shard_rows_pushed_total", table] == pushed
    assert m["xcls_shard_pushes_total", table] == pushes
    assert m["xcls_shard_owned_rows", table] == N
    assert m["xcls_shard_push_rejections_total", (("reason", "INVALID_ARGUMENT"),)] == 1
    assert m["xcls_shard_request_errors_total",
             (("code", "INVALID_ARGUMENT"), ("method", "Push"))] == 1
    assert calls(m, "Pull") == pulls
    assert calls(m, "Push") == pushes + 1  # the refused one too

    client.snapshot(5)
    client.restore(5)  # new tables: the store's counters start again (a counter reset)
    client.close()
    m = scrape(port)  # gRPC calls are counted before their answer leaves
    assert calls(m, "Snapshot") == calls(m, "Restore") == 1
    assert m["xcls_shard_snapshot_seconds_count", ()] == 1
    assert m["xcls_shard_restores_total", ()] == 1
    assert m["xcls_shard_snapshot_age_seconds", ()] >= 0


def test_scheduler_metrics_count_leases_and_expiries(tmp_path):
    port, port_file = free_port(), tmp_path / "scheduler.port"
    log_path = tmp_path / "scheduler.log"
    child = spawn("scheduler", [sys.executable, "-m", "xcls", "serve", "scheduler",
                                "--num-shards", "1", "--lease-ttl", "1", "--port-file",
                                str(port_file), "--metrics-port", str(port)],
                  log_path=log_path)
    try:
        wait_until(port_file.exists, "the scheduler's port file", 60, [child.proc],
                   log_path.read_text)
        with SchedulerClient(f"127.0.0.1:{int(port_file.read_text())}") as sched:
            sched.register(Role.WORKER, 0, "worker-0", "w0")
            m = scrape(port)
            assert xcls_families(m) == {"xcls_scheduler"}  # it serves no shard, has no store
            assert m["xcls_scheduler_leases", (("role", "worker"),)] == 1
            assert m["xcls_scheduler_leases", (("role", "shard"),)] == 0
            assert m["xcls_scheduler_generation", ()] == 0
            assert m["xcls_scheduler_shards_missing", ()] == 1
            # never renewed: the reaper expires it, which moves the generation on
            scrape_when(port, lambda m: m.get(("xcls_scheduler_lease_expiries_total",
                                               (("role", "worker"),))) == 1,
                        "the lease's expiry", timeout=60)
            m = scrape(port)
            assert m["xcls_scheduler_leases", (("role", "worker"),)] == 0
            assert m["xcls_scheduler_generation", ()] == 1
    finally:
        stop([child], 10)


def overrides(data, out, **extra) -> list[str]:
    """A tiny run on the glyph data (as tests/test_trainer.py)."""
    base = {
        "data.train": str(data / "train"), "data.test": str(data / "test"),
        "data.batch_size": 32, "data.num_workers": 0, "model.dim": 32,
        "head.kind": "knn", "head.k": 4, "head.budget": 48, "graph.k": 8,
        "optim.warmup_steps": 2, "train.out_dir": str(out), "train.log_every": 2,
        "train.threads": 2, "train.epochs": 100, "train.max_steps": 5,
        "train.checkpoint_every": 0, "train.eval_every": 0,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def test_a_training_worker_exports_its_own_families_only(glyphs_small, tmp_path):
    port, config = free_port(), tmp_path / "empty.toml"
    config.write_text("")  # every field from the overrides
    log_path = tmp_path / "train.log"
    child = spawn("train", [sys.executable, "-m", "xcls", "train", str(config),
                            "--metrics-port", str(port),
                            *[a for o in overrides(glyphs_small, tmp_path / "run",
                                                   **{"train.max_steps": 100000})
                              for a in ("--set", o)]], log_path=log_path)

    def past_two_steps() -> dict[tuple[str, tuple], float] | None:
        try:
            m = scrape(port)
        except OSError:  # its metrics server is not up yet
            return None
        return m if m.get(("xcls_trainer_step", ()), 0) >= 2 else None

    try:
        m = wait_until(past_two_steps, "the trainer's second step", 120, [child.proc],
                       lambda: log_path.read_text()[-2000:])
        # the embedded AMS's shards run in this process, but their families are a shard's:
        # an alert on xcls_shard_snapshot_age_seconds must not fire on workers
        families = xcls_families(m)
        assert "xcls_trainer" in families and not families & {"xcls_shard", "xcls_scheduler"}, \
            sorted(families)
    finally:
        stop([child], 60)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_trainer_phase_counts_equal_steps(glyphs_small, tmp_path):
    before = {phase: sample("xcls_trainer_phase_seconds_count", phase=phase)
              for phase in PHASES}
    steps_before = sample("xcls_trainer_steps_total")
    run = build_run(load_config(None, overrides(glyphs_small, tmp_path / "run")))
    result = run.trainer.train()
    assert result.steps == 5
    for phase in PHASES:
        assert sample("xcls_trainer_phase_seconds_count", phase=phase) - before[phase] == 5, \
            phase
    assert sample("xcls_trainer_steps_total") - steps_before == 5
    assert sample("xcls_trainer_step") == 5
    assert sample("xcls_trainer_loss") == pytest.approx(result.last_loss)


def test_gear_cache_counters_are_read_at_scrape_time(glyphs_small, tmp_path):
    gear = {"gear.enabled": "true", "gear.ttl": 60, "train.max_steps": 4}
    run = build_run(load_config(None, overrides(glyphs_small, tmp_path / "run", **gear)))
    run.trainer.train()
    looked_up = 4 * 32  # every id of a lookup is a hit or a miss
    hits, misses = sample("xcls_gear_cache_hits_total"), sample("xcls_gear_cache_misses_total")
    assert hits + misses == looked_up
    assert sample("xcls_gear_samples_total") == looked_up
    assert sample("xcls_gear_cache_hit_ratio") == pytest.approx(hits / looked_up)

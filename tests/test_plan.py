"""ams.cluster.plan: the capacity arithmetic, against figures worked out by hand here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ams.cluster import plan
from ams.cluster.plan import (
    Job,
    Rates,
    active_classes,
    graph_build,
    ivf_flops,
    load_rates,
    shard_memory,
    step_traffic,
)
from ams.limits import RPC_THREADS

RATES = Rates(cpu_exact=1e6, cpu_ring=2e6, cpu_ivf=5e5, gpu_exact=1e7, gpu_ivf=1e8,
              baseline=1000, buffers_per_stream=100, snapshot_overhead=0.5, sources={})


def small_job(**changes: object) -> Job:
    """10 classes of width 4 on 3 shards: shard 0 owns classes 0, 3, 6, 9."""
    base = dict(num_classes=10, dim=4, dtype="float16", state_dtype="float32", momentum=0.9,
                shards=3, hosts=1, workers=1, batch_size=2, head="knn", graph_k=2)
    return Job(**{**base, **changes})


def test_memory_storage_holds_every_part_in_ram():
    m = shard_memory(small_job(), RATES)
    # 4 rows: float16 x 4 = 8 B, float32 momentum x 4 = 16 B, clock 8 B, touched 1 B,
    # graph 2 int32 ids = 8 B a row
    assert (m.owned, m.rows, m.state, m.clocks, m.touched, m.graph) == (4, 32, 64, 32, 4, 32)
    assert m.table == 128
    assert m.at_rest == 1000 + 128 + 32
    assert m.buffers == 2 * 100  # one worker's pulls and rank 0's push
    assert m.resident == 1160 + 4 + 200
    assert m.snapshot == 240  # (128 + 32) x 1.5
    assert m.files == 0
    assert m.snapshot_peak == 1364 + 128 + 240  # a copy of the table, the piece in LMDB
    assert m.restore_peak == 1364 + 240 + 160 + 64  # piece, table + graph, the state's temp


def test_mmap_storage_keeps_the_table_out_of_ram():
    m = shard_memory(small_job(storage="mmap"), RATES)
    # 4 rows in 5 slots (a quarter more): each row's int32 slot, a 1-byte mask per slot
    assert m.slot_map == 4 * 4 + 5
    assert m.at_rest == 1000 + 21  # the graph's lists are in a scratch file too
    assert m.resident == 1021 + 4 + 200
    assert m.files == 5 * (8 + 16 + 8) + 32  # rows, momentum, clocks by slot; the graph
    assert m.snapshot == 240
    assert m.snapshot_peak == 1225 + 240  # the copy goes to scratch files
    # the piece, the graph read into RAM, the slot map, the state's temporary
    assert m.restore_peak == 1225 + 240 + 32 + 21 + 64


def test_no_momentum_no_state_and_no_graph_without_knn():
    m = shard_memory(small_job(momentum=0.0, head="partial", graph_k=0), RATES)
    assert (m.rows, m.state, m.clocks, m.graph) == (32, 0, 32, 0)
    assert m.restore_peak == m.resident + m.snapshot + 64 + 32  # rows are the largest temp


def test_ids_are_int64_from_2_to_the_31_classes():
    below = shard_memory(small_job(num_classes=2**31 - 1, shards=1024, graph_k=3), RATES)
    at = shard_memory(small_job(num_classes=2**31, shards=1024, graph_k=3), RATES)
    assert below.graph == 2**21 * 3 * 4  # shard 0 owns ceil((2**31 - 1) / 2**10) = 2**21
    assert at.graph == 2**21 * 3 * 8


def test_message_buffers_stop_at_the_handler_threads():
    assert shard_memory(small_job(workers=5), RATES).buffers == 6 * 100
    assert shard_memory(small_job(workers=100), RATES).buffers == RPC_THREADS * 100


def test_busiest_host_takes_the_rounded_up_share():
    assert small_job(shards=3, hosts=2).shards_per_host == 2
    assert small_job(shards=10, hosts=10, num_classes=10).shards_per_host == 1


@pytest.mark.parametrize("head, budget, batch, expected", [
    ("full", 0, 256, 10000),  # every class
    ("partial", 0, 256, 1000),  # 0.1 x 10,000
    ("partial", 5000, 256, 1000),  # head.budget is the knn head's only
    ("knn", 0, 256, 1000),  # budget 0: sample_rate x N
    ("knn", 500, 256, 500),
    ("knn", 100, 256, 256),  # never fewer than the batch's labels
    ("knn", 20000, 256, 10000),  # never more than N
])
def test_active_classes_follow_the_heads_rule(head, budget, batch, expected):
    job = small_job(num_classes=10000, head=head, budget=budget, batch_size=batch,
                    sample_rate=0.1)
    assert active_classes(job) == expected


def test_step_traffic_by_hand():
    # N=10, d=4 float16, knn with k=2, 3 workers of batch 2, budget 3 -> 3 active classes
    t = step_traffic(small_job(workers=3, budget=3))
    assert t.active == 3
    assert t.pull_bytes == 3 * (8 + 8)  # float16 rows of 4, int64 ids
    assert t.neighbor_bytes == 2 * (8 + 2 * 4)  # the labels' ids out, 2 int32 ids each back
    assert t.pushed == 3  # a third of the union of 3 workers' classes (9 at most)
    assert t.push_bytes == 3 * (16 + 8)  # float32 gradients and int64 ids
    assert t.exchanged == 2  # 3 x 2/3 of a worker's classes go to the other two
    assert t.exchange_bytes == 2 * (16 + 8)
    # shard 0 owns 4 of the 10 classes
    assert t.shard_out == 96  # 3 workers x (48 + 32) B x 4 / 10
    assert t.shard_in == 87  # all pushes, 216 B x 4 / 10 = 86.4, rounded up


def test_one_worker_gathers_nothing():
    t = step_traffic(small_job(workers=1, budget=3))
    assert t.exchanged == t.exchange_bytes == 0
    assert t.pushed == 3


def test_ivf_flops_by_hand():
    # train: 10 iterations x min(1000, 40 x 10) rows x 10 centroids x 2 x 4
    # assign: 1000 x 10 x 8; search: 1000 x 10 x 8 + 1000 x 2 lists x 100 rows x 8
    assert ivf_flops(1000, 4, 10, 2) == 320_000 + 80_000 + 80_000 + 1_600_000


def test_exact_build_halves_in_memory_on_the_cpu_only():
    job = small_job(num_classes=1000, shards=1)
    fits = graph_build(job, RATES, in_memory_bytes=1000 * 4 * 4, recall_queries=100)
    assert fits.in_memory
    assert (fits.cpu_flops, fits.gpu_flops) == (4_000_000, 8_000_000)  # N^2 d, 2 N^2 d
    assert (fits.cpu_seconds, fits.gpu_seconds) == (4.0, 0.8)  # at 1e6 and 1e7 FLOP/s
    ring = graph_build(job, RATES, in_memory_bytes=1000 * 4 * 4 - 1, recall_queries=100)
    assert not ring.in_memory
    assert ring.cpu_flops == 8_000_000
    assert ring.cpu_seconds == 4.0  # the ring's rate, 2e6


def test_ivf_build_by_hand():
    job = small_job(num_classes=1000, shards=1, graph_method="ivf", nlist=0, nprobe=8)
    b = graph_build(job, RATES, in_memory_bytes=1 << 30, recall_queries=100)
    # auto nlist: min(4 sqrt(1000) ~ 126, 1000 // 40 = 25) = 25
    assert (b.nlist, b.nprobe) == (25, 8)
    # train 10 x 1000 x 25 x 8, assign 1000 x 25 x 8, search 1000 x 25 x 8 + 1000 x 8 x 40 x 8
    assert b.cpu_flops == b.gpu_flops == 2_000_000 + 200_000 + 200_000 + 2_560_000
    assert b.check_flops == 2 * 100 * 1000 * 4
    assert b.cpu_seconds == pytest.approx(4_960_000 / 5e5 + 800_000 / 2e6)
    assert b.gpu_seconds == pytest.approx(4_960_000 / 1e8 + 800_000 / 1e7)
    assert b.index_bytes == 1000 * (4 * 2 + 8) + 25 * 4 * 4


@pytest.mark.parametrize("changes, message", [
    ({"num_classes": 0}, "num_classes=0"),
    ({"num_classes": 2**62}, "num_classes="),
    ({"workers": 0}, "workers=0"),
    ({"shards": 11}, "shards=11 exceeds num_classes=10"),
    ({"hosts": 4}, "hosts=4 exceeds shards=3"),
    ({"dtype": "float8"}, "dtype='float8'"),
    ({"head": "softmax"}, "head='softmax'"),
    ({"storage": "disk"}, "storage='disk'"),
    ({"momentum": 1.0}, "momentum=1.0"),
    ({"dim": 0}, "dim=0"),
])
def test_bad_jobs_are_refused_in_one_line(changes, message):
    with pytest.raises(ValueError, match=message) as e:
        small_job(**changes)
    assert "\n" not in str(e.value)


def test_shipped_rates_say_where_they_come_from():
    rates = load_rates()
    for value in (rates.cpu_exact, rates.cpu_ring, rates.cpu_ivf, rates.gpu_exact,
                  rates.gpu_ivf, rates.baseline, rates.buffers_per_stream):
        assert value > 0
    assert 0 <= rates.snapshot_overhead < 0.1
    raw = json.loads(Path(plan.__file__).with_name(plan.RATES_FILE).read_text())
    for name in ("cpu_exact", "cpu_ring", "cpu_ivf", "shard"):
        assert raw[name]["command"].startswith("python benchmarks/plan_rates.py")
        assert raw[name]["machine"]
    assert raw["gpu_exact"]["measured"] is True  # timed on an H100
    assert raw["gpu_exact"]["command"].startswith("python benchmarks/bench_graph.py")
    assert raw["gpu_ivf"]["measured"] is False
    assert "nominal" in raw["gpu_ivf"]["basis"]
    # each rate's source follows its own flag, not the kind of device
    assert rates.sources["gpu_exact"] == f"measured on {raw['gpu_exact']['device']}"
    assert rates.sources["gpu_ivf"] == f"nominal assumption for {raw['gpu_ivf']['device']}"
    assert rates.sources["cpu_ring"] == f"measured on {raw['cpu_ring']['machine']}"


def test_malformed_rates_are_one_line_errors(tmp_path, monkeypatch):
    shipped = json.loads(Path(plan.__file__).with_name(plan.RATES_FILE).read_text())
    monkeypatch.setattr(plan, "RATES_FILE", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="cannot read"):
        load_rates()
    bad = tmp_path / "rates.json"
    monkeypatch.setattr(plan, "RATES_FILE", str(bad))
    bad.write_text(json.dumps({"cpu_exact": {"flops_per_s": 1}}))
    with pytest.raises(ValueError, match="malformed.*KeyError") as e:
        load_rates()
    assert "\n" not in str(e.value)
    shipped["gpu_ivf"]["measured"] = "no"  # a rate must say whether it was measured
    bad.write_text(json.dumps(shipped))
    with pytest.raises(ValueError, match="malformed.*'measured' is 'no'"):
        load_rates()
    del shipped["gpu_ivf"]["measured"]
    bad.write_text(json.dumps(shipped))
    with pytest.raises(ValueError, match="malformed.*KeyError: 'measured'"):
        load_rates()

"""Gear mode in the trainer on real glyph data, with a real Redis for the shared backends; and
the gear alone against the bridge protocols (what it may know of the bridge, the lr it steps at,
who saves and restores which state).

Backbone work is counted by a forward hook on the backbone (independent of the gear's own
counters): a no-grad forward is a fast-gear cache miss, a forward with grad a training forward.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from bridge import MemoryFeatureCache, MemoryGradientAccumulator, WeightStore, redis_util
from bridge.codec import GradEntry, encode_features, encode_grad_entry
from bridge.redis_accumulator import dead_letter_key, stream_key
from tests.conftest import wait_until
from workers import checkpoint
from workers.backbones import build_backbone
from workers.gear import Gear, SlowGear, SlowGearGroup, run_slow_worker
from workers.predict import images_to_input
from xcls.cli import main
from xcls.config import load_config
from xcls.run import build_run

CLASSES = 120


def overrides(data: Path, out: Path, **extra: object) -> list[str]:
    base = {
        "data.train": str(data / "train"), "data.test": str(data / "test"),
        "data.batch_size": 64, "data.num_workers": 0, "model.dim": 64, "head.kind": "full",
        "optim.lr": 0.1, "optim.warmup_steps": 5, "train.out_dir": str(out),
        "train.log_every": 5, "train.threads": 2, "train.epochs": 100, "train.resume": False,
        "train.checkpoint_every": 1000, "train.eval_every": 1000, "gear.enabled": True,
    }
    base.update(extra)
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in base.items()]


def build(data: Path, out: Path, **extra: object):
    """A built run plus its backbone-row counter {"nograd": n, "grad": n}."""
    run = build_run(load_config(None, overrides(data, out, **extra)))
    counts = Counter()

    def hook(module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        counts["grad" if torch.is_grad_enabled() else "nograd"] += inputs[0].shape[0]

    run.backbone.register_forward_hook(hook)
    return run, counts


def visits(run, steps: int) -> Counter:
    """How often each sample id is trained on in the first ``steps`` steps (from the plan)."""
    plan, seen = run.trainer.plan, Counter()
    for epoch in range(steps // plan.steps_per_epoch + 1):
        for batch in plan.batches(epoch, 0):
            if sum(seen.values()) >= steps * plan.batch_size:
                return seen
            seen.update(batch)
    return seen


def test_gear_trains_with_fewer_backbone_forwards(glyphs_small, tmp_path):
    off, off_counts = build(glyphs_small, tmp_path / "off", **{"gear.enabled": False,
                                                               "train.max_steps": 4,
                                                               "data.test": ""})
    off.trainer.train()
    # gear off: one forward with grad per trained sample, nothing else
    assert off_counts == {"grad": 4 * 64}

    steps, m = 150, 2
    # Every feature stays frozen at the backbone of its first visit (the random initial one
    # for most). At the default row decay 5e-3 such a run can lose its test accuracy;
    # config.OptimConfig says to use 5e-4 with long-cached features, so this run does. The
    # rows learn those frozen features while the backbone moves on: at lr 0.1 the test
    # top-1 after 150 steps ranged from chance to 40 % with the rows' warm-up (5, 6, 7 or 10
    # steps), at lr 0.02 it was 60-66 % for each.
    run, counts = build(glyphs_small, tmp_path / "on", **{"gear.ttl": 1e6, "gear.m": m,
                                                         "train.max_steps": steps,
                                                         "optim.head_weight_decay": 5e-4,
                                                         "optim.lr": 0.02})
    result = run.trainer.train()
    seen = visits(run, steps)
    # ttl long: a sample is computed once, on its first visit; m=2: every second visit of a
    # sample trains the backbone on it (the in-process slow gear drains after every step)
    evaluated = len(run.trainer.test_set)  # the one evaluation, at the end, runs without grad
    assert counts["nograd"] == len(seen) + evaluated
    assert counts["grad"] == sum(v // m for v in seen.values())
    assert run.trainer.gear.version > 0
    gear_per_sample = (counts["nograd"] - evaluated + counts["grad"]) / (steps * 64)
    off_per_sample = off_counts["grad"] / (4 * 64)
    assert gear_per_sample < 0.95 * off_per_sample, (gear_per_sample, off_per_sample)
    # the head trains on features up to a whole run old, so the loss falls slower than with
    # gear off, but test accuracy is far above chance
    losses = [row["loss"] for row in result.history]
    assert losses[-1] < 0.85 * losses[0], losses
    assert result.eval["top1"] > 10 / CLASSES, result.eval  # unseen designs


def test_ttl_zero_recomputes_every_sample(glyphs_small, tmp_path):
    run, counts = build(glyphs_small, tmp_path / "run", **{"gear.ttl": 0, "gear.m": 1,
                                                          "train.max_steps": 20,
                                                          "data.test": ""})
    run.trainer.train()
    assert run.trainer.gear.cache is None
    assert counts == {"nograd": 20 * 64, "grad": 20 * 64}
    assert run.trainer.gear.version == 20  # m=1: one backbone step after every fast step


def redis_sets(server, prefix: str) -> dict[str, object]:
    return {"gear.backend": "redis", "gear.prefix": prefix,
            "gear.redis_url": f"redis://{server.host}:{server.port}/0"}


def parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def moved(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """Largest change of any backbone parameter between two copies."""
    return max(float((after[k] - before[k]).abs().max()) for k in before)


def redis_calls(server, command: str) -> int:
    """How often ``server`` ran ``command`` since it started, by its own statistics."""
    import redis

    with redis.Redis(host=server.host, port=server.port) as client:
        return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def test_redis_outage_mid_run_keeps_the_backbone_training(glyphs_small, tmp_path, own_redis,
                                                          caplog, monkeypatch):
    steps, kill_at, restart_at = 40, 8, 20
    run, backbone_rows = build(glyphs_small, tmp_path / "run", **{
        "gear.ttl": 1e6, "gear.m": 1, "train.max_steps": steps, "data.test": "",
        **redis_sets(own_redis, "outage")})
    gear = run.trainer.gear
    acc = gear.accumulator
    # Every call tries Redis (no back-off), so which steps see it down is fixed by the test.
    monkeypatch.setattr(redis_util, "RETRY_AFTER_S", 0.0)
    marks: dict[str, dict] = {}
    fast_features = gear.features
    calls = [0]

    def mark(name: str) -> None:
        marks[name] = {"params": parameters(run.backbone), "grad_rows": backbone_rows["grad"],
                       "hits": gear.cache.metrics.hits,
                       "unavailable": gear.cache.metrics.unavailable,
                       "fallback": acc.metrics.fallback, "added": acc.metrics.added}

    def features(ids: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == kill_at:
            mark("kill")
            own_redis.kill()
        elif calls[0] == 14:
            mark("mid")
        elif calls[0] == restart_at:
            mark("restart")
            own_redis.start()
        return fast_features(ids, images)

    gear.features = features
    with caplog.at_level("INFO", logger="bridge"):
        result = run.trainer.train()
    assert result.steps == steps
    assert all(np.isfinite(row["loss"]) for row in result.history)
    down, back = restart_at - kill_at, steps - restart_at + 1  # steps are calls 1..steps
    # down: lookups are misses, and the backbone still trains on every step's gradients
    assert marks["restart"]["unavailable"] - marks["kill"]["unavailable"] >= 64
    assert moved(marks["kill"]["params"], marks["mid"]["params"]) > 0
    assert moved(marks["mid"]["params"], marks["restart"]["params"]) > 0
    assert marks["restart"]["grad_rows"] - marks["kill"]["grad_rows"] == down * 64
    assert marks["restart"]["fallback"] == down * 64 and acc.metrics.dropped == 0
    # back: every later gradient went to Redis, as the restarted server counts them
    assert acc.metrics.fallback == down * 64
    assert acc.metrics.added - marks["restart"]["added"] == back * 64
    assert redis_calls(own_redis, "xadd") == back * 64  # m=1: one mean each
    assert backbone_rows["grad"] == steps * 64  # the slow gear applied every one of them
    assert gear.cache.metrics.hits > marks["restart"]["hits"]
    assert acc.metrics.outages == 1 and acc.metrics.outage_s > 0
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("grad_fallback who=grad_accumulator:outage") for m in messages)
    assert any(m.startswith("redis_recovered who=grad_accumulator:outage outage_s=")
               for m in messages)


def test_garbage_in_cache_and_stream_is_rejected(glyphs_small, tmp_path, redis_server):
    prefix = f"garbage{uuid.uuid4().hex[:8]}"
    client = redis_server.client()
    dim, n_bad = 64, 40
    nan_entry = encode_features(np.full((1, dim), np.nan, np.float32), 0, 1e18, "float16")[0]
    stream = stream_key(prefix)

    def plant() -> None:
        for i in range(n_bad):
            client.set(f"{prefix}:f:{i}".encode(), b"not a feature" if i % 2 else nan_entry)
            client.set(f"{prefix}:acc:{i}".encode(), b"not a record")
        client.xgroup_create(stream, "slow_gear", id="0", mkstream=True)
        client.xadd(stream, {b"junk": b"1"})
        client.xadd(stream, {**encode_grad_entry(GradEntry(0, 0, 0, 1, np.ones(dim, np.float32))),
                             b"grad": b"\x00" * 3})
        unknown = GradEntry(10**9, 0, 0, 1, np.ones(dim, np.float32))
        client.xadd(stream, encode_grad_entry(unknown))

    plant()  # left by an earlier job of the same name: a fresh run starts without it
    run, _ = build(glyphs_small, tmp_path / "run", **{
        "gear.ttl": 1e6, "gear.m": 1, "train.max_steps": 16, "data.test": "",
        **redis_sets(redis_server, prefix)})
    gear = run.trainer.gear
    slow, consumer = gear.slow
    fast_features = gear.features

    def features(ids: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        if gear.counts.samples == 0:
            assert not client.exists(stream, f"{prefix}:f:1", f"{prefix}:acc:1")
            plant()  # written while the run trains
        return fast_features(ids, images)

    gear.features = features
    result = run.trainer.train()
    assert all(np.isfinite(row["loss"]) for row in result.history)
    seen = visits(run, 16)
    bad_seen = sum(1 for i in range(n_bad) if i in seen)
    assert gear.cache.metrics.corrupt >= bad_seen > 0  # answered as misses, then overwritten
    assert gear.accumulator.metrics.corrupt >= bad_seen  # garbage partial sums start over
    assert consumer.metrics.corrupt == 2 and client.xlen(dead_letter_key(prefix)) == 2
    assert slow.counts.rejected == 1  # well-formed, but no such sample
    # only the fast gear's own means reached the backbone, each exactly once
    assert slow.counts.slow_forwards == gear.accumulator.metrics.emitted == 16 * 64
    client.close()


def consumer_group_ready(client, prefix: str) -> bool:
    """Whether the slow group's consumer group exists on the gradient stream: the external
    worker reads from then on."""
    return bool(client.exists(stream_key(prefix)) and client.xinfo_groups(stream_key(prefix)))


@pytest.mark.parametrize("flag,value,needle", [
    ("--block-ms", "-1", "--block-ms -1 must be >= 0"),
    ("--min-idle-ms", "-5", "--min-idle-ms -5 must be >= 0"),
    ("--max-steps", "-5", "--max-steps -5 must be >= 0"),
    ("--idle-exit", "-1", "--idle-exit -1.0 must be >= 0 and finite"),
    ("--idle-exit", "inf", "--idle-exit inf must be >= 0 and finite"),
])
def test_slow_gear_refuses_flags_it_cannot_run_with(flag, value, needle, capsys):
    """Refused in one line before Redis is asked (none runs here): --block-ms -1 was a Redis
    error's traceback, --min-idle-ms -5 failed every read as if Redis were down, and a negative
    --max-steps or --idle-exit stopped with exit 0 before the first step."""
    sets = ["gear.enabled=true", "gear.backend=redis", "gear.slow=external",
            "gear.redis_url=redis://127.0.0.1:1/0"]
    assert main(["gear", "slow", "/dev/null", flag, value,
                 *sum((["--set", s] for s in sets), [])]) == 2
    assert capsys.readouterr().err == f"error: {needle}\n"


def test_external_slow_gear_process(glyphs_small, tmp_path, redis_server):
    prefix = f"ext{uuid.uuid4().hex[:8]}"
    sets = overrides(glyphs_small, tmp_path / "run", **{
        "gear.ttl": 1e6, "gear.m": 1, "gear.slow": "external", "gear.sync_every": 2,
        "gear.publish_every": 2, "gear.slow_batch": 32, "train.max_steps": 12,
        "data.batch_size": 32,
        "data.test": "", **redis_sets(redis_server, prefix)})
    # m=1 and 32 means per read: one backbone step per trainer step, so the worker stops after
    # 12 (--idle-exit only guards against a hang)
    slow = subprocess.Popen(
        [sys.executable, "-m", "xcls", "gear", "slow", "/dev/null", "--max-steps", "12",
         "--idle-exit", "60", "--block-ms", "200", *sum((["--set", s] for s in sets), [])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client = redis_server.client()
    try:
        wait_until(lambda: consumer_group_ready(client, prefix), "the slow group's consumer group",
                   60, [slow], slow.stderr.read)
        run = build_run(load_config(None, sets))
        result = run.trainer.train()
        out, err = slow.communicate(timeout=120)
    finally:
        slow.kill()
    assert slow.returncode == 0, err
    assert result.steps == 12
    gear = run.trainer.gear
    emitted = gear.accumulator.metrics.emitted
    assert emitted == 12 * 32
    assert f"{emitted} means applied, 0 rejected, 0 malformed" in out, out

    # the trainer's next sync takes the final publication, the same a fresh model loads
    store = WeightStore(client, prefix)
    final = store.published_version()
    assert final == 12  # one backbone step per trainer step
    gear.sync()
    assert gear.version == final
    model = build_backbone("resnet_small", 64, 1, 24)
    assert store.load_into(model, -1) == final
    loaded = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(torch.equal(loaded[k], v) for k, v in run.backbone.state_dict().items())
    # garbage never replaces good weights
    store.client.set(store.key, b"XGW1" + b"\x00" * 100)
    store.client.set(store.version_key, str(final + 1).encode())
    assert store.load_into(model, final) is None
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_external_slow_gear_goes_back_with_the_trainers(glyphs_small, tmp_path, redis_server):
    """The trainers roll back to the checkpoint of step 6 after training to 12: the job's
    published backbone is that checkpoint's from then on, above every version of the discarded
    steps, and a running ``xcls gear slow`` goes on from it."""
    prefix = f"back{uuid.uuid4().hex[:8]}"
    out = tmp_path / "run"
    sets = overrides(glyphs_small, out, **{
        "gear.ttl": 1e6, "gear.m": 1, "gear.slow": "external", "gear.sync_every": 2,
        "gear.publish_every": 2, "gear.slow_batch": 32, "train.max_steps": 12,
        "train.checkpoint_every": 6, "train.resume": True, "data.batch_size": 32,
        "data.test": "", **redis_sets(redis_server, prefix)})
    slow = subprocess.Popen(
        [sys.executable, "-m", "xcls", "gear", "slow", "/dev/null", "--idle-exit", "60",
         "--block-ms", "100", *sum((["--set", s] for s in sets), [])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client = redis_server.client()
    store = WeightStore(client, prefix)
    model = build_backbone("resnet_small", 64, 1, 24)

    def wait_for_slow(done: Callable[[], bool], what: str) -> None:
        wait_until(done, what, 120, [slow], slow.stderr.read)

    try:
        wait_for_slow(lambda: consumer_group_ready(client, prefix),
                      "the slow group's consumer group")
        assert build_run(load_config(None, sets)).trainer.train().steps == 12
        wait_for_slow(lambda: client.xlen(stream_key(prefix)) == 0, "the slow group to ack all")
        discarded = store.published_version()
        # the rollback: steps 7-12 are gone, as after a shard lost them
        shutil.rmtree(checkpoint.checkpoint_dir(out, 12))
        back = checkpoint.load(out, 6, 0)[0]["backbone"]
        run = build_run(load_config(None, sets))
        started: dict[str, object] = {}
        fast_features = run.trainer.gear.features

        def features(ids: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
            if not started:  # the first step after the rollback
                started["version"] = store.load_into(model, -1)
                started["gear"] = run.trainer.gear.version
            return fast_features(ids, images)

        run.trainer.gear.features = features
        assert run.trainer.train().steps == 12
        assert started["version"] == started["gear"] > discarded
        assert all(torch.equal(model.state_dict()[k], v) for k, v in back.items())
        wait_for_slow(lambda: client.xlen(stream_key(prefix)) == 0, "the slow group to ack all")
        slow.send_signal(signal.SIGTERM)  # it publishes what it has and stops
        stdout, stderr = slow.communicate(timeout=120)
    finally:
        slow.kill()
        client.close()
    assert slow.returncode == 0, (stdout, stderr)
    # two resets followed: the first run's fresh start and the rollback; then one backbone
    # step per trainer step (m=1, a trainer step's 32 means per read)
    (line,) = re.findall(r"(\d+) resets followed, version (\d+)", stdout)
    assert line == ("2", str(started["version"] + 6)), stdout
    assert len(re.findall(r"slow_gear_reset version=(\d+)", stderr)) == 2, stderr
    assert store.published_version() == int(line[1])


class Crash(Exception):
    pass


def crash_at(run, call: int) -> None:
    """Make the run's trainer die inside the fast gear on its ``call``-th step."""
    fast_features, calls = run.trainer.gear.features, [0]

    def features(ids: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == call:
            raise Crash
        return fast_features(ids, images)

    run.trainer.gear.features = features


def stored_versions(cache) -> list[int]:
    """The backbone version of every feature entry in the LMDB cache's directory, read
    read-only with the lmdb package and decoded by bridge.codec. Closes the cache first (one
    open of a path per process); the gear's next use reopens it."""
    from bridge.codec import decode_feature_header
    from tests.test_bridge_cache import stored_features

    cache.close()
    return [decode_feature_header(blob, cache.dim, cache.dtype)[0]
            for blob in stored_features(cache.path).values()]


def test_gear_resume_after_crash_is_bit_identical(glyphs_small, tmp_path):
    from tests.test_trainer import final_state

    # an epoch is 33 steps: the checkpoint falls in the second, where cached features of the
    # first are reused, and where m=2 means of the first visits are applied
    steps = 44
    sets = {"gear.ttl": 1e6, "gear.m": 2, "train.max_steps": steps,
            "train.checkpoint_every": 36, "train.resume": True, "data.test": ""}
    straight, _ = build(glyphs_small, tmp_path / "straight", **sets)
    straight.trainer.train()
    counts = straight.trainer.gear.counts
    assert straight.trainer.plan.steps_per_epoch < 36
    assert counts.fast_forwards < counts.samples and counts.slow_steps > 0

    crashed, _ = build(glyphs_small, tmp_path / "crashed", **sets)
    crash_at(crashed, 41)  # 4 steps past the checkpoint
    with pytest.raises(Crash):
        crashed.trainer.train()
    resumed, _ = build(glyphs_small, tmp_path / "crashed", **sets)
    assert resumed.trainer.train().steps == steps
    assert resumed.trainer.gear.counts == counts
    assert resumed.trainer.gear.version == straight.trainer.gear.version
    a_backbone, a_rows = final_state(tmp_path / "straight", steps)
    b_backbone, b_rows = final_state(tmp_path / "crashed", steps)
    for key in a_backbone:
        assert torch.equal(a_backbone[key], b_backbone[key]), key
    for a, b in zip(a_rows, b_rows, strict=True):
        assert torch.equal(a["rows"], b["rows"]) and torch.equal(a["state"], b["state"])


def test_gear_resume_drops_features_of_the_discarded_run(glyphs_small, tmp_path):
    sets = {"gear.ttl": 1e6, "gear.m": 1, "gear.backend": "lmdb", "train.max_steps": 14,
            "train.checkpoint_every": 6, "train.resume": True, "data.test": ""}
    crashed, _ = build(glyphs_small, tmp_path / "run", **sets)
    crash_at(crashed, 11)
    with pytest.raises(Crash):
        crashed.trainer.train()
    # m=1: one backbone step per fast step, so the checkpoint of step 6 is version 6 and the
    # crashed run wrote features of versions 7..9 after it
    assert max(stored_versions(crashed.trainer.gear.cache)) == 9  # and the cache is closed

    resumed, _ = build(glyphs_small, tmp_path / "run", **sets)
    gear = resumed.trainer.gear
    first_versions: list[list[int]] = []
    fast_features = gear.features

    def features(ids: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        if not first_versions:
            first_versions.append(stored_versions(gear.cache))
        return fast_features(ids, images)

    gear.features = features
    assert resumed.trainer.train().steps == 14
    assert first_versions[0] and max(first_versions[0]) == 6
    assert gear.version == 14


# --- the gear against the bridge protocols, no trainer -------------------------------------------


def _bridge_backend_classes() -> set[str]:
    """Every class the bridge defines that implements a gear-facing method and is not one of
    the protocols: what workers/gear.py must not name."""
    import bridge

    methods = {"get", "put", "add", "read", "ack", "publish", "load_into", "checkpoint_state",
               "restore_checkpoint_state"}
    found = set()
    for info in pkgutil.iter_modules(bridge.__path__):
        module = importlib.import_module(f"bridge.{info.name}")
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and obj.__module__ == module.__name__
                    and not getattr(obj, "_is_protocol", False)
                    and methods & set(dir(obj))):
                found.add(name)
    return found


def test_gear_module_knows_only_the_bridge_protocols():
    import workers.gear

    backends = _bridge_backend_classes()
    assert {"MemoryFeatureCache", "LmdbFeatureCache", "RedisFeatureCache", "FeatureCacheBase",
            "MemoryGradientAccumulator", "RedisGradientAccumulator", "RedisGradientConsumer",
            "WeightStore"} <= backends
    tree = ast.parse(Path(workers.gear.__file__).read_text())
    names, modules = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            modules.add(node.module)
            names.update(alias.name for alias in node.names)
    assert "isinstance" not in names and "issubclass" not in names
    assert not {m for m in modules if m.split(".")[0] == "redis" or m == "bridge.redis_util"}
    assert not names & backends, names & backends


def tiny_backbone() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 4))


def tiny_images(n: int) -> torch.Tensor:
    return (torch.arange(n * 16) % 251).to(torch.uint8).view(n, 1, 4, 4)


def test_in_process_slow_gear_steps_at_the_lr_backward_is_given():
    backbone = tiny_backbone()
    before = {k: v.double() for k, v in backbone.state_dict().items()}
    # lr=0: only the rate handed to Gear.backward can move the weights
    optimizer = torch.optim.SGD(backbone.parameters(), lr=0.0)
    imgs = tiny_images(3)
    data = [(i, img, 0) for i, img in enumerate(imgs)]
    acc = MemoryGradientAccumulator(4, m=1)
    slow = SlowGear(backbone, optimizer, data, torch.device("cpu"))
    gear = Gear(backbone, MemoryFeatureCache(4, 1 << 16, ttl_s=60.0), acc, torch.device("cpu"),
                slow=(slow, acc))
    gear.begin(None)
    ids = torch.arange(3)
    gear.features(ids, imgs)
    grads = torch.linspace(-1, 1, 12).view(3, 4)
    gear.backward(ids, grads, lr=0.25)
    # m=1: one step on the three means together; y = W x + b, so dW = g^T x and db = sum g
    x = images_to_input(imgs).view(3, 16).double()
    g = grads.double()
    after = backbone.state_dict()
    np.testing.assert_allclose(after["1.weight"].double(), before["1.weight"] - 0.25 * g.T @ x,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(after["1.bias"].double(), before["1.bias"] - 0.25 * g.sum(0),
                               rtol=1e-5, atol=1e-6)
    assert gear.version == 1


class MemoryChannel:
    """A WeightChannel holding the published weights in this process."""

    def __init__(self) -> None:
        self.published: tuple[dict, int] | None = None

    def publish(self, model: torch.nn.Module, version: int, replaces: int | None = None) -> bool:
        if replaces is not None and self.published_version() != (
                replaces if replaces >= 0 else None):
            return False
        self.published = ({k: v.clone() for k, v in model.state_dict().items()}, version)
        return True

    def reset(self, model: torch.nn.Module, version: int) -> int:
        newest = self.published_version()
        version = max(version, -1 if newest is None else newest + 1)
        self.publish(model, version)
        return version

    def published_version(self) -> int | None:
        return None if self.published is None else self.published[1]

    def load_into(self, model: torch.nn.Module, newer_than: int) -> int | None:
        if self.published is None or self.published[1] <= newer_than:
            return None
        model.load_state_dict(self.published[0])
        return self.published[1]


class RecordingSink:
    """A GradientSink that records what the gear asks of it."""

    def __init__(self) -> None:
        self.added: list[int] = []
        self.restored: list[tuple[dict | None, int]] = []

    def add(self, ids: torch.Tensor, grads: torch.Tensor, version: int) -> int:
        self.added.append(version)
        return 0

    def checkpoint_state(self) -> dict:
        return {"sums": "of this process"}

    def restore_checkpoint_state(self, state: dict | None, version: int) -> None:
        self.restored.append((state, version))


def test_gradient_state_is_saved_and_restored_only_by_the_owner_of_the_slow_gear():
    cpu = torch.device("cpu")
    publisher = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 4))
    channel = MemoryChannel()
    channel.publish(publisher, 7)

    # external slow gear: the leader discards the gradient state and resets the channel to
    # its own backbone, above every version published before; the others take that version
    sink = RecordingSink()
    leader = Gear(tiny_backbone(), None, sink, cpu, weights=channel, sync_every=2)
    other_sink = RecordingSink()
    other = Gear(tiny_backbone(), None, other_sink, cpu, weights=channel, sync_every=2,
                 leader=False)
    own = {k: v.clone() for k, v in leader.backbone.state_dict().items()}
    leader.begin(None)
    assert sink.restored == [(None, -1)] and leader.version == 8
    assert channel.published_version() == 8
    assert all(torch.equal(v, own[k]) for k, v in channel.published[0].items())
    other.begin(None)
    assert other_sink.restored == [] and other.version == 0
    other.sync()
    assert other.version == 8
    assert leader.state_dict()["accumulator"] is None
    channel.publish(publisher, 9)
    leader.backward(torch.arange(2), torch.zeros(2, 4), lr=1.0)
    assert leader.version == 8  # the next sync is at step 2
    leader.backward(torch.arange(2), torch.zeros(2, 4), lr=1.0)
    assert leader.version == 9 and sink.added == [8, 8]
    assert all(torch.equal(v, publisher.state_dict()[k])
               for k, v in leader.backbone.state_dict().items())
    # a rollback to a checkpoint of version 3 restarts the job from that backbone at 10
    leader.begin({**leader.state_dict(), "version": 3})
    assert sink.restored[1] == (None, 3) and leader.version == 10
    assert channel.published_version() == 10

    # in-process slow gear: this process owns the gradient state and restores it
    sink, source = RecordingSink(), MemoryGradientAccumulator(4, m=1)
    backbone = tiny_backbone()
    slow = SlowGear(backbone, torch.optim.SGD(backbone.parameters(), lr=0.0), [], cpu)
    local = Gear(backbone, None, sink, cpu, slow=(slow, source))
    local.begin(None)
    assert sink.restored == [(None, -1)]
    state = local.state_dict()
    assert state["accumulator"] == {"sums": "of this process"}
    local.begin({**state, "version": 5})
    assert sink.restored[1] == ({"sums": "of this process"}, 5) and local.version == 5


def test_external_slow_gear_follows_a_reset_and_never_publishes_over_it():
    cpu = torch.device("cpu")
    backbone = tiny_backbone()
    # momentum: a slow gear that kept its optimizer state across the reset would be caught
    optimizer = torch.optim.SGD(backbone.parameters(), lr=0.0, momentum=0.9)
    imgs = tiny_images(8)
    data = [(i, img, 0) for i, img in enumerate(imgs)]
    source = MemoryGradientAccumulator(4, m=1)
    channel = MemoryChannel()
    slow = SlowGear(backbone, optimizer, data, cpu)
    grads = {name: torch.randn(2, 4, generator=torch.Generator().manual_seed(n))
             for n, name in enumerate("ABCDE")}
    ids = {"A": [0, 1], "B": [2, 3], "C": [4, 5], "D": [6, 7], "E": [1, 6]}
    checkpoint = tiny_backbone()
    calls = [0]

    def feed(name: str, version: int = 0) -> None:
        source.add(torch.tensor(ids[name]), grads[name], version)

    def script() -> bool:  # called once a round, after that round's read, before its apply
        calls[0] += 1
        if calls[0] == 1:
            feed("B")
        elif calls[0] == 2:  # A applied: this is the backbone the trainers will go back to
            checkpoint.load_state_dict(backbone.state_dict())
            feed("C")
        elif calls[0] == 3:  # B applied and published as 2; the trainers roll back now
            assert channel.published_version() == 2
            assert channel.reset(checkpoint, 1) == 3
            feed("D", 2)  # late, from the discarded steps
            feed("E", 3)  # from a trainer on the reset backbone
        elif calls[0] == 4:  # C was applied on the old timeline; its publication was refused
            assert channel.published_version() == 3
        return calls[0] >= 4

    feed("A")
    steps = run_slow_worker(slow, source, channel, SlowGearGroup(), start=-1,
                            lr_at_step=lambda step: 0.5, publish_every=1, should_stop=script)
    # A, B, C on the old timeline; then D and E are read in the round that sees the reset:
    # D is stale and dropped, E is applied to the reset backbone
    assert steps == 4 and slow.counts.resets == 1 and slow.counts.stale == 2
    assert slow.version == 4 and channel.published_version() == 4
    # E alone on the checkpoint's weights with fresh momentum: one plain SGD step, float64
    before = {k: v.double() for k, v in checkpoint.state_dict().items()}
    x = images_to_input(imgs[ids["E"]]).view(2, 16).double()
    g = grads["E"].double()
    for state in (backbone.state_dict(), channel.published[0]):
        np.testing.assert_allclose(state["1.weight"].double(),
                                   before["1.weight"] - 0.5 * g.T @ x, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state["1.bias"].double(), before["1.bias"] - 0.5 * g.sum(0),
                                   rtol=1e-5, atol=1e-6)


def test_gear_state_round_trip_restores_cache_and_accumulator():
    cpu = torch.device("cpu")
    imgs = tiny_images(6)
    data = [(i, img, 0) for i, img in enumerate(imgs)]

    def make() -> Gear:
        backbone = tiny_backbone()
        acc = MemoryGradientAccumulator(4, m=2)
        slow = SlowGear(backbone, torch.optim.SGD(backbone.parameters(), lr=0.0), data, cpu)
        return Gear(backbone, MemoryFeatureCache(4, 1 << 16, ttl_s=1e6), acc, cpu,
                    slow=(slow, acc))

    first = make()
    first.begin(None)
    ids = torch.tensor([0, 1, 2, 0])  # sample 0 reaches m=2: one mean applied, one step
    feats = first.features(ids, imgs[ids])
    first.backward(ids, torch.ones(4, 4), lr=0.1)
    second = make()
    second.begin(first.state_dict())
    assert second.version == first.version == 1 and second.counts == first.counts
    hit_feats, hit = second.cache.get(torch.arange(3))
    assert hit.all()
    # float16 entries of what the first gear computed
    torch.testing.assert_close(hit_feats, feats[:3].half().float())
    state = second.accumulator.checkpoint_state()
    assert state["ids"][state["counts"] > 0].tolist() == [1, 2]
    np.testing.assert_array_equal(state["sums"][state["counts"] > 0], np.ones((2, 4)))

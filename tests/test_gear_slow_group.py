"""Data-parallel slow gear: ranks with uneven (even empty) batches step one backbone together.

The unit test runs two real gloo processes against a float64 SGD reference; the integration test
runs ``xcls gear slow`` under torchrun with a real Redis and checks every mean is applied once.
"""

from __future__ import annotations

import re
import subprocess
import sys
import uuid

import numpy as np
import torch
import torch.multiprocessing as mp
from torch import nn

from bridge import GradientBatch, WeightStore, weights_digest
from bridge.redis_accumulator import RedisGradientAccumulator, stream_key
from tests.conftest import free_port, set_torchrun_env
from workers.backbones import build_backbone
from workers.distributed import process_group
from workers.gear import SlowGear, SlowGearGroup, follow_reset
from workers.predict import images_to_input

DIM, LR, MOMENTUM, DECAY = 3, 0.05, 0.9, 1e-3
# round -> rank -> sample ids that rank applies; rank 1 has nothing in round 0, rank 0 in round 1
ROUNDS = [{0: [0, 1, 2], 1: []}, {0: [], 1: [3, 4]}, {0: [5], 1: [6, 7]}]


def images(n: int) -> torch.Tensor:
    return torch.arange(n * 16, dtype=torch.int64).remainder(251).to(torch.uint8).view(n, 1, 4, 4)


def mean_grads(n: int) -> torch.Tensor:
    return torch.linspace(-1, 1, n * DIM).view(n, DIM)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(16, DIM))


def _rank_main(rank: int, world: int, port: int, out: str) -> None:
    set_torchrun_env(rank, world, port)
    with process_group(world, torch.device("cpu")):
        _group_rounds(rank, world, out)


def _group_rounds(rank: int, world: int, out: str) -> None:
    torch.manual_seed(100 + rank)  # different initial weights: the group must align them
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, DIM))
    group = SlowGearGroup(rank, world)
    if rank == 0:
        model.load_state_dict(make_model().state_dict())
    group.broadcast_state(model)
    # lr=0: the step must take the rate apply is given, not the optimizer's own
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=MOMENTUM, weight_decay=DECAY)
    data = [(i, img, 0) for i, img in enumerate(images(8))]
    slow = SlowGear(model, optimizer, data, torch.device("cpu"), group=group)
    grads = mean_grads(8)
    for plan in ROUNDS:
        ids = torch.tensor(plan[rank], dtype=torch.int64)
        slow.apply(GradientBatch(ids, grads[ids], torch.zeros_like(ids), []), LR)
    torch.save({"state": model.state_dict(), "version": slow.version}, f"{out}/rank{rank}.pt")


def test_group_step_equals_one_process_on_all_means(tmp_path):
    mp.spawn(_rank_main, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    # float64 reference: one process, SGD with momentum and weight decay, each round's gradient
    # the sum over every rank's samples of dL/dX back through y = W x + b
    ref = {k: v.double() for k, v in make_model().state_dict().items()}
    x = images_to_input(images(8)).view(8, 16).double()
    g = mean_grads(8).double()
    buf: dict[str, torch.Tensor] = {}
    for plan in ROUNDS:
        ids = torch.tensor(plan[0] + plan[1])
        grad = {"1.weight": g[ids].T @ x[ids], "1.bias": g[ids].sum(0)}
        for name, d_p in grad.items():
            d_p = d_p + DECAY * ref[name]
            buf[name] = d_p if name not in buf else MOMENTUM * buf[name] + d_p
            ref[name] = ref[name] - LR * buf[name]
    for result in results:
        assert result["version"] == len(ROUNDS)
        for name, value in ref.items():
            np.testing.assert_allclose(result["state"][name].numpy(), value.numpy(),
                                       rtol=1e-5, atol=1e-6)
    for name in ref:  # and bit-identical across the ranks
        assert torch.equal(results[0]["state"][name], results[1]["state"][name])


class CheckpointWeights:
    """The weights the trainers reset the job to, as rank 0 of a slow group loads them."""

    def __init__(self, version: int) -> None:
        self.version = version

    def load_into(self, model: nn.Module, newer_than: int) -> int | None:
        model.load_state_dict(make_model().state_dict())
        return self.version


def _reset_rank_main(rank: int, world: int, port: int, out: str) -> None:
    set_torchrun_env(rank, world, port)
    with process_group(world, torch.device("cpu")):
        torch.manual_seed(0)
        model = make_model()
        group = SlowGearGroup(rank, world)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=MOMENTUM)
        data = [(i, img, 0) for i, img in enumerate(images(8))]
        slow = SlowGear(model, optimizer, data, torch.device("cpu"), group=group)
        grads = mean_grads(8)
        for plan in ROUNDS:  # the discarded timeline: moves the weights, builds momentum
            ids = torch.tensor(plan[rank], dtype=torch.int64)
            slow.apply(GradientBatch(ids, grads[ids], torch.zeros_like(ids), []), LR)
        # only rank 0 reads the channel; rank 1 must end up with what rank 0 loaded
        version = follow_reset(slow, CheckpointWeights(40) if rank == 0 else None, group)
        ids = torch.tensor(ROUNDS[2][rank], dtype=torch.int64)
        slow.apply(GradientBatch(ids, grads[ids], torch.zeros_like(ids), []), LR)
        torch.save({"state": model.state_dict(), "version": slow.version,
                    "followed": version, "resets": slow.counts.resets}, f"{out}/rank{rank}.pt")


def test_group_follows_a_reset_together(tmp_path):
    mp.spawn(_reset_rank_main, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    # float64: the reset weights, one plain SGD step (momentum started over) on round 2's means
    ref = {k: v.double() for k, v in make_model().state_dict().items()}
    x = images_to_input(images(8)).view(8, 16).double()
    g = mean_grads(8).double()
    ids = torch.tensor(ROUNDS[2][0] + ROUNDS[2][1])
    expected = {"1.weight": ref["1.weight"] - LR * g[ids].T @ x[ids],
                "1.bias": ref["1.bias"] - LR * g[ids].sum(0)}
    for result in results:
        assert (result["followed"], result["version"], result["resets"]) == (40, 41, 1)
        for name, value in expected.items():
            np.testing.assert_allclose(result["state"][name].numpy(), value.numpy(),
                                       rtol=1e-5, atol=1e-6)


def test_torchrun_slow_workers_apply_each_mean_once(glyphs_small, tmp_path, redis_server):
    from tests.test_gear import overrides, redis_sets

    prefix = f"ddp{uuid.uuid4().hex[:8]}"
    client = redis_server.client()
    dim, n = 64, 150
    # 150 ready means (m=1) of real samples, queued before the workers start
    acc = RedisGradientAccumulator(client, dim, 1, prefix)
    rng = np.random.default_rng(0)
    acc.add(np.arange(n), rng.standard_normal((n, dim)).astype(np.float32) * 1e-2, version=0)
    sets = overrides(glyphs_small, tmp_path / "run", **{
        "gear.slow": "external", "gear.slow_batch": 16, "gear.publish_every": 3,
        "data.test": "", "train.threads": 1, **redis_sets(redis_server, prefix)})
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "xcls", "gear", "slow", "/dev/null", "--idle-exit", "3", "--block-ms", "100",
         *sum((["--set", s] for s in sets), [])],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = re.findall(r"slow gear rank (\d)/2: (\d+) backbone steps, (\d+) means applied, "
                       r"(\d+) rejected, (\d+) malformed, 0 resets followed, version (\d+), "
                       r"weights (\w+)", proc.stdout)
    assert len(lines) == 2, proc.stdout
    steps, applied, versions, digests = ({line[i] for line in lines} for i in (1, 2, 5, 6))
    # both ranks stepped together and hold the same weights; each mean applied exactly once
    assert len(steps) == 1 and len(versions) == 1 and len(digests) == 1, lines
    assert sum(int(line[2]) for line in lines) == n
    assert all(int(line[2]) > 0 for line in lines), "one rank did all the work"
    assert client.xlen(stream_key(prefix)) == 0
    assert client.xpending(stream_key(prefix), "slow_gear")["pending"] == 0
    # rank 0 published the final weights, which are the group's
    store = WeightStore(client, prefix)
    version = int(versions.pop())
    assert store.published_version() == version
    # the ranks read 16 each per round and step once per round: fewer steps than one reader
    assert -(-n // 32) <= version < -(-n // 16)
    model = build_backbone("resnet_small", dim, 1, 24)
    assert store.load_into(model, -1) == version
    assert weights_digest(model) == digests.pop()
    client.close()

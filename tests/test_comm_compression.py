"""workers.comm.compression: the error-feedback invariant in float64, and the DDP hook on two
real gloo processes against DDP's own dense all-reduce and an uninterrupted run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.conftest import free_port, set_torchrun_env
from workers.comm.compression import TopkCompressor, error_feedback_step, warmup_density
from workers.distributed import process_group


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_what_was_sent_plus_the_residual_is_every_velocity(momentum):
    """sum_t sent_t + v_T == sum_t u_t, where u_t = m * (u_{t-1} with the sent entries
    cleared) + g_t: nothing is lost, only delayed (with m = 0, u_t is the gradient)."""
    g = torch.Generator().manual_seed(0)
    n, k, steps = 5_000, 50, 12
    u, v = torch.zeros(n), torch.zeros(n)
    sent, velocities = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    u_ref = torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        grad = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4
        u_ref = momentum * u_ref + grad.double()
        velocities += u_ref
        ids, values = error_feedback_step(u, v, grad, k, momentum)
        assert ids.numel() == k and ids.unique().numel() == k
        assert torch.equal(values, values.to(torch.bfloat16).float())  # what bf16 carries
        sent[ids] += values.double()
        u_ref[ids] = 0.0  # momentum factor masking
        # the k entries of largest accumulated magnitude were the ones sent
        assert float(v.abs().max()) <= float(values.abs().min()) * 1.01 + 1e-6
    torch.testing.assert_close(sent + v.double(), velocities, rtol=1e-5, atol=1e-5)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # 64*64 and 64*8 weights go sparse; the biases (64, 8) stay under dense_below
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 8))


def _batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    teacher = torch.randn(32, 8, generator=torch.Generator().manual_seed(7))
    out = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        out.append((x, (x @ teacher).argmax(dim=1)))
    return out


def _train(rank: int, steps: int, start: int, *, compressor_args: dict | None,
           momentum: float, weight_decay: float = 0.0, state: dict | None = None
           ) -> tuple[nn.Module, dict, list[float]]:
    model = _model(1)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets
    compressor = None
    if compressor_args is not None:
        compressor = TopkCompressor(model, momentum=momentum, weight_decay=weight_decay,
                                    dense_below=100, **compressor_args)
        ddp.register_comm_hook(None, compressor.hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2,
                                momentum=0.0 if compressor else momentum,
                                weight_decay=0.0 if compressor else weight_decay)
    if state is not None:
        model.load_state_dict(state["model"])
        compressor.load_state_dict(state["comm"])
    losses = []
    for x, y in _batches(rank, start + steps)[start:]:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    comm = compressor.state_dict() if compressor else {}
    return model, {"model": model.state_dict(), "comm": comm,
                   "counters": vars(compressor.counters) if compressor else {}}, losses


def _ranks_first(rank: int, world: int, port: int, out: dict) -> None:
    set_torchrun_env(rank, world, port)
    with process_group(world, torch.device("cpu")):
        dense, _, _ = _train(rank, 5, 0, compressor_args=None, momentum=0.9, weight_decay=0.05)
        hooked, _, _ = _train(rank, 5, 0, compressor_args={"density": 1.0}, momentum=0.9,
                              weight_decay=0.05)
        args = {"density": 0.05, "warmup_steps": 3}
        whole, _, losses = _train(rank, 40, 0, compressor_args=args, momentum=0.9)
        _, half, _ = _train(rank, 20, 0, compressor_args=args, momentum=0.9)
    out[rank] = {"dense": dense.state_dict(), "hooked": hooked.state_dict(),
                 "whole": whole.state_dict(), "losses": losses, "half": half}


def _ranks_resume(rank: int, world: int, port: int, first: dict, out: dict) -> None:
    set_torchrun_env(rank, world, port)
    with process_group(world, torch.device("cpu")):
        resumed, _, _ = _train(rank, 20, 20, compressor_args={"density": 0.05, "warmup_steps": 3},
                               momentum=0.9, state=first[rank]["half"])
    out[rank] = resumed.state_dict()


def test_the_hook_on_two_gloo_ranks():
    manager = mp.Manager()
    first = manager.dict()
    mp.spawn(_ranks_first, args=(2, free_port(), first), nprocs=2, join=True)
    first = dict(first)
    for rank in (0, 1):
        r = first[rank]
        # density 1: DDP's dense all-reduce and SGD with momentum and weight decay, both now
        # in the hook, SGD without them
        for name, tensor in r["dense"].items():
            torch.testing.assert_close(r["hooked"][name], tensor, rtol=0, atol=1e-6)
        # the ranks hold the same weights: every rank applied the same averaged sparse sums
        for name, tensor in r["whole"].items():
            assert torch.equal(tensor, first[0]["whole"][name]), name
        losses = r["losses"]
        assert sum(losses[-10:]) < 0.7 * sum(losses[:10]), losses

    # bytes: sparse layers ceil(d n) entries of 6 bytes, dense layers 4 bytes an entry; the
    # warm-up's density d falls from 1 (sent dense) through 0.05^(1/3) and 0.05^(2/3) to 0.05
    sparse_n, dense_n = (32 * 64, 64 * 64, 64 * 8), (64, 64, 8)
    per_step_dense = (sum(sparse_n) + sum(dense_n)) * 4
    densities = [0.05 ** (1 / 3), 0.05 ** (2 / 3)] + [0.05] * 17
    sent = per_step_dense + sum(sum(math.ceil(d * n) * 6 for n in sparse_n) + sum(dense_n) * 4
                                for d in densities)
    counters = first[0]["half"]["counters"]
    assert counters["steps"] == 20
    assert counters["bytes_sent"] == sent
    assert counters["dense_bytes"] == 20 * per_step_dense

    resumed = manager.dict()
    mp.spawn(_ranks_resume, args=(2, free_port(), first, resumed), nprocs=2, join=True)
    for rank in (0, 1):
        for name, tensor in resumed[rank].items():
            assert torch.equal(tensor, first[rank]["whole"][name]), name


def test_the_warmup_density_falls_geometrically_to_the_density():
    assert warmup_density(0, 0.01, 100) == 1.0
    assert warmup_density(50, 0.01, 100) == pytest.approx(0.1)  # halfway: sqrt(0.01)
    assert warmup_density(99, 0.01, 100) == pytest.approx(0.01 * 100 ** (1 / 100))
    assert warmup_density(100, 0.01, 100) == warmup_density(10**6, 0.01, 100) == 0.01
    assert warmup_density(0, 0.01, 0) == 0.01  # no warm-up: sparse from the first step


def test_bad_settings_are_refused():
    model = _model(0)
    for kwargs, match in [({"density": 0.0}, "density"), ({"density": 1.5}, "density"),
                          ({"density": 0.1, "momentum": 1.0}, "momentum"),
                          ({"density": 0.1, "warmup_steps": -1}, "warmup_steps"),
                          ({"density": 0.1, "weight_decay": -0.1}, "weight_decay"),
                          ({"density": 0.1, "weight_decay": float("nan")}, "weight_decay")]:
        with pytest.raises(ValueError, match=match):
            TopkCompressor(model, **kwargs)
    compressor = TopkCompressor(model, density=0.1)
    with pytest.raises(ValueError, match="lacks"):
        compressor.load_state_dict({"step": 3, "velocity": {"nope": torch.zeros(3)},
                                    "residual": {}})


def test_run_assembly_refuses_what_compression_cannot_take():
    from xcls.config import ConfigError, load_config
    from xcls.run import build_compressor

    model = _model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    topk = ["comm.compression=topk"]
    with pytest.raises(ConfigError, match="gear mode"):
        build_compressor(load_config(None, [*topk, "gear.enabled=true"]), model, model,
                         optimizer, cpu)
    with pytest.raises(ConfigError, match="train.amp=false"):
        build_compressor(load_config(None, topk), model, model, optimizer, cuda)
    with pytest.raises(ConfigError, match="optim.name=sgd"):
        build_compressor(load_config(None, [*topk, "optim.name=lars"]), model, model,
                         optimizer, cpu)
    # a lone worker sends nothing: no hook, and the optimizer keeps its momentum
    assert build_compressor(load_config(None, topk), model, model, optimizer, cpu) is None
    assert optimizer.param_groups[0]["momentum"] == 0.9

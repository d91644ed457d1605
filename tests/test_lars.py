"""workers.lars against a float64 loop written from the LARS update rule, and its exclusions."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.lars import LARS, lars_param_groups


def reference_steps(weights: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]],
                    lr: float, momentum: float, decay: float, eta: float
                    ) -> dict[str, torch.Tensor]:
    """Float64 LARS: 1-d tensors plain momentum SGD without decay, the rest trust-scaled."""
    w = {k: v.double().clone() for k, v in weights.items()}
    buf: dict[str, torch.Tensor] = {}
    for step in grads:
        for k, g in step.items():
            g = g.double()
            if w[k].dim() <= 1:
                d = g
            else:
                wn, gn = w[k].norm().item(), g.norm().item()
                trust = eta * wn / (gn + decay * wn) if wn > 0 and gn > 0 else 1.0
                d = trust * (g + decay * w[k])
            buf[k] = d if k not in buf else momentum * buf[k] + d
            w[k] = w[k] - lr * buf[k]
    return w


def test_lars_follows_the_trust_ratio_rule_and_excludes_biases_and_norms():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    lr, momentum, decay, eta = 2.0, 0.9, 5e-4, 0.02
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = LARS(lars_param_groups(model, decay), lr=lr, momentum=momentum,
                     weight_decay=decay, eta=eta)
    g = torch.Generator().manual_seed(1)
    grads = [{k: torch.randn(v.shape, generator=g) * (1 + t) for k, v in start.items()}
             for t in range(3)]
    for step in grads:
        for k, p in model.named_parameters():
            p.grad = step[k].clone()
        optimizer.step()
    want = reference_steps(start, grads, lr, momentum, decay, eta)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.detach().double(), want[k], rtol=1e-5, atol=1e-6)


def test_a_zero_weight_or_gradient_keeps_the_global_rate():
    w = nn.Parameter(torch.zeros(3, 2))
    optimizer = LARS([w], lr=0.5, momentum=0.0, eta=1e-3)
    w.grad = torch.ones(3, 2)
    optimizer.step()
    torch.testing.assert_close(w.detach(), torch.full((3, 2), -0.5))
    w.grad = torch.zeros(3, 2)
    optimizer.step()  # no gradient, no move, no division by zero
    assert bool(torch.isfinite(w).all()) and torch.equal(w.detach(), torch.full((3, 2), -0.5))


@pytest.mark.parametrize("kwargs", [{"lr": -1.0}, {"lr": 0.1, "momentum": 1.0},
                                    {"lr": 0.1, "weight_decay": -1e-4}, {"lr": 0.1, "eta": 0.0}])
def test_bad_hyperparameters_are_refused(kwargs):
    with pytest.raises(ValueError, match="need lr >= 0"):
        LARS([nn.Parameter(torch.ones(2, 2))], **kwargs)


def test_the_config_picks_lars_with_its_exclusions():
    from workers.data.lmdb_dataset import DatasetMetadata
    from xcls.config import ConfigError, load_config
    from xcls.run import build_backbone_and_optimizer

    meta = DatasetMetadata(num_samples=8, num_classes=4, height=16, width=16, channels=1,
                           split="train", class_names=["a", "b", "c", "d"])
    cfg = load_config(None, ["optim.name=lars", "optim.lars_eta=0.01", "model.dim=8"])
    _, optimizer = build_backbone_and_optimizer(cfg, meta, torch.device("cpu"))
    assert isinstance(optimizer, LARS)
    weights, excluded = optimizer.param_groups
    assert all(p.dim() > 1 for p in weights["params"]) and weights["eta"] == 0.01
    assert all(p.dim() <= 1 for p in excluded["params"]) and excluded["weight_decay"] == 0.0
    for bad in (["optim.name=adam"], ["optim.lars_eta=0"]):
        with pytest.raises(ConfigError, match="optim"):
            load_config(None, bad)

"""LARS: SGD whose step of each weight tensor is scaled by its trust ratio (layer-wise adaptive
rate scaling; You, Gitman and Ginsburg 2017; docs/references.md).

With large data-parallel batches one global learning rate is too large for some layers and too
small for others; LARS gives each tensor ``w`` the local rate
``eta * |w| / (|g| + weight_decay * |w|)`` times the global one, so every layer moves by about
the same fraction of its norm per step. Biases and normalization parameters (tensors of at most
one dimension) are excluded as usual: no weight decay and no trust ratio, plain momentum SGD.

Per tensor, with ``d = g + weight_decay * w``::

    trust = eta * |w| / (|g| + weight_decay * |w|)   (1 when |w| or |g| is 0, or excluded)
    v <- momentum * v + trust * d
    w <- w - lr * v
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn


def lars_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The model's parameters in two groups: weights (decayed, trust-scaled) and the tensors
    of at most one dimension, biases and norms (``weight_decay`` 0, ``lars_exclude``)."""
    weights, excluded = [], []
    for p in model.parameters():
        if p.requires_grad:
            (excluded if p.dim() <= 1 else weights).append(p)
    return [{"params": weights, "weight_decay": weight_decay, "lars_exclude": False},
            {"params": excluded, "weight_decay": 0.0, "lars_exclude": True}]


class LARS(torch.optim.Optimizer):
    """Momentum SGD with layer-wise trust ratios (module docstring).

    params: tensors or groups (``lars_param_groups``; a group's ``lars_exclude`` turns the
    trust ratio off); lr: the global rate; momentum in [0, 1); weight_decay >= 0;
    eta > 0: the trust coefficient. The momentum buffer is kept per tensor as in SGD, under
    ``state[p]["momentum_buffer"]``.
    """

    def __init__(self, params: Iterable, lr: float, momentum: float = 0.9,
                 weight_decay: float = 0.0, eta: float = 0.001) -> None:
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0 or eta <= 0:
            raise ValueError(f"need lr >= 0, 0 <= momentum < 1, weight_decay >= 0 and eta > 0; "
                             f"got lr={lr}, momentum={momentum}, weight_decay={weight_decay}, "
                             f"eta={eta}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                                  "eta": eta, "lars_exclude": False})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            decay, momentum = group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                update = grad.add(p, alpha=decay) if decay else grad.clone()
                if not group["lars_exclude"]:
                    w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(grad)
                    trust = group["eta"] * w_norm / (g_norm + decay * w_norm)
                    # a fresh (zero) tensor or a zero gradient keeps the global rate
                    update.mul_(torch.where((w_norm > 0) & (g_norm > 0), trust,
                                            torch.ones_like(trust)))
                if momentum:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        state["momentum_buffer"] = buf = update
                    else:
                        buf.mul_(momentum).add_(update)
                    update = buf
                p.add_(update, alpha=-group["lr"])
        return loss

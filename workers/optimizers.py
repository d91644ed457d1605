"""The backbone's optimizer, chosen by name: momentum SGD, or LARS for large global batches."""

from __future__ import annotations

from enum import StrEnum

import torch
from torch import nn

from workers.lars import LARS, lars_param_groups


class OptimizerKind(StrEnum):
    """How the backbone's weights step."""

    SGD = "sgd"  # momentum SGD with weight decay on every tensor
    LARS = "lars"  # momentum SGD scaled per tensor by its trust ratio (workers.lars)


def build_optimizer(kind: OptimizerKind | str, backbone: nn.Module, *, lr: float,
                    momentum: float, weight_decay: float,
                    lars_eta: float) -> torch.optim.Optimizer:
    """The optimizer ``kind`` over ``backbone``'s parameters. LARS, with trust coefficient
    ``lars_eta``, leaves biases and norms without weight decay and trust ratio
    (``lars_param_groups``); SGD decays every tensor."""
    if kind == OptimizerKind.LARS:
        return LARS(lars_param_groups(backbone, weight_decay), lr=lr, momentum=momentum,
                    weight_decay=weight_decay, eta=lars_eta)
    if kind == OptimizerKind.SGD:
        return torch.optim.SGD(backbone.parameters(), lr=lr, momentum=momentum,
                               weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {kind!r}; known optimizers: {', '.join(OptimizerKind)}")

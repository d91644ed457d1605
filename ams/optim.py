"""Server-side sparse optimizers: the update touches exactly the pushed rows and their state.

Pure torch. The state lives next to the row (same local position in a tensor of the same
shape), so a pull of W never needs the state and a push reads both with one gather each.
"""

from __future__ import annotations

import torch


class SparseMomentumSGD:
    """Momentum SGD with L2 weight decay on a subset of rows, equal to ``torch.optim.SGD``
    (dampening 0, no Nesterov) restricted to those rows:

        v <- momentum * v + (g + weight_decay * w);   w <- w - lr * v

    With momentum 0 there is no v: the state tensor has no columns and is left alone.
    Low-precision rows and state are widened to float32 for the arithmetic and rounded once.
    """

    def __init__(self, momentum: float, weight_decay: float) -> None:
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)

    def apply(self, rows: torch.Tensor, state: torch.Tensor, positions: torch.Tensor,
              grads: torch.Tensor, lr: float) -> None:
        """Update in place.

        rows: (n_local, dim) rows of the shard; state: (n_local, dim) momentum, or
        (n_local, 0) when momentum is 0; positions: int64 (m,) unique local positions;
        grads: float32 (m, dim), already summed over repeated ids; lr: float.
        """
        w = rows.index_select(0, positions).to(torch.float32)
        g = grads.to(torch.float32)
        if self.weight_decay:
            g = g + self.weight_decay * w
        if self.momentum:
            v = state.index_select(0, positions).to(torch.float32)
            g = v.mul_(self.momentum).add_(g)
            state.index_copy_(0, positions, g.to(state.dtype))
        w.sub_(lr * g)
        rows.index_copy_(0, positions, w.to(rows.dtype))

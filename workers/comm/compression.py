"""Layer-wise top-k gradient compression for DistributedDataParallel, as in deep gradient
compression (Lin et al., 2017) and the KNN-softmax paper's layer-wise sparsification.

Each rank sends, per layer, only the entries of largest magnitude (``density`` of them) as
(index, value) pairs; every rank gathers all ranks' pairs and sums them into the averaged
gradient. What a rank did not send is kept and added next step (error feedback), so nothing
is lost, only delayed. Momentum moves from the optimizer into the hook (momentum correction):
each rank keeps a local velocity u = m·u + g and accumulates it, v = v + u; the top-k of |v|
is sent, and the sent entries of both v and u are cleared (momentum factor masking: a
delayed entry does not also carry stale momentum). Weight decay moves along with it: g is the
local gradient plus ``weight_decay``·w, as SGD adds it before its momentum (the decay would
otherwise skip the momentum and act 1/(1-m) times weaker). The optimizer must then run without
momentum and weight decay; ``xcls`` builds it so.

Over the first ``warmup_steps`` steps the density falls geometrically from 1 to ``density``
(``warmup_density``; deep gradient compression's exponential warm-up), so training starts
dense and thins its messages while the weights settle. Layers below ``dense_below`` entries
(biases, norms), and every layer in a step whose density is at least ``DENSE_FROM``, are
all-reduced densely and take their momentum after averaging, which is exactly SGD with
momentum and weight decay; a density of 1 sends everything densely.

Values travel as bfloat16 (fp32's range, so a large gradient cannot overflow). The rounding
error stays in the residual v, so what was sent plus the residual is still exactly the sum
of the velocities. Indices travel as int32 offsets into the DDP bucket. At density 1 % a
sparse layer costs 6 bytes per sent entry against 4 bytes per entry dense, 67x fewer bytes.

Use::

    ddp = DistributedDataParallel(model)
    compressor = TopkCompressor(model, density=0.01, momentum=0.9, weight_decay=5e-4)
    ddp.register_comm_hook(None, compressor.hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.0, weight_decay=0.0)
"""

# No "from __future__ import annotations": DDP checks the hook's annotations as objects.
import math
from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.distributed as dist
from torch import Tensor, nn

from workers.comm.topk_selection import topk

# a sent entry costs 6 bytes (int32 offset, bfloat16 value), a dense one 4: from this density
# on, the dense all-reduce is the smaller message, and exact
DENSE_FROM = 2 / 3


def warmup_density(step: int, density: float, warmup_steps: int) -> float:
    """Share of a sparse layer's entries sent in ``step`` (0-based): 1 at step 0, falling
    geometrically to ``density`` at ``warmup_steps`` (``density ** (step / warmup_steps)``),
    then ``density``."""
    if step >= warmup_steps:
        return density
    return density ** (step / warmup_steps)


class Compression(StrEnum):
    """How the backbone's gradients travel between data-parallel ranks."""

    NONE = "none"  # DDP's dense all-reduce
    TOPK = "topk"  # each layer's largest entries with error feedback (TopkCompressor)


@dataclass
class CommCounters:
    """Bytes this rank handed to collectives since start, and what dense all-reduces of the
    same gradients would have handed over (4 bytes an entry)."""

    bytes_sent: int = 0
    dense_bytes: int = 0
    steps: int = 0


def error_feedback_step(u: Tensor, v: Tensor, grad: Tensor, k: int, momentum: float
                        ) -> tuple[Tensor, Tensor]:
    """One layer's selection on one rank, in place on its state.

    u (n,) float32 velocity and v (n,) float32 residual are updated: u = m·u + grad,
    v = v + u; then the k entries of largest |v| are taken, their bfloat16-rounded values
    leave v (the rounding stays in it) and their velocity is cleared.

    Returns (indices (k,) int64, values (k,) float32: exactly what is sent, bfloat16 values).
    """
    u.mul_(momentum).add_(grad)
    v.add_(u)
    _, indices = topk(v.abs(), k)
    values = v[indices].to(torch.bfloat16).float()
    v[indices] -= values
    u[indices] = 0.0
    return indices, values


class TopkCompressor:
    """DDP communication hook state: per-parameter velocity and residual of this rank.

    model: the module DDP wraps (parameters are keyed by their names in it); density: share
    of each sparse layer's entries sent per step, in (0, 1]; momentum: the backbone's SGD
    momentum, applied here instead of in the optimizer; weight_decay: the backbone's SGD
    weight decay, every parameter's, likewise added here; warmup_steps: steps over which the
    density falls from 1 to ``density`` (``warmup_density``);
    dense_below: layers with fewer entries always go dense. The ranks are those of the
    default process group.
    """

    def __init__(self, model: nn.Module, *, density: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, warmup_steps: int = 0,
                 dense_below: int = 128) -> None:
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density={density} must be in (0, 1]")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum} must be in [0, 1)")
        if not 0.0 <= weight_decay < math.inf:
            raise ValueError(f"weight_decay={weight_decay} must be a finite number >= 0")
        if warmup_steps < 0 or dense_below < 0:
            raise ValueError(f"warmup_steps={warmup_steps} and dense_below={dense_below} "
                             "must be >= 0")
        self.density, self.momentum, self.weight_decay = density, momentum, weight_decay
        self.warmup_steps, self.dense_below = warmup_steps, dense_below
        self.step = 0  # completed steps; the hook of a step's last bucket advances it
        self.counters = CommCounters()
        self._names = {p: name for name, p in model.named_parameters()}
        self._velocity: dict[str, Tensor] = {}
        self._residual: dict[str, Tensor] = {}

    # ---- the hook -----------------------------------------------------------------------

    def hook(self, _state: object, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """``DistributedDataParallel.register_comm_hook(None, compressor.hook)``: returns a
        future of the bucket's averaged (momentum-corrected) gradient, (n,) like the bucket."""
        buffer = bucket.buffer()
        world = dist.get_world_size()
        density = warmup_density(self.step, self.density, self.warmup_steps)
        dense_phase = density >= DENSE_FROM
        dense: list[tuple[str, int, Tensor]] = []
        sparse_ids: list[Tensor] = []
        sparse_values: list[Tensor] = []
        offset = 0
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            name, n = self._names[param], grad.numel()
            flat = grad.reshape(-1)
            if self.weight_decay:
                flat = flat + self.weight_decay * param.detach().reshape(-1)
            if dense_phase or n < self.dense_below:
                dense.append((name, offset, flat))
            else:
                k = max(1, math.ceil(density * n))
                velocity = self._state(self._velocity, name, flat)
                residual = self._state(self._residual, name, flat)
                ids, values = error_feedback_step(velocity, residual, flat.float(), k,
                                                  self.momentum)
                sparse_ids.append(ids + offset)
                sparse_values.append(values)
            offset += n
        self.counters.dense_bytes += buffer.numel() * 4
        futures = []
        dense_flat = None
        if dense:
            dense_flat = torch.cat([flat for _, _, flat in dense])
            futures.append(dist.all_reduce(dense_flat, async_op=True).get_future())
            self.counters.bytes_sent += dense_flat.numel() * dense_flat.element_size()
        gathered: list[Tensor] = []
        if sparse_ids:
            packet = _pack(torch.cat(sparse_ids), torch.cat(sparse_values))
            gathered = [torch.empty_like(packet) for _ in range(world)]
            futures.append(dist.all_gather(gathered, packet, async_op=True).get_future())
            self.counters.bytes_sent += packet.numel()
        if bucket.is_last():
            self.step += 1
            self.counters.steps += 1

        def average(_: object) -> Tensor:
            out = torch.zeros_like(buffer)
            for packet in gathered:  # rank by rank: the same sums in the same order everywhere
                ids, values = _unpack(packet)
                out[ids] += values.to(out.dtype)
            out /= world
            if dense_flat is not None:
                dense_flat.div_(world)
                start = 0
                for name, at, flat in dense:
                    n = flat.numel()
                    mean = dense_flat[start:start + n]
                    if self.momentum:
                        velocity = self._state(self._velocity, name, flat)
                        velocity.mul_(self.momentum).add_(mean)
                        mean = velocity
                    out[at:at + n] = mean
                    start += n
            return out

        return torch.futures.collect_all(futures).then(average)

    # ---- state --------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's velocities and residuals (CPU tensors by parameter name) and step."""
        return {"step": self.step,
                "velocity": {k: t.cpu() for k, t in self._velocity.items()},
                "residual": {k: t.cpu() for k, t in self._residual.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (tensors move to their parameters' devices)."""
        devices = {name: p.device for p, name in self._names.items()}
        unknown = (set(state["velocity"]) | set(state["residual"])) - set(devices)
        if unknown:
            raise ValueError(f"compression state names parameters the model lacks: "
                             f"{sorted(unknown)[:5]}")
        self.step = int(state["step"])
        self._velocity = {k: t.to(devices[k]) for k, t in state["velocity"].items()}
        self._residual = {k: t.to(devices[k]) for k, t in state["residual"].items()}

    @staticmethod
    def _state(store: dict[str, Tensor], name: str, like: Tensor) -> Tensor:
        tensor = store.get(name)
        if tensor is None:
            tensor = store[name] = torch.zeros(like.numel(), dtype=torch.float32,
                                               device=like.device)
        return tensor


def _pack(ids: Tensor, values: Tensor) -> Tensor:
    """One uint8 packet: int32 bucket offsets (k,), then bfloat16 values (k,)."""
    return torch.cat([ids.to(torch.int32).view(torch.uint8),
                      values.to(torch.bfloat16).view(torch.uint8)])


def _unpack(packet: Tensor) -> tuple[Tensor, Tensor]:
    k = packet.numel() // 6
    return (packet[:4 * k].view(torch.int32).long(),
            packet[4 * k:].view(torch.bfloat16).float())

"""Collective mode (``head.placement = "collective"``): the class rows sharded over the workers.

When W fits the workers' own memory, no parameter server needs to be on the step's path
(PLSC, PartialFC; docs/references.md). Rank r of W holds slice r of the table, the classes
``c % W == r`` with their optimizer state and decay clock, in an in-process shard
(``ams.client.local.LocalShard``: the same store, sparse update and snapshots as an AMS shard). One
step (:meth:`CollectiveHead.forward_backward`):

1. all-gather every rank's labels and features (W·B of each);
2. each rank selects active classes within its slice (``workers.selection.select_in_slice``):
   ``full`` the whole slice, ``partial`` the slice's labels plus uniform negatives up to
   ``sample_rate`` of the slice (PartialFC's scheme), ``knn`` the slice's share of the labels'
   neighbor lists, each list read on the rank that owns its class and all-reduced;
3. it reads those rows from its own shard (on a GPU, from the slice's working copy in GPU
   memory, ``workers.device_slice``) and computes the cosine logits of all W·B features
   against them; the softmax is model-parallel: the row maxima and the sums of exponentials
   are all-reduced, so every rank holds the loss of the global batch;
4. dL/dX is reduce-scattered: each rank receives the sum over slices of its own samples'
   rows (B·dim, where an all-reduce would deliver all W·B·dim); dL/dW of the slice is the
   gradient of the global batch's mean loss, which the rank applies to its own shard (one
   update per row per step, as the AMS applies the rank-0 push).

Between steps (graph builds, snapshots, evaluation, export) the slices are one AMS: every rank
serves its shard over gRPC and the data plane (:class:`CollectiveShards`), so rank 0 builds
the graph with the ring builder, snapshots every slice into one AMS snapshot, and reads the
rows for evaluation exactly as in AMS mode. A snapshot of W slices restores into any other
number of shards, so a resume with another world size reshards the rows.
"""

from __future__ import annotations

import logging
import math
import secrets
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ams.client.connect import join_shards
from ams.client.local import LocalShard
from ams.client.sharded import ShardedClient
from ams.cluster.plan import budget_for_sample_rate
from ams.server.service import RunningServer, create_server
from ams.shard.neighbor_lists import lists_to_dense
from ams.sharding import owned_count
from workers.device_slice import DeviceSlice
from workers.heads import ActiveBatch, HeadKind, HeadStep, RowStore, checked_labels
from workers.losses import CombinedMarginLoss
from workers.selection import Selection, select_in_slice

log = logging.getLogger(__name__)

# torch renamed reduce_scatter_tensor (2.13 warns on every call); older torch builds, which GPU
# hosts may bring, have only the old name
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveHead:
    """Margin softmax over the classes of all ranks' slices, model-parallel.

    store: the client over the slices (:class:`CollectiveShards`' ``client``); this rank reads
    and writes only its own slice through it. ``kind``: full | partial | knn;
    ``sample_rate`` (partial): the share of each slice active per step; ``k``, ``budget``,
    ``random_share`` (knn): as ``workers.heads.build_head``, with ``budget`` counting all
    slices (each slice takes its share of it). ``seed``: the seed of this rank's random
    negatives. ``device_rows``: this rank's slice in the memory of the device it computes on,
    which the head then reads its rows from (None: from ``store``); the trainer's row update
    pushes to it. The same interface as ``workers.heads.ClassifierHead``; every rank calls
    ``forward_backward`` for every step with the same batch size.
    """

    # A slice's row gradient is already the global batch's: each rank applies its own.
    combine_row_grads = False

    def __init__(self, store: RowStore, table: str, num_classes: int,
                 margin: CombinedMarginLoss, kind: HeadKind | str, *, rank: int, world: int,
                 sample_rate: float | None = None, k: int | None = None,
                 budget: int | None = None, random_share: float = 0.0,
                 logq_correction: bool = True, seed: int = 0,
                 device_rows: DeviceSlice | None = None) -> None:
        if kind not in list(HeadKind):
            raise ValueError(f"unknown head {kind!r}; known heads: {', '.join(HeadKind)}")
        if num_classes < world:
            raise ValueError(f"collective mode needs at least one class per rank: "
                             f"{num_classes} classes over {world} ranks")
        self.store, self.table, self.device_rows = store, table, device_rows
        self.num_classes, self.margin, self.kind = num_classes, margin, HeadKind(kind)
        self.rank, self.world = rank, world
        self.slice_size = owned_count(num_classes, rank, world)
        if self.kind == HeadKind.PARTIAL:
            if sample_rate is None:
                raise ValueError("the partial head needs sample_rate")
            self.budget = budget_for_sample_rate(sample_rate, self.slice_size)
        elif self.kind == HeadKind.KNN:
            if k is None or budget is None or k <= 0 or budget <= 0:
                raise ValueError(f"the knn head needs positive k and budget, got k={k}, "
                                 f"budget={budget}")
            self.budget = max(1, math.ceil(budget * self.slice_size / num_classes))
        else:
            self.budget = self.slice_size
        self._slice = torch.arange(rank, num_classes, world, dtype=torch.int64)
        self._no_weight = torch.zeros(self.slice_size, dtype=torch.float32)
        self.k, self.random_share = k, random_share
        self.logq_correction = logq_correction and self.kind != HeadKind.FULL
        self.generator = torch.Generator().manual_seed(seed)

    # ---- the two halves of a step ------------------------------------------------------

    def prepare(self, labels: torch.Tensor) -> ActiveBatch:
        """Check ``labels`` (int64 (B,)) and pass them on: selection needs every rank's labels,
        a collective, so it runs in :meth:`forward_backward` on the trainer's thread, never in
        the prefetch thread. The batch holds only ``target`` = the labels."""
        return self.pull(self.select(labels))

    def select(self, labels: torch.Tensor) -> Selection:
        """``labels`` (int64 (B,)) checked, as the selection's ``target``; no class is chosen
        here (see :meth:`prepare`)."""
        empty = torch.empty(0, dtype=torch.int64)
        return Selection(active=empty, target=checked_labels(labels, self.num_classes),
                         log_weight=torch.empty(0))

    def pull(self, selection: Selection) -> ActiveBatch:
        """The batch of :meth:`select`'s labels; no row is read here (see :meth:`prepare`)."""
        return ActiveBatch(active_ids=selection.active, target=selection.target,
                           rows=torch.empty(0, 0), log_weight=selection.log_weight)

    def forward_backward(self, features: torch.Tensor, batch: ActiveBatch,
                         logq: bool = True) -> HeadStep:
        """One step of the model-parallel softmax; a collective over all ranks.

        features: (B, dim) float, this rank's samples; batch: :meth:`prepare`'s, the labels
        int64 (B,); ``logq`` as in ``ClassifierHead.forward_backward``. Computes in float32,
        or float64 for float64 features.
        Returns ``loss`` and ``accuracy`` of the global batch (equal on every rank),
        ``feature_grad`` (B, dim) the gradient of the mean loss over this rank's samples (as
        ``ClassifierHead`` returns it; DDP's average over ranks makes it the global batch's),
        ``active_ids`` / ``row_grad`` (A_r,) on the CPU, (A_r, dim) float32 on the features'
        device: this slice's active classes and the gradient of the global batch's mean loss
        w.r.t. their rows, and ``num_active`` the active classes of all slices together.
        """
        labels = batch.target
        if features.dim() != 2 or features.shape[0] != labels.shape[0]:
            raise ValueError(f"features must be (B, dim) with B={labels.shape[0]}, "
                             f"got {tuple(features.shape)}")
        device = features.device
        dtype = torch.promote_types(features.dtype, torch.float32)
        all_labels = self._gather(labels.to(device)).cpu()
        selection = self._select(all_labels, device)
        rows = (self.device_rows or self.store).pull(self.table, selection.active)
        if features.shape[1] != rows.shape[1]:
            raise ValueError(f"features have dim {features.shape[1]} but table {self.table!r} "
                             f"rows have dim {rows.shape[1]}")
        with torch.autocast(device_type=device.type, enabled=False):
            x = self._gather(features.detach().to(dtype)).requires_grad_(True)
            w = rows.to(device=device, dtype=dtype).requires_grad_(True)
            target = selection.target.to(device)
            cosine = F.normalize(x, dim=1) @ F.normalize(w, dim=1).t()
            logits = self.margin(cosine, target).to(dtype)
            if self.logq_correction and logq:
                logits = logits + selection.log_weight.to(device=device, dtype=dtype)
            loss, accuracy, num_active, logit_grad = self._softmax(
                logits.detach(), cosine.detach(), target)
            feature_grad, row_grad = torch.autograd.grad(logits, (x, w), logit_grad)
        mine = self._reduce_scatter(feature_grad) * self.world
        return HeadStep(loss=loss, feature_grad=mine.to(features.dtype), accuracy=accuracy,
                        num_active=num_active,
                        row_grad=row_grad.float(), active_ids=selection.active)

    # ---- parts ------------------------------------------------------------------------

    def _select(self, labels: torch.Tensor, device: torch.device | None = None) -> Selection:
        """This slice's active classes for the global batch's labels (W·B,) (CPU; ``device``:
        where the collectives run, the features' device)."""
        if self.kind == HeadKind.FULL:
            # the whole slice, the same every step: no draw, no selection
            own = labels % self.world == self.rank
            target = torch.where(own, labels // self.world, -1)
            return Selection(active=self._slice, target=target, log_weight=self._no_weight)
        neighbors = None
        if self.kind == HeadKind.KNN:
            neighbors = self._neighbor_lists(labels, device)
        return select_in_slice(labels, neighbors, self.budget, self.generator,
                               self.num_classes, self.rank, self.world, self.random_share)

    def _neighbor_lists(self, labels: torch.Tensor, device: torch.device | None
                        ) -> torch.Tensor:
        """The first ``k`` neighbors of every label, int64 (W·B, k), -1 padding: each rank
        reads the lists of the labels in its slice, and a max all-reduce (every other entry
        -1) hands all of them to every rank."""
        own = labels % self.world == self.rank
        lists = torch.full((labels.numel(), self.k), -1, dtype=torch.int64)
        if bool(own.any()):
            # short lists (an IVF graph's) stay -1 padded, as in ClassifierHead's lookup
            lists[own] = lists_to_dense(None, self.store.neighbors(self.table, labels[own]),
                                        self.k)
        # NCCL reduces device tensors only
        return self._all_reduce(lists.to(device or "cpu"), dist.ReduceOp.MAX).cpu()

    def _softmax(self, logits: torch.Tensor, cosine: torch.Tensor, target: torch.Tensor
                 ) -> tuple[float, float, int, torch.Tensor]:
        """Cross-entropy of the global batch over the columns of all slices: (loss, top-1
        accuracy by cosine, active classes of all slices, dL/dlogits of this slice's columns
        (W·B, A_r))."""
        samples = logits.shape[0]
        rows = torch.arange(samples, device=logits.device)
        here = target >= 0
        column = target.clamp(min=0)
        # 1. the largest logit (for a stable exp) and cosine (for accuracy) of each sample
        maxima = torch.stack([logits.max(dim=1).values, cosine.max(dim=1).values.to(logits.dtype)])
        maxima = self._all_reduce(maxima, dist.ReduceOp.MAX)
        shifted = torch.exp(logits - maxima[0, :, None])
        # 2. sums of exponentials, the target logits and whether the target cosine is the
        #    largest, each held by exactly one slice
        target_logit = torch.where(here, logits[rows, column], 0.0)
        correct = here & (cosine[rows, column].to(logits.dtype) >= maxima[1])
        columns = torch.tensor([float(logits.shape[1])], dtype=logits.dtype,
                               device=logits.device)
        packed = self._all_reduce(torch.cat([shifted.sum(dim=1), target_logit,
                                             correct.to(logits.dtype), columns]))
        sums = packed[:-1].view(3, samples)
        loss = (sums[0].log() + maxima[0] - sums[1]).mean()
        grad = shifted / sums[0, :, None]
        grad[rows[here], column[here]] -= 1.0
        return float(loss), float(sums[2].mean()), int(packed[-1]), grad / samples

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (same shape on all) stacked along dim 0, rank order."""
        if self.world == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def _reduce_scatter(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part (rows ``rank·n/W`` to ``(rank+1)·n/W``) of the sum over ranks of
        ``tensor`` (n, ...)."""
        if self.world == 1:
            return tensor
        part = torch.empty((tensor.shape[0] // self.world, *tensor.shape[1:]),
                           dtype=tensor.dtype, device=tensor.device)
        _reduce_scatter_single(part, tensor.contiguous())
        return part

    def _all_reduce(self, tensor: torch.Tensor,
                    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(tensor, op)
        return tensor

    # ---- checkpoint state --------------------------------------------------------------

    def sampler_state(self) -> torch.Tensor:
        """The state of this rank's generator of random negatives (for a checkpoint)."""
        return self.generator.get_state()

    def load_sampler_state(self, state: torch.Tensor | None) -> None:
        """Restore what :meth:`sampler_state` returned."""
        if state is not None:
            self.generator.set_state(state)


class CollectiveShards:
    """This rank's slice of the class rows and the client over all ranks' slices.

    Rank ``rank`` of ``world`` holds shard ``rank`` of ``world`` in process
    (``ams.client.local.LocalShard``; snapshots under ``data_dir``, tables per ``storage`` in
    ``storage_dir``) and serves it on ``host`` (ports chosen free), so rank 0 can build the
    graph, snapshot and evaluate across every slice. The addresses and a fresh token are
    exchanged over the default process group (every rank constructs it at the same time).
    ``client``: ``shards[r]`` is the local slice on rank r, the others are gRPC shards.
    """

    def __init__(self, rank: int, world: int, *, data_dir: Path, keep_snapshots: int,
                 storage: str = "memory", storage_dir: Path | None = None,
                 host: str = "127.0.0.1") -> None:
        self.local = LocalShard(rank, world, data_dir, keep_snapshots, storage, storage_dir)
        self.server: RunningServer | None = None
        if world == 1:
            self.client = ShardedClient([self.local])
            return
        # rank 0's fresh token guards every slice for this run
        box = [secrets.token_hex(16) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        self.server = create_server(self.local.store, host=host, data_dir=data_dir,
                                    token=box[0], keep_snapshots=keep_snapshots, max_workers=4)
        addresses: list = [None] * world
        dist.all_gather_object(addresses, f"{host}:{self.server.port}")
        shards: list = [self.local if r == rank else addresses[r] for r in range(world)]
        self.client = join_shards(shards, token=box[0])
        log.info("collective_slice rank=%d world=%d address=%s", rank, world, addresses[rank])

    def close(self) -> None:
        """Stop serving this slice and close the client (mmap tables stay for a resume)."""
        if self.server is not None:
            self.server.stop(1.0)
        self.client.close()

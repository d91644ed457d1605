"""Classification heads over class rows kept in the AMS: ``full``, ``partial`` and ``knn``.

All three share one step and differ only in which classes are active:

* ``full``: all N classes (the accuracy reference; only for small N),
* ``partial`` (PartialFC): the batch labels plus uniform random negatives, ``sample_rate * N``
  classes in all,
* ``knn``: the batch labels plus their ``k`` nearest neighbors in normalized-W space, filled or
  cut to ``budget`` classes.

A step is split in two so the trainer's prefetch thread can run the first half one step ahead:

1. :meth:`ClassifierHead.prepare` (labels -> :class:`ActiveBatch`): select the active classes
   (:meth:`ClassifierHead.select`, which reads no row) and pull their rows
   (:meth:`ClassifierHead.pull`). Only talks to the AMS; safe to run in another thread while the
   previous batch is in ``forward_backward``; the prefetch thread selects while the previous
   push is still being applied and pulls once it is.
2. :meth:`ClassifierHead.forward_backward` (features, batch -> :class:`HeadStep`): normalize
   features and rows, cosine logits, margin, cross-entropy, backward; hand back dL/dX for the
   backbone and dL/dW of the active rows, which ``workers.row_update`` pushes.

The head never changes the rows. Rows pulled ahead miss the previous step's push (one step
stale, as in any pipelined parameter server); the push is still applied to the shard's current
rows.

Use::

    head = build_head("knn", client, "fc", num_classes, margin, k=12, budget=1024)
    updater = RowUpdater(client, "fc", head_lrs)
    batch = head.prepare(labels)                   # select + pull
    out = head.forward_backward(features, batch)   # loss, dL/dX, dL/dW
    updater.update(step, out.active_ids, out.row_grad)
    features.backward(out.feature_grad)            # continue into the backbone
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import torch
import torch.nn.functional as F

from ams.cluster.plan import budget_for_sample_rate
from ams.shard.neighbor_lists import lists_to_dense
from workers.device_slice import DeviceSlice
from workers.losses import CombinedMarginLoss
from workers.selection import Selection, select_weighted


class RowStore(Protocol):
    """The part of the AMS client API a head reads (``ams.connect(...)`` satisfies it)."""

    def pull(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 (n,) -> rows (n, dim) in the table's dtype, in request order."""
        ...

    def neighbors(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 (n,) -> int64 (n, k) neighbor ids, nearest first (the class itself)."""
        ...


@dataclass(frozen=True)
class ActiveBatch:
    """One batch's active classes and their rows, as produced by :meth:`ClassifierHead.prepare`.

    active_ids: int64 (A,) sorted unique class ids.
    target: int64 (B,) position of each sample's label in ``active_ids``.
    rows: (A, dim) the pulled rows of ``active_ids``, in the table's dtype.
    log_weight: float32 (A,) log inverse probability that each class was drawn (0 for the
        classes taken for sure; see :class:`workers.selection.Selection`).
    """

    active_ids: torch.Tensor
    target: torch.Tensor
    rows: torch.Tensor
    log_weight: torch.Tensor

    def to_dict(self) -> dict[str, torch.Tensor]:
        """The four tensors by field name: what a checkpoint holds of a prepared batch (plain
        tensors, so it loads with ``torch.load(weights_only=True)``)."""
        return {"active_ids": self.active_ids, "target": self.target, "rows": self.rows,
                "log_weight": self.log_weight}

    @classmethod
    def from_dict(cls, state: dict[str, torch.Tensor]) -> ActiveBatch:
        """The batch :meth:`to_dict` described."""
        return cls(state["active_ids"], state["target"], state["rows"], state["log_weight"])


@dataclass(frozen=True)
class HeadStep:
    """Result of :meth:`ClassifierHead.forward_backward`.

    loss: mean cross-entropy over the batch.
    feature_grad: (B, dim) dL/dfeatures in the features' dtype; the caller continues the
        backbone's backward with ``features.backward(step.feature_grad)``.
    accuracy: fraction of samples whose highest cosine among the active classes is their label.
    num_active: A, the number of classes in the softmax.
    row_grad: (A, dim) float32 dL/dW of the active rows (w.r.t. the unnormalized rows), in
        the order of ``active_ids``, on the features' device; the caller pushes it
        (``workers.row_update`` copies it to the host without blocking).
    active_ids: int64 (A,) the classes of ``row_grad``'s rows.
    """

    loss: float
    feature_grad: torch.Tensor
    accuracy: float
    num_active: int
    row_grad: torch.Tensor
    active_ids: torch.Tensor


class ActiveSelector(Protocol):
    """Chooses the active classes of a batch: labels int64 (B,) -> :class:`Selection`."""

    def __call__(self, labels: torch.Tensor) -> Selection: ...


class AllClasses:
    """``full``: every class is active, so a label's position is the label itself."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        # The same for every batch; nothing downstream writes to them.
        self._active = torch.arange(num_classes, dtype=torch.int64)
        self._log_weight = torch.zeros(num_classes, dtype=torch.float32)

    def __call__(self, labels: torch.Tensor) -> Selection:
        return Selection(active=self._active, target=labels.clone(), log_weight=self._log_weight)


class SampledClasses:
    """``partial``: labels plus uniform random negatives, ``sample_rate * N`` classes in all
    (never fewer than the distinct labels)."""

    def __init__(self, num_classes: int, sample_rate: float, generator: torch.Generator) -> None:
        self.num_classes = num_classes
        self.budget = budget_for_sample_rate(sample_rate, num_classes)
        self.generator = generator

    def __call__(self, labels: torch.Tensor) -> Selection:
        return select_weighted(labels, None, self.budget, self.generator, self.num_classes)


class NeighborClasses:
    """``knn``: labels plus their ``k`` nearest neighbors from the AMS graph, filled with
    uniform random classes or cut (keeping every label) to ``budget``; ``random_share`` of the
    negative slots (beyond the labels) always go to uniform random classes."""

    def __init__(self, store: RowStore, table: str, num_classes: int, k: int, budget: int,
                 generator: torch.Generator, random_share: float = 0.0) -> None:
        if k <= 0 or budget <= 0:
            raise ValueError(f"k and budget must be positive, got k={k}, budget={budget}")
        if not 0.0 <= random_share <= 1.0:
            raise ValueError(f"random_share must lie in [0, 1], got {random_share}")
        self.store, self.table = store, table
        self.num_classes, self.k, self.budget = num_classes, k, budget
        self.random_share = random_share
        self.generator = generator

    def __call__(self, labels: torch.Tensor) -> Selection:
        # The lookup's width is the longest of these labels' lists: an IVF graph's lists may
        # all be shorter than k (the config keeps head.k <= graph.k), and a short one is -1
        # padded like any other.
        neighbors = lists_to_dense(None, self.store.neighbors(self.table, labels), self.k)
        return select_weighted(labels, neighbors, self.budget, self.generator,
                               self.num_classes, self.random_share)


def checked_labels(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """``labels`` on the CPU after checking they are int64 (B,) class ids in [0, num_classes);
    ValueError otherwise."""
    if labels.dim() != 1 or labels.dtype != torch.int64:
        raise ValueError(f"labels must be int64 (B,), got {labels.dtype} {tuple(labels.shape)}")
    labels = labels.cpu()
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got range "
                         f"[{int(labels.min())}, {int(labels.max())}]")
    return labels


class RowHead(Protocol):
    """What the trainer drives: ``ClassifierHead`` (rows in the AMS) or
    ``workers.collective.CollectiveHead`` (rows sliced over the ranks)."""

    num_classes: int
    combine_row_grads: bool  # whether the ranks' row gradients of a step are one push
    # where the head reads its rows and the row update pushes, when not through the client:
    # collective placement's slice in GPU memory
    device_rows: DeviceSlice | None

    def select(self, labels: torch.Tensor) -> Selection: ...
    def pull(self, selection: Selection) -> ActiveBatch: ...
    def prepare(self, labels: torch.Tensor) -> ActiveBatch: ...
    def forward_backward(self, features: torch.Tensor, batch: ActiveBatch,
                         logq: bool = True) -> HeadStep: ...
    def sampler_state(self) -> torch.Tensor | None: ...
    def load_sampler_state(self, state: torch.Tensor | None) -> None: ...


class ClassifierHead:
    """Margin softmax over the active classes of each batch, rows in an AMS table.

    store: the AMS client; table: name of the (num_classes, dim) class-row table;
    margin: the margin applied to the target cosine; selector: which classes are active.
    logq_correction: add each active class's ``log_weight`` to its logit, so a class drawn
    uniformly from a pool stands for every class of that pool it represents (sampled softmax
    made an unbiased estimate of the full one; no effect on classes taken for sure).
    The head computes in float32 on the features' device whatever the table's dtype.
    """

    # Each data-parallel rank's row gradient covers only its own samples: the ranks' gradients
    # of a step are combined into one push (workers.row_update).
    combine_row_grads = True
    device_rows = None  # the rows are read and pushed through the client

    def __init__(self, store: RowStore, table: str, num_classes: int,
                 margin: CombinedMarginLoss, selector: ActiveSelector,
                 logq_correction: bool = True) -> None:
        self.store, self.table = store, table
        self.num_classes = num_classes
        self.margin = margin
        self.selector = selector
        self.logq_correction = logq_correction

    def prepare(self, labels: torch.Tensor) -> ActiveBatch:
        """Select the active classes for ``labels`` (int64 (B,) class ids) and pull their rows.

        Not reentrant (the selector's random generator is shared), but independent of
        ``forward_backward``, so one prefetch thread may call it while the trainer steps.
        """
        return self.pull(self.select(labels))

    def select(self, labels: torch.Tensor) -> Selection:
        """The active classes for ``labels`` (int64 (B,) class ids); reads no row (a knn
        selector reads the graph's lists). Not reentrant, as :meth:`prepare`."""
        return self.selector(checked_labels(labels, self.num_classes))

    def pull(self, selection: Selection) -> ActiveBatch:
        """The batch of ``selection`` with its rows pulled from the AMS."""
        rows = self.store.pull(self.table, selection.active)
        return ActiveBatch(active_ids=selection.active, target=selection.target, rows=rows,
                           log_weight=selection.log_weight)

    def forward_backward(self, features: torch.Tensor, batch: ActiveBatch,
                         logq: bool = True) -> HeadStep:
        """Loss and gradients of one batch over its active classes; changes no row.

        features: (B, dim) float, the backbone's output (its graph is left untouched: the head
        differentiates a detached copy and returns dL/dfeatures in ``HeadStep.feature_grad``).
        ``HeadStep.row_grad`` is w.r.t. the unnormalized rows, float32 (A, dim) on the
        features' device. ``logq``: False computes this step's softmax without the drawn
        classes' weights even when the head applies them (its schedule, see
        ``HeadConfig.logq_start_step``).
        """
        if features.dim() != 2 or features.shape[0] != batch.target.shape[0]:
            raise ValueError(f"features must be (B, dim) with B={batch.target.shape[0]}, "
                             f"got {tuple(features.shape)}")
        if features.shape[1] != batch.rows.shape[1]:
            raise ValueError(f"features have dim {features.shape[1]} but table {self.table!r} "
                             f"rows have dim {batch.rows.shape[1]}")
        device = features.device
        with torch.autocast(device_type=device.type, enabled=False):
            x = features.detach().float().requires_grad_(True)
            w = batch.rows.to(device=device, dtype=torch.float32).requires_grad_(True)
            target = batch.target.to(device)
            cosine = F.normalize(x, dim=1) @ F.normalize(w, dim=1).t()
            logits = self.margin(cosine, target)
            if self.logq_correction and logq:
                logits = logits + batch.log_weight.to(device)
            loss = F.cross_entropy(logits, target)
            feature_grad, row_grad = torch.autograd.grad(loss, (x, w))
        accuracy = (cosine.detach().argmax(dim=1) == target).float().mean()
        return HeadStep(loss=float(loss.detach()), feature_grad=feature_grad.to(features.dtype),
                        accuracy=float(accuracy), num_active=int(batch.active_ids.numel()),
                        row_grad=row_grad, active_ids=batch.active_ids)

    def sampler_state(self) -> torch.Tensor | None:
        """The state of the generator that draws random negatives (None if the head draws
        none), for a checkpoint: restored, a resumed run draws what the uninterrupted one
        would have."""
        generator = getattr(self.selector, "generator", None)
        return generator.get_state() if generator is not None else None

    def load_sampler_state(self, state: torch.Tensor | None) -> None:
        """Restore what :meth:`sampler_state` returned."""
        generator = getattr(self.selector, "generator", None)
        if generator is not None and state is not None:
            generator.set_state(state)


class Placement(StrEnum):
    """Where the class rows live while a job trains."""

    AMS = "ams"  # the model server: in process, or shards at their addresses
    COLLECTIVE = "collective"  # sliced over the worker ranks (workers.collective)


class HeadKind(StrEnum):
    """Which classes are active in a step."""

    FULL = "full"  # every class: the accuracy reference, only for small N
    PARTIAL = "partial"  # labels + uniform random negatives (PartialFC)
    KNN = "knn"  # labels + their nearest classes from the graph (KNN softmax)


def build_head(name: HeadKind | str, store: RowStore, table: str, num_classes: int,
               margin: CombinedMarginLoss, *, sample_rate: float | None = None,
               k: int | None = None, budget: int | None = None, random_share: float = 0.0,
               logq_correction: bool = True, seed: int = 0) -> ClassifierHead:
    """The head called ``name`` over table ``table`` of ``num_classes`` rows.

    ``partial`` needs ``sample_rate``; ``knn`` needs ``k`` and ``budget`` (and a built graph),
    and gives ``random_share`` of its negative slots to uniform random classes.
    ``logq_correction`` weights the uniformly drawn classes' logits (see ClassifierHead).
    ``seed`` seeds the generator that draws random negatives.
    """
    if name not in list(HeadKind):
        raise ValueError(f"unknown head {name!r}; known heads: {', '.join(HeadKind)}")
    generator = torch.Generator().manual_seed(seed)
    if name == HeadKind.FULL:
        selector: ActiveSelector = AllClasses(num_classes)
    elif name == HeadKind.PARTIAL:
        if sample_rate is None:
            raise ValueError("the partial head needs sample_rate")
        selector = SampledClasses(num_classes, sample_rate, generator)
    else:
        if k is None or budget is None:
            raise ValueError("the knn head needs k and budget")
        selector = NeighborClasses(store, table, num_classes, k, budget, generator,
                                    random_share)
    # full draws nothing, so there is nothing to weight (and a (B, N) add saved per step)
    return ClassifierHead(store, table, num_classes, margin, selector,
                          logq_correction and name != HeadKind.FULL)

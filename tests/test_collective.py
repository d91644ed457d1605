"""workers.collective on 1, 2 and 3 real gloo ranks: the model-parallel softmax against a float64
single-process reference (loss, dL/dX, the updated rows; the partial and knn heads' loss with
logQ offsets derived here from the documented rule), and the slices' selections against a
plain-Python priority order over a brute-force neighbor search; with the slices in host memory
and as working copies on the compute device (``workers.device_slice``, which a GPU run uses),
written back before anything reads them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import ams
from ams.graph.build import build_graph
from tests.conftest import free_port, set_torchrun_env
from workers.collective import CollectiveHead, CollectiveShards
from workers.device_slice import DeviceSlice
from workers.distributed import process_group
from workers.losses import CombinedMarginLoss
from workers.row_update import RowUpdater

N, D, B = 23, 6, 4  # 23 classes: no world size here divides them evenly
SCALE, MARGIN = 16.0, 0.35  # CosFace
LR, WD = 0.7, 0.01
KNN_BUDGET = 6  # 2 and 3 slices cut their priority order at it; one runs out and fills


def make_table(client) -> None:
    client.create_table("fc", num_rows=N, dim=D, momentum=0.0, weight_decay=WD, seed=3,
                        init_std=0.3)


def global_batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    features = torch.randn(world * B, D, generator=g, dtype=torch.float64)
    labels = torch.randint(0, N, (world * B,), generator=g)
    labels[:3] = torch.tensor([0, 0, N - 1])  # a repeated label and the last class
    return features, labels


def _rank_main(rank: int, world: int, port: int, out: str, device: str,
               in_device: bool) -> None:
    set_torchrun_env(rank, world, port)
    with process_group(world, torch.device("cpu")):
        shards = CollectiveShards(rank, world, data_dir=Path(out) / f"ams-{rank}",
                                  keep_snapshots=1)
        client = shards.client
        make_table(client)
        features, labels = global_batch(world)
        features = features.to(device)  # gloo ranks on one GPU move CUDA tensors too
        mine = slice(rank * B, (rank + 1) * B)
        margin = CombinedMarginLoss(SCALE, m3=MARGIN)
        result = {}
        rows = DeviceSlice(shards.local.store, "fc", device) if in_device else None

        full = CollectiveHead(client, "fc", N, margin, "full", rank=rank, world=world,
                              device_rows=rows)
        before = client.pull("fc", torch.arange(N))
        step = full.forward_backward(features[mine], full.prepare(labels[mine]))
        updater = RowUpdater(rows or client, "fc", [LR])
        updater.update(0, step.active_ids, step.row_grad)
        updater.flush()
        updater.close()
        assert step.feature_grad.device == step.row_grad.device == features.device
        result["full"] = {"loss": step.loss, "accuracy": step.accuracy,
                          "feature_grad": step.feature_grad.cpu(), "active": step.active_ids,
                          "row_grad": step.row_grad.cpu(), "num_active": step.num_active,
                          "before": before, "after": client.pull("fc", step.active_ids)}

        partial = CollectiveHead(client, "fc", N, margin, "partial", rank=rank, world=world,
                                 sample_rate=0.5, seed=5 + rank, device_rows=rows)
        dist_barrier()  # every slice has taken the full step
        now = client.pull("fc", torch.arange(N))
        step = partial.forward_backward(features[mine], partial.prepare(labels[mine]))
        result["partial"] = {"loss": step.loss, "active": step.active_ids,
                             "num_active": step.num_active, "rows": now}

        dist_barrier()
        if rank == 0:
            build_graph(client, "fc", 4)
        dist_barrier()
        now = client.pull("fc", torch.arange(N))
        knn = CollectiveHead(client, "fc", N, margin, "knn", rank=rank, world=world, k=3,
                             budget=KNN_BUDGET, random_share=0.0, seed=9, device_rows=rows)
        step = knn.forward_backward(features[mine], knn.prepare(labels[mine]))
        result["knn"] = {"loss": step.loss, "active": step.active_ids,
                         "num_active": step.num_active, "rows": now}
        torch.save(result, Path(out) / f"rank{rank}.pt")
        dist_barrier()
        shards.close()


def dist_barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def reference_step(world: int, rows: torch.Tensor, columns: torch.Tensor,
                   log_weight: torch.Tensor | None = None):
    """Float64 CosFace softmax over the rows of ``columns`` for the global batch: loss,
    dL/dX (W·B, D), dL/dW of those rows, and the top-1 accuracy."""
    features, labels = global_batch(world)
    x = features.clone().requires_grad_(True)
    w = rows[columns].double().requires_grad_(True)
    cosine = F.normalize(x, dim=1) @ F.normalize(w, dim=1).t()
    target = torch.searchsorted(columns, labels)
    assert torch.equal(columns[target], labels)
    onehot = F.one_hot(target, columns.numel()).double()
    logits = SCALE * (cosine - MARGIN * onehot)
    if log_weight is not None:
        logits = logits + log_weight.double()
    loss = F.cross_entropy(logits, target)
    dx, dw = torch.autograd.grad(loss, (x, w))
    accuracy = (cosine.argmax(dim=1) == target).double().mean()
    return float(loss.detach()), dx, dw, float(accuracy)


def slice_log_weights(size: int, sure: set[int], active: list[int]) -> dict[int, float]:
    """The logQ offset of each of one slice's ``active`` classes by the documented rule
    (``workers.selection.Selection``, ``select_in_slice``): 0 on the classes taken for sure,
    ``log(pool / drawn)`` on the ``drawn`` others, drawn uniformly from the ``pool`` classes of
    the slice's ``size`` left over once the sure ones are out."""
    drawn = [c for c in active if c not in sure]
    pool = size - len(sure)
    return {c: 0.0 if c in sure else math.log(pool / len(drawn)) for c in active}


def reference_over_slices(world: int, rows: torch.Tensor, weights: dict[int, float]) -> float:
    """The float64 loss of the softmax over every slice's active classes (the keys of
    ``weights``) with their logQ offsets, rounded to float32 as the selection documents them
    (a float64 offset moves the loss by ~1e-9, more than this comparison allows)."""
    columns = torch.tensor(sorted(weights))
    log_weight = torch.tensor([weights[c] for c in columns.tolist()], dtype=torch.float32)
    return reference_step(world, rows.double(), columns, log_weight)[0]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this host")


@pytest.mark.parametrize("world, device, in_device", [
    (1, "cpu", False), (2, "cpu", False), (3, "cpu", False), (1, "cpu", True), (2, "cpu", True),
    # on CUDA, as a GPU run keeps its slice: one rank, and two gloo ranks sharing the one GPU
    pytest.param(1, "cuda", True, marks=CUDA), pytest.param(2, "cuda", True, marks=CUDA)])
def test_collective_heads_match_one_process_in_float64(tmp_path, world, device, in_device):
    mp.spawn(_rank_main, args=(world, free_port(), str(tmp_path), device, in_device),
             nprocs=world, join=True)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    rows = parts[0]["full"]["before"].double()
    _, labels = global_batch(world)

    # full: loss, dL/dX and the rows after one step equal the single-process full head
    loss, dx, dw, accuracy = reference_step(world, rows, torch.arange(N))
    for r, part in enumerate(parts):
        got = part["full"]
        assert got["loss"] == pytest.approx(loss, rel=1e-12)
        assert got["accuracy"] == pytest.approx(accuracy)
        assert got["num_active"] == N
        assert torch.equal(got["active"], torch.arange(r, N, world))
        # each rank's dL/dX is that of the mean loss over its own samples (DDP averages)
        torch.testing.assert_close(got["feature_grad"], dx[r * B:(r + 1) * B] * world,
                                   rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got["row_grad"].double(), dw[got["active"]],
                                   rtol=1e-5, atol=1e-7)
        before = rows[got["active"]]
        want = before - LR * (dw[got["active"]] + WD * before)  # dense SGD, float64
        torch.testing.assert_close(got["after"].double(), want, rtol=1e-5, atol=1e-6)

    # partial: each slice keeps its own labels and draws uniform others up to sample_rate of
    # the slice; the loss is the softmax over all slices' columns, each drawn class offset by
    # log(pool / drawn) of its own slice (the labels are never drawn: offset 0)
    weights: dict[int, float] = {}
    for r, part in enumerate(parts):
        size = len(range(r, N, world))
        sure = {int(c) for c in labels if c % world == r}
        active = part["partial"]["active"].tolist()
        assert active == sorted(set(active)) and all(c % world == r for c in active)
        # half the slice (at least one class), never fewer than the slice's labels
        assert len(active) == max(1, int(0.5 * size), len(sure))
        assert sure <= set(active)
        weights |= slice_log_weights(size, sure, active)
    assert any(w != 0 for w in weights.values())  # some class was drawn: the offsets count
    loss = reference_over_slices(world, parts[0]["partial"]["rows"], weights)
    for part in parts:
        assert part["partial"]["num_active"] == len(weights)
        assert part["partial"]["loss"] == pytest.approx(loss, rel=1e-12)

    # knn (random_share 0): each slice takes the first classes of the global priority order
    # (labels, then the lists' entries rank by rank) that fall in it, up to its share of the
    # budget; the lists are a brute-force float64 search (the class itself first). A slice
    # whose order runs out first (one rank: the labels' lists overlap) fills its share with
    # distinct other classes of its own, drawn at random, which carry log(pool / drawn)
    rows = parts[0]["knn"]["rows"].double()
    normed = F.normalize(rows, dim=1)
    nearest = (normed @ normed.t()).topk(3, dim=1).indices
    priority = labels.tolist() + [int(nearest[c, j]) for j in range(3) for c in labels]
    weights = {}
    for r, part in enumerate(parts):
        size = len(range(r, N, world))
        mine = list(dict.fromkeys(c for c in priority if c % world == r))
        labels_here = len({int(c) for c in labels if c % world == r})
        total = max(min(math.ceil(KNN_BUDGET * size / N), size), labels_here)
        active = part["knn"]["active"].tolist()
        assert len(active) == len(set(active)) == total
        assert set(mine[:total]) <= set(active)
        assert active == sorted(active) and all(c % world == r for c in active)
        weights |= slice_log_weights(size, set(mine[:total]), active)
    loss = reference_over_slices(world, rows, weights)
    for part in parts:
        assert part["knn"]["num_active"] == len(weights)
        assert part["knn"]["loss"] == pytest.approx(loss, rel=1e-12)


def test_collective_head_refuses_more_ranks_than_classes():
    client = ams.connect(local_shards=1)
    make_table(client)
    with pytest.raises(ValueError, match="one class per rank"):
        CollectiveHead(client, "fc", 2, CombinedMarginLoss(SCALE), "full", rank=0, world=3)

"""Heads over a real in-process AMS: against a dense float64 reference and against each other."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ams
from tests.conftest import DEVICES
from tests.test_selection import priority_order
from workers.heads import HeadKind, build_head
from workers.losses import CombinedMarginLoss

N, DIM, B = 40, 16, 12
S, M2 = 16.0, 0.5  # ArcFace at a scale that keeps float32 comparisons tight
MOMENTUM, WEIGHT_DECAY = 0.9, 5e-4
INIT_STD = 1 / math.sqrt(DIM)  # rows of norm ~1, so row gradients are O(1)


def make_client(dtype: str = "float32", num_rows: int = N, shards: int = 2):
    client = ams.connect(local_shards=shards)
    client.create_table("fc", num_rows=num_rows, dim=DIM, dtype=dtype, momentum=MOMENTUM,
                        weight_decay=WEIGHT_DECAY, seed=7, init_std=INIT_STD)
    return client


def all_rows(client, num_rows: int = N) -> torch.Tensor:
    return client.pull("fc", torch.arange(num_rows))


def write_exact_graph(client, k: int, num_rows: int = N) -> torch.Tensor:
    """Brute-force cosine KNN of the current rows (self first), stored on the shards."""
    w = F.normalize(all_rows(client, num_rows).double(), dim=1)
    similarity = w @ w.t()
    similarity.fill_diagonal_(2.0)
    neighbors = similarity.topk(k, dim=1).indices
    client.set_neighbors("fc", torch.arange(num_rows), neighbors, version=1, step=0,
                         replace_all=True)
    return neighbors


def arcface_margin() -> CombinedMarginLoss:
    return CombinedMarginLoss(S, 1.0, M2, 0.0)


def batch(seed: int, num_rows: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, DIM, generator=g), torch.randint(0, num_rows, (B,), generator=g)


def reference_loss(x: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """ArcFace cross-entropy over all classes in float64, written out independently."""
    cosine = F.normalize(x, dim=1) @ F.normalize(w, dim=1).t()
    target_cos = cosine.gather(1, labels[:, None]).squeeze(1)
    theta = torch.acos(target_cos)
    switch = math.pi - M2
    target = torch.where(theta <= switch, torch.cos(theta + M2),
                         target_cos - 1.0 - math.cos(switch))
    logits = cosine.scatter(1, labels[:, None], target[:, None]) * S
    return F.cross_entropy(logits, labels)


def run_step(head, client, seed: int, lr: float = 0.1, device: str = "cpu"):
    """One head step and a plain push of its row gradient; returns (step, rows after)."""
    features, labels = batch(seed)
    active = head.prepare(labels)
    step = head.forward_backward(features.to(device), active)
    client.push("fc", active.active_ids, step.row_grad.cpu(), lr=lr)
    return step, all_rows(client)


@pytest.mark.parametrize("device", DEVICES)
def test_full_head_matches_dense_float64_sgd(device):
    client = make_client()
    head = build_head("full", client, "fc", N, arcface_margin())
    w = nn.Parameter(all_rows(client).double())
    optimizer = torch.optim.SGD([w], lr=0.1, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    for seed in (1, 2):
        step, rows = run_step(head, client, seed, device=device)
        features, labels = batch(seed)
        x = features.double().requires_grad_(True)
        optimizer.zero_grad()
        loss = reference_loss(x, w, labels)
        loss.backward()
        optimizer.step()
        assert step.loss == pytest.approx(loss.item(), abs=1e-5)
        assert step.num_active == N
        assert step.feature_grad.dtype == torch.float32
        assert step.feature_grad.device.type == step.row_grad.device.type == device
        torch.testing.assert_close(step.feature_grad.cpu().double(), x.grad, rtol=0, atol=1e-6)
        torch.testing.assert_close(rows.double(), w.detach(), rtol=0, atol=1e-6)


def test_feature_grad_continues_the_backbone_backward():
    client = make_client()
    head = build_head("full", client, "fc", N, arcface_margin())
    torch.manual_seed(0)
    backbone = nn.Linear(8, DIM)
    inputs, labels = torch.randn(B, 8), batch(3)[1]
    w = all_rows(client).double()
    step = head.forward_backward(backbone(inputs), head.prepare(labels))
    backbone(inputs).backward(step.feature_grad)

    reference = nn.Linear(8, DIM).double()
    reference.load_state_dict(backbone.state_dict())
    reference_loss(reference(inputs.double()), w, labels).backward()
    torch.testing.assert_close(backbone.weight.grad.double(), reference.weight.grad,
                               rtol=0, atol=1e-5)


def run_two_steps(name: str, **options):
    client = make_client()
    if name == "knn":
        write_exact_graph(client, k=5)
    head = build_head(name, client, "fc", N, arcface_margin(), **options)
    return [run_step(head, client, seed) for seed in (1, 2)]


@pytest.mark.parametrize(
    ("name", "options"),
    [("partial", {"sample_rate": 1.0}), ("knn", {"k": 5, "budget": N}),
     ("knn", {"k": 5, "budget": 10 * N}),
     ("knn", {"k": 5, "budget": N, "random_share": 0.5, "logq_correction": True}),
     ("partial", {"sample_rate": 1.0, "logq_correction": True})],
)
def test_heads_covering_all_classes_equal_full(name, options):
    for (full, full_rows), (other, other_rows) in zip(
            run_two_steps("full"), run_two_steps(name, **options), strict=True):
        assert other.num_active == N
        assert other.loss == pytest.approx(full.loss, abs=1e-6)
        torch.testing.assert_close(other.feature_grad, full.feature_grad, rtol=0, atol=1e-6)
        torch.testing.assert_close(other_rows, full_rows, rtol=0, atol=1e-6)


def assert_only_active_rows_moved(before: torch.Tensor, after: torch.Tensor,
                                  active: torch.Tensor) -> None:
    moved = (before != after).any(dim=1)
    inactive = torch.ones(before.shape[0], dtype=torch.bool)
    inactive[active] = False
    assert not moved[inactive].any(), "a row outside the active set changed"
    assert moved[active].all(), "an active row did not change"


def test_partial_head_samples_and_updates_only_its_rows():
    num_rows = 400
    client = make_client(num_rows=num_rows)
    head = build_head("partial", client, "fc", num_rows, arcface_margin(), sample_rate=0.1)
    features, labels = batch(4, num_rows)
    active = head.prepare(labels)
    assert active.active_ids.numel() == 40
    assert bool((active.active_ids[active.target] == labels).all())
    before = all_rows(client, num_rows)
    step = head.forward_backward(features, active)
    client.push("fc", active.active_ids, step.row_grad, lr=0.1)
    assert step.num_active == 40 and math.isfinite(step.loss)
    assert_only_active_rows_moved(before, all_rows(client, num_rows), active.active_ids)


def test_knn_head_takes_labels_and_their_neighbors():
    num_rows, k = 400, 4
    client = make_client(num_rows=num_rows)
    neighbors = write_exact_graph(client, k=8, num_rows=num_rows)
    head = build_head("knn", client, "fc", num_rows, arcface_margin(), k=k, budget=B * k)
    features, labels = batch(5, num_rows)
    active = head.prepare(labels)
    wanted = torch.unique(neighbors[labels, :k])
    assert bool(torch.isin(wanted, active.active_ids).all())
    assert bool((active.active_ids[active.target] == labels).all())
    before = all_rows(client, num_rows)
    step = head.forward_backward(features, active)
    client.push("fc", active.active_ids, step.row_grad, lr=0.1)
    assert_only_active_rows_moved(before, all_rows(client, num_rows), active.active_ids)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_table_computes_in_float32(dtype):
    client = make_client(dtype=dtype)
    head = build_head("full", client, "fc", N, arcface_margin())
    features, labels = batch(6)
    active = head.prepare(labels)
    assert active.rows.dtype == getattr(torch, dtype)
    x = features.double().requires_grad_(True)
    want = reference_loss(x, active.rows.double(), labels)
    want.backward()
    step = head.forward_backward(features, active)
    assert step.loss == pytest.approx(want.item(), abs=1e-5)
    torch.testing.assert_close(step.feature_grad.double(), x.grad, rtol=0, atol=1e-6)


def test_low_precision_features_get_gradients_in_their_dtype():
    client = make_client()
    head = build_head("full", client, "fc", N, arcface_margin())
    features, labels = batch(7)
    features = features.bfloat16()
    active = head.prepare(labels)
    x = features.double().requires_grad_(True)
    want = reference_loss(x, active.rows.double(), labels)
    step = head.forward_backward(features, active)
    assert step.feature_grad.dtype == torch.bfloat16
    assert step.loss == pytest.approx(want.item(), abs=1e-5)


def test_accuracy_counts_labels_with_the_highest_cosine():
    client = make_client()
    head = build_head("full", client, "fc", N, arcface_margin())
    labels = torch.arange(B)
    features = all_rows(client)[labels].float() * 3.0  # each feature points at its own row
    features[0] = -features[0]
    step = head.forward_backward(features, head.prepare(labels))
    assert step.accuracy == pytest.approx((B - 1) / B)


@pytest.mark.parametrize("name", ["partial", "knn"])
def test_logq_correction_weights_the_uniform_draws(name):
    # float64 reference: ArcFace logits of the active classes, plus log(pool / drawn) on the
    # classes drawn uniformly from the pool left after the labels (and, for knn, the labels'
    # nearest rank-1 neighbors), 0 on the classes taken for sure.
    num_rows = 400
    client = make_client(num_rows=num_rows)
    neighbors = write_exact_graph(client, k=4, num_rows=num_rows)
    options = {"sample_rate": 0.1} if name == "partial" else {"k": 2, "budget": 40,
                                                               "random_share": 0.5}
    head = build_head(name, client, "fc", num_rows, arcface_margin(), logq_correction=True,
                      **options)
    features, labels = batch(8, num_rows)
    active = head.prepare(labels)
    ids = active.active_ids
    sure = set(labels.tolist())
    if name == "knn":
        slots = 40 - len(sure)
        rank1 = [n for n in dict.fromkeys(neighbors[labels, 1].tolist()) if n not in sure]
        sure |= set(rank1[:slots - round(0.5 * slots)])
    drawn = [i for i in ids.tolist() if i not in sure]
    offsets = torch.tensor([0.0 if i in sure else math.log((num_rows - len(sure)) / len(drawn))
                            for i in ids.tolist()], dtype=torch.float64)
    x = features.double().requires_grad_(True)
    w = active.rows.double()
    cosine = F.normalize(x, dim=1) @ F.normalize(w, dim=1).t()
    target = active.target
    theta = torch.acos(cosine.gather(1, target[:, None]).squeeze(1))
    assert bool((theta < math.pi - M2).all())  # ArcFace's plain branch on this batch
    logits = cosine.scatter(1, target[:, None], torch.cos(theta + M2)[:, None]) * S + offsets
    want = F.cross_entropy(logits, target)
    want.backward()
    step = head.forward_backward(features, active)
    assert step.loss == pytest.approx(want.item(), abs=1e-5)
    torch.testing.assert_close(step.feature_grad.double(), x.grad, rtol=0, atol=1e-6)
    plain = build_head(name, make_client(num_rows=num_rows), "fc", num_rows, arcface_margin(),
                       logq_correction=False, **options)
    assert plain.forward_backward(features, active).loss < step.loss - 0.1
    # a step outside the weights' schedule: the softmax without the offsets
    unweighted = F.cross_entropy(logits.detach() - offsets, target)
    assert head.forward_backward(features, active, logq=False).loss == pytest.approx(
        unweighted.item(), abs=1e-5)


def test_knn_head_needs_a_graph_and_takes_short_lists_as_they_are():
    """No graph: the lookup fails. Lists shorter than the head's k (an IVF graph's, whose
    probed lists held fewer rows) are taken as they are, not refused; the config keeps
    head.k <= graph.k, so a run's lists are short only where the graph's are."""
    client = make_client()
    head = build_head("knn", client, "fc", N, arcface_margin(), k=3, budget=20, seed=7)
    labels = torch.tensor([1, 2])
    with pytest.raises(ams.AmsError):
        head.prepare(labels)
    lists = write_exact_graph(client, k=2)
    # the plain-Python priority order (labels, then the lists rank by rank) holds fewer than
    # the 20 classes of the budget: all of it is active, and random classes fill the rest
    order = priority_order(labels.tolist(), lists[labels].tolist())
    assert len(order) < 20
    batch = head.prepare(labels)
    active = batch.active_ids.tolist()
    assert len(active) == len(set(active)) == 20
    assert set(order) <= set(active)
    assert torch.equal(batch.active_ids[batch.target], labels)


@pytest.mark.parametrize(
    ("labels", "message"),
    [(torch.tensor([0, N]), r"\[0, 40\)"), (torch.tensor([-1, 0]), r"\[0, 40\)"),
     (torch.tensor([0, 1], dtype=torch.int32), "int64"), (torch.zeros(2, 2).long(), r"\(B,\)")],
)
def test_bad_labels_are_rejected(labels, message):
    head = build_head("full", make_client(), "fc", N, arcface_margin())
    with pytest.raises(ValueError, match=message):
        head.prepare(labels)


def test_features_must_match_the_batch_and_the_table():
    head = build_head("full", make_client(), "fc", N, arcface_margin())
    active = head.prepare(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="B=3"):
        head.forward_backward(torch.zeros(4, DIM), active)
    with pytest.raises(ValueError, match="dim"):
        head.forward_backward(torch.zeros(3, DIM + 1), active)


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [("fullest", {}, "full, partial, knn"), ("partial", {}, "sample_rate"),
     ("partial", {"sample_rate": 1.5}, "sample_rate"), ("knn", {"k": 3}, "budget"),
     ("knn", {"k": 0, "budget": 5}, "positive")],
)
def test_bad_head_options_are_rejected(name, options, message):
    with pytest.raises(ValueError, match=message):
        build_head(name, make_client(), "fc", N, arcface_margin(), **options)


def test_head_kinds_are_the_config_names():
    assert [str(kind) for kind in HeadKind] == ["full", "partial", "knn"]


def test_forward_backward_changes_no_row():
    client = make_client()
    head = build_head("full", client, "fc", N, arcface_margin())
    features, labels = batch(9)
    before = all_rows(client)
    step = head.forward_backward(features, head.prepare(labels))
    assert step.row_grad.shape == (N, DIM) and bool(step.row_grad.abs().sum() > 0)
    assert torch.equal(all_rows(client), before)

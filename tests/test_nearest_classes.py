"""Nearest-row classification (evaluation and Classifier.predict) against a float64 brute force."""

from __future__ import annotations

import torch

from workers import predict
from workers.predict import nearest_classes


def brute_force(features: torch.Tensor, rows: torch.Tensor, k: int):
    f = features.double() / features.double().norm(dim=1, keepdim=True)
    w = rows.double() / rows.double().norm(dim=1, keepdim=True)
    return (f @ w.t()).topk(k, dim=1)


def test_chunked_streaming_equals_brute_force(monkeypatch):
    g = torch.Generator().manual_seed(0)
    features, rows = torch.randn(97, 16, generator=g), torch.randn(250, 16, generator=g)
    # shuffled class ids, uneven blocks, and a score budget far below 97 x 250 force many
    # feature chunks against every block
    perm = torch.randperm(250, generator=g)
    blocks = [(perm[s:e], rows[perm[s:e]]) for s, e in ((0, 7), (7, 7), (7, 130), (130, 250))]
    monkeypatch.setattr(predict, "MAX_SCORES", 300)
    ids, scores = nearest_classes(features, blocks, 5)
    ref_scores, ref_ids = brute_force(features, rows, 5)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(scores.double(), ref_scores, atol=1e-5, rtol=0)


def test_k_above_the_class_count_pads(monkeypatch):
    features, rows = torch.randn(4, 8), torch.randn(3, 8)
    monkeypatch.setattr(predict, "MAX_SCORES", 2)
    ids, scores = nearest_classes(features, [(torch.arange(3), rows)], 5)
    _, ref_ids = brute_force(features, rows, 3)
    assert torch.equal(ids[:, :3], ref_ids)
    assert (ids[:, 3:] == -1).all() and torch.isneginf(scores[:, 3:]).all()

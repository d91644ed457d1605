"""workers.predict.class_means against a float64 per-sample reference."""

from __future__ import annotations

import pytest
import torch

from workers.predict import ROW_SOURCES, class_means
from xcls.cli import build_parser


def reference_means(features: torch.Tensor, labels: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros(n, features.shape[1], dtype=torch.float64)
    for f, y in zip(features.double(), labels.tolist(), strict=True):
        out[y] += f / f.norm()
    norms = out.norm(dim=1, keepdim=True)
    return torch.where(norms > 0, out / norms.clamp_min(1e-300), out)


def test_means_over_batches_match_float64_reference():
    g = torch.Generator().manual_seed(0)
    n, d = 11, 6
    features = torch.randn(300, d, generator=g) * torch.rand(300, 1, generator=g) * 5
    labels = torch.randint(0, n, (300,), generator=g)
    labels[labels == 4] = 5  # class 4 has no sample
    batches = [(features[s:s + 64], labels[s:s + 64]) for s in range(0, 300, 64)]
    means, counts = class_means(batches, n, d)
    assert means.dtype == torch.float32 and means.shape == (n, d)
    assert counts.tolist() == torch.bincount(labels, minlength=n).tolist()
    torch.testing.assert_close(means.double(), reference_means(features, labels, n),
                               atol=1e-6, rtol=0)
    assert float(means[4].abs().sum()) == 0.0
    # the mean of normalized features: a sample's scale does not weigh it
    scaled = [(f * 1000 if i == 0 else f, y) for i, (f, y) in enumerate(batches)]
    torch.testing.assert_close(class_means(scaled, n, d)[0], means, atol=1e-6, rtol=0)


@pytest.mark.parametrize("features, labels, match", [
    (torch.zeros(3, 5), torch.zeros(3, dtype=torch.int64), "pair"),          # wrong dim
    (torch.zeros(3, 4), torch.zeros(2, dtype=torch.int64), "pair"),          # short labels
    (torch.zeros(3, 4), torch.tensor([0, 1, 7]), "0..6"),                    # out of range
    (torch.zeros(3, 4), torch.tensor([0, -1, 2]), "0..6"),                   # negative
])
def test_bad_batches_are_rejected(features, labels, match):
    with pytest.raises(ValueError, match=match):
        class_means([(features, labels)], 7, 4)


def test_cli_offers_the_row_sources_the_trainer_takes(capsys):
    parser = build_parser()
    for command in (["eval", "c.toml"], ["export", "c.toml", "--out", "x"]):
        for source in ROW_SOURCES:
            assert parser.parse_args([*command, "--rows", source]).rows == source
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--rows", "centroids"])
        assert "invalid choice" in capsys.readouterr().err

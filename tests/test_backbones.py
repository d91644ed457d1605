"""Backbones: shapes, dtypes, input checks, and that a small one can fit a tiny batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.backbones import BackboneKind, build_backbone


@pytest.fixture(scope="module")
def iresnet50():
    torch.manual_seed(0)
    return build_backbone("iresnet50", dim=512, in_channels=3, image_size=112)


@pytest.mark.parametrize(("in_channels", "image_size"), [(1, 32), (3, 32), (3, 64), (1, 16)])
def test_resnet_small_embeds_to_float32(in_channels, image_size):
    net = build_backbone("resnet_small", dim=64, in_channels=in_channels, image_size=image_size)
    out = net(torch.randn(4, in_channels, image_size, image_size))
    assert out.shape == (4, 64) and out.dtype == torch.float32


def test_resnet_small_is_small():
    net = build_backbone("resnet_small", dim=128, in_channels=1, image_size=32)
    assert 300_000 <= sum(p.numel() for p in net.parameters()) <= 1_000_000


def test_iresnet50_matches_insightface_layout(iresnet50):
    # insightface's r50 at 512-d: 43.6 M parameters, 24 blocks, frozen embedding-BN scale.
    assert sum(p.numel() for p in iresnet50.parameters()) == pytest.approx(43.59e6, rel=1e-3)
    assert [len(stage) for stage in iresnet50.stages] == [3, 4, 14, 3]
    assert not iresnet50.features.weight.requires_grad


def test_iresnet50_embeds_and_backpropagates(iresnet50):
    iresnet50.eval()  # batch statistics of one image are undefined; eval allows B = 1
    out = iresnet50(torch.randn(1, 3, 112, 112))
    assert out.shape == (1, 512) and out.dtype == torch.float32
    out.square().sum().backward()
    assert all(p.grad is not None for p in iresnet50.parameters() if p.requires_grad)


def test_embedding_is_float32_under_autocast():
    net = build_backbone("resnet_small", dim=32, in_channels=3, image_size=32)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        out = net(torch.randn(4, 3, 32, 32))
    assert out.dtype == torch.float32


@pytest.mark.parametrize(
    "shape",
    [(4, 3, 32, 32), (4, 1, 28, 28), (4, 1, 32, 64), (1, 32, 32), (4, 1, 32, 32, 1)],
)
def test_wrong_input_shape_names_the_expected_shape(shape):
    net = build_backbone("resnet_small", dim=16, in_channels=1, image_size=32)
    with pytest.raises(ValueError, match=r"\(B, 1, 32, 32\)"):
        net(torch.zeros(shape))


def test_integer_images_are_rejected():
    net = build_backbone("resnet_small", dim=16, in_channels=1, image_size=32)
    with pytest.raises(ValueError, match="floating point"):
        net(torch.zeros(2, 1, 32, 32, dtype=torch.uint8))


def test_iresnet50_input_is_checked(iresnet50):
    with pytest.raises(ValueError, match=r"\(B, 3, 112, 112\)"):
        iresnet50(torch.zeros(1, 3, 64, 64))


@pytest.mark.parametrize(
    ("name", "dim", "in_channels", "image_size", "message"),
    [
        ("resnet_tiny", 16, 1, 32, "resnet_small, iresnet50"),
        ("resnet_small", 16, 1, 112, "16-64 px"),
        ("resnet_small", 16, 1, 8, "16-64 px"),
        ("iresnet50", 16, 3, 64, "112x112"),
        ("resnet_small", 0, 1, 32, "positive"),
        ("resnet_small", 16, 0, 32, "positive"),
    ],
)
def test_bad_build_arguments(name, dim, in_channels, image_size, message):
    with pytest.raises(ValueError, match=message):
        build_backbone(name, dim, in_channels, image_size)


def test_backbone_names_are_listed():
    assert set(BackboneKind) == {"resnet_small", "iresnet50"}


def test_resnet_small_overfits_a_tiny_batch():
    torch.manual_seed(0)
    net = build_backbone("resnet_small", dim=32, in_channels=1, image_size=16)
    classifier = nn.Linear(32, 4)
    images = torch.randn(8, 1, 16, 16)
    labels = torch.arange(4).repeat(2)
    params = [*net.parameters(), *classifier.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(classifier(net(images)), labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.05 * losses[0]
    # Train-mode BN: after 20 steps the running statistics still lag the batch statistics.
    with torch.no_grad():
        assert bool((classifier(net(images)).argmax(1) == labels).all())

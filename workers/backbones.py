"""Backbones: image batch (B, C, H, W) -> embedding (B, dim) float32.

Two networks, chosen by name with :func:`build_backbone`:

* ``"resnet_small"``: a four-stage ResNet of BasicBlocks (16-32-64-128 channels, about 0.4 M
  parameters plus the embedding layer) for 16-64 px inputs; small enough to train on CPU.
* ``"iresnet50"``: the insightface IResNet-50 (pre-activation BN-conv-BN-PReLU-conv-BN blocks,
  [3, 4, 14, 3]) for aligned 112x112 faces, about 43.6 M parameters at dim 512.

Both check the input shape they were built for and raise ``ValueError`` naming the expected
shape, because a wrong size otherwise surfaces as a cryptic matmul error deep in the head (or,
with global pooling, not at all).
"""

from __future__ import annotations

from enum import StrEnum

import torch
from torch import nn


class Backbone(nn.Module):
    """Base class: validates the input, then embeds it.

    Subclasses implement ``embed(x)``; ``forward(x)`` takes (B, in_channels, image_size,
    image_size) floating point and returns (B, dim) float32.
    """

    def __init__(self, dim: int, in_channels: int, image_size: int) -> None:
        super().__init__()
        self.dim = dim
        self.in_channels = in_channels
        self.image_size = image_size

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        expected = (self.in_channels, self.image_size, self.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(
                f"{type(self).__name__} expects images of shape (B, {expected[0]}, "
                f"{expected[1]}, {expected[2]}), got {tuple(images.shape)}"
            )
        if not images.is_floating_point():
            raise ValueError(f"{type(self).__name__} expects floating point images, "
                             f"got {images.dtype}")
        return self.embed(images)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def _embedding_layer(flat: torch.Tensor, fc: nn.Linear, bn: nn.BatchNorm1d) -> torch.Tensor:
    """FC + BN in float32 outside autocast: the embedding feeds a cosine softmax with scale s
    (64), so its rounding error is multiplied by s in the logits."""
    with torch.autocast(device_type=flat.device.type, enabled=False):
        return bn(fc(flat.float()))


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus identity (or 1x1 conv-BN when the shape changes), ReLU."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNetSmall(Backbone):
    """Stem conv3x3 -> 4 BasicBlock stages (16, 32, 64, 128 ch; strides 1, 2, 2, 2) -> global
    average pool -> Linear -> BatchNorm1d.

    Inputs above 32 px get a stride-2 stem, so the stages always see at most 32x32 maps and a
    64 px batch costs about what a 32 px one does.
    """

    widths = (16, 32, 64, 128)
    min_size, max_size = 16, 64

    def __init__(self, dim: int, in_channels: int, image_size: int) -> None:
        super().__init__(dim, in_channels, image_size)
        if not self.min_size <= image_size <= self.max_size:
            raise ValueError(f"resnet_small is built for {self.min_size}-{self.max_size} px "
                             f"inputs, got image_size={image_size}; use iresnet50 for 112 px")
        stem_stride = 1 if image_size <= 32 else 2
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, self.widths[0], 3, stem_stride, 1, bias=False),
            nn.BatchNorm2d(self.widths[0]),
            nn.ReLU(inplace=True),
        )
        stages = []
        in_width = self.widths[0]
        for i, width in enumerate(self.widths):
            stages.append(BasicBlock(in_width, width, stride=1 if i == 0 else 2))
            in_width = width
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(in_width, dim)
        self.bn = nn.BatchNorm1d(dim)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        pooled = self.stages(self.stem(images)).mean(dim=(2, 3))
        return _embedding_layer(pooled, self.fc, self.bn)


class IBasicBlock(nn.Module):
    """insightface IResNet block: BN-conv3x3-BN-PReLU-conv3x3(stride)-BN plus shortcut, with no
    activation after the sum."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_channels, eps=1e-5)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels, eps=1e-5)
        self.prelu = nn.PReLU(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels, eps=1e-5)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels, eps=1e-5),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.prelu(self.bn2(self.conv1(self.bn1(x))))
        out = self.bn3(self.conv2(out))
        return out + self.downsample(x)


class IResNet(Backbone):
    """insightface IResNet for 112x112 inputs: conv3x3-BN-PReLU stem, four stride-2 stages of
    IBasicBlocks (64, 128, 256, 512 ch), then BN -> flatten (512*7*7) -> Linear ->
    BatchNorm1d whose scale is frozen at 1 (as in insightface: the embedding is normalized
    downstream, so a learned per-dimension scale only reweights the cosine). insightface's
    dropout before the Linear is p=0 by default, so there is none here."""

    widths = (64, 128, 256, 512)
    input_size = 112

    def __init__(self, layers: tuple[int, int, int, int], dim: int, in_channels: int,
                 image_size: int) -> None:
        super().__init__(dim, in_channels, image_size)
        if image_size != self.input_size:
            raise ValueError(f"iresnet expects {self.input_size}x{self.input_size} aligned faces "
                             f"(its FC layer is sized for a 7x7 map), got image_size={image_size}")
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, self.widths[0], 3, 1, 1, bias=False),
            nn.BatchNorm2d(self.widths[0], eps=1e-5),
            nn.PReLU(self.widths[0]),
        )
        stages = []
        in_width = self.widths[0]
        for width, depth in zip(self.widths, layers, strict=True):
            blocks = [IBasicBlock(in_width, width, stride=2)]
            blocks += [IBasicBlock(width, width, stride=1) for _ in range(depth - 1)]
            stages.append(nn.Sequential(*blocks))
            in_width = width
        self.stages = nn.Sequential(*stages)
        self.bn = nn.BatchNorm2d(in_width, eps=1e-5)
        final_map = self.input_size // 2 ** len(self.widths)
        self.fc = nn.Linear(in_width * final_map * final_map, dim)
        self.features = nn.BatchNorm1d(dim, eps=1e-5)
        nn.init.constant_(self.features.weight, 1.0)
        self.features.weight.requires_grad = False
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, 0.0, 0.1)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        maps = self.bn(self.stages(self.stem(images)))
        return _embedding_layer(torch.flatten(maps, 1), self.fc, self.features)


class BackboneKind(StrEnum):
    """The embedding networks a config can pick."""

    RESNET_SMALL = "resnet_small"  # a small ResNet for 16-64 px images (glyphs, thumbnails)
    IRESNET50 = "iresnet50"  # insightface's IResNet-50 for 112x112 faces


def build_backbone(name: BackboneKind | str, dim: int, in_channels: int,
                   image_size: int) -> Backbone:
    """The backbone called ``name``: images (B, in_channels, image_size, image_size) float ->
    embeddings (B, dim) float32.

    Raises ``ValueError`` for an unknown name (listing :class:`BackboneKind`), a non-positive
    ``dim``/``in_channels``, or an image size the network is not built for.
    """
    if dim <= 0 or in_channels <= 0:
        raise ValueError(f"dim and in_channels must be positive, got dim={dim}, "
                         f"in_channels={in_channels}")
    if name == BackboneKind.RESNET_SMALL:
        return ResNetSmall(dim, in_channels, image_size)
    if name == BackboneKind.IRESNET50:
        return IResNet((3, 4, 14, 3), dim, in_channels, image_size)
    raise ValueError(f"unknown backbone {name!r}; known backbones: {', '.join(BackboneKind)}")

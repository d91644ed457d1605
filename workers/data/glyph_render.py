"""Render one glyph as a fixed-size grayscale image, normalised for size and position.

Fonts use their em box very differently, so each (font, script) gets a scale from the coverage
scan: ``extent`` is the median ink extent (max of ink width and height) of its glyphs as a
fraction of the font size. A glyph is drawn at ``size * FILL / extent`` pixels, so a typical glyph
fills ``FILL`` of the image, and centred on its ink box (not on the advance box, which differs
between fonts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageFont

# How much of the image a typical glyph's ink box should span: at 0.86 the largest training
# variant (scale 1.08, a pixel's shift) still spans 0.93 of it, inside the image.
FILL = 0.86
# Font size (px) ink_extent measures at: a pixel of rounding is under 2 % of a typical extent.
EXTENT_FONT_PX = 64
# Ink below this (0..255) counts as background when finding the ink box.
INK_THRESHOLD = 32


@dataclass(frozen=True)
class Variant:
    """A small deterministic change to a rendering: scale factor and pixel shift (dy, dx)."""

    scale: float = 1.0
    dy: int = 0
    dx: int = 0


CANONICAL = Variant()
# Extra train-only renderings of each train design: slightly smaller, larger, shifted.
TRAIN_VARIANTS = (CANONICAL, Variant(0.9, 0, 0), Variant(1.0, 1, -1), Variant(1.08, -1, 1),
                  Variant(0.95, 1, 1))


def glyph_mask(font: ImageFont.FreeTypeFont, code_point: int) -> np.ndarray:
    """The glyph's coverage, uint8 [h, w], cropped to its ink box (shape (0, 0) if blank)."""
    mask = font.getmask(chr(code_point), mode="L")
    width, height = mask.size
    array = np.frombuffer(bytes(mask), dtype=np.uint8).reshape(height, width)
    rows = np.flatnonzero((array > INK_THRESHOLD).any(axis=1))
    cols = np.flatnonzero((array > INK_THRESHOLD).any(axis=0))
    if rows.size == 0:
        return np.zeros((0, 0), dtype=np.uint8)
    return array[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1]


def place(ink: np.ndarray, size: int, dy: int = 0, dx: int = 0) -> np.ndarray:
    """Centre an ink-box crop on a black ``size`` x ``size`` canvas, uint8 [size, size].

    A crop larger than the canvas is shrunk to fit (rare: a glyph much wider than typical).
    """
    canvas = np.zeros((size, size), dtype=np.uint8)
    if ink.size == 0:
        return canvas
    h, w = ink.shape
    if h > size or w > size:
        factor = size / max(h, w)
        nh, nw = max(1, round(h * factor)), max(1, round(w * factor))
        ink = np.asarray(Image.fromarray(ink).resize((nw, nh), Image.Resampling.BILINEAR))
        h, w = ink.shape
    top = min(max((size - h) // 2 + dy, 0), size - h)
    left = min(max((size - w) // 2 + dx, 0), size - w)
    canvas[top:top + h, left:left + w] = ink
    return canvas


class GlyphRenderer:
    """Draws glyphs of one font face at ``size`` x ``size``; keeps a FreeType face per pixel size.

    Args:
        path, face_index: the font file and face inside a collection.
        size: output image side in pixels.
        extent: typical ink extent as a fraction of the font size (from the coverage scan);
            a typical glyph's ink box spans ``FILL`` of ``size``.
    """

    def __init__(self, path: str | Path, face_index: int, size: int, extent: float) -> None:
        self.path, self.face_index, self.size = str(path), face_index, size
        self.base_px = size * FILL / extent
        self._fonts: dict[int, ImageFont.FreeTypeFont] = {}

    def _font(self, px: int) -> ImageFont.FreeTypeFont:
        if px not in self._fonts:
            self._fonts[px] = ImageFont.truetype(self.path, px, index=self.face_index)
        return self._fonts[px]

    def render(self, code_point: int, variant: Variant = CANONICAL) -> np.ndarray:
        """uint8 [size, size], white ink on black; all zeros if the glyph is blank."""
        px = max(4, round(self.base_px * variant.scale))
        return place(glyph_mask(self._font(px), code_point), self.size, variant.dy, variant.dx)


def ink_extent(path: str | Path, face_index: int, code_points: list[int]) -> float:
    """Median ink extent (max of ink height and width) / font size over ``code_points``,
    drawn at ``EXTENT_FONT_PX``."""
    font_px = EXTENT_FONT_PX
    font = ImageFont.truetype(str(path), font_px, index=face_index)
    extents = [max(m.shape) for m in (glyph_mask(font, cp) for cp in code_points) if m.size]
    return float(np.median(extents)) / font_px if extents else 1.0

"""Which code points each design really draws, and which designs can be trusted: cached.

The scan, per design and script (han / hangul):

1. cmap: code points mapped to a glyph, minus any glyph that several code points share (the
   placeholder trap: a font mapping thousands of code points to a few reference glyphs), then
   minus code points whose rendering is blank, is the ``.notdef`` box, or repeats another code
   point's rendering in the same font (Baekmuk Dotum and Nanum Square map all 11,172 Hangul
   syllables but draw only the 2,350 common ones; Nanum Square draws Han as a crossed box).
2. scale: the median ink extent of its glyphs (see ``glyph_render``).
3. agreement: a sample of its glyphs is classified by nearest mean among the other families'
   renderings of the same sample. A true design of the script scores far above chance; a font
   drawing Han code points as their Hangul reading, or with a cmap shifted by a few code points,
   scores near zero and is not used for that script.
4. near copies: two designs of different families whose sampled glyphs are near-identical are
   put in one family, so the test split never holds out one while training on the other.

The result is cached as JSON under the cache directory, keyed by every font's path, face, mtime
and size (and the scan version), so only the first build pays for it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from workers.data.cmap import read_cmap
from workers.data.fonts import SCRIPT_RANGES, FontFile, script_of
from workers.data.glyph_render import GlyphRenderer, ink_extent

log = logging.getLogger(__name__)

SCAN_VERSION = 1
CHECK_SIZE = 32
SAMPLE_PER_DESIGN = 120
MIN_SAMPLE = 30
# Nearest-mean accuracy below this means the design does not draw the script's code points
# (docs/data.md gives the scores real designs reach).
MIN_AGREEMENT = 0.15
# Mean correlation of sampled glyphs above this means two designs share outlines.
NEAR_COPY_CORRELATION = 0.9


@dataclass
class DesignCoverage:
    """Scan result for one design: per script, the usable code points and checks."""

    name: str
    code_points: dict[str, list[int]]
    extent: dict[str, float]
    agreement: dict[str, float]
    trusted: dict[str, bool]
    family: dict[str, str]


def _cmap_code_points(font: FontFile) -> dict[str, list[int]]:
    cmap = read_cmap(font.path, font.design.face_index)
    users = Counter(cmap.values())
    by_script: dict[str, list[int]] = defaultdict(list)
    for cp, gid in cmap.items():
        script = script_of(cp)
        if script is not None and users[gid] == 1:
            by_script[script].append(cp)
    return {s: sorted(cps) for s, cps in by_script.items()}


def _unmapped_code_point(font: FontFile) -> int:
    """A code point the font does not map, so Pillow draws ``.notdef`` for it."""
    cmap = read_cmap(font.path, font.design.face_index)
    return next(cp for cp in (0x10FFFD, 0xFFFF, 0xE000, 0xE001) if cp not in cmap)


def _scan_font(font: FontFile) -> tuple[str, dict[str, list[int]], dict[str, float]]:
    """Runs in a pool worker: the code points this font really draws, and its ink extents.

    Drops code points whose rendering is blank, equals the ``.notdef`` rendering, or equals the
    rendering of another code point in the same font (placeholders under distinct glyph ids).
    """
    mapped = _cmap_code_points(font)
    notdef_cp = _unmapped_code_point(font)
    drawn: dict[str, list[int]] = {}
    extents: dict[str, float] = {}
    for script, cps in mapped.items():
        extent = ink_extent(font.path, font.design.face_index, _evenly(cps, 200))
        renderer = GlyphRenderer(font.path, font.design.face_index, CHECK_SIZE, extent)
        notdef = renderer.render(notdef_cp).tobytes()
        digests = {}
        for cp in cps:
            image = renderer.render(cp)
            if image.any():
                digests[cp] = hashlib.blake2b(image.tobytes(), digest_size=8).digest()
        counts = Counter(digests.values())
        notdef_digest = hashlib.blake2b(notdef, digest_size=8).digest()
        kept = [cp for cp, d in digests.items() if counts[d] == 1 and d != notdef_digest]
        if kept:
            drawn[script], extents[script] = kept, extent
        log.debug("font_scanned design=%s script=%s mapped=%d drawn=%d", font.design.name,
                  script, len(cps), len(kept))
    return font.design.name, drawn, extents


def _evenly(items: list[int], k: int) -> list[int]:
    if len(items) <= k:
        return list(items)
    return [items[i] for i in np.linspace(0, len(items) - 1, k).astype(int)]


def _normalise(images: np.ndarray) -> np.ndarray:
    """Rows of float images centred and scaled to unit norm (for correlation)."""
    x = images.reshape(len(images), -1).astype(np.float32)
    x -= x.mean(axis=1, keepdims=True)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-6)


def _check_script(script: str, fonts: list[FontFile], cps: dict[str, dict[str, list[int]]],
                  extents: dict[str, dict[str, float]]) -> tuple[dict, dict, dict]:
    """Agreement scores, trust flags and merged families of every design covering ``script``."""
    names = [f.design.name for f in fonts if cps[f.design.name].get(script)]
    covers = Counter(cp for n in names for cp in cps[n][script])
    samples = {n: _evenly([cp for cp in cps[n][script] if covers[cp] >= 4], SAMPLE_PER_DESIGN)
               for n in names}
    renders: dict[str, dict[int, np.ndarray]] = {}
    wanted = set().union(*samples.values()) if samples else set()
    for font in fonts:
        n = font.design.name
        if n not in samples:
            continue
        renderer = GlyphRenderer(font.path, font.design.face_index, CHECK_SIZE,
                                 extents[n][script])
        own = set(cps[n][script])
        renders[n] = {cp: renderer.render(cp) for cp in sorted(wanted & own)}
    family = {f.design.name: f.design.family_for(script) for f in fonts if f.design.name in names}

    # Near copies first, so agreement compares each design against independent ones only.
    parent = {n: family[n] for n in names}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if parent[a] == parent[b]:
                continue
            common = sorted(set(samples[a]) & renders[b].keys())
            if len(common) < MIN_SAMPLE:
                continue
            xa = _normalise(np.stack([renders[a][cp] for cp in common]))
            xb = _normalise(np.stack([renders[b][cp] for cp in common]))
            corr = float(np.mean(np.sum(xa * xb, axis=1)))
            if corr > NEAR_COPY_CORRELATION:
                old, new = parent[b], parent[a]
                log.info("near_copy script=%s a=%s b=%s correlation=%.3f", script, a, b, corr)
                for n in names:
                    if parent[n] == old:
                        parent[n] = new

    agreement, trusted = {}, {}
    for n in names:
        sample = [cp for cp in samples[n] if cp in renders[n]]
        means, kept = [], []
        for cp in sample:
            others = [renders[m][cp] for m in names if parent[m] != parent[n] and cp in renders[m]]
            if len(others) >= 2:
                means.append(np.mean(others, axis=0))
                kept.append(cp)
        if len(kept) < MIN_SAMPLE:
            agreement[n], trusted[n] = float("nan"), True  # too little overlap to judge
            continue
        own = _normalise(np.stack([renders[n][cp] for cp in kept]))
        ref = _normalise(np.stack(means))
        accuracy = float(np.mean(np.argmax(own @ ref.T, axis=1) == np.arange(len(kept))))
        agreement[n], trusted[n] = accuracy, accuracy >= MIN_AGREEMENT
        if not trusted[n]:
            log.warning("design_untrusted design=%s script=%s agreement=%.3f", n, script,
                        accuracy)
    return agreement, trusted, parent


def _cache_path(cache_dir: Path, fonts: list[FontFile]) -> Path:
    key = json.dumps([SCAN_VERSION, CHECK_SIZE] + [f.cache_key for f in fonts])
    return cache_dir / f"coverage-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def scan_coverage(fonts: list[FontFile], cache_dir: Path | None = None, workers: int = 1
                  ) -> dict[str, DesignCoverage]:
    """Design name -> its coverage; read from ``cache_dir`` when the fonts are unchanged.

    ``workers`` processes render in parallel (the first scan renders every mapped glyph once).
    """
    cache = _cache_path(cache_dir, fonts) if cache_dir is not None else None
    if cache is not None and cache.is_file():
        log.info("coverage_cache_hit path=%s", cache)
        raw = json.loads(cache.read_text())
        return {n: DesignCoverage(**d) for n, d in raw.items()}

    cps: dict[str, dict[str, list[int]]] = {}
    extents: dict[str, dict[str, float]] = {}
    # Largest fonts first so the pool does not end waiting on one big font.
    order = sorted(fonts, key=lambda f: -f.size)
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        for name, drawn, ext in tqdm(pool.imap_unordered(_scan_font, order), total=len(order),
                                     desc="scan fonts", unit="font"):
            cps[name], extents[name] = drawn, ext
    result = {f.design.name: DesignCoverage(f.design.name, cps[f.design.name],
                                            extents[f.design.name], {}, {}, {})
              for f in fonts}
    for script in SCRIPT_RANGES:
        agreement, trusted, family = _check_script(script, fonts, cps, extents)
        for n in agreement:
            result[n].agreement[script] = agreement[n]
            result[n].trusted[script] = trusted[n]
            result[n].family[script] = family[n]
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps({n: vars(c) for n, c in result.items()}))
        tmp.replace(cache)
        log.info("coverage_cache_written path=%s", cache)
    return result

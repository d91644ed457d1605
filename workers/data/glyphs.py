"""Build a many-class glyph dataset: one class per code point, train and test by design.

For each class, its trusted designs are grouped into families (designs sharing outlines);
``test_designs`` families are held out for the test split (every design in them, canonical
rendering only), the rest train (each design rendered with ``TRAIN_VARIANTS[:variants]``: the
canonical image plus small deterministic scale/shift changes). A class needs ``min_designs``
independent families. Classes are chosen deterministically: the code points covered by the most
families first, ties broken by a seeded shuffle; labels follow code point order.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import random
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from workers.data.coverage import DesignCoverage, scan_coverage
from workers.data.errors import DatasetError
from workers.data.fonts import (
    DEFAULT_FONT_DIRS,
    DESIGNS,
    FONT_PACKAGES_FILE,
    FontFile,
    find_fonts,
    script_of,
)
from workers.data.glyph_render import TRAIN_VARIANTS, GlyphRenderer
from workers.data.lmdb_dataset import LmdbImageWriter, encode_png

# image sides a glyph is rendered at: below 8 pixels no glyph is legible, and the renderer
# (PIL's FreeType) refuses sizes in the tens of thousands
MIN_SIZE, MAX_SIZE = 8, 1024
# Code points per render job: a job opens its font once, yet jobs stay small enough for the
# workers, biggest first, to finish at about the same time.
JOB_CODE_POINTS = 400

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GlyphJob:
    """Render ``code_points`` in one design; ``variants`` renderings each (canonical first)."""

    path: str
    face_index: int
    extent: float
    size: int
    code_points: tuple[int, ...]
    variants: int
    design: str


def _render_job(job: GlyphJob) -> tuple[str, int, list[tuple[int, list[bytes]]]]:
    """Pool worker: ``(design, jobs done, [(code point, PNGs)])``; blank glyphs are skipped."""
    renderer = GlyphRenderer(job.path, job.face_index, job.size, job.extent)
    out = []
    for cp in job.code_points:
        images = [renderer.render(cp, v) for v in TRAIN_VARIANTS[:job.variants]]
        if images[0].any():
            out.append((cp, [encode_png(image) for image in images]))
    return job.design, len(job.code_points), out


@dataclass
class ClassPlan:
    """One class: which designs train and which test."""

    code_point: int
    train: list[str]
    test: list[str]


def plan_classes(coverage: dict[str, DesignCoverage], num_classes: int, min_designs: int,
                 test_designs: int, seed: int) -> list[ClassPlan]:
    """Choose classes and split their designs; raises DatasetError if too few qualify."""
    if test_designs < 1 or min_designs < test_designs + 1:
        raise DatasetError(f"need test_designs >= 1 and min_designs > test_designs, got "
                           f"min_designs={min_designs}, test_designs={test_designs}")
    designs_of: dict[int, list[str]] = {}
    for name, cov in coverage.items():
        for script, cps in cov.code_points.items():
            if cov.trusted.get(script, False):
                for cp in cps:
                    designs_of.setdefault(cp, []).append(name)
    families_of = {cp: sorted({coverage[n].family[script_of(cp)] for n in names})
                   for cp, names in designs_of.items()}
    eligible = [cp for cp, fams in families_of.items() if len(fams) >= min_designs]
    if len(eligible) < num_classes:
        remedy = (f"all {len(DESIGNS)} designs xcls renders are installed, so lower "
                  "--classes or --min-designs" if len(coverage) >= len(DESIGNS) else
                  f"{len(coverage)} of the {len(DESIGNS)} designs xcls renders were found: "
                  f"install the others ({FONT_PACKAGES_FILE}) or lower --min-designs")
        raise DatasetError(f"only {len(eligible)} code points are drawn by >= {min_designs} "
                           f"independent designs, asked for {num_classes} classes; {remedy}")
    rng = random.Random(seed)
    rng.shuffle(eligible)
    eligible.sort(key=lambda cp: -len(families_of[cp]))  # stable: the shuffle breaks ties
    plans = []
    for cp in sorted(eligible[:num_classes]):
        fams = families_of[cp]
        held_out = set(random.Random(seed * 1_000_003 + cp).sample(fams, test_designs))
        script = script_of(cp)
        names = sorted(designs_of[cp])
        plans.append(ClassPlan(
            cp, [n for n in names if coverage[n].family[script] not in held_out],
            [n for n in names if coverage[n].family[script] in held_out]))
    return plans


def _jobs(plans: list[ClassPlan], fonts: dict[str, FontFile], coverage: dict[str, DesignCoverage],
          size: int, variants: int) -> list[GlyphJob]:
    """One job per (design, split role, ``JOB_CODE_POINTS`` code points): a worker keeps one
    font open."""
    chunk = JOB_CODE_POINTS
    wanted: dict[tuple[str, int, str], list[int]] = {}
    for plan in plans:
        script = script_of(plan.code_point)
        for names, n_var in ((plan.train, variants), (plan.test, 1)):
            for name in names:
                wanted.setdefault((name, n_var, script), []).append(plan.code_point)
    jobs = []
    for (name, n_var, script), cps in wanted.items():
        font = fonts[name]
        for i in range(0, len(cps), chunk):
            jobs.append(GlyphJob(str(font.path), font.design.face_index,
                                 coverage[name].extent[script], size,
                                 tuple(cps[i:i + chunk]), n_var, name))
    # Big jobs first keeps both workers busy to the end.
    return sorted(jobs, key=lambda j: -len(j.code_points) * j.variants)


def build_glyph_dataset(out: str | Path, *, num_classes: int, size: int = 32,
                        min_designs: int = 4, test_designs: int = 1, variants: int = 2,
                        seed: int = 0, workers: int = 1,
                        font_dirs: tuple[str | Path, ...] = DEFAULT_FONT_DIRS,
                        cache_dir: str | Path | None = None, overwrite: bool = False) -> dict:
    """Write ``out/train``, ``out/test`` (LMDB datasets) and ``out/summary.json``.

    Returns the summary: classes, designs per split, image counts, timings.
    """
    out = Path(out)
    if num_classes < 1:
        raise DatasetError(f"classes must be >= 1, got {num_classes}")
    if not MIN_SIZE <= size <= MAX_SIZE:
        raise DatasetError(f"size must be in [{MIN_SIZE}, {MAX_SIZE}] pixels, got {size}")
    if workers < 1:
        raise DatasetError(f"processes must be >= 1, got {workers}")
    if not 1 <= variants <= len(TRAIN_VARIANTS):
        raise DatasetError(f"variants must be in [1, {len(TRAIN_VARIANTS)}], got {variants}")
    for split in ("train", "test"):
        if (out / split).exists() and not overwrite:
            raise DatasetError(f"{out / split} already exists (use --overwrite to replace it)")
    t0 = time.monotonic()
    found = find_fonts(tuple(font_dirs))
    coverage = scan_coverage(found, Path(cache_dir) if cache_dir else None, workers=workers)
    t_scan = time.monotonic() - t0
    plans = plan_classes(coverage, num_classes, min_designs, test_designs, seed)
    fonts = {f.design.name: f for f in found}
    jobs = _jobs(plans, fonts, coverage, size, variants)

    rendered: dict[tuple[str, int], list[bytes]] = {}
    total = sum(len(j.code_points) for j in jobs)
    with multiprocessing.get_context("fork").Pool(workers) as pool, \
            tqdm(total=total, desc="render glyphs", unit="glyph") as bar:
        for design, done, items in pool.imap_unordered(_render_job, jobs):
            for cp, pngs in items:
                rendered[(design, cp)] = pngs
            bar.update(done)
    t_render = time.monotonic() - t0 - t_scan

    class_names = [f"U+{p.code_point:04X}" for p in plans]
    counts = {"train": 0, "test": 0}
    designs_used: dict[str, set[str]] = {"train": set(), "test": set()}
    per_split_sources = {"generator": "xcls data glyphs", "size": size, "seed": seed,
                         "min_designs": min_designs, "test_designs": test_designs,
                         "variants": variants,
                         "fonts": {n: str(f.path) for n, f in fonts.items()}}
    writers = {split: LmdbImageWriter(out / split, height=size, width=size, channels=1,
                                      class_names=class_names, split=split,
                                      sources=per_split_sources, overwrite=overwrite)
               for split in ("train", "test")}
    try:
        for label, plan in enumerate(plans):
            for split, names in (("train", plan.train), ("test", plan.test)):
                for name in names:
                    for png in rendered.get((name, plan.code_point), []):
                        writers[split].add_encoded(png, label)
                        counts[split] += 1
                        designs_used[split].add(name)
        metas = {split: w.close() for split, w in writers.items()}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    summary = {
        "classes": len(plans),
        "size": size,
        "seed": seed,
        "min_designs": min_designs,
        "test_designs_per_class": test_designs,
        "train_variants_per_design": variants,
        "images": counts,
        "classes_in_split": {s: len(set(metas[s].class_names)) for s in metas},
        "designs_used": {s: sorted(v) for s, v in designs_used.items()},
        "untrusted": {n: [s for s, ok in c.trusted.items() if not ok]
                      for n, c in coverage.items() if not all(c.trusted.values())},
        "families": {n: c.family for n, c in coverage.items()},
        "seconds": {"scan": round(t_scan, 1), "render": round(t_render, 1),
                    "total": round(time.monotonic() - t0, 1)},
        "class_designs": {f"U+{p.code_point:04X}": {"train": p.train, "test": p.test}
                          for p in plans},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    log.info("glyph_dataset_built out=%s classes=%d train=%d test=%d seconds=%.1f", out,
             len(plans), counts["train"], counts["test"], summary["seconds"]["total"])
    return summary

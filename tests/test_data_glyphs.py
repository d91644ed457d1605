"""Glyph dataset builder on a small set of the installed Debian fonts (the setup installs them)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from workers.data.coverage import DesignCoverage
from workers.data.errors import DatasetError
from workers.data.fonts import DESIGNS, script_of
from workers.data.glyphs import build_glyph_dataset, plan_classes
from workers.data.lmdb_dataset import LmdbImageDataset


@pytest.fixture(scope="module")
def built(small_font_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("glyphs")
    summary = build_glyph_dataset(out, num_classes=50, size=24, min_designs=4, test_designs=1,
                                  variants=2, seed=3, workers=2, font_dirs=(small_font_dir,),
                                  cache_dir=out / "cache")
    return out, summary


def test_splits_written_with_labels_in_range(built):
    out, summary = built
    assert json.loads((out / "summary.json").read_text())["classes"] == 50
    for split in ("train", "test"):
        ds = LmdbImageDataset(out / split)
        assert ds.metadata.num_classes == 50 and ds.metadata.height == 24
        labels = ds.labels()
        assert labels.min() >= 0 and labels.max() < 50
        assert len(np.unique(labels)) == 50  # every class has train and test images
        for i in range(0, len(ds), max(1, len(ds) // 200)):
            _, image, _ = ds[i]
            assert image.shape == (1, 24, 24) and int(image.max()) > 0  # no blank images
    assert all(name.startswith("U+") for name in ds.metadata.class_names)


def test_test_families_never_in_train(built):
    _, summary = built
    family = {d.name: d for d in DESIGNS}
    for name, split in summary["class_designs"].items():
        script = script_of(int(name[2:], 16))
        fam = {n: summary["families"][n][script] for n in split["train"] + split["test"]}
        train_fams = {fam[n] for n in split["train"]}
        test_fams = {fam[n] for n in split["test"]}
        assert test_fams and train_fams and not (test_fams & train_fams)
        assert len(train_fams | test_fams) >= 4
        # NanumGothic and its bold share a family: both land on the same side.
        both = {"nanum-gothic", "nanum-gothic-bold"}
        sides = {("train" if n in split["train"] else "test") for n in both
                 if n in split["train"] + split["test"]}
        assert len(sides) <= 1
        assert all(n in family for n in fam)


def test_deterministic_class_choice(built, small_font_dir, tmp_path):
    _, summary = built
    again = build_glyph_dataset(tmp_path / "again", num_classes=50, size=24, seed=3, workers=1,
                                variants=1, font_dirs=(small_font_dir,),
                                cache_dir=Path(built[0]) / "cache")
    assert list(again["class_designs"]) == list(summary["class_designs"])


@pytest.mark.parametrize("kwargs,match", [
    ({"num_classes": 0}, "classes must be >= 1, got 0"),
    ({"num_classes": -3}, "classes must be >= 1, got -3"),  # was: every code point
    ({"size": 0}, r"size must be in \[8, 1024\] pixels, got 0"),
    ({"size": 100_000}, r"size must be in \[8, 1024\] pixels, got 100000"),
    ({"workers": 0}, "processes must be >= 1, got 0"),
])
def test_impossible_settings_are_refused_before_any_work(tmp_path, kwargs, match):
    with pytest.raises(DatasetError, match=match):
        build_glyph_dataset(tmp_path / "out", **{"num_classes": 10, **kwargs})
    assert not (tmp_path / "out").exists()


def test_missing_fonts_clear_error(tmp_path):
    empty = tmp_path / "no-fonts"
    empty.mkdir()
    with pytest.raises(DatasetError, match="debian-fonts.txt.*apt-get install"):
        build_glyph_dataset(tmp_path / "out", num_classes=10, font_dirs=(empty,))


def test_too_many_classes_clear_error(small_font_dir, built, tmp_path):
    # the small font dir holds 7 of the known designs: the message says so and what to install
    with pytest.raises(DatasetError, match=r"independent designs.*7 of the \d+ designs xcls "
                                           r"renders were found: install the others "
                                           r"\(scripts/debian-fonts.txt\)"):
        build_glyph_dataset(tmp_path / "o", num_classes=10**6, font_dirs=(small_font_dir,),
                            cache_dir=Path(built[0]) / "cache")


def test_too_many_classes_with_every_design_installed_says_lower_the_ask():
    # every known design found, each drawing the same 3 code points as its own family
    coverage = {d.name: DesignCoverage(d.name, {"han": [0x4E00, 0x4E01, 0x4E02]}, {"han": 1.0},
                                       {"han": 1.0}, {"han": True}, {"han": d.name})
                for d in DESIGNS}
    assert len(plan_classes(coverage, 3, min_designs=4, test_designs=1, seed=0)) == 3
    with pytest.raises(DatasetError, match=r"only 3 code points .* asked for 4 classes; all "
                                           r"\d+ designs xcls renders are installed, so lower "
                                           r"--classes or --min-designs"):
        plan_classes(coverage, 4, min_designs=4, test_designs=1, seed=0)

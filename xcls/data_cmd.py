"""``xcls data ...``: build and inspect LMDB image datasets.

The builders and readers import torch (a couple of seconds), so each subcommand imports its
own when it runs: ``xcls --help`` and the other commands start at once."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from workers.data.errors import DatasetError
from workers.data.fonts import DEFAULT_FONT_DIRS

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "xcls", "fonts")


def _run(fn, *args, **kwargs) -> int:  # noqa: ANN001 - fn is any importer/builder
    try:
        fn(*args, **kwargs)
    except DatasetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # an output that cannot be written, a disk that filled up
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    return 0


def cmd_glyphs(args: argparse.Namespace) -> int:
    from workers.data.glyphs import build_glyph_dataset

    def build() -> None:
        summary = build_glyph_dataset(
            args.out, num_classes=args.classes, size=args.size, min_designs=args.min_designs,
            test_designs=args.test_designs, variants=args.variants, seed=args.seed,
            workers=args.processes, font_dirs=tuple(args.font_dir or DEFAULT_FONT_DIRS),
            cache_dir=args.cache_dir,
            overwrite=args.overwrite)
        print(f"wrote {args.out}/train ({summary['images']['train']} images) and "
              f"{args.out}/test ({summary['images']['test']} images), {summary['classes']} "
              f"classes, in {summary['seconds']['total']} s; summary: {args.out}/summary.json")
    return _run(build)


def cmd_folder(args: argparse.Namespace) -> int:
    from workers.data.importers import import_folder, import_folder_splits

    if args.test_fraction is None:
        def build() -> None:
            meta = import_folder(args.root, args.out, size=args.size, channels=args.channels,
                                 split=args.split, overwrite=args.overwrite)
            print(f"wrote {args.out} ({meta.num_samples} images, {meta.num_classes} classes, "
                  f"split {meta.split})")
        return _run(build)
    if args.split != "train":
        print("error: --split names the one split written without --test-fraction; with it "
              "the splits are OUT/train and OUT/test", file=sys.stderr)
        return 2

    def build_splits() -> None:
        train, test = import_folder_splits(
            args.root, args.out, size=args.size, channels=args.channels,
            test_fraction=args.test_fraction, seed=args.seed, overwrite=args.overwrite)
        print(f"wrote {args.out}/train ({train.num_samples} images) and {args.out}/test "
              f"({test.num_samples} images), {train.num_classes} classes")
    return _run(build_splits)


def cmd_rec(args: argparse.Namespace) -> int:
    from workers.data.importers import import_recordio

    return _run(import_recordio, args.rec, args.out, size=args.size, channels=args.channels,
                idx=args.idx, split=args.split, overwrite=args.overwrite, workers=args.processes,
                num_classes=args.num_classes)


def cmd_bin(args: argparse.Namespace) -> int:
    from workers.data.importers import import_pairs_bin

    return _run(import_pairs_bin, args.bin, args.out, size=args.size, channels=args.channels,
                overwrite=args.overwrite)


def cmd_info(args: argparse.Namespace) -> int:
    from workers.data.lmdb_dataset import read_metadata, verify_dataset

    def show() -> None:
        metadata = read_metadata(args.path)
        meta, names = asdict(metadata), metadata.class_names
        meta["class_names"] = names[:10] + (["..."] if len(names) > 10 else [])
        if args.verify:
            meta["verified"] = verify_dataset(args.path)
        print(json.dumps(meta, indent=1, ensure_ascii=False))
    return _run(show)


def _add_output_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="dataset directory to create")
    p.add_argument("--size", type=int, default=32, help="image side in pixels (default 32)")
    p.add_argument("--split", default="train", help="split name stored in the metadata")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser("data", help="build and inspect datasets (LMDB images)",
                                 description="Build LMDB image datasets that 'xcls train' reads, "
                                 "and inspect them. Format: docs/data.md.")
    sub = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)

    g = sub.add_parser("glyphs", help="render a many-class dataset from Debian's CJK/Hangul fonts",
                       description="One class per Unicode code point, drawn by several typeface "
                       "designs; the test split holds out designs (with their near-copies) that "
                       "training never sees for that class. Needs the packages in "
                       "scripts/debian-fonts.txt (sudo xargs -a scripts/debian-fonts.txt "
                       "apt-get install -y). Writes OUT/train, OUT/test and OUT/summary.json.")
    g.add_argument("--classes", type=int, default=2000, help="number of classes (default 2000)")
    g.add_argument("--size", type=int, default=32, help="image side in pixels (default 32)")
    g.add_argument("--min-designs", type=int, default=4,
                   help="independent designs a code point needs to become a class (default 4)")
    g.add_argument("--test-designs", type=int, default=1,
                   help="designs (families) per class held out for the test split (default 1)")
    g.add_argument("--variants", type=int, default=2,
                   help="train images per train design: 1 = canonical only, up to 5 adds small "
                   "scale/shift changes (default 2)")
    g.add_argument("--out", required=True, help="output directory")
    g.add_argument("--seed", type=int, default=0, help="seed for class choice and held-out designs")
    g.add_argument("--processes", type=int, default=os.cpu_count() or 1,
                   help="render processes (default: number of cores)")
    g.add_argument("--font-dir", action="append", default=[],
                   help="where to look for fonts (repeatable; default /usr/share/fonts)")
    g.add_argument("--cache-dir", default=DEFAULT_CACHE,
                   help=f"font coverage scan cache (default {DEFAULT_CACHE})")
    g.add_argument("--overwrite", action="store_true", help="replace existing OUT/train, OUT/test")
    g.set_defaults(func=cmd_glyphs)

    f = sub.add_parser("folder", help="import ROOT/<class>/<image> folders",
                       description="One sub-folder per class (sorted names become labels 0..N-1); "
                       "every image inside is resized to --size x --size. Writes the dataset "
                       "OUT; with --test-fraction, OUT/train and OUT/test (data.train and "
                       "data.test of a config).")
    f.add_argument("root", help="folder holding one sub-folder per class")
    _add_output_options(f)
    f.add_argument("--test-fraction", type=float, metavar="F",
                   help="hold out this share of each class's images, chosen at random, as a "
                   "test split: writes OUT/train and OUT/test (e.g. 0.1; every class keeps at "
                   "least one training image)")
    f.add_argument("--seed", type=int, default=0,
                   help="seed of the --test-fraction choice (default 0)")
    f.add_argument("--channels", type=int, choices=(1, 3), default=3,
                   help="1 = grayscale, 3 = RGB (default 3)")
    f.set_defaults(func=cmd_folder)

    r = sub.add_parser("rec", help="import an insightface train.rec/train.idx (no mxnet needed)",
                       description="Reads MXNet RecordIO as insightface writes it (MS1M, "
                       "Glint360K, WebFace: header record 0 whose labels give the image range, "
                       "then one image per record, its class a float or the first of a float "
                       "array). Records are read by their .idx offsets and decoded in --processes "
                       "processes; JPEGs that already have --size are kept byte for byte.")
    r.add_argument("rec", help="path to train.rec")
    r.add_argument("--processes", type=int, default=os.cpu_count() or 1,
                   help="decode processes (default: number of cores)")
    r.add_argument("--idx", help="path to train.idx (default: next to the .rec)")
    r.add_argument("--num-classes", type=int, metavar="C",
                   help="the class count: class ids are 0..C-1 (default: one more than the "
                   "largest id, which may not exceed the number of images; give C for sparse "
                   "ids, such as a subset of a larger set)")
    _add_output_options(r)
    r.add_argument("--channels", type=int, choices=(1, 3), default=3,
                   help="1 = grayscale, 3 = RGB (default 3)")
    r.set_defaults(func=cmd_rec)

    b = sub.add_parser("bin", help="import an insightface verification pair set (.bin)",
                       description="Reads lfw.bin, cfp_fp.bin, agedb_30.bin and the like (a "
                       "pickle of 2n encoded images and n same/different flags; nothing in it "
                       "is run) into a pair dataset for data.verification: samples 2i and 2i+1 "
                       "are pair i, labelled 1 (same) or 0 (different).")
    b.add_argument("bin", help="path to the .bin pair file")
    b.add_argument("--out", required=True, help="dataset directory to create")
    b.add_argument("--size", type=int, default=112, help="image side in pixels (default 112)")
    b.add_argument("--channels", type=int, choices=(1, 3), default=3,
                   help="1 = grayscale, 3 = RGB (default 3)")
    b.add_argument("--overwrite", action="store_true", help="replace an existing dataset")
    b.set_defaults(func=cmd_bin)

    i = sub.add_parser("info", help="print a dataset's metadata",
                       description="Print the metadata record of an LMDB dataset as JSON.")
    i.add_argument("path", help="dataset directory")
    i.add_argument("--verify", action="store_true",
                   help="also read and decode every record (checks CRCs, sizes, labels)")
    i.set_defaults(func=cmd_info)

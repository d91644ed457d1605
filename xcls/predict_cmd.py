"""``xcls predict``: classify image files with a model that ``xcls export`` wrote."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from xcls.cli_help import DefaultsHelpFormatter


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "predict", help="classify image files with an exported model",
        description="Print the top-k classes of each image, one JSON line per image: "
        '{"image": PATH, "classes": [names], "ids": [class ids], "scores": [cosines]}, best '
        "first. MODEL is a directory written by 'xcls export'; its class rows stay "
        "memory-mapped. Images (PNG, JPEG, ...) are converted to the model's channels and "
        "resized to its input size.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("model", type=Path, help="export directory ('xcls export --out')")
    p.add_argument("images", type=Path, nargs="+", help="image files")
    p.add_argument("--topk", type=int, default=5, help="classes per image")
    p.add_argument("--device", default="auto",
                   help="auto (CUDA when there is one), cpu, cuda or cuda:N")
    p.add_argument("--batch-size", type=int, default=256,
                   help="images read and passed through the backbone at a time")
    p.set_defaults(func=run_predict)


def run_predict(args: argparse.Namespace) -> int:
    import numpy as np

    from workers.data.errors import DatasetError
    from workers.data.importers import load_image
    from workers.predict import Classifier

    if args.topk < 1 or args.batch_size < 1:
        raise SystemExit(f"error: --topk {args.topk} and --batch-size {args.batch_size} must "
                         "be >= 1")
    try:
        clf = Classifier.load(args.model, device=args.device)
    except (OSError, ValueError, RuntimeError) as e:
        raise SystemExit(f"error: {args.model}: cannot load the model ({e})") from None
    for start in range(0, len(args.images), args.batch_size):
        paths = args.images[start:start + args.batch_size]
        try:
            images = np.stack([load_image(path, clf.image_size, clf.channels, str(path))
                               for path in paths])
        except DatasetError as e:
            raise SystemExit(f"error: {e}") from None
        if clf.channels == 3:
            images = images.transpose(0, 3, 1, 2)  # (N, H, W, C) -> (N, C, H, W)
        try:
            ids, scores = clf.predict(images, topk=args.topk, batch_size=args.batch_size)
        except ValueError as e:  # a damaged export's rows
            raise SystemExit(f"error: {args.model}: {e}") from None
        for path, names, row_ids, row_scores in zip(paths, clf.names(ids), ids.tolist(),
                                                    scores.tolist(), strict=True):
            print(json.dumps({"image": str(path), "classes": names, "ids": row_ids,
                              "scores": [round(s, 6) for s in row_scores]},
                             ensure_ascii=False))
    return 0

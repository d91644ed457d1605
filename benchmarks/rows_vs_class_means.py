"""Is a head's accuracy gap in its class rows or in its backbone?

    python benchmarks/rows_vs_class_means.py data/glyphs-10k model-full/ model-knn/

For each export directory (``xcls export``), embeds the training split with the model's own
backbone and takes each class's mean feature direction (``workers.predict.class_means``,
what ``xcls export --rows class-means`` writes). Then classifies the test split (unseen
designs) twice, by nearest trained row and by nearest class mean, and prints one markdown row
per model. Class means depend on the backbone alone, so two models whose class-mean accuracy
agrees have equally good features, and a gap left in their row accuracy lies in the rows the
head trained. Also printed: top-1 on the training images by trained rows (how well the rows
fit them) and the mean cosine of each class's row to its class mean.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from workers.data.lmdb_dataset import LmdbImageDataset
from workers.predict import Classifier, class_means, nearest_classes


def load_split(path: Path, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images (n, C, H, W) and int64 labels (n,) of an LMDB split: all of it, or a
    seeded random ``limit`` of its ids when ``limit`` > 0."""
    split = LmdbImageDataset(path)
    ids = torch.arange(len(split))
    if 0 < limit < len(split):
        ids = torch.randperm(len(split), generator=torch.Generator().manual_seed(0))[:limit]
    images = torch.stack([split[i][1] for i in tqdm(ids.tolist(), desc=path.name, leave=False)])
    labels = torch.as_tensor(split.labels(), dtype=torch.int64)[ids]
    return images, labels


def top1(features: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor) -> float:
    """Percent of features whose highest-cosine row is their label's."""
    ids, _ = nearest_classes(features, [(torch.arange(rows.shape[0]), rows)], 1)
    return 100.0 * float((ids[:, 0] == labels).float().mean())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("data", type=Path, help="dataset directory with train/ and test/ splits")
    p.add_argument("exports", type=Path, nargs="+", help="export directories (xcls export)")
    p.add_argument("--train-limit", type=int, default=0,
                   help="embed only this many training images (0: all)")
    args = p.parse_args(argv)
    train_images, train_labels = load_split(args.data / "train", args.train_limit)
    test_images, test_labels = load_split(args.data / "test", 0)
    print("| model | top-1 by rows | top-1 by class means | train top-1 by rows "
          "| mean cos(row, class mean) |")
    print("|---|---:|---:|---:|---:|")
    for path in args.exports:
        clf = Classifier.load(path)
        train_features = clf.embed(train_images)
        test_features = clf.embed(test_images)
        means, counts = class_means([(train_features, train_labels)], *clf.rows.shape)
        seen = counts > 0
        cos = (F.normalize(clf.rows.float(), dim=1) * means).sum(dim=1)[seen].mean()
        print(f"| {path} | {top1(test_features, clf.rows, test_labels):.2f} % "
              f"| {top1(test_features, means, test_labels):.2f} % "
              f"| {top1(train_features, clf.rows, train_labels):.2f} % | {float(cos):.3f} |",
              flush=True)


if __name__ == "__main__":
    main()

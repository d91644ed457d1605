"""Where a model's test errors lie in the class-row neighborhood of the true class.

    python benchmarks/error_ranks.py data/glyphs-10k/test model-full/ model-knn/

For each export directory (``xcls export``), classifies the test split by nearest row and,
for every wrong prediction, finds the rank of the predicted class in the true class's
neighbor list over the model's own normalized rows (rank 1 = the true class's nearest other
class). Prints one markdown row per model: errors by rank bucket. A head that trains against
too few or stale neighbors shows its extra errors at low ranks.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from results import record, table_row

from ams.graph import knn
from workers.data.lmdb_dataset import LmdbImageDataset
from workers.predict import Classifier

BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 64))


def error_ranks(clf: Classifier, images: torch.Tensor, labels: torch.Tensor,
                depth: int) -> tuple[int, torch.Tensor]:
    """(errors, rank of each error's predicted class among the true class's ``depth``
    nearest other rows: int64 (errors,), 1-based, 0 where it is not among them)."""
    ids, _ = clf.predict(images, topk=1)
    wrong = ids[:, 0] != labels
    rows = F.normalize(clf.rows.float(), dim=1)
    neighbors, _ = knn(rows, depth + 1)
    lists = neighbors[labels[wrong]]
    hit = lists == ids[wrong, :1]
    rank = torch.where(hit.any(dim=1), hit.float().argmax(dim=1), 0)
    return int(wrong.sum()), rank


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("test", type=Path, help="LMDB test split (e.g. data/glyphs-10k/test)")
    p.add_argument("exports", type=Path, nargs="+", help="export directories (xcls export)")
    args = p.parse_args(argv)
    test = LmdbImageDataset(args.test)
    images = torch.stack([test[i][1] for i in range(len(test))])
    labels = torch.as_tensor(test.labels(), dtype=torch.int64)
    depth = BUCKETS[-1][1]
    head = " | ".join(f"rank {lo}" if lo == hi else f"rank {lo}-{hi}" for lo, hi in BUCKETS)
    header = f"| model | top-1 | errors | {head} | rank > {depth} |"
    print(header)
    print("|---" + "|---:" * (len(BUCKETS) + 3) + "|")
    rows = []
    for path in args.exports:
        clf = Classifier.load(path)
        errors, rank = error_ranks(clf, images, labels, depth)
        counts = [int(((rank >= lo) & (rank <= hi)).sum()) for lo, hi in BUCKETS]
        top1 = 100 * (1 - errors / len(labels))
        line = (f"| {path} | {top1:.2f} % | {errors} | "
                + " | ".join(map(str, counts)) + f" | {int((rank == 0).sum())} |")
        print(line)
        rows.append({**table_row(header, line), "top-1": round(top1, 2)})
    record("error_ranks", rows)


if __name__ == "__main__":
    main()

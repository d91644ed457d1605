"""How evenly a trained run's neighbor graph spreads the knn head's negatives.

A class is a knn negative when it is among the first ranks of a batch label's list, so how often
each class is taken follows its in-degree in the graph truncated to those ranks. Prints, for
ranks 1..r, the in-degree's maximum, the share of all in-edges held by the top 1 % of classes,
and the fraction of classes that no list contains (never a neighbor-negative).

    python benchmarks/graph_indegree.py runs/accuracy-study/knn --ranks 1,3,15
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from ams.shard.restore import read_piece


def load_graph(run_dir: Path, table: str) -> torch.Tensor:
    """The newest snapshot's neighbor lists of ``table``, (N, k) int64 in class order."""
    snapshots = sorted((run_dir / "ams" / "snapshots").glob("step-*"))
    if not snapshots:
        raise SystemExit(f"error: no AMS snapshot under {run_dir / 'ams' / 'snapshots'}")
    pieces = sorted(snapshots[-1].iterdir())
    lists = []
    for piece in pieces:
        t = read_piece(piece)[1][table]
        if "graph_neighbors" not in t:
            raise SystemExit(f"error: {piece} holds no graph (was the run's head knn?)")
        lists.append(t["graph_neighbors"].view(t["rows"].shape[0], -1))
    num_shards = len(lists)
    graph = torch.empty(sum(len(x) for x in lists), lists[0].shape[1], dtype=torch.int64)
    for shard, rows in enumerate(lists):
        graph[shard::num_shards] = rows  # class c lives on shard c mod S, at c // S
    return graph


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="a training run's out_dir (holds ams/snapshots)")
    p.add_argument("--table", default="fc")
    p.add_argument("--ranks", default="1,3,15", help="comma-separated list depths r")
    args = p.parse_args()
    graph = load_graph(args.run, args.table)
    n = graph.shape[0]
    print("| ranks | mean in-degree | max | top 1 % share | never a neighbor |")
    print("|---|---:|---:|---:|---:|")
    for r in (int(x) for x in args.ranks.split(",")):
        cols = graph[:, 1:r + 1].reshape(-1).numpy()
        indeg = np.bincount(cols[cols >= 0], minlength=n)
        top = np.sort(indeg)[::-1][:max(1, n // 100)].sum() / max(indeg.sum(), 1)
        print(f"| 1..{r} | {indeg.mean():.2f} | {indeg.max()} | {100 * top:.1f} % | "
              f"{100 * np.mean(indeg == 0):.1f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

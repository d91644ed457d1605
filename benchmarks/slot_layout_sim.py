"""Would slots in the graph's order cut the pages a knn step reads from a table beyond RAM?

A simulation, not a timing: the slot maps of an mmap table (``ams.shard.slots.RowSlots``, the
product's own relocation) under a knn trainer's pushes, and the distinct 4 KiB row pages each
step touches per active row. Labels are uniform over the classes; the active rows of a step
are the labels and their k neighbors, routed to shards by ``id mod shards``; every active row
is pushed, so it moves to the free slots at its shard's cursor.

The graph is a stand-in that favours the layout: classes fall in random clusters of
``--cluster`` ids, and a class's neighbors are drawn from its own cluster (a trained graph is
less tidy). Three layouts, each from the same steps:

* class order: slots as a table is created (row p in slot p), pushes in position order;
* graph order: slots assigned once in breadth-first order of each shard's part of the graph
  (a compaction at graph install), pushes in position order;
* graph order, kept: the same start, and each push's rows take their new slots in that order.

After the steps in class order it counts the free slots on each page: whether pushes could
write into pages with no live row (none to read first), as a log-structured store would.

    python benchmarks/slot_layout_sim.py                 # about 10 s
    python benchmarks/slot_layout_sim.py --classes 40000 --steps 300   # a smoke run
"""

from __future__ import annotations

import argparse
from collections import deque

import numpy as np
import torch
from results import record, table_row

from ams.shard.slots import RowSlots, slot_capacity

PAGE_BYTES = 4096


def clustered_graph(rng: np.random.Generator, classes: int, k: int, cluster: int
                    ) -> np.ndarray:
    """(classes, k) int64 neighbor ids, each drawn from the class's own random cluster."""
    cluster_of = rng.permutation(classes) // cluster
    members = np.argsort(cluster_of, kind="stable")
    start = np.searchsorted(cluster_of[members], cluster_of)
    size = np.bincount(cluster_of)[cluster_of]
    pick = (rng.random((classes, k)) * size[:, None]).astype(np.int64)
    return members[start[:, None] + pick]


def graph_rank(graph: np.ndarray, shard: int, shards: int) -> np.ndarray:
    """Breadth-first rank of each of ``shard``'s positions over its own part of the graph."""
    owned = np.arange(shard, graph.shape[0], shards)
    seen = np.zeros(owned.size, dtype=bool)
    order: list[int] = []
    for root in range(owned.size):
        if seen[root]:
            continue
        seen[root] = True
        queue = deque([root])
        while queue:
            p = queue.popleft()
            order.append(p)
            for n in graph[owned[p]]:
                if n % shards == shard and not seen[n // shards]:
                    seen[n // shards] = True
                    queue.append(n // shards)
    rank = np.empty(owned.size, dtype=np.int64)
    rank[np.asarray(order)] = np.arange(owned.size)
    return rank


def pages_per_active_row(graph: np.ndarray, shards: int, slots: list[RowSlots],
                         ranks: list[np.ndarray] | None, rows_per_page: int, batch: int,
                         steps: int, seed: int) -> np.ndarray:
    """Distinct row pages touched per active row, one figure per step."""
    rng = np.random.default_rng(seed)
    out = np.empty(steps)
    for t in range(steps):
        labels = rng.integers(0, graph.shape[0], batch)
        active = np.unique(np.concatenate([labels, graph[labels].ravel()]))
        pages = 0
        for s in range(shards):
            positions = active[active % shards == s] // shards
            pages += np.unique(slots[s].slot_of[positions] // rows_per_page).size
            if ranks is not None:
                positions = positions[np.argsort(ranks[s][positions])]
            slots[s].relocate(torch.from_numpy(positions))
        out[t] = pages / active.size
    return out


def free_slots_per_page(slots: list[RowSlots], rows_per_page: int) -> np.ndarray:
    """Free slots on each whole page of every shard's slots, one count per page."""
    counts = []
    for m in slots:
        whole = m.capacity // rows_per_page * rows_per_page
        counts.append((~m.used[:whole]).reshape(-1, rows_per_page).sum(axis=1))
    return np.concatenate(counts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--classes", type=int, default=400_000)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--k", type=int, default=12, help="neighbors per class")
    p.add_argument("--batch", type=int, default=256, help="labels per step")
    p.add_argument("--cluster", type=int, default=64, help="classes per stand-in cluster")
    p.add_argument("--row-bytes", type=int, default=256, help="d = 128, float16")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = np.random.default_rng(args.seed)
    graph = clustered_graph(rng, args.classes, args.k, args.cluster)
    ranks = [graph_rank(graph, s, args.shards) for s in range(args.shards)]
    rows_per_page = PAGE_BYTES // args.row_bytes
    early, late = 100, min(300, args.steps // 2)

    def slot_maps(by_rank: bool) -> list[RowSlots]:
        maps = []
        for s in range(args.shards):
            owned = ranks[s].size
            start = ranks[s] if by_rank else np.arange(owned)
            maps.append(RowSlots(start.copy(), slot_capacity(owned), owned))
        return maps

    print(f"# {args.classes:,} classes, {args.shards} shards, k = {args.k}, batch {args.batch}, "
          f"clusters of {args.cluster}, {rows_per_page} rows a page, {args.steps} steps")
    header = ("| slots | pushed rows take new slots in | pages per active row, first "
              f"{early} steps | last {late} steps |")
    print(f"{header}\n|---|---|---:|---:|")
    rows = []
    census = None
    for name, by_rank, keep in (("class order", False, False), ("graph order", True, False),
                                ("graph order", True, True)):
        maps = slot_maps(by_rank)
        figures = pages_per_active_row(graph, args.shards, maps, ranks if keep else None,
                                       rows_per_page, args.batch, args.steps, args.seed + 1)
        line = (f"| {name} | {'graph order' if keep else 'position order'} | "
                f"{figures[:early].mean():.3f} | {figures[-late:].mean():.3f} |")
        print(line, flush=True)
        rows.append(table_row(header, line))
        if census is None:
            census = free_slots_per_page(maps, rows_per_page)
    print(f"\nFree slots a page after the steps in class order: mean {census.mean():.2f} of "
          f"{rows_per_page}, at most {census.max()}; pages with no live row: "
          f"{int((census == rows_per_page).sum()):,} of {census.size:,}")
    record("slot_layout_sim", rows, table="pages")
    record("slot_layout_sim", [{"order": "class order", "pages": census.size,
                                "free slots a page, mean": round(float(census.mean()), 2),
                                "free slots a page, max": int(census.max()),
                                "pages with no live row": int((census == rows_per_page).sum()),
                                "slots a page": rows_per_page}], table="free slots")


if __name__ == "__main__":
    main()

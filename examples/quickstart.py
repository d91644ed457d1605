"""Start two AMS shard processes on 127.0.0.1 and use the client API against them.

    python examples/quickstart.py [--rows 1000000] [--dim 128]

What it shows: create a table, pull rows, push gradients (sparse momentum SGD on the shards),
snapshot, and stats; then the same calls on the in-process (embedded) AMS.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

import ams
from xcls.shards import shard_processes


def tour(client: ams.ShardedClient, rows: int, dim: int, where: str) -> None:
    client.create_table("fc", num_rows=rows, dim=dim, dtype="float16", momentum=0.9,
                        weight_decay=5e-4, seed=0)
    ids = torch.randint(0, rows, (10_000,))
    t0 = time.perf_counter()
    w = client.pull("fc", ids)
    t1 = time.perf_counter()
    client.push("fc", ids, torch.randn(ids.numel(), dim) * 0.01, lr=0.1)
    t2 = time.perf_counter()
    moved = (client.pull("fc", ids).float() - w.float()).norm(dim=1).mean()
    print(f"[{where}] pulled {tuple(w.shape)} {w.dtype} in {1e3 * (t1 - t0):.1f} ms, "
          f"pushed in {1e3 * (t2 - t1):.1f} ms, rows moved by {moved:.4f} on average")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="classes in the table")
    parser.add_argument("--dim", type=int, default=128, help="row width")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, \
            shard_processes(2, data_dir=Path(tmp), xcls_flags=["-q"]) as shards:
        addresses = [shard.address for shard in shards]
        with ams.connect(addresses) as client:
            tour(client, args.rows, args.dim, "2 gRPC shards " + ",".join(addresses))
            print("snapshot pieces:", *client.snapshot(step=1), sep="\n  ")
            for s in client.stats():
                t = s["tables"]["fc"]
                print(f"  shard {s['shard_id']}: {t['owned_rows']} rows, "
                      f"{(t['row_bytes'] + t['state_bytes']) / 2**20:.0f} MiB, "
                      f"{t['rows_pulled']} rows pulled, {t['rows_pushed']} pushed")
    with ams.connect(local_shards=2) as client:
        tour(client, args.rows, args.dim, "embedded, 2 in-process shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())

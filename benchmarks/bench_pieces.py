"""How large the data plane's pieces should be where rows go through the client's shared
buffer: pulls into a result there, and pushes, with each size taking turns in one run.

    python benchmarks/bench_pieces.py            # about 2.5 minutes on a 2-core host
    python benchmarks/bench_pieces.py --quick    # smoke run

A pull or push to a shard travels as pieces, a few on the wire at once, so that the shard
works on one while the client sends or takes the next. Over a socket that pipelining hides
the copies; through the shared buffer (``ams/shm.py``) no row crosses the socket, and each
piece costs a round trip. This measures both choices against 2 MiB pieces (``PIECE_BYTES``,
what rows crossing the socket use): a pull into a result in the shared buffer asking each
shard for up to ``ShardedClient.direct_pull_bytes`` at once, and pushes in pieces of
``SHARED_PIECE_BYTES``. S ``xcls serve shard`` processes on 127.0.0.1, one client, random
unique ids; the sizes take turns, ``--calls`` calls a turn, and cells are medians over turns
of ms per call.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from results import record, table_row

import ams
from ams.wire import PIECE_BYTES, SHARED_PIECE_BYTES
from xcls.shards import shard_processes


def timed_turns(calls: int, turns: int, variants: dict, work) -> dict[str, float]:
    """Median ms per call of ``work(i)`` under each variant (a function that sets it up),
    the variants taking turns."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(turns):
        for name, set_up in variants.items():
            set_up()
            t0 = time.perf_counter()
            for i in range(calls):
                work(i)
            times[name].append((time.perf_counter() - t0) / calls * 1e3)
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=128, help="row width d")
    parser.add_argument("--table-rows", type=int, default=500_000, help="table rows")
    parser.add_argument("--batches", type=int, nargs="+", default=[10_000, 100_000],
                        help="rows per pull/push call")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2], help="shard counts")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16"],
                        choices=["float32", "float16"])
    parser.add_argument("--turns", type=int, default=10, help="turns of every size")
    parser.add_argument("--calls", type=int, default=20, help="calls per turn")
    parser.add_argument("--quick", action="store_true", help="small table, 2 turns")
    args = parser.parse_args()
    if args.quick:
        args.table_rows, args.batches, args.shards = 50_000, [10_000], [2]
        args.dtypes, args.turns, args.calls = ["float32"], 2, 3
    if max(args.batches) > args.table_rows:
        parser.error("--table-rows must be >= the largest batch (ids are unique)")

    mib = 1 << 20
    print(f"# d={args.dim}, table {args.table_rows:,} rows, {args.turns} turns of "
          f"{args.calls} calls; ms per call (medians), and the ratio to 2 MiB pieces\n")
    header = "| op | dtype | batch | shards | 2 MiB pieces | larger | larger / 2 MiB |"
    print(f"{header}\n|---|---|---:|---:|---:|---|---:|")
    rows = []
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="bench_pieces_") as tmp:
        for num_shards in args.shards:
            with shard_processes(num_shards, data_dir=Path(tmp), xcls_flags=["-q"],
                                 log_dir=Path(tmp),
                                 extra_args=["--torch-threads", "1"]) as shards, \
                    ams.connect([s.address for s in shards]) as client:
                if client.arena is None or client.shards[0].piece_bytes != SHARED_PIECE_BYTES:
                    parser.error("the shards did not map this client's shared buffer")
                for dtype in args.dtypes:
                    table = f"t_{dtype}"
                    client.create_table(table, num_rows=args.table_rows, dim=args.dim,
                                        dtype=dtype, momentum=0.9, weight_decay=5e-4)
                    for n in args.batches:
                        batches = [torch.randperm(args.table_rows, generator=gen)[:n]
                                   for _ in range(4)]
                        grads = torch.randn(n, args.dim, generator=gen) * 1e-3

                        def pull(i: int, table: str = table, batches: list = batches) -> None:
                            client.pull(table, batches[i % 4])

                        def push(i: int, table: str = table, batches: list = batches,
                                 grads: torch.Tensor = grads) -> None:
                            client.push(table, batches[i % 4], grads, 1e-3)

                        def direct(nbytes: int) -> None:
                            client.direct_pull_bytes = nbytes

                        def pieces(nbytes: int) -> None:
                            for shard in client.shards:
                                shard.piece_bytes = nbytes

                        for op, work, variants, larger in (
                                ("pull", pull,
                                 {"2 MiB": lambda: direct(PIECE_BYTES),
                                  "larger": lambda: direct(type(client).direct_pull_bytes)},
                                 f"{type(client).direct_pull_bytes // mib} MiB a request"),
                                ("push", push,
                                 {"2 MiB": lambda: pieces(PIECE_BYTES),
                                  "larger": lambda: pieces(SHARED_PIECE_BYTES)},
                                 f"{SHARED_PIECE_BYTES // mib} MiB pieces")):
                            work(0)  # connections, buffers, first-touch pages
                            ms = timed_turns(args.calls, args.turns, variants, work)
                            line = (f"| {op} | {dtype} | {n:,} | {num_shards} | "
                                    f"{ms['2 MiB']:.2f} | {ms['larger']:.2f} ({larger}) | "
                                    f"{ms['larger'] / ms['2 MiB']:.2f} |")
                            print(line, flush=True)
                            rows.append(table_row(header, line))
                        direct(type(client).direct_pull_bytes)
                        pieces(SHARED_PIECE_BYTES)
    record("bench_pieces", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

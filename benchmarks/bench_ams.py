"""AMS pull/push throughput against Redis and a raw TCP socket, plus resident memory per class.

    python benchmarks/bench_ams.py            # full table (a few minutes)
    python benchmarks/bench_ams.py --quick    # smoke run (seconds)

Backends, measured side by side (each repeat runs every backend once, in turn, on the same ids,
so drift on a shared machine hits them alike; the table shows medians over repeats):

* in-proc: ``ams.connect(local_shards=S)``, the embedded store;
* xcls: ``ams.connect([...])`` against S real ``xcls serve shard`` processes on 127.0.0.1 (gRPC
  control plane, frames on each shard's data port); on one host rows of 1 MiB or more bypass
  the socket through the client's shared buffer (``ams.dataplane.shm``), each shard writing
  its rows of a pull straight into the result;
* xcls tcp: the same shards with ``shared_memory=False``, the rows in the frames: what a
  client on another host gets;
* redis: S ``redis-server`` processes (no persistence), one key per row holding the row's bytes,
  ids split by id % S, pipelined MGET / MSET, shards queried from parallel threads;
* raw: S socket server processes that receive the ids' bytes (plus the gradients on push) and
  answer with n*d*itemsize bytes, read with recv_into a preallocated buffer: the ceiling for
  any wire protocol in Python on this machine;
* bare gRPC: S grpcio servers doing the raw socket's job with no serializer at all (bytes in,
  a ready bytes reply out): the ceiling of a data plane carried by gRPC, beside which xcls's
  own frames on a TCP port were chosen (proto/ams/api/frames.md).

A second table gives the latency of a 1-row pull, p50 and p99 over many calls, for each
backend.

Rows are random unique ids. MB/s counts the row payload (n * d * itemsize of the table dtype) in
every column; a push moves what each backend must move to update the rows: xcls and raw send
float32 gradients (the AMS push contract), Redis writes the new rows in the table dtype (no
read-modify-write, so Redis does strictly less work there).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import platform
import random
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import grpc
import numpy as np
import redis
import torch
from results import record

import ams
from ams import sharding
from ams.alloc import keep_large_buffers
from ams.limits import GRPC_OPTIONS
from ams.shard import rowcopy
from xcls.shards import shard_processes

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"float32": torch.float32, "float16": torch.float16}
# Keys per MGET/MSET command inside one pipeline: large enough to amortise the per-command
# cost, small enough that Redis streams replies instead of building one huge buffer.
REDIS_CHUNK = 1000

def _on_each_shard(pool: ThreadPoolExecutor | None, parts: list, work) -> list:
    """``work(s, parts[s])`` for every shard s, in parallel threads when there is a pool."""
    if pool is None:
        return [work(0, parts[0])]
    return list(pool.map(work, range(len(parts)), parts))


# ---- raw socket ceiling ------------------------------------------------------------------

# op (0 pull, 1 push), request payload bytes, reply bytes
_RAW_HEADER = struct.Struct("<BQQ")


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionError("peer closed")
        view = view[got:]


def _raw_server(port_queue: mp.Queue) -> None:
    """Answer each request with reply-bytes bytes from a preallocated buffer."""
    listener = socket.create_server(("127.0.0.1", 0))
    port_queue.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    header = bytearray(_RAW_HEADER.size)
    inbox = bytearray(1)
    outbox = bytearray(1)
    try:
        while True:
            _recv_exact(conn, memoryview(header))
            _, size, reply = _RAW_HEADER.unpack(header)
            if size > len(inbox):
                inbox = bytearray(size)
            if reply > len(outbox):
                outbox = bytearray(reply)
            _recv_exact(conn, memoryview(inbox)[:size])
            conn.sendall(memoryview(outbox)[:reply])
    except ConnectionError:
        pass


class RawClient:
    """One connection per shard; pull/push move exactly the bytes xcls moves for the payload."""

    def __init__(self, num_shards: int, dim: int, pool: ThreadPoolExecutor | None) -> None:
        ctx = mp.get_context("spawn")
        self.dim, self.pool, self.num_shards = dim, pool, num_shards
        self.procs, self.socks = [], []
        for _ in range(num_shards):
            q = ctx.Queue()
            p = ctx.Process(target=_raw_server, args=(q,), daemon=True)
            p.start()
            sock = socket.create_connection(("127.0.0.1", q.get(timeout=60)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.procs.append(p)
            self.socks.append(sock)
        self.ack = bytearray(1)

    def pull(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        """Rows land in ``out`` grouped by shard (a ceiling: no reassembly into request order)."""
        parts = _split(ids, self.num_shards)
        starts = np.cumsum([0] + [p.numel() for p in parts]).tolist()
        flat = out.view(torch.uint8).numpy().reshape(-1)
        row_bytes = self.dim * out.element_size()

        def work(s: int, part: torch.Tensor) -> None:
            sock = self.socks[s]
            n = part.numel()
            sock.sendall(_RAW_HEADER.pack(0, n * 8, n * row_bytes))
            sock.sendall(part.numpy().data)
            _recv_exact(sock, memoryview(flat)[starts[s] * row_bytes:starts[s + 1] * row_bytes])

        _on_each_shard(self.pool, parts, work)

    def push(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        parts = _split(ids, self.num_shards)
        starts = np.cumsum([0] + [p.numel() for p in parts]).tolist()
        g = grads.numpy().data.cast("B")
        row_bytes = self.dim * 4

        def work(s: int, part: torch.Tensor) -> None:
            sock = self.socks[s]
            n = part.numel()
            sock.sendall(_RAW_HEADER.pack(1, n * 8 + n * row_bytes, 1))
            sock.sendall(part.numpy().data)
            sock.sendall(g[starts[s] * row_bytes:starts[s + 1] * row_bytes])
            _recv_exact(sock, memoryview(self.ack))

        _on_each_shard(self.pool, parts, work)

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        for p in self.procs:
            p.join(10)


def _split(ids: torch.Tensor, num_shards: int) -> list[torch.Tensor]:
    return [ids.index_select(0, pos) for pos in sharding.split_by_shard(ids, num_shards)]


# ---- bare gRPC ceiling --------------------------------------------------------------------

_GRPC_SERVICE = "bench.Bytes"


def _bare_grpc_server(port_queue: mp.Queue) -> None:
    """Answer Pull (8-byte reply size, then the ids) with that many ready bytes, and Push with
    nothing: grpcio's own cost of moving the bytes, no (de)serializer."""
    keep_large_buffers()
    ready: dict[int, bytes] = {}  # one reply per size, built once: no per-call copy

    def pull(request: bytes, context: object) -> bytes:
        size = int.from_bytes(request[:8], "little")
        if size not in ready:
            ready[size] = bytes(size)
        return ready[size]

    handlers = {"Pull": grpc.unary_unary_rpc_method_handler(pull),
                "Push": grpc.unary_unary_rpc_method_handler(lambda request, context: b"")}
    server = grpc.server(futures.ThreadPoolExecutor(4), options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_GRPC_SERVICE,
                                                                          handlers),))
    port_queue.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    server.wait_for_termination()


class BareGrpcClient:
    """One channel per shard; pull/push move the bytes xcls moves, with no serializer."""

    def __init__(self, num_shards: int, dim: int, pool: ThreadPoolExecutor | None) -> None:
        ctx = mp.get_context("spawn")
        self.dim, self.pool, self.num_shards = dim, pool, num_shards
        self.procs, self.channels, self.pulls, self.pushes = [], [], [], []
        self._built: dict[tuple, tuple[torch.Tensor, list[bytes]]] = {}
        for _ in range(num_shards):
            q = ctx.Queue()
            p = ctx.Process(target=_bare_grpc_server, args=(q,), daemon=True)
            p.start()
            channel = grpc.insecure_channel(f"127.0.0.1:{q.get(timeout=60)}",
                                            options=GRPC_OPTIONS)
            self.procs.append(p)
            self.channels.append(channel)
            self.pulls.append(channel.unary_unary(f"/{_GRPC_SERVICE}/Pull"))
            self.pushes.append(channel.unary_unary(f"/{_GRPC_SERVICE}/Push"))

    def _requests(self, op: str, ids: torch.Tensor, build) -> list[bytes]:
        """Each shard's request bytes for this batch, built once (the batches repeat): the
        column times grpcio moving bytes, not this client preparing them. The cache keeps the
        ids alive, so their id() names them until ``forget``."""
        key = (op, id(ids))
        if key not in self._built:
            parts = sharding.split_by_shard(ids, self.num_shards)
            self._built[key] = (ids, [build(pos) for pos in parts])
        return self._built[key][1]

    def forget(self) -> None:
        self._built.clear()

    def pull(self, ids: torch.Tensor, row_bytes: int) -> None:
        requests = self._requests("pull", ids, lambda pos: (
            (pos.numel() * row_bytes).to_bytes(8, "little")
            + ids.index_select(0, pos).numpy().tobytes()))
        _on_each_shard(self.pool, requests, lambda s, request: self.pulls[s](request, timeout=60))

    def push(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        requests = self._requests("push", ids, lambda pos: (
            ids.index_select(0, pos).numpy().tobytes()
            + grads.index_select(0, pos).numpy().tobytes()))
        _on_each_shard(self.pool, requests, lambda s, request: self.pushes[s](request, timeout=60))

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        for p in self.procs:
            p.kill()
            p.join(10)


# ---- Redis -------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisShards:
    """S redis-server processes; rows of dtype d live in database ``DB[d]``, key id -> bytes."""

    DB = {torch.float32: 0, torch.float16: 1}

    def __init__(self, num_shards: int, workdir: Path, pool: ThreadPoolExecutor | None) -> None:
        self.num_shards, self.pool = num_shards, pool
        self.procs, self.clients = [], {}
        for s in range(num_shards):
            port = _free_port()
            self.procs.append(subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(workdir), "--logfile", ""],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            for dtype, db in self.DB.items():
                self.clients[s, dtype] = redis.Redis(host="127.0.0.1", port=port, db=db)
        deadline = time.monotonic() + 30
        for s in range(num_shards):
            while True:
                try:
                    self.clients[s, torch.float32].ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)

    def load(self, rows: torch.Tensor) -> None:
        ids = torch.arange(rows.shape[0])
        self.push(ids, rows)
        self.clients[0, rows.dtype].ping()

    def pull(self, ids: torch.Tensor, dtype: torch.dtype, dim: int) -> torch.Tensor:
        positions = sharding.split_by_shard(ids, self.num_shards)
        out = torch.empty((ids.numel(), dim), dtype=dtype)

        def work(s: int, pos: torch.Tensor) -> None:
            keys = ids.index_select(0, pos).tolist()
            pipe = self.clients[s, dtype].pipeline(transaction=False)
            for i in range(0, len(keys), REDIS_CHUNK):
                pipe.mget(keys[i:i + REDIS_CHUNK])
            raw = b"".join(b"".join(chunk) for chunk in pipe.execute())
            got = torch.frombuffer(bytearray(raw), dtype=dtype).view(-1, dim)
            if self.num_shards == 1:
                out.copy_(got)
            else:
                rowcopy.scatter(out, pos, got)

        _on_each_shard(self.pool, positions, work)
        return out

    def push(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        positions = sharding.split_by_shard(ids, self.num_shards)
        data = rows.contiguous().view(torch.uint8).numpy().reshape(-1).data
        row_bytes = rows.shape[1] * rows.element_size()

        def work(s: int, pos: torch.Tensor) -> None:
            keys, where = ids.index_select(0, pos).tolist(), pos.tolist()
            pipe = self.clients[s, rows.dtype].pipeline(transaction=False)
            for i in range(0, len(keys), REDIS_CHUNK):
                pipe.mset({k: data[p * row_bytes:(p + 1) * row_bytes]
                           for k, p in zip(keys[i:i + REDIS_CHUNK], where[i:i + REDIS_CHUNK],
                                           strict=True)})
            pipe.execute()

        _on_each_shard(self.pool, positions, work)

    def close(self) -> None:
        for c in self.clients.values():
            c.close()
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(10)


# ---- measurement -------------------------------------------------------------------------


def process_cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread, living or ended) that process ``pid`` has used,
    seconds: its process CPU clock, which Linux lets another process read (the clock id is
    what glibc's ``clock_getcpuclockid`` makes, which Python does not wrap). A thread running
    on another core is counted up to its last scheduler tick, so a window of a few ms (as in
    ``--quick``) can show more cores busy than the host has."""
    return time.clock_gettime(((~pid) << 3) | 2)


def measure(backends: dict, batches: list[torch.Tensor], repeats: int, calls: int,
            min_seconds: float, shard_pids: list[int]) -> dict:
    """Median rows/s of each backend and median per-repeat ratios; backends run in turn,
    each for ``calls`` calls and at least ``min_seconds`` a repeat (a fast backend's few
    calls would be a window of milliseconds, where one slow wake-up moves the figure).
    "cpu": per xcls call, ms of wall time and of CPU in this process and in the shard
    processes (``shard_pids``) while the xcls backend ran."""
    n = batches[0].numel()
    for fn in backends.values():  # warm-up: connections, buffers, first-touch pages
        fn(batches[0])
    rates: dict[str, list[float]] = {name: [] for name in backends}
    cpu = {"wall": 0.0, "client": 0.0, "shards": 0.0}
    xcls_calls = 0
    for r in range(repeats):
        for name, fn in backends.items():
            client0, shards0 = time.process_time(), sum(map(process_cpu_seconds, shard_pids))
            t0 = time.perf_counter()
            done = 0
            while done < calls or time.perf_counter() - t0 < min_seconds:
                fn(batches[(r * calls + done) % len(batches)])
                done += 1
            wall = time.perf_counter() - t0
            rates[name].append(done * n / wall)
            if name == "xcls":
                xcls_calls += done
                cpu["wall"] += wall
                cpu["client"] += time.process_time() - client0
                cpu["shards"] += sum(map(process_cpu_seconds, shard_pids)) - shards0
    out = {name: statistics.median(v) for name, v in rates.items()}
    for mine, other in (("xcls", "raw"), ("tcp", "raw"), ("xcls", "redis"), ("xcls", "grpc")):
        out[f"{mine}/{other}"] = statistics.median(
            a / b for a, b in zip(rates[mine], rates[other], strict=True))
    out["cpu"] = {k: v * 1e3 / xcls_calls for k, v in cpu.items()}
    return out


def throughput(args: argparse.Namespace, workdir: Path) -> tuple[list[tuple], list[dict]]:
    """The throughput table's rows (printed as they come), and the 1-row pull latencies."""
    dim, results, latencies = args.dim, [], []
    gen = torch.Generator().manual_seed(0)
    for num_shards in args.shards:
        pool = ThreadPoolExecutor(num_shards) if num_shards > 1 else None
        with ExitStack() as stack:
            shards = stack.enter_context(shard_processes(
                num_shards, data_dir=workdir, xcls_flags=["-q"], log_dir=workdir,
                extra_args=["--torch-threads", str(args.shard_torch_threads)]))
            pids = [shard.proc.pid for shard in shards]
            remote = stack.enter_context(ams.connect([shard.address for shard in shards]))
            tcp = stack.enter_context(ams.connect([shard.address for shard in shards],
                                                  shared_memory=False))
            local = stack.enter_context(ams.connect(local_shards=num_shards))
            red = RedisShards(num_shards, workdir, pool)
            stack.callback(red.close)
            raw = RawClient(num_shards, dim, pool)
            stack.callback(raw.close)
            bare = BareGrpcClient(num_shards, dim, pool)
            stack.callback(bare.close)
            if pool is not None:
                stack.callback(pool.shutdown)
            for dtype_name in args.dtypes:
                table = f"bench_{dtype_name}"
                for client in (remote, local):
                    client.create_table(table, num_rows=args.table_rows, dim=dim, dtype=dtype_name)
                red.load(local.pull(table, torch.arange(args.table_rows)))
                for n in args.batches:
                    batches = [torch.randperm(args.table_rows, generator=gen)[:n]
                               for _ in range(4)]
                    grads = torch.randn(n, dim, generator=gen) * 1e-3
                    calls = max(1, args.rows_per_repeat // n)
                    pulls, pushes = _backends(local, remote, tcp, red, raw, bare, table,
                                              grads)
                    pull = measure(pulls, batches, args.repeats, calls, args.min_seconds,
                                   pids)
                    push = measure(pushes, batches, args.repeats, calls, args.min_seconds,
                                   pids)
                    bare.forget()
                    for op, res in (("pull", pull), ("push", push)):
                        results.append((op, dtype_name, n, num_shards, res))
                        print(_row(op, dtype_name, n, num_shards, res, dim), flush=True)
                if num_shards == 1 and dtype_name == args.dtypes[0]:
                    latencies.append(one_row_latency(
                        *_backends(local, remote, tcp, red, raw, bare, table,
                                   torch.randn(1, dim) * 1e-3)[:1], args.latency_calls))
    return results, latencies


def _backends(local: ams.ShardedClient, remote: ams.ShardedClient, tcp: ams.ShardedClient,
              red: RedisShards, raw: RawClient, bare: BareGrpcClient, table: str,
              grads: torch.Tensor) -> tuple[dict, dict]:
    """Pull and push callables (ids -> None) of every backend for one table and batch size."""
    spec = local.spec(table)
    rows = grads.to(spec.dtype)
    out = torch.empty_like(rows)
    row_bytes = spec.dim * spec.dtype.itemsize
    pulls = {
        "in-proc": lambda ids: local.pull(table, ids),
        "xcls": lambda ids: remote.pull(table, ids),
        "tcp": lambda ids: tcp.pull(table, ids),
        "redis": lambda ids: red.pull(ids, spec.dtype, spec.dim),
        "raw": lambda ids: raw.pull(ids, out),
        "grpc": lambda ids: bare.pull(ids, row_bytes),
    }
    pushes = {
        "in-proc": lambda ids: local.push(table, ids, grads, 1e-3),
        "xcls": lambda ids: remote.push(table, ids, grads, 1e-3),
        "tcp": lambda ids: tcp.push(table, ids, grads, 1e-3),
        "redis": lambda ids: red.push(ids, rows),
        "raw": lambda ids: raw.push(ids, grads),
        "grpc": lambda ids: bare.push(ids, grads),
    }
    return pulls, pushes


def one_row_latency(pulls: dict, calls: int) -> dict[str, tuple[float, float]]:
    """(p50, p99) seconds of a 1-row pull of each backend, over ``calls`` calls each, the
    backends taking turns call by call (so drift hits them alike) in an order shuffled each
    round: a call right after another backend's runs slower or faster (caches, a core gone
    to sleep, a shard's thread still awake), and no backend should always follow the same
    one."""
    ids = [torch.tensor([i]) for i in range(64)]
    times: dict[str, list[float]] = {name: [] for name in pulls}
    for fn in pulls.values():
        for i in range(20):  # warm-up
            fn(ids[i])
    names, shuffle = list(pulls), random.Random(0).shuffle
    for c in range(calls):
        shuffle(names)
        for name in names:
            t0 = time.perf_counter()
            pulls[name](ids[c % len(ids)])
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(t), statistics.quantiles(t, n=100)[98])
            for name, t in times.items()}


def _row(op: str, dtype_name: str, n: int, num_shards: int, res: dict, dim: int) -> str:
    mb = dim * torch.empty((), dtype=DTYPES[dtype_name]).element_size() / 1e6

    def cell(name: str) -> str:
        return f"{res[name] / 1e6:.2f} ({res[name] * mb:,.0f})"

    return (f"| {op} | {dtype_name} | {n:,} | {num_shards} | {cell('in-proc')} | "
            f"{cell('xcls')} | {cell('tcp')} | {cell('redis')} | {cell('raw')} | "
            f"{cell('grpc')} | {res['xcls/raw']:.2f} | {res['tcp/raw']:.2f} | "
            f"{res['xcls/redis']:.1f}x | {res['xcls/grpc']:.1f}x |")


BACKEND_COLUMNS = {"in-proc": "in-proc", "xcls": "xcls", "xcls tcp": "tcp", "redis": "redis",
                   "raw socket": "raw", "bare grpc": "grpc"}


def _record_row(op: str, dtype_name: str, n: int, num_shards: int, res: dict) -> dict:
    """A throughput row as data: M rows/s per backend, the ratios, the CPU of an xcls call."""
    cpu = res["cpu"]
    return {"op": op, "dtype": dtype_name, "batch": n, "shards": num_shards,
            **{column: round(res[name] / 1e6, 2) for column, name in BACKEND_COLUMNS.items()},
            "xcls/raw": round(res["xcls/raw"], 2), "tcp/raw": round(res["tcp/raw"], 2),
            "xcls/redis": f"{res['xcls/redis']:.1f}x", "xcls/grpc": f"{res['xcls/grpc']:.1f}x",
            "xcls wall ms": round(cpu["wall"], 2), "client CPU ms": round(cpu["client"], 2),
            "shards CPU ms": round(cpu["shards"], 2),
            "cores busy": round((cpu["client"] + cpu["shards"]) / cpu["wall"], 2)}


TABLE_HEAD = ("| op | dtype | batch | shards | in-proc | xcls | xcls tcp | redis | raw socket | "
              "bare grpc | xcls/raw | tcp/raw | xcls/redis | xcls/grpc |\n"
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

# ---- resident memory ---------------------------------------------------------------------

_MEMORY_PROBE = r"""
import sys, torch
from ams.shard.spec import TableSpec
from ams.shard.store import ShardStore

def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS:'):
            return int(line.split()[1]) * 1024

rows, dim = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
store = ShardStore(0, 1)
before = rss()
store.create_table(TableSpec(name='m', num_rows=rows, dim=dim, dtype=torch.float16,
                             state_dtype=torch.float16))
created = rss()
store.table('m').state.fill_(0)  # momentum pages are committed lazily, on a row's first push
print(before, created, rss())
"""


def memory(rows: int, dim: int) -> tuple[float, float, float]:
    """In a fresh process: RSS delta per class after create_table and once every momentum row
    has been written, against the payload d * (2 + 2) bytes."""
    got = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, str(rows), str(dim)],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    before, created, touched = map(int, got.stdout.split())
    return (created - before) / rows, (touched - before) / rows, dim * 4.0


# ---- main --------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=128, help="row width d")
    parser.add_argument("--batches", type=int, nargs="+", default=[1_000, 10_000, 100_000],
                        help="rows per pull/push call")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2], help="shard counts")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--table-rows", type=int, default=500_000,
                        help="classes in the benchmark table (>= the largest batch)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median is shown)")
    parser.add_argument("--rows-per-repeat", type=int, default=100_000,
                        help="rows moved per backend per repeat (calls = this // batch, >= 1)")
    parser.add_argument("--min-seconds", type=float, default=0.25,
                        help="each backend calls on until it has run this long in a repeat")
    parser.add_argument("--memory-rows", type=int, default=10_000_000,
                        help="classes in the resident-memory probe (0: skip it)")
    parser.add_argument("--latency-calls", type=int, default=2000,
                        help="1-row pulls per backend for the latency table")
    parser.add_argument("--shard-torch-threads", type=int, default=1,
                        help="each shard process's torch threads (xcls serve shard "
                             "--torch-threads; 1, its default, suits a host with few cores)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1k/10k batches, 2 repeats, small tables")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.repeats = [1_000, 10_000], 2
        args.table_rows, args.rows_per_repeat, args.memory_rows = 50_000, 10_000, 300_000
        args.latency_calls, args.min_seconds = 200, 0.0
    if max(args.batches) > args.table_rows:
        parser.error("--table-rows must be >= the largest batch (ids are unique)")
    if shutil.which("redis-server") is None:
        parser.error("redis-server not found on PATH")

    torch.manual_seed(0)
    start = time.monotonic()
    print(f"# bench_ams {datetime.date.today()} {platform.node()} {os.cpu_count()} cpus, "
          f"python {platform.python_version()}, torch {torch.__version__}, "
          f"torch threads {torch.get_num_threads()} (shards {args.shard_torch_threads}), "
          f"redis parser {'hiredis' if redis.utils.HIREDIS_AVAILABLE else 'python'}")
    print(f"# d={args.dim}, table {args.table_rows:,} rows, {args.repeats} repeats, "
          f"~{args.rows_per_repeat:,} rows and >= {args.min_seconds:g} s per backend per "
          "repeat; cells: M rows/s (MB/s)")
    print(TABLE_HEAD, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench_ams_") as tmp:
        results, latencies = throughput(args, Path(tmp))
    print(f"\nCPU per xcls call (shared buffer), ms; cores busy = (client + shards) / wall, "
          f"out of {os.cpu_count()}\n\n"
          "| op | dtype | batch | shards | wall | client CPU | shards CPU | cores busy |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|")
    for op, dtype_name, n, num_shards, res in results:
        cpu = res["cpu"]
        print(f"| {op} | {dtype_name} | {n:,} | {num_shards} | {cpu['wall']:.2f} | "
              f"{cpu['client']:.2f} | {cpu['shards']:.2f} | "
              f"{(cpu['client'] + cpu['shards']) / cpu['wall']:.2f} |")
    for latency in latencies:
        print(f"\n1-row pull, {args.dtypes[0]}, 1 shard, {args.latency_calls:,} calls each: "
              "ms\n\n| backend | p50 | p99 |\n|---|---:|---:|")
        for name, (p50, p99) in latency.items():
            print(f"| {name} | {p50 * 1e3:.3f} | {p99 * 1e3:.3f} |")
    record("bench_ams", [_record_row(*r) for r in results], table="throughput")
    record("bench_ams", [{"backend": name, "p50": round(p50 * 1e3, 3), "p99": round(p99 * 1e3, 3)}
                         for latency in latencies for name, (p50, p99) in latency.items()],
           table="1-row pull")
    if args.memory_rows:
        created, touched, payload = memory(args.memory_rows, args.dim)
        print(f"\nresident memory, {args.memory_rows:,} classes, fp16 rows + fp16 momentum, "
              f"d={args.dim}: payload {payload:.0f} B/class; after create_table "
              f"{created:.1f} B/class ({created / payload:.3f}x); momentum written "
              f"{touched:.1f} B/class ({touched / payload:.3f}x)")
        record("bench_ams", [{"classes": args.memory_rows, "payload B/class": round(payload),
                              "after create_table B/class": round(created, 1),
                              "after create_table vs payload": round(created / payload, 3),
                              "momentum written B/class": round(touched, 1),
                              "momentum written vs payload": round(touched / payload, 3)}],
               table="memory")
    print(f"\n# wall {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

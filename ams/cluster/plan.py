"""What a job needs before it starts: each shard's memory and disk, each step's traffic, and the
graph build's work and time. Pure arithmetic on a job's sizes (no gRPC; the only I/O reads the
rates file beside this module); ``xcls plan`` prints it.

Memory follows the shard's own layout (``ams.shard.store``, ``ams.shard.storage``,
``ams.shard.neighbor_lists``).
Shard i of S owns the classes c with c mod S == i, so shard 0 owns the most and its figures
bound every shard's. Per owned class it keeps:

* a row of ``dim`` values in the row dtype,
* momentum of ``dim`` values in the state dtype, only when momentum > 0,
* a float64 decay clock (8 B),
* a touched mark (1 B, bool), from the first push on,
* with a graph (knn head), ``k`` neighbor ids, int32 while N < 2**31 (int64 from there), in
  one fixed-width (owned, k) table without offsets.

Storage. ``memory`` keeps rows, state and clocks in RAM. ``mmap`` keeps them in files mapped
into the shard: their pages are page cache that the kernel reads in on demand and evicts when
memory is short, so they count as disk and as page cache (all of it for full speed, less costs
disk reads), not as resident. The files hold ``ams.shard.slots.SPARE_SLOTS`` more slots than rows
(a push moves its rows into free slots next to each other), and RAM holds each row's slot
(int32 below 2**31 slots) and a free-slot mask (1 B a slot). The graph's lists are in an
unlinked scratch file of the shard's (page cache, like the rows). What mmap leaves in RAM: the
process, the slot map, the touched marks and the message buffers.

Message buffers. A serving shard keeps the buffers of finished requests for the next ones
(``ams.alloc.keep_large_buffers``): about one set per request served at a time, i.e. per
client stream (each worker's prefetch pulls and pushes), at most one per gRPC handler
thread (``ams.limits.RPC_THREADS``, the default of ``xcls serve shard --rpc-threads``). The
set's size is measured (``benchmarks/plan_rates.py``).

Snapshots (``ams.shard.snapshot``). Writing copies each table at one instant (memory: a copy in RAM
of rows, state and clocks; mmap: into scratch files, disk not RAM) and writes the piece in LMDB
write transactions of at most ``ams.shard.snapshot.COMMIT_BYTES``, whose pages LMDB holds in memory
until each commits: peak = resident + copy + one batch. Restoring reads a piece whole (each
piece that holds rows of this shard, one at a time), selects this shard's rows from it (a
temporary of the largest tensor) and assembles the new table beside the live one (memory: in
RAM; mmap: in files) before it replaces it: peak = resident + piece + assembled table +
temporary. On disk a piece is its tensors plus LMDB's pages and the manifest (a measured
fraction).

Graph build FLOPs count a multiply-add as 2. Exact: every class against every class, 2 N^2 d;
on the CPU a table whose float32 rows fit the in-memory limit is searched symmetrically, N^2 d;
on a GPU the build scores in fp16 on the ring, 2 N^2 d. IVF (``ams.graph.ivf``): k-means
(``KMEANS_ITERATIONS`` over ``TRAIN_ROWS_PER_LIST`` rows per list, each against nlist
centroids), every row assigned to a list, every row searched (nlist centroids, then nprobe
lists of N / nlist rows), and the exact check of the sampled classes' lists.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ams.dtypes import ROW_DTYPES
from ams.graph.ivf import TRAIN_ROWS_PER_LIST, resolve_nlist
from ams.graph.methods import GraphMethod
from ams.limits import RPC_THREADS
from ams.shard.neighbor_lists import id_dtype
from ams.shard.slots import slot_capacity, slot_dtype
from ams.shard.snapshot import COMMIT_BYTES
from ams.shard.storage import StorageKind
from ams.sharding import MAX_ROWS, owned_count

# The measured rates: a file beside this module, so it ships with the package. Joined to this
# module's directory, so an absolute path (a test's own file) is read as it is.
RATES_FILE = "plan_rates.json"
CLOCK_BYTES = 8  # float64 decay clock per row
TOUCHED_BYTES = 1  # bool touched mark per row
ID_BYTES = 8  # int64 class ids on the wire
GRAD_BYTES = 4  # gradients are pushed as float32
# k-means iterations of the IVF training: faiss IndexIVF's default (cp.niter), which
# ams.graph.ivf keeps.
KMEANS_ITERATIONS = 10
# Largest count of shards, hosts or workers a plan takes: far past any cluster, and it keeps
# every product of the arithmetic finite.
MAX_COUNT = 1 << 24


@dataclass(frozen=True)
class Rates:
    """Compute rates (FLOP/s) and shard memory figures the plan's estimates scale.

    cpu_exact, cpu_ring, cpu_ivf: a CPU's rates of the symmetric in-memory exact build, the
    exact ring build and a faiss IVF build (counted with ``ivf_flops``);
    gpu_exact, gpu_ivf: a GPU's rates of the exact and the IVF build;
    sources: for each of those five rates (by name), where it comes from, as the rates file's
    own "measured" flag says: "measured on MACHINE" or "nominal assumption for DEVICE";
    baseline: a shard process's resident bytes with no table;
    buffers_per_stream: message buffers a shard keeps per client stream;
    snapshot_overhead: a snapshot piece's bytes beyond its tensors, as a fraction of them.
    """

    cpu_exact: float
    cpu_ring: float
    cpu_ivf: float
    gpu_exact: float
    gpu_ivf: float
    baseline: int
    buffers_per_stream: int
    snapshot_overhead: float
    sources: Mapping[str, str]


RATE_NAMES = ("cpu_exact", "cpu_ring", "cpu_ivf", "gpu_exact", "gpu_ivf")


def _source(entry: Mapping) -> str:
    """Where one rate of the rates file comes from, by its own "measured" flag."""
    measured = entry["measured"]
    if not isinstance(measured, bool):
        raise TypeError(f"'measured' is {measured!r}, not true or false")
    where = entry.get("machine") or entry["device"]
    return f"measured on {where}" if measured else f"nominal assumption for {where}"


def load_rates() -> Rates:
    """The rates recorded in ``RATES_FILE``. ValueError, in one line, when the file is missing
    or lacks an entry."""
    path = Path(__file__).parent / RATES_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        shard = data["shard"]
        return Rates(
            cpu_exact=float(data["cpu_exact"]["flops_per_s"]),
            cpu_ring=float(data["cpu_ring"]["flops_per_s"]),
            cpu_ivf=float(data["cpu_ivf"]["flops_per_s"]),
            gpu_exact=float(data["gpu_exact"]["flops_per_s"]),
            gpu_ivf=float(data["gpu_ivf"]["flops_per_s"]),
            baseline=int(shard["baseline_bytes"]),
            buffers_per_stream=int(shard["buffers_per_stream_bytes"]),
            snapshot_overhead=float(shard["snapshot_overhead_fraction"]),
            sources={name: _source(data[name]) for name in RATE_NAMES})
    except OSError as e:
        raise ValueError(f"planner rates {path}: cannot read it ({e.strerror})") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"planner rates {path}: malformed ({type(e).__name__}: {e}); "
                         "regenerate it with benchmarks/plan_rates.py --write") from None


@dataclass(frozen=True)
class Job:
    """The sizes a plan is made of.

    num_classes: N; dim: row width d; dtype, state_dtype: row and momentum dtype names
    (``ams.dtypes.RowDtype``); momentum: the rows' momentum (0: no state columns);
    shards, hosts: S shards spread evenly over H hosts; workers: W data-parallel workers;
    batch_size: samples per step per worker; head: full | partial | knn; sample_rate, budget:
    the head's (budget 0: sample_rate * N; knn only); graph_k: neighbors per class kept in
    the graph (0: no graph); storage: ``ams.shard.storage.StorageKind``; graph_method: exact | ivf,
    nlist (0: auto), nprobe; snapshots_kept: complete snapshots kept on disk.
    A shard is taken to run ``ams.limits.RPC_THREADS`` gRPC handler threads (the default of
    ``xcls serve shard --rpc-threads``).
    """

    num_classes: int
    dim: int
    dtype: str = "float32"
    state_dtype: str = ""
    momentum: float = 0.0
    shards: int = 1
    hosts: int = 1
    workers: int = 1
    batch_size: int = 256
    head: str = "knn"
    sample_rate: float = 0.1
    budget: int = 0
    graph_k: int = 0
    storage: str = StorageKind.MEMORY
    graph_method: str = GraphMethod.EXACT
    nlist: int = 0
    nprobe: int = 8
    snapshots_kept: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.num_classes, int) or not 0 < self.num_classes < MAX_ROWS:
            raise ValueError(f"num_classes={self.num_classes} must be an integer in "
                             "[1, 2**62)")
        for name in ("shards", "hosts", "workers", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 < value <= MAX_COUNT:
                raise ValueError(f"{name}={value} must be an integer in [1, {MAX_COUNT}]")
        for name, low in (("dim", 1), ("nprobe", 1), ("budget", 0), ("graph_k", 0),
                          ("nlist", 0), ("snapshots_kept", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value} must be an integer >= {low}")
        for name in ("dtype", "state_dtype"):
            value = getattr(self, name)
            if value not in ROW_DTYPES and not (name == "state_dtype" and value == ""):
                raise ValueError(f"{name}={value!r} is not one of {', '.join(ROW_DTYPES)}")
        if self.head not in ("full", "partial", "knn"):
            raise ValueError(f"head={self.head!r} is not one of 'full', 'partial', 'knn'")
        if self.storage not in list(StorageKind):
            raise ValueError(f"storage={self.storage!r} is not one of "
                             f"{', '.join(repr(str(k)) for k in StorageKind)}")
        if self.graph_method not in list(GraphMethod):
            raise ValueError(f"graph_method={self.graph_method!r} is not one of "
                             f"{', '.join(repr(str(m)) for m in GraphMethod)}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum={self.momentum} must be in [0, 1)")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample_rate={self.sample_rate} must be in (0, 1]")
        if self.shards > self.num_classes:
            raise ValueError(f"shards={self.shards} exceeds num_classes={self.num_classes}: "
                             "a shard would own no class")
        if self.hosts > self.shards:
            raise ValueError(f"hosts={self.hosts} exceeds shards={self.shards}: every host "
                             "runs at least one shard")

    @property
    def shards_per_host(self) -> int:
        """Shards on the busiest host when the S shards are spread evenly over H hosts."""
        return -(-self.shards // self.hosts)

    @property
    def row_bytes(self) -> int:
        return self.dim * ROW_DTYPES[self.dtype].itemsize

    @property
    def state_bytes(self) -> int:
        """Momentum bytes per row: none without momentum (``TableSpec.state_width``)."""
        if not self.momentum:
            return 0
        return self.dim * ROW_DTYPES[self.state_dtype or self.dtype].itemsize

    @property
    def id_bytes(self) -> int:
        """Bytes of one neighbor id in the graph (``ams.shard.neighbor_lists.id_dtype``)."""
        return id_dtype(self.num_classes).itemsize


@dataclass(frozen=True)
class ShardMemory:
    """Bytes one shard (the largest, shard 0) holds, by part, and its totals.

    rows, state, clocks, touched, graph: its tensors; baseline: the process with no table;
    buffers: message buffers while serving; snapshot: one snapshot piece on disk;
    in_ram_table: whether rows, state, clocks and graph are in RAM (memory storage) or in
    mapped files (mmap); spare: the files' spare slots (mmap); slot_map: each row's slot and
    the free-slot mask, in RAM (mmap).
    """

    owned: int
    rows: int
    state: int
    clocks: int
    touched: int
    graph: int
    baseline: int
    buffers: int
    snapshot: int
    in_ram_table: bool
    spare: int = 0
    slot_map: int = 0

    @property
    def table(self) -> int:
        """Rows, state and clocks: what the storage holds (RAM or mapped files)."""
        return self.rows + self.state + self.clocks

    @property
    def at_rest(self) -> int:
        """Resident bytes of a serving shard before traffic: right after its table was
        created or restored."""
        return (self.baseline + self.slot_map
                + (self.table + self.graph if self.in_ram_table else 0))

    @property
    def resident(self) -> int:
        """Resident bytes while training: at rest, plus touched marks and message buffers."""
        return self.at_rest + self.touched + self.buffers

    @property
    def files(self) -> int:
        """Bytes of mapped files on disk (mmap: the table's and the graph's), and the page
        cache that holds all of them; 0 for memory storage."""
        return 0 if self.in_ram_table else self.table + self.spare + self.graph

    @property
    def snapshot_peak(self) -> int:
        """Resident bytes at the peak of writing a snapshot: a copy of rows, state and clocks
        (in RAM for memory storage) and one batch of the piece in LMDB's write transaction."""
        return (self.resident + (self.table if self.in_ram_table else 0)
                + min(self.snapshot, COMMIT_BYTES))

    @property
    def restore_peak(self) -> int:
        """Resident bytes at the peak of a restore over the live table: the piece read, the
        assembled table (its rows, state and clocks in RAM for memory storage, its slot map
        for mmap; its graph read into RAM either way) and one tensor's temporary while this
        shard's rows are selected from the piece."""
        assembled = self.graph + self.slot_map + (self.table if self.in_ram_table else 0)
        return self.resident + self.snapshot + assembled + max(self.rows, self.state,
                                                               self.graph)


def shard_memory(job: Job, rates: Rates) -> ShardMemory:
    """The memory and snapshot bytes of ``job``'s largest shard."""
    owned = owned_count(job.num_classes, 0, job.shards)
    rows, state, clocks = owned * job.row_bytes, owned * job.state_bytes, owned * CLOCK_BYTES
    graph = owned * job.graph_k * job.id_bytes
    tensors = rows + state + clocks + graph
    streams = min(job.workers + 1, RPC_THREADS)
    in_ram = job.storage == StorageKind.MEMORY
    slots = owned if in_ram else slot_capacity(owned)
    return ShardMemory(
        owned=owned, rows=rows, state=state, clocks=clocks, touched=owned * TOUCHED_BYTES,
        graph=graph, baseline=rates.baseline, buffers=streams * rates.buffers_per_stream,
        snapshot=tensors + math.ceil(tensors * rates.snapshot_overhead),
        in_ram_table=in_ram,
        spare=(slots - owned) * (job.row_bytes + job.state_bytes + CLOCK_BYTES),
        slot_map=0 if in_ram else owned * slot_dtype(slots).itemsize + slots)


@dataclass(frozen=True)
class StepTraffic:
    """Rows and bytes one training step moves.

    active: classes each worker pulls (at most: the head's budget, never fewer than the
    batch's distinct labels); pull_bytes: each worker's pull, rows in the row dtype and their
    int64 ids; neighbor_bytes: each worker's neighbor-list lookup of its labels (knn);
    pushed: rows each worker pushes (its share of the union of every worker's active classes,
    the classes c mod W of worker c mod W, ``workers.row_update``); push_bytes: that push,
    float32 gradients and int64 ids; exchanged, exchange_bytes: what each worker sends the
    others before the pushes, the gradients of its classes that other workers push (W > 1);
    shard_out, shard_in: bytes one shard sends (pulls, lookups) and receives (its share of
    all workers' pushes) per step.
    """

    active: int
    pull_bytes: int
    neighbor_bytes: int
    pushed: int
    push_bytes: int
    exchanged: int
    exchange_bytes: int
    shard_out: int
    shard_in: int


def budget_for_sample_rate(sample_rate: float, num_classes: int) -> int:
    """PartialFC's budget: ``sample_rate * num_classes`` classes (at least 1)."""
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    return max(1, int(sample_rate * num_classes))


def active_classes(job: Job) -> int:
    """Classes a worker's step pulls at most, by the head's rule (``workers.heads``): full
    all N; partial ``sample_rate * N``; knn ``budget``, or ``sample_rate * N`` when 0; never
    fewer than the batch's labels, never more than N."""
    n = job.num_classes
    if job.head == "full":
        return n
    budget = job.budget if job.head == "knn" and job.budget else \
        budget_for_sample_rate(job.sample_rate, n)
    return min(n, max(budget, job.batch_size))


def step_traffic(job: Job) -> StepTraffic:
    """Each step's pulls, neighbor lookups, gathers and push for ``job``."""
    active = active_classes(job)
    pull = active * (job.row_bytes + ID_BYTES)
    neighbors = job.batch_size * (ID_BYTES + job.graph_k * job.id_bytes) if job.graph_k else 0
    grad_bytes = job.dim * GRAD_BYTES + ID_BYTES
    union = min(job.num_classes, job.workers * active)
    pushed = -(-union // job.workers)
    # the rows of other workers' classes, (W - 1) / W of a worker's own (ceil, in integers)
    exchanged = -(-active * (job.workers - 1) // job.workers)
    # Shard 0's share, in proportion to the classes it owns (ceil(x * owned / N), in integers)
    owned, n = owned_count(job.num_classes, 0, job.shards), job.num_classes
    return StepTraffic(active=active, pull_bytes=pull, neighbor_bytes=neighbors, pushed=pushed,
                       push_bytes=pushed * grad_bytes, exchanged=exchanged,
                       exchange_bytes=exchanged * grad_bytes,
                       shard_out=-(-job.workers * (pull + neighbors) * owned // n),
                       shard_in=-(-union * grad_bytes * owned // n))


def ivf_flops(num_classes: int, dim: int, nlist: int, nprobe: int) -> int:
    """FLOPs of an IVF build of ``num_classes`` rows of ``dim`` with ``nlist`` lists, each
    query scanning ``nprobe``: k-means training, assignment of every row, search of every
    row (centroids, then nprobe lists of N / nlist rows). The exact check of sampled lists is
    counted apart (``graph_build``)."""
    n, d = num_classes, dim
    train = KMEANS_ITERATIONS * min(n, TRAIN_ROWS_PER_LIST * nlist) * nlist * 2 * d
    assign = n * nlist * 2 * d
    search = n * (nlist * 2 * d) + math.ceil(n * min(nprobe, nlist) * (n / nlist)) * 2 * d
    return train + assign + search


@dataclass(frozen=True)
class GraphBuild:
    """The work of one full graph build and its time on this CPU and on the nominal GPU.

    method: exact | ivf; cpu_flops, gpu_flops: the work each does (exact: the CPU's symmetric
    in-memory search halves it when ``in_memory``); check_flops: the exact check of the IVF
    lists of the sampled classes (0 for exact), in both; nlist, nprobe: the IVF index's
    (0 for exact); index_bytes: the IVF builder's index in memory (0 for exact).
    """

    method: str
    in_memory: bool
    cpu_flops: int
    gpu_flops: int
    check_flops: int
    cpu_seconds: float
    gpu_seconds: float
    nlist: int
    nprobe: int
    index_bytes: int


def graph_build(job: Job, rates: Rates, *, in_memory_bytes: int, recall_queries: int
                ) -> GraphBuild:
    """The full build of ``job``'s graph. ``in_memory_bytes``: the float32 rows up to which one
    CPU builder searches in memory (``ams.graph.build.IN_MEMORY_BUILD_BYTES``);
    ``recall_queries``: classes whose IVF lists are checked exactly
    (``ams.graph.build.RECALL_QUERIES``)."""
    n, d = job.num_classes, job.dim
    if job.graph_method == GraphMethod.EXACT:
        in_memory = n * d * 4 <= in_memory_bytes
        ring = 2 * n * n * d
        cpu = ring // 2 if in_memory else ring
        return GraphBuild(
            method="exact", in_memory=in_memory, cpu_flops=cpu, gpu_flops=ring, check_flops=0,
            cpu_seconds=cpu / (rates.cpu_exact if in_memory else rates.cpu_ring),
            gpu_seconds=ring / rates.gpu_exact, nlist=0, nprobe=0, index_bytes=0)
    nlist = resolve_nlist(job.nlist, n)
    nprobe = min(job.nprobe, nlist)
    work = ivf_flops(n, d, nlist, nprobe)
    check = 2 * min(recall_queries, n) * n * d
    # float16 rows and int64 ids (ams.graph.ivf.IvfIndex), float32 centroids
    index = n * (d * 2 + ID_BYTES) + nlist * d * 4
    return GraphBuild(
        method="ivf", in_memory=False, cpu_flops=work, gpu_flops=work, check_flops=check,
        cpu_seconds=work / rates.cpu_ivf + check / rates.cpu_ring,
        gpu_seconds=work / rates.gpu_ivf + check / rates.gpu_exact, nlist=nlist,
        nprobe=nprobe, index_bytes=index)

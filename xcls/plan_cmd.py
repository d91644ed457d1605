"""``xcls plan``: what a job needs of its shards, hosts, network and graph builder, before it
starts. The arithmetic is ``ams.cluster.plan``; this module reads the config and the flags, and
prints."""

from __future__ import annotations

import argparse
import re
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from workers.settings import ExperimentConfig
from xcls.config import ConfigError, load_config

if TYPE_CHECKING:  # the command line imports torch only when a command runs
    from ams.cluster.plan import GraphBuild, Job, Rates, ShardMemory, StepTraffic

_UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)\s*$", re.IGNORECASE)
_COUNT = re.compile(r"^\d[\d_,]*$|^\d+(?:\.\d+)?e\d+$", re.IGNORECASE)
# Host memory a plan takes at most: far past any machine, and every sum stays a float.
MAX_HOST_BYTES = 1 << 70

EXAMPLES = """\
examples:
  xcls plan configs/glyphs-2k-knn.toml
  xcls plan configs/glyphs-2k-knn.toml --classes 100000000 --shards 4 --hosts 4 \\
      --host-mem 24GiB --set ams.dtype=float16 --set head.budget=100000
  xcls plan my.toml --classes 1e8 --shards 8 --hosts 2 --workers 16 --set ams.storage=mmap

Memory is the largest shard's (shard 0 owns the most classes) and the busiest host's (shards
spread evenly over the hosts). The process baseline, the message buffers and the CPU rates were
measured on the machine ams/cluster/plan_rates.json names (benchmarks/plan_rates.py measures yours).
Each graph-build line says what that file marks its rate: measured (on what) or a nominal
assumption. docs/scale.md explains each line."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan", help="capacity plan: memory per shard and host, traffic per step, graph build",
        description="Plan a job before starting it: what each shard and host holds in memory\n"
        "and on disk (rows, optimizer state, decay clocks, graph, process, snapshots and their\n"
        "peaks), what each training step pulls and pushes, and how long a full graph build\n"
        "takes on this CPU and on a GPU. Sizes come from CONFIG and the flags below. Exits 2\n"
        "when the busiest host's shards need more resident memory than --host-mem.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", type=Path, nargs="?",
                   help="experiment TOML file (see configs/; default: every default)")
    p.add_argument("--classes", metavar="N",
                   help="number of classes, e.g. 100000000 or 1e8 (default: the class count "
                   "of the config's data.train dataset)")
    p.add_argument("--shards", metavar="S",
                   help="shard processes (default: one per ams.addresses entry, else "
                   "ams.local_shards)")
    p.add_argument("--hosts", metavar="H",
                   help="hosts the shards are spread over evenly (default: the distinct hosts "
                   "of ams.addresses, else 1)")
    p.add_argument("--host-mem", metavar="SIZE",
                   help="memory of one host, e.g. 24GiB, 512MiB or 64GB: checks that the "
                   "shards of the busiest host fit (default: not checked)")
    p.add_argument("--workers", metavar="W", default="1",
                   help="data-parallel training workers (default: 1)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set ams.dtype=float16 (repeatable)")
    p.set_defaults(func=run_plan)
    p.error = _one_line_error  # argparse's usage dump would hide the one line that matters


def _one_line_error(message: str) -> NoReturn:
    print(f"error: xcls plan: {message} (see xcls plan --help)", file=sys.stderr)
    raise SystemExit(2)


def parse_size(text: str, flag: str) -> int:
    """``"24GiB"``, ``"512 MiB"``, ``"64GB"`` -> bytes (binary and decimal units, any case);
    ValueError naming ``flag`` for anything else, zero or negative sizes included."""
    m = _SIZE.match(text)
    unit = _UNITS.get(m.group(2).lower()) if m else None
    if unit is None:
        raise ValueError(f"{flag} {text!r}: expected a size with a unit, e.g. 24GiB, 512MiB "
                         "or 64GB")
    size = int(Decimal(m.group(1)) * unit)
    if not 0 < size <= MAX_HOST_BYTES:
        raise ValueError(f"{flag} {text!r}: must be more than 0 bytes and at most 2**70")
    return size


def parse_count(text: str, flag: str, high: int) -> int:
    """``"100000000"``, ``"100_000_000"``, ``"1e8"`` -> an integer in [1, high]; ValueError
    naming ``flag`` otherwise."""
    try:
        value = Decimal(text.replace("_", "").replace(",", "")) if _COUNT.match(text) else None
    except InvalidOperation:
        value = None
    if value is None or value != value.to_integral_value():
        raise ValueError(f"{flag} {text!r}: expected a whole number >= 1, e.g. 100000000 or "
                         "1e8")
    if not 1 <= value <= high:
        raise ValueError(f"{flag} {text}: must be in [1, {high:,}]")
    return int(value)


def run_plan(args: argparse.Namespace) -> int:
    from ams.cluster.plan import graph_build, load_rates, shard_memory, step_traffic
    from ams.graph.build import IN_MEMORY_BUILD_BYTES, RECALL_QUERIES

    try:
        cfg = load_config(args.config, args.overrides)
        job = build_job(cfg, args)
        host_mem = parse_size(args.host_mem, "--host-mem") if args.host_mem else None
        rates = load_rates()
        build = graph_build(job, rates, in_memory_bytes=IN_MEMORY_BUILD_BYTES,
                            recall_queries=RECALL_QUERIES) if job.graph_k else None
    except ValueError as e:  # ConfigError is one
        print(f"error: {e}", file=sys.stderr)
        return 2
    memory = shard_memory(job, rates)
    print(render(job, memory, step_traffic(job), build, rates, host_mem))
    per_host = job.shards_per_host * memory.resident
    if host_mem is not None and per_host > host_mem:
        advice = '--shards/--hosts or ams.storage = "mmap"' if memory.in_ram_table \
            else "--shards/--hosts"
        print(f"plan: {job.num_classes} classes on {job.shards} shards need "
              f"{fmt_bytes(per_host)} resident per host, more than --host-mem "
              f"{fmt_bytes(host_mem)}; use {advice}", file=sys.stderr)
        return 2
    return 0


def build_job(cfg: ExperimentConfig, args: argparse.Namespace) -> Job:
    """The ``ams.cluster.plan.Job`` of ``cfg`` with the flags' sizes; ValueError (one line) for bad
    flags or a class count that cannot be found."""
    from ams.addresses import parse_address
    from ams.cluster.plan import MAX_COUNT, Job
    from ams.errors import AmsError
    from ams.sharding import MAX_ROWS
    from workers.data.errors import DatasetError
    from workers.data.lmdb_dataset import read_metadata
    from workers.heads import HeadKind

    if args.classes is not None:
        classes = parse_count(args.classes, "--classes", MAX_ROWS - 1)
    elif cfg.data.train:
        try:
            classes = read_metadata(cfg.data.train).num_classes
        except DatasetError as e:
            raise ValueError(f"data.train: {e}; or give --classes N") from None
    else:
        raise ValueError("no class count: give --classes N, or data.train (a dataset whose "
                         "class count the plan reads)")
    if args.shards is not None:
        shards = parse_count(args.shards, "--shards", MAX_COUNT)
    elif cfg.ams.scheduler:
        raise ValueError("ams.scheduler: the shard count comes from the scheduler; give "
                         "--shards S")
    else:
        shards = len(cfg.ams.addresses) or cfg.ams.local_shards
    if args.hosts is not None:
        hosts = parse_count(args.hosts, "--hosts", MAX_COUNT)
    else:
        try:
            hosts = len({parse_address(a)[0] for a in cfg.ams.addresses}) or 1
        except AmsError as e:
            raise ConfigError(f"ams.addresses: {e}") from None
    knn = cfg.head.kind == HeadKind.KNN
    return Job(
        num_classes=classes, dim=cfg.model.dim, dtype=str(cfg.ams.dtype),
        state_dtype=str(cfg.ams.state_dtype), momentum=cfg.optim.head_momentum, shards=shards,
        hosts=hosts, workers=parse_count(args.workers, "--workers", MAX_COUNT),
        batch_size=cfg.data.batch_size, head=str(cfg.head.kind),
        sample_rate=cfg.head.sample_rate, budget=cfg.head.budget,
        graph_k=cfg.graph.k if knn else 0, storage=str(cfg.ams.storage),
        graph_method=str(cfg.graph.method), nlist=cfg.graph.nlist, nprobe=cfg.graph.nprobe,
        snapshots_kept=cfg.train.snapshots_to_keep)


# ---- printing ------------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    """Bytes as a newcomer reads them: ``"0 B"``, ``"512 B"``, ``"23.8 MiB"``, ``"5.96 GiB"``."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        n /= 1024
        if n < 1024 or unit == "EiB":
            break
    digits = 2 if n < 10 else 1 if n < 100 else 0
    return f"{n:.{digits}f} {unit}"


def fmt_seconds(s: float) -> str:
    """A duration in the unit that reads best: seconds, minutes, hours, days or years."""
    if s < 0.1:
        return "< 0.1 s"
    for limit, unit, size in ((120, "s", 1), (7200, "min", 60), (172800, "h", 3600),
                              (63072000, "days", 86400)):
        if s < limit:
            return f"{s / size:.{1 if s / size < 100 else 0}f} {unit}"
    return f"{s / 31557600:,.1f} years"


def fmt_flops(n: int) -> str:
    """``2.56e18 FLOP``: three digits and a power of ten."""
    mantissa, exponent = f"{n:.2e}".split("e")
    return f"{mantissa}e{int(exponent)} FLOP"


def _row(label: str, *cells: str, note: str = "") -> str:
    return f"  {label:<26}" + "".join(f"{c:>13}" for c in cells) + (f"   {note}" if note else "")


def render(job: Job, mem: ShardMemory, step: StepTraffic, build: GraphBuild | None,
           rates: Rates, host_mem: int | None) -> str:
    """The plan as aligned text tables."""
    n = job.shards_per_host
    momentum = f"momentum {job.momentum:g} ({job.state_dtype or job.dtype})" if job.momentum \
        else "no momentum"
    graph = f"graph k={job.graph_k} (int{8 * job.id_bytes} ids, {job.graph_method})" \
        if job.graph_k else "no graph"
    lines = [
        f"xcls plan: {job.num_classes:,} classes x {job.dim}, {job.dtype} rows, {momentum}, "
        f"storage {job.storage}",
        f"  {job.shards} shard{'s' * (job.shards > 1)} on {job.hosts} "
        f"host{'s' * (job.hosts > 1)} (at most {n} per host); {job.workers} "
        f"worker{'s' * (job.workers > 1)}, batch {job.batch_size}; head {job.head}, {graph}",
        "",
        _row("memory", "per shard", "per host", note="what"),
    ]

    def both(b: int) -> tuple[str, str]:
        return fmt_bytes(b), fmt_bytes(b * n)

    mmap = not mem.in_ram_table
    where = " (mmap)" if mmap else ""
    lines += [
        _row("rows" + where, *both(mem.rows),
             note=f"{mem.owned:,} rows x {job.dim} {job.dtype}"),
        _row("optimizer state" + where, *both(mem.state),
             note=f"momentum in {job.state_dtype or job.dtype}" if job.momentum
             else "none: optim.head_momentum = 0"),
        _row("decay clocks" + where, *both(mem.clocks), note="float64, 8 B a row"),
        _row("graph" + where, *both(mem.graph),
             note=f"{job.graph_k} int{8 * job.id_bytes} ids a row, fixed width" if job.graph_k
             else "none: only the knn head keeps one"),
        *([_row("slot map (mmap)", *both(mem.slot_map),
                note=f"{mem.slot_map // max(1, mem.owned)} B a row: its slot, free slots")]
          if mmap else []),
        _row("process baseline", *both(mem.baseline),
             note="python + torch + grpc, measured"),
        _row("resident at rest", *both(mem.at_rest),
             note="after its table is created or restored" +
             (", rows and graph in files" if mmap else "")),
        _row("touched marks", *both(mem.touched), note="1 B a row, from the first push"),
        _row("message buffers", *both(mem.buffers),
             note=f"{mem.buffers // rates.buffers_per_stream} client streams x "
             f"{fmt_bytes(rates.buffers_per_stream)} (measured per stream)"),
        _row("resident", *both(mem.resident), note="while training: must fit in RAM"),
    ]
    if mmap:
        lines.append(_row("page cache (mmap)", *both(mem.files),
                          note="the mapped files; less than all of it costs disk reads"))
    # A host's shards snapshot the same step, and a rollback restores all of them.
    host_peak, restore_peak = n * mem.snapshot_peak, n * mem.restore_peak
    lines += [
        "",
        _row("disk and peaks", "per shard", "per host", note="what"),
        _row("snapshot on disk", *both(mem.snapshot),
             note="rows, state, clocks and graph in LMDB"),
        _row(f"snapshots kept ({job.snapshots_kept})", *both(mem.snapshot * job.snapshots_kept),
             note="train.keep_checkpoints + 1"),
    ]
    if mmap:
        lines.append(_row("table files", *both(mem.files),
                          note="rows, state and clocks with spare slots; graph"))
    lines += [
        _row("peak while snapshotting", fmt_bytes(mem.snapshot_peak), fmt_bytes(host_peak),
             note=("a copy of rows, state and clocks, " if not mmap else "") +
             "one LMDB commit batch"),
        _row("peak while restoring", fmt_bytes(mem.restore_peak), fmt_bytes(restore_peak),
             note="the piece read, the table assembled, a temporary"),
        "",
        _row("per training step", "rows", "bytes", note="what"),
        _row("pull, each worker", f"{step.active:,}", fmt_bytes(step.pull_bytes),
             note=f"active classes ({_active_rule(job)}): {job.dtype} rows, int64 ids"),
    ]
    if job.graph_k:
        lines.append(_row("neighbor lists, each", f"{job.batch_size:,}",
                          fmt_bytes(step.neighbor_bytes),
                          note=f"the labels' lists of {job.graph_k} ids"))
    lines.append(_row("push, each worker", f"{step.pushed:,}", fmt_bytes(step.push_bytes),
                      note="float32 gradients and int64 ids of its share of all classes"))
    if job.workers > 1:
        lines.append(_row("exchange, each worker", f"{step.exchanged:,}",
                          fmt_bytes(step.exchange_bytes),
                          note="to the workers that push those classes"))
    lines.append(_row("shard 0 sends, receives", fmt_bytes(step.shard_out),
                      fmt_bytes(step.shard_in), note="pulls and lookups out, the push in"))
    if build is not None:
        lines += ["", _build_lines(job, build, rates)]
    if host_mem is not None:
        lines += ["", _fit_line(n * mem.resident, host_peak, restore_peak, host_mem)]
    return "\n".join(lines)


def _active_rule(job: Job) -> str:
    if job.head == "full":
        return "full: all"
    if job.head == "knn" and job.budget:
        return "head.budget"
    return f"{job.head}: sample_rate {job.sample_rate:g} x N"


def _build_lines(job: Job, build: GraphBuild, rates: Rates) -> str:
    if build.method == "exact":
        how = ("in memory, symmetric: N^2 d" if build.in_memory
               else "ring: 2 N^2 d, the float32 rows exceed the in-memory limit")
        head = f"graph build: exact, {fmt_flops(build.cpu_flops)} on the CPU ({how})"
        if build.gpu_flops != build.cpu_flops:
            head += f", {fmt_flops(build.gpu_flops)} on a GPU (ring)"
        cpu_name = "cpu_exact" if build.in_memory else "cpu_ring"
        gpu_name = "gpu_exact"
    else:
        head = (f"graph build: ivf, nlist {build.nlist:,}, nprobe {build.nprobe}: "
                f"{fmt_flops(build.cpu_flops)} + {fmt_flops(build.check_flops)} for the recall "
                "check; "
                f"index {fmt_bytes(build.index_bytes)} in the builder's memory")
        cpu_name, gpu_name = "cpu_ivf", "gpu_ivf"
    # each rate says what the rates file says of it: measured (where) or a nominal assumption
    cpu_rate, gpu_rate = getattr(rates, cpu_name), getattr(rates, gpu_name)
    return "\n".join([
        head,
        f"  this CPU {fmt_seconds(build.cpu_seconds):>14}   at {cpu_rate / 1e9:,.1f} GFLOP/s, "
        f"{rates.sources[cpu_name]}",
        f"  GPU      {fmt_seconds(build.gpu_seconds):>14}   at {gpu_rate / 1e12:,.1f} TFLOP/s, "
        f"{rates.sources[gpu_name]}",
    ])


def _fit_line(resident: int, snapshot_peak: int, restore_peak: int, host_mem: int) -> str:
    fits = "fits" if resident <= host_mem else "does NOT fit"
    line = f"host memory {fmt_bytes(host_mem)}: resident {fmt_bytes(resident)} {fits}"
    over = [f"{what} {fmt_bytes(b)}" for what, b in (("the snapshot peak", snapshot_peak),
                                                    ("the restore peak", restore_peak))
            if b > host_mem]
    if over and resident <= host_mem:
        line += f"; {' and '.join(over)} {'exceed' if len(over) > 1 else 'exceeds'} it"
    return line

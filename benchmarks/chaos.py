"""Chaos run: a training job on loopback while shards are killed or paused and Redis stops.

Runs one job twice with ``xcls cluster up`` (2 shard processes, torchrun workers, all on
127.0.0.1): once without faults (the reference), once while a fault thread kills a shard
(SIGKILL) or pauses one (SIGSTOP, held past the cluster's hang timeout) every ``--fault-every``
seconds, or each time the job reaches another ``--fault-every-checkpoints`` checkpoints (what
``--quick`` does, so that a fast machine cannot finish before the first fault), and, in the
gear job, stops the job's redis-server once for ``--redis-down`` seconds.
``cluster up`` restarts the dead or hung shard and the workers roll back to their newest
checkpoint (every shard restores that checkpoint's snapshot step).

The table reports the faults, the rollbacks and restarts the cluster logged, the time the faults
cost (chaos wall time minus reference wall time), and two ways to see lost or doubled pushes:

* ``rows differing from the reference``: the knn job is deterministic, so with exactly-once
  pushes and exact rollbacks its final rows and momentum equal the reference's bit for bit; any
  acknowledged push lost (outside the snapshot contract: pushes after the restored checkpoint
  are redone by design) or applied twice shows up here.
* ``top-1``: the final evaluation of both runs; the gear job, whose Redis outage changes where
  gradients go, is judged by it (target: within 0.5 points).

    python benchmarks/chaos.py                          # 20-minute gear job, faults every 60 s
    python benchmarks/chaos.py --quick --data DIR       # the 1-minute knn job
    python benchmarks/chaos.py --quick --steps 60 --fault-every-checkpoints 1 --data DIR
                                                        # what CI runs: a kill, a pause
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from results import record

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ams.shard.restore import read_piece  # noqa: E402
from ams.shard.snapshot import step_dir  # noqa: E402

PIECES = ("shard-00000-of-00002", "shard-00001-of-00002")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train one job twice on a local cluster, once without faults and once "
        "while shards are killed or paused and Redis is stopped, and compare.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--job", choices=("gear", "knn"), default="gear",
                   help="gear: KNN head in gear mode with the Redis backend (Redis is stopped "
                        "once); knn: plain KNN head, deterministic, compared row by row")
    p.add_argument("--data", type=Path,
                   help="a glyph dataset (xcls data glyphs); default: build --classes classes "
                        "under --out")
    p.add_argument("--classes", type=int, default=1000, help="classes of the dataset built")
    p.add_argument("--steps", type=int, default=argparse.SUPPRESS,
                   help="training steps of the job (about 0.1 s each on 2 CPU cores; default "
                        "12000, about 20 minutes of fault-free training; 100 with --quick)")
    p.add_argument("--checkpoint-every", type=int, default=argparse.SUPPRESS,
                   help="steps between checkpoints (what a rollback can lose; default 100, 20 "
                        "with --quick)")
    p.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults")
    p.add_argument("--fault-every-checkpoints", type=int, default=argparse.SUPPRESS,
                   help="instead of by time: a fault once the job has written checkpoint "
                        "K·checkpoint_every, 2K·checkpoint_every, ... below the last step "
                        "(progress, whatever the machine's speed; default 0: by time, 2 with "
                        "--quick)")
    p.add_argument("--hang-timeout", type=float, default=argparse.SUPPRESS,
                   help="cluster up --hang-timeout: seconds a paused shard may stay silent "
                        "(default 10, 4 with --quick)")
    p.add_argument("--redis-down", type=float, default=30.0,
                   help="gear job: seconds Redis stays stopped")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "chaos", help="work directory")
    p.add_argument("--keep", action="store_true",
                   help="keep both runs' directories (checkpoints, snapshots, logs)")
    p.add_argument("--quick", action="store_true",
                   help="the CI version: knn job, 100 steps, a checkpoint every 20 steps, a "
                        "fault after every second one, a 4 s hang timeout (a flag given "
                        "explicitly wins)")
    args = p.parse_args(argv)
    if args.quick:
        args.job = "knn"
    for name, default, quick in (("steps", 12000, 100), ("checkpoint_every", 100, 20),
                                 ("fault_every_checkpoints", 0, 2), ("hang_timeout", 10.0, 4.0)):
        if not hasattr(args, name):  # the flag was not given
            setattr(args, name, quick if args.quick else default)
    if args.steps < 1 or args.checkpoint_every < 1 or args.fault_every <= 0:
        p.error("--steps, --checkpoint-every and --fault-every must be positive")
    if args.fault_every_checkpoints < 0:
        p.error("--fault-every-checkpoints must be >= 0")
    return args


# ---- the job ------------------------------------------------------------------------------


def write_config(data: Path, out: Path, args: argparse.Namespace, redis_url: str | None) -> Path:
    # ttl about one epoch (the README's advice): with a ttl longer than the run, the reference
    # trains on features frozen at their first visit, while every rollback and the Redis
    # restart refresh the chaos run's, and the top-1 gap measures the cache, not the faults.
    gear = "" if redis_url is None else f"""
[gear]
enabled = true
backend = "redis"
redis_url = "{redis_url}"
prefix = "chaos{os.getpid()}"
ttl = 100
m = 1
"""
    test = f'"{data / "test"}"' if (data / "test").is_dir() else '""'
    path = out.with_suffix(".toml")
    path.write_text(f"""
[data]
train = "{data / 'train'}"
test = {test}
batch_size = 32
num_workers = 0

[model]
dim = 64

[head]
kind = "knn"
k = 8
budget = 64

[optim]
warmup_steps = 20

[graph]
k = 16
rebuild_every = {max(args.checkpoint_every * 5, 50)}

[train]
max_steps = {args.steps}
checkpoint_every = {args.checkpoint_every}
keep_checkpoints = 2
log_every = 10
threads = 1
out_dir = "{out}"
{gear}""")
    return path


@dataclass
class Run:
    """One ``cluster up`` of the job, and what it logged."""

    out: Path
    seconds: float = 0.0
    exit_code: int = 0
    log: str = ""
    faults: list[str] = field(default_factory=list)


def shard_pids(tag: Path) -> dict[int, int]:
    """shard id -> pid of the live ``xcls serve shard`` processes whose command line names
    ``tag`` (the run's directory)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        words = [w.decode(errors="replace") for w in cmd]
        if state == "Z" or "serve" not in words or "shard" not in words:
            continue
        if any(str(tag) in w for w in words) and "--shard-id" in words:
            found[int(words[words.index("--shard-id") + 1])] = int(entry.name)
    return found


class Faults:
    """Kill, then pause, a shard in turn, every ``--fault-every`` seconds or every
    ``--fault-every-checkpoints`` checkpoints of progress; Redis stopped once."""

    def __init__(self, tag: Path, args: argparse.Namespace, redis: RedisProcess | None) -> None:
        self.tag, self.args, self.redis = tag, args, redis
        self.done = threading.Event()
        self.injected: list[str] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        redis_due = self.redis is not None
        while not self._wait_for_fault(n):
            if self._trained():
                return  # a fault now would hit shards the job no longer needs
            pids = shard_pids(self.tag)
            if redis_due and n == 1:
                redis_due = False
                self.injected.append(f"redis stopped {self.args.redis_down:.0f}s")
                self.redis.stop()
                if self.done.wait(self.args.redis_down):
                    self.redis.start()
                    return
                self.redis.start()
                continue
            shard = n % 2
            pid = pids.get(shard)
            if pid is None:  # between a death and its restart: try again shortly
                self.done.wait(0.2)
                continue
            if n % 2 == 0:
                os.kill(pid, signal.SIGKILL)
                self.injected.append(f"shard {shard} killed")
            else:
                os.kill(pid, signal.SIGSTOP)
                self.injected.append(f"shard {shard} paused")
                # held past the hang timeout: cluster up must notice and replace it
                self.done.wait(self.args.hang_timeout * 2)
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            n += 1

    def _wait_for_fault(self, n: int) -> bool:
        """Wait until fault ``n`` (0-based) is due; True if the run ended first."""
        if not self.args.fault_every_checkpoints:
            return self.done.wait(self.args.fault_every)
        step = (n + 1) * self.args.fault_every_checkpoints * self.args.checkpoint_every
        if step >= self.args.steps:
            self.done.wait()
            return True
        marker = self.tag / "checkpoints" / f"step-{step:012d}"
        while not marker.is_dir():
            if self.done.wait(0.05):
                return True
        return False

    def _trained(self) -> bool:
        """Whether the job wrote its final checkpoint (every step done, every shard's
        snapshot of the last step taken): what is left is its shutdown."""
        return (self.tag / "checkpoints" / f"step-{self.args.steps:012d}").is_dir()


def run_job(config: Path, out: Path, args: argparse.Namespace,
            redis: RedisProcess | None, faults: bool) -> Run:
    run = Run(out)
    log_path = out.with_suffix(".log")
    cmd = [sys.executable, "-m", "xcls", "cluster", "up", str(config), "--shards", "2",
           "--workers", "1", "--max-restarts", "1000", "--hang-timeout",
           str(args.hang_timeout)]
    injector = Faults(out, args, redis) if faults else None
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        if injector is not None:
            injector.thread.start()
        try:
            run.exit_code = proc.wait()
        finally:
            if injector is not None:
                injector.done.set()
                injector.thread.join()
                run.faults = injector.injected
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    run.seconds = time.perf_counter() - started
    run.log = log_path.read_text(errors="replace")
    return run


# ---- what a run left behind ---------------------------------------------------------------


def final_top1(out: Path, step: int) -> float | None:
    """Top-1 of the evaluation at ``step`` (None: the run has none)."""
    path = out / "eval.csv"
    rows = list(csv.DictReader(path.open())) if path.exists() else []
    return next((float(r["top1"]) for r in reversed(rows) if int(r["step"]) == step), None)


def final_tables(out: Path, step: int) -> dict[str, dict[str, torch.Tensor]]:
    return {piece: read_piece(step_dir(out / "ams", step) / piece)[1]["fc"] for piece in PIECES}


def rows_differing(a: Path, b: Path, step: int) -> tuple[int, float]:
    """(rows whose row or momentum differ, largest |difference|) between two runs' final
    snapshots."""
    differing, largest = 0, 0.0
    ta, tb = final_tables(a, step), final_tables(b, step)
    for piece in PIECES:
        for what in ("rows", "state"):
            x, y = ta[piece][what].double(), tb[piece][what].double()
            diff = (x - y).abs()
            if diff.numel():
                differing += int((diff.reshape(diff.shape[0], -1) > 0).any(dim=1).sum()) \
                    if what == "rows" else 0
                largest = max(largest, float(diff.max()))
    return differing, largest


def backbone_differing(a: Path, b: Path, step: int) -> tuple[int, int]:
    """(backbone tensors that differ, tensors in all) between two runs' final checkpoints,
    BatchNorm running statistics included."""
    name = f"checkpoints/step-{step:012d}/worker.pt"
    sa = torch.load(a / name, weights_only=True)["backbone"]
    sb = torch.load(b / name, weights_only=True)["backbone"]
    return sum(not torch.equal(sa[k], sb[k]) for k in sa), len(sa)


def count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


# ---- Redis --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """A throwaway redis-server on a loopback port, stoppable and restartable on that port."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("error: the gear job needs redis-server (bash scripts/setup.sh)")
        self.binary, self.workdir, self.port = binary, workdir, free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# ---- main ---------------------------------------------------------------------------------


def build_data(args: argparse.Namespace) -> Path:
    data = args.out / f"glyphs-{args.classes}"
    if not (data / "train").is_dir():
        subprocess.run([sys.executable, "-m", "xcls", "data", "glyphs", "--classes",
                        str(args.classes), "--size", "24", "--out", str(data)], check=True,
                       cwd=ROOT)
    return data


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.data if args.data is not None else build_data(args)
    work = Path(tempfile.mkdtemp(prefix="chaos-", dir=args.out))
    redis = RedisProcess(work) if args.job == "gear" else None
    try:
        if redis is not None:
            redis.start()
        url = redis.url if redis is not None else None
        ref_out, chaos_out = work / "reference", work / "chaos"
        reference = run_job(write_config(data, ref_out, args, url), ref_out, args, redis,
                            faults=False)
        if redis is not None:  # a clean Redis for the second run, as for the first
            redis.stop()
            redis.start()
        chaos = run_job(write_config(data, chaos_out, args, url), chaos_out, args, redis,
                        faults=True)
    finally:
        if redis is not None:
            redis.stop()
    for name, run in (("reference", reference), ("chaos", chaos)):
        if run.exit_code != 0:
            print(f"error: the {name} run exited with {run.exit_code}; the end of its log:\n"
                  f"{run.log[-4000:]}", file=sys.stderr)
            return 1
    differing, largest = rows_differing(ref_out, chaos_out, args.steps)
    tensors_differing, tensors = backbone_differing(ref_out, chaos_out, args.steps)
    top_ref, top_chaos = final_top1(ref_out, args.steps), final_top1(chaos_out, args.steps)

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.2f} %"

    cadence = (f"a fault after every {args.fault_every_checkpoints} checkpoints"
               if args.fault_every_checkpoints else f"a fault every {args.fault_every:.0f} s")
    print(f"\n### chaos: {args.job} job, {args.steps} steps, checkpoint every "
          f"{args.checkpoint_every}, {cadence}\n")
    print("| measure | reference | chaos |")
    print("|---|---:|---:|")
    print(f"| faults injected | 0 | {len(chaos.faults)} ({'; '.join(chaos.faults)}) |")
    print(f"| shard restarts | {count(r'shard_restarted', reference.log)} | "
          f"{count(r'shard_restarted', chaos.log)} |")
    print(f"| rollbacks (worker group restarts) | {count(r'rollback restart=', reference.log)} | "
          f"{count(r'rollback restart=', chaos.log)} |")
    print(f"| wall time | {reference.seconds:.0f} s | {chaos.seconds:.0f} s |")
    print(f"| time lost to faults | - | {chaos.seconds - reference.seconds:.0f} s |")
    print(f"| rows differing from the reference | - | {differing} "
          f"(max abs diff {largest:.3g}) |")
    print(f"| backbone tensors differing from the reference | - | {tensors_differing} of "
          f"{tensors} |")
    print(f"| top-1 | {pct(top_ref)} | {pct(top_chaos)} |")
    record("chaos", [{
        "job": args.job, "steps": args.steps, "faults injected": len(chaos.faults),
        "faults": "; ".join(chaos.faults),
        "shard restarts": count(r"shard_restarted", chaos.log),
        "rollbacks": count(r"rollback restart=", chaos.log),
        "wall s, reference": round(reference.seconds), "wall s, chaos": round(chaos.seconds),
        "time lost to faults s": round(chaos.seconds - reference.seconds),
        "rows differing": differing, "max abs diff": float(f"{largest:.3g}"),
        "backbone tensors differing": f"{tensors_differing} of {tensors}",
        "top-1 %, reference": None if top_ref is None else round(100 * top_ref, 2),
        "top-1 %, chaos": None if top_chaos is None else round(100 * top_chaos, 2)}])
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

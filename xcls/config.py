"""Experiment configuration: one TOML file per experiment, read into typed dataclasses.

Unknown keys and wrong types are rejected with the dotted key in the message; ``--set a.b=c``
overrides any field. Library code never reads this tree: the command line unpacks it into
explicit arguments.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import textwrap
import tomllib
import types
import typing
import urllib.parse
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from ams.errors import clip, shorten


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the dotted key."""


# What a secret becomes wherever a config is written out (config.toml, exports, 'config print').
REDACTED = "***"
# Field metadata: the password part of this URL field is a secret.
URL_PASSWORD_SECRET = types.MappingProxyType({"secret": "url_password"})


@dataclass
class DataConfig:
    train: str = ""
    """LMDB image dataset to train on (``xcls data glyphs|folder|rec`` writes one)."""
    test: str = ""
    """LMDB dataset for evaluation (empty: no evaluation)."""
    batch_size: int = 256
    """samples per step per worker"""
    num_workers: int = 2
    """DataLoader worker processes (0: load in the training process)"""
    flip: bool = False
    """mirror images are the same class: each training image is mirrored left-right with
    probability 1/2, and verification adds each pair image's mirror embedding to its own, as
    insightface scores LFW (faces, products; not for glyphs, whose mirror image is another
    character or none)"""
    verification: list[str] = field(default_factory=list)
    """pair sets ('xcls data bin': LFW, CFP-FP, AgeDB-30) whose face-verification accuracy
    each evaluation reports as verify_<directory name>: 10-fold, at the best cosine threshold,
    as insightface reports it"""


@dataclass
class ModelConfig:
    backbone: str = "resnet_small"
    """resnet_small (32-64 px) or iresnet50 (112 px faces)"""
    dim: int = 128
    """embedding width = class-row width"""


@dataclass
class HeadConfig:
    kind: str = "knn"
    """which classes are active per step: full | partial | knn (workers.heads.HeadKind)"""
    placement: str = "ams"
    """where the class rows live: ams (the model server: in process, or the shards of
    ams.addresses / ams.scheduler) | collective (sliced over the worker ranks, rank r
    holding the classes c % W == r in its own memory, softmax computed model-parallel; no
    server on the step's path; for tables whose rows and optimizer state fit the workers,
    up to a few tens of millions of classes per host; workers.collective)"""
    sample_rate: float = 0.1
    """partial: fraction of all classes active per step, in (0, 1] (collective: of each
    rank's slice, PartialFC's scheme)"""
    k: int = 16
    """knn: neighbors per label taken into the active set, > 0 and <= graph.k"""
    budget: int = 0
    """knn: active classes per step, >= 0 (0: sample_rate * num_classes, so knn and partial
    compare at equal size)"""
    random_share: float = 0.5
    """knn: fraction of the negative slots (budget minus the batch's labels) given to uniform
    random classes, in [0, 1]; the rest go to the labels' neighbors by rank. 0 is KNN
    softmax's own selection (docs/accuracy.md compares the two)"""
    logq_correction: bool = True
    """partial, knn: weight each uniformly drawn class's logit by the number of left-over
    classes it stands for (log(pool / drawn)), so the sampled softmax estimates the full one
    without bias; classes taken for sure (labels, neighbors) are unweighted. Off is
    PartialFC's (and KNN softmax's) plain softmax over the active classes (docs/accuracy.md)"""
    margin: str = "cosface"
    """margin on the target logit: arcface | cosface | softmax (no margin;
    workers.losses.Margin)"""
    scale: float = 32.0
    """logit scale s, > 0"""


@dataclass
class OptimConfig:
    name: str = "sgd"
    """the backbone's optimizer: sgd (momentum SGD) | lars (momentum SGD with each weight
    tensor's step scaled by its trust ratio, lars_eta * |w| / (|g| + weight_decay * |w|);
    biases and norms excluded: no decay, no trust ratio; for large global batches;
    workers.lars)"""
    lars_eta: float = 0.001
    """lars: the trust coefficient, > 0"""
    lr: float = 0.1
    """peak learning rate of the backbone, >= 0"""
    head_lr: float = 0.0
    """peak learning rate of the class rows, >= 0 (0: lr * (1 - head_momentum) / (1 -
    momentum), so a row moves as far per unit of gradient as a backbone weight does under
    momentum)"""
    head_momentum: float = 0.0
    """momentum of the class rows' sparse SGD in the AMS, in [0, 1). A sampled head's row is
    active in few steps and sparse momentum moves it only then, so with momentum m a gradient
    takes effect over the row's next 1/(1-m) activations; at 0 a row takes its whole step at
    once (docs/accuracy.md)"""
    momentum: float = 0.9
    """momentum of the backbone's SGD, in [0, 1)"""
    weight_decay: float = 5e-4
    """weight decay of the backbone's SGD, >= 0"""
    head_weight_decay: float = 5e-3
    """weight decay of the class rows, >= 0, applied by the AMS to every row in every step
    (rows that sit out steps take what they owe at their next push, see
    workers.row_update); the rows' peak lr times it must stay below 1. Gear mode with
    features cached for a whole run is more stable at 5e-4 (docs/accuracy.md)"""
    warmup_steps: int = 100
    """steps of linear warmup from 0 to the peak learning rates, >= 0"""
    head_warmup_steps: int = -1
    """steps of linear warmup of the class rows' learning rate, >= 0, or -1: until each class
    has been a label about 3 times (3 * classes / global batch steps), at least warmup_steps.
    A row that sits out only decays, and its first label step at full rate leaves it a norm
    so large that it hardly turns afterwards (benchmarks/trace_start.py traces it)"""
    schedule: str = "cosine"
    """after warmup: cosine (to 0 at the last step) | constant"""

    def effective_head_lr(self) -> float:
        """The class rows' peak learning rate: ``head_lr``, or when 0 the rows' step that
        matches the backbone's steady-state momentum step."""
        return self.head_lr or self.lr * (1 - self.head_momentum) / (1 - self.momentum)


@dataclass
class AmsConfig:
    addresses: list[str] = field(default_factory=list)
    """shard host:port list in shard order; empty: shards run in this process"""
    local_shards: int = 2
    """embedded mode: number of in-process shards"""
    table: str = "fc"
    dtype: str = "float32"
    """row dtype: float32 | float16 | bfloat16 (ams.dtypes.RowDtype)"""
    state_dtype: str = ""
    """momentum dtype: float32 | float16 | bfloat16 (empty: same as dtype)"""
    storage: str = "memory"
    """where the shards keep rows, momentum and decay clocks: memory | mmap
    (ams.storage.StorageKind). mmap: files under the shards' data dir (embedded:
    train.out_dir/ams/tables), mapped into memory and paged by the OS, for tables larger
    than RAM; kept across a clean stop, discarded after a crash (the run resumes from its
    snapshot)"""
    token_file: str = ""
    """file with the shards' shared secret (empty: none)"""
    tls_ca_file: str = ""
    """PEM certificate of the authority that signed the shards' TLS certificates ('xcls serve
    shard --tls-cert'); empty: the shards are reached in plaintext"""
    scheduler: str = ""
    """host:port of an 'xcls serve scheduler' to find the shards through and keep a lease with,
    instead of addresses (a lost shard or worker then rolls training back); empty: none"""
    shared_memory: bool = True
    """rows of 1 MiB or more to and from a shard on this host (same pid namespace) bypass the
    socket through memory both processes map (ams.shm; never with TLS); false: always in the
    data plane's frames"""


@dataclass
class GraphConfig:
    k: int = 32
    """neighbors kept per class in the graph, > 0 and >= head.k"""
    rebuild_every: int = 0
    """steps between graph rebuilds, >= 0 (0: once per epoch). Each rebuild writes the share
    of neighbors it replaced to OUT/graph.csv ("turnover"): how stale the lists the knn head
    took were (docs/accuracy.md)"""
    device: str = ""
    """where to build (empty: the training device)"""
    method: str = "exact"
    """how a full build finds the neighbors: exact (every pair scored, O(N^2 d)) | ivf (faiss
    inverted lists over float16 rows, about O(N^1.5 d); each build logs and writes to
    OUT/graph.csv the recall of 1,000 sampled lists against an exact search)
    (ams.graph.GraphMethod)"""
    nlist: int = 0
    """ivf: k-means lists the rows are split into (0: about 4 sqrt(N), see
    ams.graph.resolve_nlist)"""
    nprobe: int = 8
    """ivf: lists each class scans for its neighbors, <= nlist when nlist is given; more:
    higher recall, longer builds"""
    refresh: str = "full"
    """what a rebuild recomputes: full (every list) | touched (after a full build, only the
    lists of the classes pushed since, exactly; cheaper when few classes move between
    rebuilds) (ams.graph.GraphRefresh, ams.graph_build.GraphUpdater)"""
    full_every: int = 10
    """refresh = touched: a full build after this many touched refreshes (0: never), since an
    untouched class keeps its list while its neighbors move"""


@dataclass
class TrainConfig:
    epochs: int = 10
    max_steps: int = 0
    """stop after this many steps (0: run all epochs)"""
    batch_schedule: list[int] = field(default_factory=list)
    """a batch that grows during training: the per-rank batch of each epoch, e.g. [64, 96,
    128, 192, 256] (epochs past the list keep its last entry; each > 0); empty: data.batch_size
    throughout. With optim.name = lars and optim.schedule = constant this is the fast
    continuous convergence strategy (docs/accuracy.md)"""
    batch_lr_scaling: bool = True
    """with a batch_schedule, multiply each step's learning rates (backbone and rows) by its
    batch over the first epoch's (the linear scaling rule); false keeps them as optim says
    (growing the batch then stands in for decaying the learning rate)"""
    seed: int = 0
    prefetch_depth: int = 1
    """batches whose active rows are pulled ahead (0: strict, pull after the last push)"""
    amp: bool = True
    """mixed precision on CUDA (ignored on CPU)"""
    device: str = "auto"
    """auto (CUDA when there is one) | cpu | cuda; each worker takes the GPU of its LOCAL_RANK"""
    threads: int = 0
    """torch CPU threads, at most 1024 (0: torch's default)"""
    out_dir: str = "runs/experiment"
    """checkpoints, AMS snapshots, metrics.csv, TensorBoard events"""
    log_every: int = 50
    eval_every: int = 0
    """steps between evaluations (0: at each epoch end)"""
    checkpoint_every: int = 0
    """steps between checkpoints (0: at each epoch end)"""
    keep_checkpoints: int = 2
    """newest checkpoints kept, >= 1; the AMS keeps one snapshot more (the newest may lack
    its checkpoint after a crash between the two)"""
    resume: bool = True
    """continue from the newest checkpoint in out_dir if there is one"""

    @property
    def snapshots_to_keep(self) -> int:
        """AMS snapshots a run keeps: one per kept checkpoint, plus one for a snapshot whose
        checkpoint was never written (a crash between the two)."""
        return self.keep_checkpoints + 1


@dataclass
class GearConfig:
    enabled: bool = False
    ttl: float = 0.0
    """seconds a cached feature stays usable (0: never reuse)"""
    m: int = 1
    """gradients per sample averaged before the slow gear applies them"""
    backend: str = "memory"
    """where the feature cache and gradient sums live: memory | lmdb | redis
    (bridge.GearBackend)"""
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata=URL_PASSWORD_SECRET)
    """redis://[user[:password]@]host[:port][/db]. A password here is never written out:
    OUT/config.toml, exports and 'xcls config print' show it as ***, so a run resumed from
    such a file needs redis_password_file (or the password put back in the URL)"""
    redis_password_file: str = ""
    """file holding the Redis password (empty: the URL's, if any); keeps the secret out of
    every config, on disk or on a command line"""
    prefix: str = "xcls"
    """job name: every Redis key of the job starts with it (no ':')"""
    slow: str = "local"
    """local: the slow gear runs in the trainer after each step | external: separate
    'xcls gear slow' processes, redis backend only (workers.gear.SlowGearMode)"""
    slow_batch: int = 256
    """most mean gradients the slow gear applies in one backbone step"""
    cache_mb: int = 512
    """memory/lmdb backend: feature cache bound in MiB (lmdb lives in train.out_dir/gear_cache)"""
    sync_every: int = 10
    """slow=external: trainer steps between checks for newer published backbone weights"""
    publish_every: int = 10
    """slow=external: slow-gear backbone steps between weight publications"""


@dataclass
class CommConfig:
    compression: str = "none"
    """how the backbone's gradients travel between workers: none (DDP's dense all-reduce) |
    topk (each layer's largest entries, with error feedback and momentum correction,
    workers.comm; optim.momentum then runs in it, not in the optimizer). CPU or fp32 only:
    not with train.amp on CUDA"""
    density: float = 0.01
    """topk: share of each layer's entries sent per step, in (0, 1]; from 2/3 on a layer is
    sent dense (fewer bytes than index-value pairs)"""
    warmup_steps: int = 0
    """topk: steps over which the share falls geometrically from 1 (dense) to comm.density,
    as deep gradient compression warms up, >= 0 (0: comm.density from the first step; a
    tenth of the run is what docs/accuracy.md measured level with dense)"""
    dense_below: int = 128
    """topk: layers with fewer entries (biases, norms) are always sent dense, >= 0"""


@dataclass
class ExperimentConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ams: AmsConfig = field(default_factory=AmsConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    gear: GearConfig = field(default_factory=GearConfig)
    comm: CommConfig = field(default_factory=CommConfig)


CHOICES = {
    "optim.name": ("sgd", "lars"),
    "optim.schedule": ("cosine", "constant"),
    "train.device": ("auto", "cpu", "cuda"),
}


def enum_fields() -> dict[str, type[StrEnum]]:
    """Fields whose values are a library Enum's members: a config holds the member after
    validation. Imported when a config is validated, not when the command line starts
    (the libraries import torch)."""
    from ams.dtypes import RowDtype
    from ams.graph import GraphMethod, GraphRefresh
    from ams.storage import StorageKind
    from bridge import GearBackend
    from workers.comm import Compression
    from workers.gear import SlowGearMode
    from workers.heads import HeadKind, Placement
    from workers.losses import Margin

    return {"head.kind": HeadKind, "head.placement": Placement, "head.margin": Margin,
            "ams.dtype": RowDtype,
            "graph.method": GraphMethod, "graph.refresh": GraphRefresh,
            "ams.state_dtype": RowDtype, "ams.storage": StorageKind,
            "gear.backend": GearBackend, "gear.slow": SlowGearMode,
            "comm.compression": Compression}
FLOAT32_MAX = 3.4028234663852886e38
MAX_THREADS = 1024
# An experiment file is a few KiB; the bound keeps a wrong path (/dev/zero, a dataset) from
# being read whole.
MAX_CONFIG_BYTES = 1 << 20
POSITIVE = {"data.batch_size", "model.dim", "head.k", "graph.k", "train.epochs",
            "train.log_every", "train.keep_checkpoints", "head.scale", "ams.local_shards",
            "gear.m", "gear.slow_batch", "gear.cache_mb", "gear.sync_every",
            "gear.publish_every", "graph.nprobe"}
NON_NEGATIVE = {"data.num_workers", "head.budget", "optim.lr", "optim.head_lr",
                "optim.weight_decay", "optim.head_weight_decay", "optim.warmup_steps",
                "graph.rebuild_every", "graph.nlist", "graph.full_every",
                "train.max_steps", "train.seed", "train.prefetch_depth", "train.threads",
                "train.eval_every", "train.checkpoint_every", "gear.ttl",
                "comm.warmup_steps", "comm.dense_below"}


def _coerce(value: Any, kind: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``kind``; ints are accepted for floats."""
    origin = typing.get_origin(kind)
    if origin in (list, types.GenericAlias) or kind is list:
        (item,) = typing.get_args(kind) or (str,)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} "
                              f"{shorten(value)}")
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {shorten(value)}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {shorten(value)}")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {shorten(value)}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: expected a finite number, got {shorten(value)}")
        if abs(value) > FLOAT32_MAX:  # every such setting ends up a factor in float32 math
            raise ConfigError(f"{key}: {shorten(value)} is beyond float32's range "
                              f"(|x| <= {FLOAT32_MAX:.6g})")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {shorten(value)}")
        return value
    raise ConfigError(f"{key}: unsupported field type {kind}")  # pragma: no cover


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a table, got {shorten(data)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(f"unknown key {clip(where + unknown[0])} "
                          f"(known: {', '.join(sorted(names))})")
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        kind = hints[name]
        if dataclasses.is_dataclass(kind):
            kwargs[name] = _build(kind, value, key)
        else:
            kwargs[name] = _coerce(value, kind, key)
    return cls(**kwargs)


def validate(cfg: ExperimentConfig) -> ExperimentConfig:
    """Range and choice checks that a type alone does not express."""
    for key, allowed in CHOICES.items():
        value = get_value(cfg, key)
        if value not in allowed:
            raise ConfigError(f"{key}: {shorten(value)} is not one of "
                              f"{', '.join(map(repr, allowed))}")
    for key, enum in enum_fields().items():
        value = get_value(cfg, key)
        if key == "ams.state_dtype" and value == "":
            continue  # the rows' dtype
        if value not in list(enum):
            raise ConfigError(f"{key}: {shorten(value)} is not one of "
                              f"{', '.join(repr(str(m)) for m in enum)}")
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, enum(value))
    for key in POSITIVE:
        if get_value(cfg, key) <= 0:
            raise ConfigError(f"{key}: must be > 0, got {get_value(cfg, key)}")
    for key in NON_NEGATIVE:
        if get_value(cfg, key) < 0:
            raise ConfigError(f"{key}: must be >= 0, got {get_value(cfg, key)}")
    if cfg.train.threads > MAX_THREADS:  # torch starts them all, and a process has a limit
        raise ConfigError(f"train.threads: must be at most {MAX_THREADS}, got "
                          f"{cfg.train.threads}")
    if not 0 < cfg.head.sample_rate <= 1:
        raise ConfigError(f"head.sample_rate: must be in (0, 1], got {cfg.head.sample_rate}")
    if not 0 <= cfg.head.random_share <= 1:
        raise ConfigError(f"head.random_share: must be in [0, 1], got {cfg.head.random_share}")
    if cfg.graph.nlist and cfg.graph.nprobe > cfg.graph.nlist:
        raise ConfigError(f"graph.nprobe={cfg.graph.nprobe} exceeds graph.nlist="
                          f"{cfg.graph.nlist}: a class cannot scan more lists than there are")
    if cfg.head.kind == "knn" and cfg.head.k > cfg.graph.k:
        raise ConfigError(f"head.k={cfg.head.k} exceeds graph.k={cfg.graph.k}: the graph must "
                          "keep at least as many neighbors as the head takes")
    if cfg.gear.slow == "external" and cfg.gear.backend != "redis":
        raise ConfigError("gear.slow: 'external' slow gears read the Redis stream; set "
                          "gear.backend=redis")
    if not cfg.gear.prefix or ":" in cfg.gear.prefix:
        raise ConfigError(f"gear.prefix: must be a non-empty name without ':', "
                          f"got {shorten(cfg.gear.prefix)}")
    _check_scheduler(cfg.ams)
    if cfg.head.placement == "collective":
        if cfg.ams.addresses or cfg.ams.scheduler:
            raise ConfigError("head.placement: 'collective' keeps the rows in the workers; "
                              "leave ams.addresses and ams.scheduler empty (or use "
                              "placement 'ams')")
        if cfg.gear.enabled:
            raise ConfigError("head.placement: gear mode trains with placement 'ams' only")
    if not 0 < cfg.comm.density <= 1:
        raise ConfigError(f"comm.density: must be in (0, 1], got {cfg.comm.density}")
    if any(b <= 0 for b in cfg.train.batch_schedule):
        raise ConfigError(f"train.batch_schedule: every batch must be > 0, got "
                          f"{shorten(cfg.train.batch_schedule)}")
    if cfg.optim.lars_eta <= 0:
        raise ConfigError(f"optim.lars_eta: must be > 0, got {cfg.optim.lars_eta}")
    if not 0 <= cfg.optim.momentum < 1:
        raise ConfigError(f"optim.momentum: must be in [0, 1), got {cfg.optim.momentum}")
    if cfg.optim.head_warmup_steps < -1:
        raise ConfigError(f"optim.head_warmup_steps: must be >= 0 or -1 (auto), got "
                          f"{cfg.optim.head_warmup_steps}")
    if not 0 <= cfg.optim.head_momentum < 1:
        raise ConfigError(f"optim.head_momentum: must be in [0, 1), got "
                          f"{cfg.optim.head_momentum}")
    if cfg.optim.effective_head_lr() * cfg.optim.head_weight_decay >= 1:
        raise ConfigError(f"optim.head_weight_decay: the class rows' lr "
                          f"{cfg.optim.effective_head_lr():g} x head_weight_decay "
                          f"{cfg.optim.head_weight_decay:g} must be below 1")
    return cfg


def _check_scheduler(ams: AmsConfig) -> None:
    """ams.scheduler is a host:port, and the shards come from it or from ams.addresses."""
    if not ams.scheduler:
        return
    if ams.addresses:
        raise ConfigError("ams.scheduler: the shards come from the scheduler; leave "
                          "ams.addresses empty")
    host, _, port = ams.scheduler.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"ams.scheduler: expected host:port, got {shorten(ams.scheduler)}")


def get_value(cfg: Any, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _parse_override(text: str, kind: Any, key: str) -> Any:
    """``--set`` value text -> a value of the field's type (TOML literal syntax accepted)."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):  # RecursionError: nested too deep
        value = text  # bare words are strings: --set head.kind=knn
    if kind is str and not isinstance(value, str):
        value = text
    if kind is bool and isinstance(value, str):
        value = {"true": True, "yes": True, "1": True, "false": False, "no": False,
                 "0": False}.get(value.lower(), value)
    if typing.get_origin(kind) is list and isinstance(value, str):
        value = [v for v in value.split(",") if v]
    return _coerce(value, kind, key)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b=c`` overrides to the raw config dict (checked against the schema)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {shorten(item)}: expected KEY=VALUE, e.g. head.kind=knn")
        dotted, text = item.split("=", 1)
        parts = dotted.strip().split(".")
        cls: Any = ExperimentConfig
        node = data
        for i, part in enumerate(parts):
            fields = {f.name: f for f in dataclasses.fields(cls)}
            key = ".".join(parts[:i + 1])
            if part not in fields:
                raise ConfigError(f"--set {clip(dotted)}: unknown key {clip(key)} "
                                  f"(known: {', '.join(sorted(fields))})")
            kind = typing.get_type_hints(cls)[part]
            if dataclasses.is_dataclass(kind):
                if i == len(parts) - 1:
                    raise ConfigError(f"--set {clip(dotted)}: {key} is a section, name a field "
                                      "in it")
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"{key}: expected a table")
                cls = kind
            else:
                if i != len(parts) - 1:
                    raise ConfigError(f"--set {clip(dotted)}: {key} is not a section")
                node[part] = _parse_override(text.strip(), kind, key)
    return data


def example_configs() -> list[Path]:
    """The example experiment configs installed with the package (``xcls/configs/*.toml``)."""
    return sorted((Path(__file__).parent / "configs").glob("*.toml"))


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read a TOML experiment file (None: all defaults), apply overrides, validate."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        try:
            with open(p, "rb") as f:
                raw = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"cannot read config {p}: {e.strerror}") from None
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"config {p}: more than {MAX_CONFIG_BYTES} bytes, not an "
                              "experiment file")
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(f"config {p} is not UTF-8 text") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config {p} is not valid TOML: {e}") from None
        except RecursionError:
            raise ConfigError(f"config {p} is not valid TOML: nested too deep") from None
    data = apply_overrides(data, overrides or [])
    return validate(_build(ExperimentConfig, data, ""))


def to_toml(cfg: ExperimentConfig) -> str:
    """The full resolved config as TOML (every field, defaults included), each field under its
    documentation as comments; secrets are replaced by ``REDACTED``, as this text is what goes
    to disk (OUT/config.toml, exports) and to the terminal."""
    lines = []
    for section in dataclasses.fields(cfg):
        part = getattr(cfg, section.name)
        docs = field_docs(type(part))
        lines.append(f"[{section.name}]")
        for f in dataclasses.fields(part):
            lines.extend(f"# {line}".rstrip() for line in docs.get(f.name, "").splitlines())
            lines.append(f"{f.name} = {_toml_value(redacted(getattr(part, f.name), f))}")
        lines.append("")
    return "\n".join(lines)


def redacted(value: Any, f: dataclasses.Field) -> Any:
    """``value`` of field ``f`` as it may be written out: with a secret field's secret part
    replaced by ``REDACTED``."""
    if f.metadata.get("secret") == "url_password":
        return redact_url_password(value)
    return value


def redact_url_password(url: str) -> str:
    """``url`` with the password of its user info (``scheme://user:PASSWORD@host``) replaced by
    ``REDACTED``; unchanged when it has none; all of it replaced when it does not parse and
    holds an ``@``."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return REDACTED if "@" in url else url
    userinfo, at, hostport = parts.netloc.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    if not (at and colon):
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:{REDACTED}@{hostport}"))


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field's documentation: the string literal written under it in the class body
    (the dataclass convention this module follows), keyed by field name."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # installed without its sources: print the bare values
        return {}
    body = ast.parse(textwrap.dedent(source)).body[0].body
    docs = {}
    for stmt, after in zip(body, body[1:], strict=False):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'

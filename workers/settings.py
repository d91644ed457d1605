"""The run's parameters: one dataclass per section of an experiment file, each field with its
type, its constraints (``workers.field_marks``) and its documentation, the string under it.

This is their one home: ``xcls.config`` reads a TOML file into an ``ExperimentConfig`` (refusing
what a field's annotation does not admit), run assembly (``xcls.run``) builds the parts from it,
and the trainer takes it whole (``workers.trainer``); ``ams.cluster.plan.Job`` is made from it by
``xcls.plan_cmd.build_job``.

A choice is a ``StrEnum`` of the library that acts on it, each member with a one-line comment.
Those libraries import torch, which the command line loads only once a command runs, so this
module names them for type checkers only, writes a choice's default as its member's value, and
``choice_enums`` imports them when a config is loaded; a loaded config holds the members.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

from ams.limits import MAX_DIM
from workers.field_marks import (
    NON_NEGATIVE,
    OR_EMPTY,
    POSITIVE,
    URL_PASSWORD_SECRET,
    Each,
    Range,
    Rule,
)

if TYPE_CHECKING:
    from ams.dtypes import RowDtype
    from ams.graph.methods import GraphMethod, GraphRefresh
    from ams.shard.storage import StorageKind
    from bridge import GearBackend
    from workers.backbones import BackboneKind
    from workers.comm import Compression
    from workers.distributed import DeviceSetting
    from workers.gear import SlowGearMode
    from workers.heads import HeadKind, Placement
    from workers.losses import Margin
    from workers.optimizers import OptimizerKind
    from workers.schedule import Schedule


def choice_enums() -> dict[str, type[StrEnum]]:
    """The enums the sections' annotations name, by name: the namespace in which
    ``typing.get_type_hints`` resolves them."""
    from ams.dtypes import RowDtype
    from ams.graph.methods import GraphMethod, GraphRefresh
    from ams.shard.storage import StorageKind
    from bridge import GearBackend
    from workers.backbones import BackboneKind
    from workers.comm import Compression
    from workers.distributed import DeviceSetting
    from workers.gear import SlowGearMode
    from workers.heads import HeadKind, Placement
    from workers.losses import Margin
    from workers.optimizers import OptimizerKind
    from workers.schedule import Schedule

    return {e.__name__: e for e in (RowDtype, GraphMethod, GraphRefresh, StorageKind,
                                    GearBackend, BackboneKind, Compression, DeviceSetting,
                                    SlowGearMode, HeadKind, Placement, Margin, OptimizerKind,
                                    Schedule)}


# torch starts every thread asked for, and a process has a limit on its threads.
MAX_THREADS = 1024
FRACTION = Range(gt=0, le=1)  # a share that cannot be nothing: (0, 1]
SHARE = Range(ge=0, le=1)  # [0, 1]
MOMENTUM = Range(ge=0, lt=1)  # at 1 a velocity would never decay
# The longest a cached feature may stay usable: about 31 years, far below what every cache
# backend takes (Redis refuses an EX past about 2**63 / 1000 s and then caches nothing).
MAX_TTL_S = 10**9


def _host_port(text: str) -> bool:
    """``text`` is ``host:port`` with a port in 1..65535."""
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def _key_prefix(text: str) -> bool:
    """``text`` can start Redis keys: not empty, and no ':' (the keys' separator)."""
    return bool(text) and ":" not in text


@dataclass
class DataConfig:
    train: str = ""
    """LMDB image dataset to train on (``xcls data glyphs|folder|rec`` writes one)."""
    test: str = ""
    """LMDB dataset for evaluation (empty: no evaluation)."""
    batch_size: Annotated[int, POSITIVE] = 256
    """samples per step per worker"""
    num_workers: Annotated[int, NON_NEGATIVE] = 2
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
    backbone: BackboneKind = "resnet_small"
    """resnet_small (16-64 px) or iresnet50 (112 px faces) (workers.backbones.BackboneKind)"""
    dim: Annotated[int, POSITIVE, Range(le=MAX_DIM)] = 128
    """embedding width = class-row width, at most 65536"""


@dataclass
class HeadConfig:
    kind: HeadKind = "knn"
    """which classes are active per step: full | partial | knn (workers.heads.HeadKind)"""
    placement: Placement = "ams"
    """where the class rows live: ams (the model server: in process, or the shards of
    ams.addresses / ams.scheduler) | collective (sliced over the worker ranks, rank r
    holding the classes c % W == r in its own memory, softmax computed model-parallel; no
    server on the step's path; for tables whose rows and optimizer state fit the workers,
    up to a few tens of millions of classes per host; workers.collective)"""
    sample_rate: Annotated[float, FRACTION] = 0.1
    """partial: fraction of all classes active per step, in (0, 1] (collective: of each
    rank's slice, PartialFC's scheme)"""
    k: Annotated[int, POSITIVE] = 16
    """knn: neighbors per label taken into the active set, > 0 and <= graph.k"""
    budget: Annotated[int, NON_NEGATIVE] = 0
    """knn: active classes per step, >= 0 (0: sample_rate * num_classes, so knn and partial
    compare at equal size)"""
    random_share: Annotated[float, SHARE] = 0.5
    """knn: fraction of the negative slots (budget minus the batch's labels) given to uniform
    random classes, in [0, 1]; the rest go to the labels' neighbors by rank. 0 is KNN
    softmax's own selection (docs/accuracy.md compares the two)"""
    logq_correction: bool = True
    """partial, knn: weight each uniformly drawn class's logit by the number of left-over
    classes it stands for (log(pool / drawn)), so the sampled softmax estimates the full one
    without bias; classes taken for sure (labels, neighbors) are unweighted. Off is
    PartialFC's (and KNN softmax's) plain softmax over the active classes (docs/accuracy.md)"""
    logq_start_step: Annotated[int, Range(ge=-1)] = -1
    """knn with logq_correction: the first step that weights the drawn classes, >= 0, or -1:
    the step after the class rows' warm-up (optim.head_warmup_steps). Before it the softmax is
    plain: while the rows are untrained, the weighted draws hold most of its probability and
    slow the rows' pull toward their classes (docs/accuracy.md, "The start"). partial weights
    its draws from the first step: a later start costs it accuracy (docs/decisions.md)"""
    margin: Margin = "cosface"
    """margin on the target logit: arcface | cosface | softmax (no margin;
    workers.losses.Margin)"""
    scale: Annotated[float, POSITIVE] = 32.0
    """logit scale s, > 0"""


@dataclass
class OptimConfig:
    name: OptimizerKind = "sgd"
    """the backbone's optimizer: sgd (momentum SGD) | lars (momentum SGD with each weight
    tensor's step scaled by its trust ratio, lars_eta * |w| / (|g| + weight_decay * |w|);
    biases and norms excluded: no decay, no trust ratio; for large global batches;
    workers.lars)"""
    lars_eta: Annotated[float, POSITIVE] = 0.001
    """lars: the trust coefficient, > 0"""
    lr: Annotated[float, NON_NEGATIVE] = 0.1
    """peak learning rate of the backbone, >= 0"""
    head_lr: Annotated[float, NON_NEGATIVE] = 0.0
    """peak learning rate of the class rows, >= 0 (0: lr * (1 - head_momentum) / (1 -
    momentum), so a row moves as far per unit of gradient as a backbone weight does under
    momentum)"""
    head_momentum: Annotated[float, MOMENTUM] = 0.0
    """momentum of the class rows' sparse SGD in the AMS, in [0, 1). A sampled head's row is
    active in few steps and sparse momentum moves it only then, so with momentum m a gradient
    takes effect over the row's next 1/(1-m) activations; at 0 a row takes its whole step at
    once (docs/accuracy.md)"""
    momentum: Annotated[float, MOMENTUM] = 0.9
    """momentum of the backbone's SGD, in [0, 1)"""
    weight_decay: Annotated[float, NON_NEGATIVE] = 5e-4
    """weight decay of the backbone's SGD, >= 0"""
    head_weight_decay: Annotated[float, NON_NEGATIVE] = 5e-3
    """weight decay of the class rows, >= 0, applied by the AMS to every row in every step
    (rows that sit out steps take what they owe at their next push, see
    workers.row_update); the rows' peak lr times it must stay below 1. Gear mode with
    features cached for a whole run is more stable at 5e-4 (docs/accuracy.md)"""
    warmup_steps: Annotated[int, NON_NEGATIVE] = 100
    """steps of linear warmup from 0 to the peak learning rates, >= 0"""
    head_warmup_steps: Annotated[int, Range(ge=-1)] = -1
    """steps of linear warmup of the class rows' learning rate, >= 0, or -1: until each class
    has been a label about 3 times (3 * classes / global batch steps), at least warmup_steps.
    A row that sits out only decays, and its first label step at full rate leaves it a norm
    so large that it hardly turns afterwards (docs/accuracy.md, "The start")"""
    schedule: Schedule = "cosine"
    """after warmup: cosine (to 0 at the last step) | constant (workers.schedule.Schedule)"""

    def effective_head_lr(self) -> float:
        """The class rows' peak learning rate: ``head_lr``, or when 0 the rows' step that
        matches the backbone's steady-state momentum step."""
        return self.head_lr or self.lr * (1 - self.head_momentum) / (1 - self.momentum)


@dataclass
class AmsConfig:
    addresses: list[str] = field(default_factory=list)
    """shard host:port list in shard order; empty: shards run in this process"""
    local_shards: Annotated[int, POSITIVE] = 2
    """embedded mode: number of in-process shards"""
    table: str = "fc"
    """name of the class-row table on the shards"""
    dtype: RowDtype = "float32"
    """row dtype: float32 | float16 | bfloat16 (ams.dtypes.RowDtype)"""
    state_dtype: Annotated[RowDtype, OR_EMPTY] = ""
    """momentum dtype: float32 | float16 | bfloat16 (empty: same as dtype)"""
    storage: StorageKind = "memory"
    """where the shards keep rows, momentum and decay clocks: memory | mmap
    (ams.shard.storage.StorageKind). mmap: files under the shards' data dir (embedded:
    train.out_dir/ams/tables), mapped into memory and paged by the OS, for tables larger
    than RAM; kept across a clean stop, discarded after a crash (the run resumes from its
    snapshot)"""
    token_file: str = ""
    """file with the shards' shared secret (empty: none)"""
    tls_ca_file: str = ""
    """PEM certificate of the authority that signed the shards' TLS certificates ('xcls serve
    shard --tls-cert'); empty: the shards are reached in plaintext"""
    scheduler: Annotated[str, OR_EMPTY, Rule(_host_port, "expected host:port")] = ""
    """host:port of an 'xcls serve scheduler' to find the shards through and keep a lease with,
    instead of addresses (a lost shard or worker then rolls training back); empty: none"""
    shared_memory: bool = True
    """rows of 1 MiB or more to and from a shard on this host (same pid namespace) bypass the
    socket through memory both processes map (ams.dataplane.shm; never with TLS); false: always
    in the data plane's frames"""


@dataclass
class GraphConfig:
    k: Annotated[int, POSITIVE] = 32
    """neighbors kept per class in the graph, > 0 and >= head.k"""
    rebuild_every: Annotated[int, NON_NEGATIVE] = 0
    """steps between graph rebuilds, >= 0 (0: once per epoch). Each rebuild writes the share
    of neighbors it replaced to OUT/graph.csv ("turnover"): how stale the lists the knn head
    took were (docs/accuracy.md)"""
    device: str = ""
    """where to build: cpu, cuda or cuda:N (empty: the training device)"""
    method: GraphMethod = "exact"
    """how a full build finds the neighbors: exact (every pair scored, O(N^2 d)) | ivf (faiss
    inverted lists over float16 rows, about O(N^1.5 d); each build logs and writes to
    OUT/graph.csv the recall of 1,000 sampled lists against an exact search)
    (ams.graph.GraphMethod)"""
    nlist: Annotated[int, NON_NEGATIVE] = 0
    """ivf: k-means lists the rows are split into (0: about 4 sqrt(N), see
    ams.graph.resolve_nlist)"""
    nprobe: Annotated[int, POSITIVE] = 8
    """ivf: lists each class scans for its neighbors, <= nlist when nlist is given; more:
    higher recall, longer builds"""
    refresh: GraphRefresh = "full"
    """what a rebuild recomputes: full (every list) | touched (after a full build, only the
    lists of the classes pushed since, exactly; cheaper when few classes move between
    rebuilds) (ams.graph.GraphRefresh, ams.graph.build.GraphUpdater)"""
    full_every: Annotated[int, NON_NEGATIVE] = 10
    """refresh = touched: a full build after this many touched refreshes (0: never), since an
    untouched class keeps its list while its neighbors move"""


@dataclass
class TrainConfig:
    epochs: Annotated[int, POSITIVE] = 10
    """passes over the training set"""
    max_steps: Annotated[int, NON_NEGATIVE] = 0
    """stop after this many steps (0: run all epochs)"""
    batch_schedule: Annotated[list[int], Each(POSITIVE, "batch")] = field(default_factory=list)
    """a batch that grows during training: the per-rank batch of each epoch, e.g. [64, 96,
    128, 192, 256] (epochs past the list keep its last entry; each > 0); empty: data.batch_size
    throughout. With optim.name = lars and optim.schedule = constant this is the fast
    continuous convergence strategy (docs/accuracy.md)"""
    batch_lr_scaling: bool = True
    """with a batch_schedule, multiply each step's learning rates (backbone and rows) by its
    batch over the first epoch's (the linear scaling rule); false keeps them as optim says
    (growing the batch then stands in for decaying the learning rate)"""
    seed: Annotated[int, NON_NEGATIVE] = 0
    """seed of the backbone's and rows' initialization, the data order, augmentation and the
    random negatives"""
    prefetch_depth: Annotated[int, NON_NEGATIVE] = 1
    """batches whose active rows are pulled ahead, each missing the pushes since (0: the
    strict order, pull after the last push)"""
    amp: bool = True
    """mixed precision on CUDA (ignored on CPU)"""
    device: DeviceSetting = "auto"
    """auto (CUDA when there is one) | cpu | cuda; each worker takes the GPU of its LOCAL_RANK"""
    threads: Annotated[int, NON_NEGATIVE, Range(le=MAX_THREADS)] = 0
    """torch CPU threads, at most 1024 (0: torch's default)"""
    out_dir: Annotated[str, Rule(bool, "must name the run's directory (empty would write it "
                                      "all into the current one)")] = "runs/experiment"
    """checkpoints, AMS snapshots, train.csv, eval.csv, graph.csv, TensorBoard events"""
    log_every: Annotated[int, POSITIVE] = 50
    """steps between log lines (and rows of train.csv)"""
    eval_every: Annotated[int, NON_NEGATIVE] = 0
    """steps between evaluations (0: at each epoch end)"""
    checkpoint_every: Annotated[int, NON_NEGATIVE] = 0
    """steps between checkpoints (0: at each epoch end)"""
    keep_checkpoints: Annotated[int, POSITIVE] = 2
    """newest checkpoints kept, >= 1; the AMS keeps one snapshot more (the newest may lack
    its checkpoint after a crash between the two)"""
    resume: bool = True
    """continue from the newest checkpoint in out_dir if there is one (false: train afresh,
    in an out_dir without checkpoints; xcls train refuses one that holds a run's)"""

    def largest_batch_scale(self) -> float:
        """The largest factor the learning rates are multiplied by over the run's epochs: its
        largest batch over the first epoch's with batch_lr_scaling and a batch_schedule, 1
        otherwise (``workers.trainer.Trainer._batch_scale`` per step)."""
        if not (self.batch_lr_scaling and self.batch_schedule):
            return 1.0
        reached = self.batch_schedule[:self.epochs]
        return max(reached) / reached[0]

    @property
    def snapshots_to_keep(self) -> int:
        """AMS snapshots a run keeps: one per kept checkpoint, plus one for a snapshot whose
        checkpoint was never written (a crash between the two)."""
        return self.keep_checkpoints + 1


@dataclass
class GearConfig:
    enabled: bool = False
    """gear mode: cache the backbone's features and train the head on them (docs/architecture.md)"""
    ttl: Annotated[float, NON_NEGATIVE, Range(le=MAX_TTL_S)] = 0.0
    """seconds a cached feature stays usable, at most 1e9 (0: never reuse)"""
    m: Annotated[int, POSITIVE] = 1
    """gradients per sample averaged before the slow gear applies them"""
    backend: GearBackend = "memory"
    """where the feature cache and gradient sums live: memory | lmdb | redis
    (bridge.GearBackend)"""
    redis_url: Annotated[str, URL_PASSWORD_SECRET] = "redis://127.0.0.1:6379/0"
    """redis://[user[:password]@]host[:port][/db]. A password here is never written out:
    OUT/config.toml, exports and 'xcls config print' show it as ***, so a run resumed from
    such a file needs redis_password_file (or the password put back in the URL)"""
    redis_password_file: str = ""
    """file holding the Redis password (empty: the URL's, if any); keeps the secret out of
    every config, on disk or on a command line"""
    prefix: Annotated[str, Rule(_key_prefix, "must be a non-empty name without ':'")] = "xcls"
    """job name: every Redis key of the job starts with it (no ':')"""
    slow: SlowGearMode = "local"
    """local: the slow gear runs in the trainer after each step | external: separate
    'xcls gear slow' processes, redis backend only (workers.gear.SlowGearMode)"""
    slow_batch: Annotated[int, POSITIVE] = 256
    """most mean gradients the slow gear applies in one backbone step"""
    cache_mb: Annotated[int, POSITIVE] = 512
    """memory/lmdb backend: feature cache bound in MiB (lmdb lives in train.out_dir/gear_cache)"""
    sync_every: Annotated[int, POSITIVE] = 10
    """slow=external: trainer steps between checks for newer published backbone weights"""
    publish_every: Annotated[int, POSITIVE] = 10
    """slow=external: slow-gear backbone steps between weight publications"""


@dataclass
class CommConfig:
    compression: Compression = "none"
    """how the backbone's gradients travel between workers: none (DDP's dense all-reduce) |
    topk (each layer's largest entries, with error feedback and momentum correction,
    workers.comm; optim.momentum then runs in it, not in the optimizer). CPU or fp32 only:
    not with train.amp on CUDA"""
    density: Annotated[float, FRACTION] = 0.01
    """topk: share of each layer's entries sent per step, in (0, 1]; from 2/3 on a layer is
    sent dense (fewer bytes than index-value pairs)"""
    warmup_steps: Annotated[int, NON_NEGATIVE] = 0
    """topk: steps over which the share falls geometrically from 1 (dense) to comm.density,
    as deep gradient compression warms up, >= 0 (0: comm.density from the first step; a
    tenth of the run is what docs/accuracy.md measured level with dense)"""
    dense_below: Annotated[int, NON_NEGATIVE] = 128
    """topk: layers with fewer entries (biases, norms) are always sent dense, >= 0"""


@dataclass
class ExperimentConfig:
    """One experiment: a section per table of its TOML file."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ams: AmsConfig = field(default_factory=AmsConfig)
    graph: GraphConfig = field(default_factory=GraphConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    gear: GearConfig = field(default_factory=GearConfig)
    comm: CommConfig = field(default_factory=CommConfig)

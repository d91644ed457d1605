"""Run assembly: where a config becomes objects.

``build_run`` is a pipeline of stages, each a ``create_*`` function: the datasets, the output
directory, the AMS client and its table, the backbone (with its optimizer, DDP wrapper and
gradient compression), the head, the graph updater, gear mode's parts, and the
``workers.trainer.Trainer`` that drives them. ``build_slow_worker`` assembles an
``xcls gear slow`` process likewise. The ``xcls/*_cmd.py`` modules only parse arguments, call
into here, and print.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from workers.settings import ExperimentConfig, GearConfig
from xcls.config import REDACTED, ConfigError, redact_url_password, to_toml
from xcls.secret_files import read_secret, read_secret_text, read_token

if TYPE_CHECKING:  # the command line imports torch, grpc and redis only when a command runs
    import redis
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    from ams.client.sharded import ShardedClient
    from ams.graph.build import GraphBuildReport
    from bridge import FeatureCache, RedisGradientConsumer, WeightStore
    from workers.comm import TopkCompressor
    from workers.data.lmdb_dataset import DatasetMetadata, LmdbImageDataset
    from workers.gear import Gear, SlowGear, SlowGearGroup
    from workers.heads import RowHead
    from workers.trainer import Trainer


@dataclass
class Run:
    """Everything built from a config, ready to train, evaluate or export."""

    cfg: ExperimentConfig
    trainer: Trainer
    client: ShardedClient
    train_set: LmdbImageDataset
    backbone: nn.Module


def training_device(cfg: ExperimentConfig, local_rank: int = 0) -> torch.device:
    """The device ``train.device`` names for the worker with this local rank (made current when
    it is a GPU); ConfigError when it cannot be had."""
    from workers.distributed import worker_device

    try:
        return worker_device(cfg.train.device, local_rank)
    except ValueError as e:
        raise ConfigError(f"train.device: {e}") from None


def worker_placement(cfg: ExperimentConfig) -> tuple[int, int, torch.device]:
    """(rank, world size, device) of a worker under torchrun ((0, 1, ...) in a plain process);
    ConfigError, in one line, when torchrun's environment or ``train.device`` is wrong."""
    from workers.distributed import torchrun_env

    try:
        rank, world, local_rank = torchrun_env()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return rank, world, training_device(cfg, local_rank)


def build_run(cfg: ExperimentConfig,
              placement: tuple[int, int, torch.device] | None = None,
              restarted: bool = False) -> Run:
    """Datasets, AMS client and table, backbone, optimizer, head and trainer from ``cfg``, for
    the worker at ``placement`` (``worker_placement``; default: a lone worker, rank 0 of 1).
    ``restarted``: torchrun restarted this worker group, so the shards' table is this run's."""
    import torch

    rank, world, device = placement or (0, 1, training_device(cfg))
    check_workers(cfg, world)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    data = create_datasets(cfg)
    check_graph(cfg, data.num_classes)
    out_dir = create_out_dir(cfg)
    # A training worker keeps a lease; eval and export (no placement) only find the shards.
    client = create_client(cfg, out_dir, rank, world, lease=placement is not None)
    create_table(cfg, client, data.num_classes, world, restarted)
    backbone = create_backbone(cfg, data.train.metadata, device, world)
    head = create_head(cfg, client, data.num_classes, rank, world, device)
    build_graph = create_graph_updater(cfg, client, device)
    gear = create_gear(cfg, backbone.model, backbone.optimizer, data.train, device, out_dir,
                       (rank, world))
    trainer = create_trainer(cfg, client, data, backbone, head, build_graph, gear, device,
                             rank, world)
    return Run(cfg, trainer, client, data.train, backbone.net)


def check_run(cfg: ExperimentConfig, world: int) -> None:
    """What a worker can check before its process group forms, so that a bad config is one
    refusal (exit 2) rather than a failure inside the group, which torchrun would restart into
    a rendezvous that fails or hangs: the rules that depend on the number of workers, the
    datasets and the output directory. ConfigError, the same on every rank."""
    check_workers(cfg, world)
    check_graph(cfg, create_datasets(cfg).num_classes)
    create_out_dir(cfg)


def check_workers(cfg: ExperimentConfig, world: int) -> None:
    """The settings ``world`` data-parallel workers cannot run with; ConfigError."""
    from workers.gear import SlowGearMode
    from workers.heads import Placement

    if world == 1:
        return
    if not (cfg.ams.addresses or cfg.ams.scheduler or cfg.head.placement == Placement.COLLECTIVE):
        raise ConfigError("ams.addresses: several workers need shared shards (the embedded "
                          "AMS lives inside one process); start shards with 'xcls serve shard' "
                          "or use 'xcls cluster up', or head.placement = 'collective'")
    if cfg.gear.enabled and cfg.gear.slow == SlowGearMode.LOCAL:
        raise ConfigError("gear.slow: an in-process slow gear steps each worker's backbone "
                          "alone, which data-parallel workers cannot share; use "
                          "gear.slow=external with 'xcls gear slow'")


def check_graph(cfg: ExperimentConfig, num_classes: int) -> None:
    """The graph settings this host and the data cannot run with, refused before anything is
    written: a ``graph.device`` that names no device here (the check of ``xcls graph build
    --device``), and for knn a ``graph.k`` past the classes, which no build can list;
    ConfigError."""
    from ams.graph import resolve_device
    from workers.heads import HeadKind

    if cfg.graph.device:
        try:
            resolve_device(cfg.graph.device)
        except ValueError as e:
            raise ConfigError(f"graph.device: {e}") from None
    if cfg.head.kind == HeadKind.KNN and cfg.graph.k > num_classes:
        raise ConfigError(f"graph.k={cfg.graph.k} exceeds the {num_classes} classes of "
                          f"data.train: lower graph.k to at most {num_classes}")


@dataclass
class Datasets:
    """A run's data: the training split, the evaluation split (None: none) and the pair sets
    for face verification by name."""

    train: LmdbImageDataset
    test: LmdbImageDataset | None
    pair_sets: dict[str, LmdbImageDataset]

    @property
    def num_classes(self) -> int:
        return self.train.metadata.num_classes


def create_datasets(cfg: ExperimentConfig) -> Datasets:
    """``cfg.data``'s datasets, opened and checked to fit together: square training images, a
    test split of the same classes and image size, pair sets of that image size."""
    from workers.data.errors import DatasetError
    from workers.data.lmdb_dataset import LmdbImageDataset

    if not cfg.data.train:
        raise ConfigError("data.train: no training dataset given (an LMDB dataset directory)")
    try:
        train_set = LmdbImageDataset(cfg.data.train)
        test_set = LmdbImageDataset(cfg.data.test) if cfg.data.test else None
    except DatasetError as e:
        raise ConfigError(f"data: {e}") from None
    meta = train_set.metadata
    if test_set is not None:
        t = test_set.metadata
        if (t.num_classes, t.height, t.width, t.channels) != (meta.num_classes, meta.height,
                                                              meta.width, meta.channels):
            raise ConfigError(f"data.test: {cfg.data.test} has {t.num_classes} classes of "
                              f"{t.channels}x{t.height}x{t.width}, data.train has "
                              f"{meta.num_classes} of {meta.channels}x{meta.height}x{meta.width}")
    if meta.height != meta.width:
        raise ConfigError(f"data.train: images are {meta.height}x{meta.width}; square images "
                          "are expected")
    return Datasets(train_set, test_set, open_pair_sets(cfg.data.verification, meta))


def open_pair_sets(paths: list[str], train: DatasetMetadata) -> dict[str, LmdbImageDataset]:
    """``data.verification``: name (the directory's name) -> pair dataset, each checked to be
    one ('xcls data bin') with the training images' size and channels."""
    from workers.data.errors import DatasetError
    from workers.data.importers import PAIR_CLASSES
    from workers.data.lmdb_dataset import LmdbImageDataset

    sets: dict[str, LmdbImageDataset] = {}
    for path in paths:
        try:
            pairs = LmdbImageDataset(path)
        except DatasetError as e:
            raise ConfigError(f"data.verification: {e}") from None
        m, name = pairs.metadata, Path(path).name
        if m.class_names != list(PAIR_CLASSES) or m.num_samples % 2:
            raise ConfigError(f"data.verification: {path} is not a pair set (import one with "
                              "'xcls data bin')")
        if (m.height, m.width, m.channels) != (train.height, train.width, train.channels):
            raise ConfigError(f"data.verification: {path} has {m.channels}x{m.height}x{m.width}"
                              f" images, data.train {train.channels}x{train.height}x"
                              f"{train.width}")
        if name in sets:
            raise ConfigError(f"data.verification: two pair sets are named {name!r}")
        sets[name] = pairs
    return sets


def create_out_dir(cfg: ExperimentConfig) -> Path:
    """``train.out_dir``, made if missing: checkpoints, snapshots, logs and config.toml go
    there."""
    out_dir = Path(cfg.train.out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, no permission, a read-only file system
        raise ConfigError(f"train.out_dir: cannot make {out_dir} ({e.strerror or e})") from None
    return out_dir


def create_client(cfg: ExperimentConfig, out_dir: Path, rank: int, world: int, *,
                  lease: bool) -> ShardedClient:
    """The client of the shards that hold the class rows: collective mode's slices over the
    ranks (``collective_slices``), or the AMS ``cfg.ams`` names (``connect_ams``), keeping a
    worker lease with its scheduler when ``lease``."""
    from workers.heads import Placement

    if cfg.head.placement == Placement.COLLECTIVE:
        return collective_slices(cfg, out_dir, rank, world)
    token = read_token(cfg.ams.token_file, "ams.token_file") \
        if cfg.ams.token_file else None
    tls_ca = read_secret(cfg.ams.tls_ca_file, "ams.tls_ca_file") \
        if cfg.ams.tls_ca_file else None
    return connect_ams(cfg, out_dir, token, lease_rank=rank if lease else None, tls_ca=tls_ca)


def create_table(cfg: ExperimentConfig, client: ShardedClient, num_classes: int,
                 world: int = 1, restarted: bool = False) -> None:
    """The class-row table ``ams.table``: one row of ``model.dim`` per class, seeded, with the
    rows' optimizer settings (kept as it is when it exists already, a resumed run's).

    A run that starts afresh refuses a table the shards already hold: it is another run's
    (shards that outlive a run, or restored its snapshots), and training on from its rows
    would mix the two runs and prune the new run's first snapshot among the old run's steps.
    ``world``: the workers, which all look before any of them creates it. ``restarted``: a
    restarted worker group, whose failed attempt may have made the table before any
    checkpoint."""
    import torch.distributed as dist

    from ams.errors import TableNotFound
    from workers.checkpoint import latest_step

    out_dir = Path(cfg.train.out_dir)
    resuming = cfg.train.resume and latest_step(out_dir) is not None
    if not (resuming or restarted):
        try:
            client.spec(cfg.ams.table)
            foreign = True
        except TableNotFound:
            foreign = False
        if world > 1:
            dist.barrier()  # every rank has looked before any creates it
        if foreign:
            raise ConfigError(
                f"ams.table: the shards already hold a table {cfg.ams.table!r}, but this run "
                f"starts afresh (no checkpoint in train.out_dir {out_dir}): it is another "
                "run's. Give each run shards and a data dir of its own (compose: XCLS_RUN=NAME "
                "docker compose ...; cluster up keeps them in train.out_dir/ams), or resume "
                "the run that made it (its train.out_dir)")
    client.create_table(cfg.ams.table, num_rows=num_classes, dim=cfg.model.dim,
                        dtype=cfg.ams.dtype, state_dtype=cfg.ams.state_dtype or None,
                        momentum=cfg.optim.head_momentum,
                        weight_decay=cfg.optim.head_weight_decay, seed=cfg.train.seed)


@dataclass
class BackboneParts:
    """The backbone as the trainer runs it. net: the network; model: what the trainer calls
    (``net``, or DistributedDataParallel around it when W > 1); optimizer: over ``net``'s
    parameters; compressor: the top-k gradient compression on the DDP wrapper (None: dense)."""

    net: nn.Module
    model: nn.Module
    optimizer: torch.optim.Optimizer
    compressor: TopkCompressor | None


def create_backbone(cfg: ExperimentConfig, meta: DatasetMetadata, device: torch.device,
                    world: int) -> BackboneParts:
    """``cfg.model``'s backbone for ``meta``'s images and its optimizer
    (``build_backbone_and_optimizer``), wrapped for data parallelism over ``world`` workers,
    with ``cfg.comm``'s gradient compression (``build_compressor``)."""
    from torch.nn.parallel import DistributedDataParallel

    net, optimizer = build_backbone_and_optimizer(cfg, meta, device)
    gpu_ids = [device.index] if device.type == "cuda" else None
    model = DistributedDataParallel(net, device_ids=gpu_ids) if world > 1 else net
    compressor = build_compressor(cfg, net, model, optimizer, device)
    return BackboneParts(net, model, optimizer, compressor)


def build_backbone_and_optimizer(cfg: ExperimentConfig, meta: DatasetMetadata,
                                 device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``cfg.model``'s backbone for ``meta``'s images, seeded with ``train.seed`` and moved to
    ``device``, and the optimizer of ``cfg.optim`` (SGD or LARS) over its parameters.

    Every process that builds from the same config starts from the same weights: the
    data-parallel ranks, and a slow-gear worker standing in for weights nobody published yet.
    """
    import torch

    from workers.backbones import build_backbone
    from workers.optimizers import build_optimizer

    torch.manual_seed(cfg.train.seed)
    try:
        backbone = build_backbone(cfg.model.backbone, cfg.model.dim, meta.channels, meta.height)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None
    backbone = backbone.to(device)
    # A DistributedDataParallel wrapper shares these parameter objects, so this optimizer
    # also steps a wrapped backbone.
    o = cfg.optim
    optimizer = build_optimizer(o.name, backbone, lr=o.lr, momentum=o.momentum,
                                weight_decay=o.weight_decay, lars_eta=o.lars_eta)
    return backbone, optimizer


def build_compressor(cfg: ExperimentConfig, backbone: nn.Module, model: nn.Module,
                     optimizer: torch.optim.Optimizer,
                     device: torch.device) -> TopkCompressor | None:
    """``cfg.comm``'s gradient compression registered on the DDP wrapper ``model`` of
    ``backbone`` (None: dense all-reduce, or a lone worker, which sends nothing). The
    compressor takes over ``optimizer``'s momentum and weight decay (momentum correction runs
    before the gradients are sparsified, so the optimizer must not apply them again)."""
    from workers.comm import Compression, TopkCompressor
    from workers.optimizers import OptimizerKind

    if cfg.comm.compression == Compression.NONE:
        return None
    if cfg.gear.enabled:
        raise ConfigError("comm.compression: gear mode steps the backbone in the slow gear, "
                          "which takes no compressed gradients; set comm.compression=none")
    if cfg.optim.name == OptimizerKind.LARS:
        raise ConfigError("comm.compression: top-k moves the momentum into the hook, ahead of "
                          "LARS's trust ratios, which would then scale velocities; use "
                          "optim.name=sgd with compression")
    if device.type == "cuda" and cfg.train.amp:
        raise ConfigError("comm.compression: top-k does not take AMP's scaled gradients "
                          "(a changing loss scale would corrupt the kept residuals); set "
                          "train.amp=false")
    if model is backbone:
        return None
    compressor = TopkCompressor(backbone, density=cfg.comm.density,
                                momentum=cfg.optim.momentum,
                                weight_decay=cfg.optim.weight_decay,
                                warmup_steps=cfg.comm.warmup_steps,
                                dense_below=cfg.comm.dense_below)
    model.register_comm_hook(None, compressor.hook)
    for group in optimizer.param_groups:
        group["momentum"] = group["weight_decay"] = 0.0
    return compressor


def create_head(cfg: ExperimentConfig, client: ShardedClient, num_classes: int, rank: int,
                world: int, device: torch.device) -> RowHead:
    """``cfg.head``'s head over the table's rows with its margin (collective mode: the
    model-parallel head over the ranks' slices, which on a GPU ``device`` keeps this rank's
    slice in GPU memory); its sampler seeded per rank."""
    from ams.cluster.plan import budget_for_sample_rate
    from workers.collective import CollectiveHead
    from workers.device_slice import DeviceSlice
    from workers.heads import Placement, build_head
    from workers.losses import CombinedMarginLoss

    h = cfg.head
    margin = CombinedMarginLoss.from_preset(h.margin, s=h.scale)
    budget = h.budget or budget_for_sample_rate(h.sample_rate, num_classes)
    head_args = dict(sample_rate=h.sample_rate, k=h.k, budget=budget,
                     random_share=h.random_share, logq_correction=h.logq_correction,
                     seed=cfg.train.seed * 1000 + rank)
    try:
        if h.placement == Placement.COLLECTIVE:
            # on the CPU the slice's shard is in the memory the head computes in already
            device_rows = DeviceSlice(client.shards[rank].store, cfg.ams.table, device) \
                if device.type != "cpu" else None
            return CollectiveHead(client, cfg.ams.table, num_classes, margin, h.kind,
                                  rank=rank, world=world, device_rows=device_rows, **head_args)
        return build_head(h.kind, client, cfg.ams.table, num_classes, margin, **head_args)
    except ValueError as e:
        raise ConfigError(f"head: {e}") from None


def create_graph_updater(cfg: ExperimentConfig, client: ShardedClient,
                         device: torch.device) -> Callable[[int], GraphBuildReport] | None:
    """The knn head's graph builder as ``cfg.graph`` says (``GraphUpdater.update``, on the
    training device unless ``graph.device`` names one); None for the heads that need no
    graph."""
    from ams.graph.build import GraphMethod, GraphUpdater
    from ams.graph.ivf import load_faiss
    from workers.heads import HeadKind

    if cfg.head.kind != HeadKind.KNN:
        return None
    g = cfg.graph
    if g.method == GraphMethod.IVF:
        try:
            load_faiss()
        except ImportError as e:
            raise ConfigError(f"graph.method: {e}") from None
    return GraphUpdater(client, cfg.ams.table, g.k, method=g.method, refresh=g.refresh,
                        full_every=g.full_every, nlist=g.nlist, nprobe=g.nprobe,
                        device=g.device or str(device), seed=cfg.train.seed).update


def create_gear(cfg: ExperimentConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
                train_set: Dataset, device: torch.device, out_dir: Path,
                ranks: tuple[int, int]) -> Gear | None:
    """The trainer's :class:`workers.gear.Gear` for ``cfg.gear``, None when gear mode is off.

    model: the (possibly DDP-wrapped) backbone the trainer runs; optimizer: over its parameters,
    stepped by an in-process slow gear at the lr the trainer passes to ``Gear.backward``;
    ranks: (this trainer's rank, world size).
    """
    from bridge import (
        GearBackend,
        MemoryGradientAccumulator,
        RedisGradientAccumulator,
        RedisGradientConsumer,
        WeightStore,
    )
    from workers.gear import Gear, SlowGear, SlowGearMode

    g = cfg.gear
    if not g.enabled:
        return None
    rank, _world = ranks
    dim = cfg.model.dim
    client = redis_client(g) if g.backend == GearBackend.REDIS else None
    cache = build_cache(g, dim, out_dir, client)
    if client is not None:
        # While Redis is down an in-process slow gear trains from the accumulator's fallback;
        # an external one cannot reach it, so its means wait there until Redis is back.
        accumulator = RedisGradientAccumulator(client, dim, g.m, g.prefix)
    else:
        accumulator = MemoryGradientAccumulator(dim, g.m)
    if g.slow == SlowGearMode.EXTERNAL:
        return Gear(model, cache, accumulator, device, weights=WeightStore(client, g.prefix),
                    sync_every=g.sync_every, leader=rank == 0)
    source = RedisGradientConsumer(client, dim, g.prefix) if client is not None else accumulator
    backbone = getattr(model, "module", model)
    slow = SlowGear(backbone, optimizer, train_set, device, max_items=g.slow_batch)
    fallback = accumulator.fallback if client is not None else None
    return Gear(model, cache, accumulator, device, slow=(slow, source), fallback=fallback)


def create_trainer(cfg: ExperimentConfig, client: ShardedClient, data: Datasets,
                   backbone: BackboneParts, head: RowHead,
                   build_graph: Callable[[int], GraphBuildReport] | None, gear: Gear | None,
                   device: torch.device, rank: int, world: int) -> Trainer:
    """The loop over the parts; ConfigError for settings that do not fit the data (a batch
    larger than the dataset, say)."""
    from workers.trainer import Trainer

    try:
        return Trainer(cfg=cfg, client=client, backbone=backbone.model,
                       optimizer=backbone.optimizer, head=head, train_set=data.train,
                       test_set=data.test, device=device, build_graph=build_graph, rank=rank,
                       world=world, gear=gear, compressor=backbone.compressor,
                       pair_sets=data.pair_sets, config_toml=to_toml(cfg))
    except ValueError as e:
        raise ConfigError(str(e)) from None


# How long a worker waits for every shard to register with the scheduler: the shards may start
# after the workers.
SHARDS_WAIT_S = 300.0


def collective_slices(cfg: ExperimentConfig, out_dir: Path, rank: int,
                      world: int) -> ShardedClient:
    """Collective mode's client: this rank's slice of the rows in process, the other ranks'
    slices reached through the shard servers they start (``workers.collective``). Snapshots
    go to ``out_dir/ams`` as the embedded AMS's do, so eval and export (one process) restore
    them into one shard. The slices of ranks on one host talk over 127.0.0.1; a job over
    several hosts serves them on this host's address toward the rendezvous host
    (``MASTER_ADDR``, which torchrun sets), the interface the other hosts reach it on."""
    import atexit

    from workers.collective import CollectiveShards
    from workers.distributed import address_toward

    one_host = int(os.environ.get("LOCAL_WORLD_SIZE") or world) == world
    try:
        host = "127.0.0.1" if one_host else address_toward(os.environ.get("MASTER_ADDR", ""))
    except ValueError as e:
        raise ConfigError(f"head.placement = collective over several hosts: {e}") from None
    shards = CollectiveShards(rank, world, data_dir=out_dir / "ams",
                              keep_snapshots=cfg.train.snapshots_to_keep,
                              storage=cfg.ams.storage, storage_dir=out_dir / "ams" / "tables",
                              host=host)
    atexit.register(shards.close)
    return shards.client


def connect_ams(cfg: ExperimentConfig, out_dir: Path, token: str | None,
                lease_rank: int | None = None, tls_ca: bytes | None = None) -> ShardedClient:
    """The AMS client ``cfg.ams`` asks for: the shards at ``ams.addresses``, the shards the
    scheduler at ``ams.scheduler`` knows (once all have registered), or shards in process.

    ``tls_ca``: PEM of the authority that signed the shards' certificates (None: plaintext).
    With a scheduler, ``lease_rank`` (a training worker's global rank) keeps a worker lease
    until the process exits; once the scheduler loses a shard or worker, the client is
    invalidated, every later call raises ShardRestarted, and the group rolls back.

    Shards in process keep their tables as ``ams.storage`` says, mmap files in
    ``out_dir/ams/tables``, which are closed when the process exits, so that the next run
    there reopens them instead of making them again.
    """
    import atexit

    import ams
    from ams.shard.storage import StorageKind

    if not cfg.ams.scheduler:
        if cfg.ams.addresses:
            return ams.connect(cfg.ams.addresses, token=token, tls_ca=tls_ca,
                               shared_memory=cfg.ams.shared_memory)
        client = ams.connect(local_shards=cfg.ams.local_shards, data_dir=out_dir / "ams",
                             keep_snapshots=cfg.train.snapshots_to_keep,
                             storage=cfg.ams.storage, storage_dir=out_dir / "ams" / "tables")
        if cfg.ams.storage == StorageKind.MMAP:
            atexit.register(client.close)
        return client
    import socket
    import uuid

    from ams.cluster.lease import Role
    from ams.cluster.scheduler import SchedulerClient

    scheduler = SchedulerClient(cfg.ams.scheduler, token=token)
    shard_map = scheduler.wait_for_shards(timeout=SHARDS_WAIT_S)
    client = ams.connect(list(shard_map.addresses), token=token, tls_ca=tls_ca,
                         shared_memory=cfg.ams.shared_memory)
    if lease_rank is None:
        scheduler.close()
        return client
    keeper = scheduler.keep_lease(Role.WORKER, lease_rank,
                                  f"{socket.gethostname()}/pid-{os.getpid()}", uuid.uuid4().hex,
                                  on_lost=client.invalidate, expect=shard_map)
    # Released at exit, so a restarted group's ranks find their slots free rather than an old
    # lease expiring under them (which would move the generation once more).
    atexit.register(keeper.stop)
    return client


def redis_client(g: GearConfig) -> redis.Redis:
    """A bridge Redis client (short timeouts) for ``g.redis_url``
    (``redis://[user[:password]@]host[:port][/db]``), with the password of
    :func:`redis_password`."""
    from bridge import make_client

    url, shown = g.redis_url, redact_url_password(g.redis_url)  # errors never show the secret
    try:
        u = urlparse(url)
        db = int(u.path.lstrip("/") or 0)
        port = u.port or 6379
    except ValueError:
        raise ConfigError(f"gear.redis_url: bad host, port or db in {shown!r}") from None
    if u.scheme != "redis" or not u.hostname:
        raise ConfigError(f"gear.redis_url: expected redis://host[:port][/db], got {shown!r}")
    return make_client(u.hostname, port, db, redis_password(g, u.password),
                       username=unquote(u.username) if u.username else None)


def redis_password(g: GearConfig, in_url: str | None) -> str | None:
    """The Redis password: the contents of ``g.redis_password_file`` or the URL's
    (``in_url``, still %-quoted); None when neither gives one.

    ConfigError when the URL holds the placeholder a config written out carries instead of the
    password (a run resumed from OUT/config.toml) and no file gives it, or when both give one.
    """
    password = unquote(in_url) if in_url else None
    if g.redis_password_file:
        if password not in (None, REDACTED):
            raise ConfigError("gear.redis_password_file: gear.redis_url holds a password too; "
                              "give it in one place")
        return read_secret_text(g.redis_password_file, "gear.redis_password_file")
    if password == REDACTED:
        raise ConfigError(f"gear.redis_url: its password was replaced by {REDACTED} when the "
                          "config was written out; give it with "
                          "gear.redis_password_file=FILE, or put it back in the URL")
    return password


def build_cache(g: GearConfig, dim: int, out_dir: Path,
                client: redis.Redis | None) -> FeatureCache | None:
    """The feature cache of ``g.backend``; None when ``g.ttl`` is 0 (never reuse)."""
    from bridge import GearBackend, LmdbFeatureCache, MemoryFeatureCache, RedisFeatureCache

    if g.ttl == 0:
        return None
    if g.backend == GearBackend.MEMORY:
        return MemoryFeatureCache(dim, g.cache_mb << 20, ttl_s=g.ttl)
    if g.backend == GearBackend.LMDB:
        return LmdbFeatureCache(out_dir / "gear_cache", dim, g.cache_mb << 20, ttl_s=g.ttl)
    return RedisFeatureCache(client, dim, g.prefix, ttl_s=g.ttl)


@dataclass
class SlowWorker:
    """An ``xcls gear slow`` process's parts, built from a config; ``start``: the published
    version its backbone was loaded from (-1: none was published)."""

    slow: SlowGear
    consumer: RedisGradientConsumer
    weights: WeightStore
    group: SlowGearGroup
    start: int


def build_slow_worker(cfg: ExperimentConfig, placement: tuple[int, int, torch.device], *,
                      consumer: str | None, min_idle_ms: int) -> SlowWorker:
    """The slow gear of ``cfg``'s job for the worker at ``placement``: the backbone and
    optimizer, started from the newest published weights (rank 0's, on every rank), and the
    Redis consumer it reads ready means from (``consumer``: its name in the group, '-RANK'
    appended when several ranks run)."""
    import torch

    from bridge import RedisGradientConsumer, WeightStore
    from workers.data.errors import DatasetError
    from workers.data.lmdb_dataset import LmdbImageDataset
    from workers.gear import SlowGear, SlowGearGroup

    rank, world, device = placement
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    try:
        train_set = LmdbImageDataset(cfg.data.train)
    except DatasetError as e:
        raise ConfigError(f"data.train: {e}") from None
    # The trainers' initial backbone, should none be published yet.
    backbone, optimizer = build_backbone_and_optimizer(cfg, train_set.metadata, device)
    backbone.train()
    client = redis_client(cfg.gear)
    weights = WeightStore(client, cfg.gear.prefix)
    group = SlowGearGroup(rank, world)
    # Take over where a previous slow worker stopped (its optimizer momentum is not kept);
    # rank 0's copy is everyone's, should the ranks have read different publications.
    start = weights.load_into(backbone, -1)
    version = group.from_rank0(start if start is not None else 0)
    group.broadcast_state(backbone)
    name = f"{consumer}-{rank}" if consumer and world > 1 else consumer
    reader = RedisGradientConsumer(client, cfg.model.dim, cfg.gear.prefix, consumer=name,
                                   min_idle_ms=min_idle_ms)
    slow = SlowGear(backbone, optimizer, train_set, device, cfg.gear.slow_batch, version,
                    group if world > 1 else None)
    return SlowWorker(slow, reader, weights, group, -1 if start is None else start)

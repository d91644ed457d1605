"""Building a client: ``connect`` to shard servers by address or to shards in this process
(the embedded default), and ``join_shards`` over a mix of both (collective placement)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ams.addresses import parse_address
from ams.client.backend import ShardBackend
from ams.client.local import LocalShard
from ams.client.remote import RemoteShard
from ams.client.sharded import ShardedClient
from ams.dataplane.shm import SharedArena
from ams.errors import AmsError, InvalidArgument


def connect(addresses: Sequence[str] | str | None = None, *, local_shards: int | None = None,
            data_dir: str | Path | None = None, token: str | None = None,
            tls_ca: bytes | None = None, timeout: float = 60.0,
            ready_timeout: float = 30.0, keep_snapshots: int = 3, storage: str = "memory",
            storage_dir: str | Path | None = None, shared_memory: bool = True) -> ShardedClient:
    """Connect to an AMS: gRPC shards at ``addresses`` (shard i at ``addresses[i]``), or
    ``local_shards`` in-process shards (the embedded default; ``data_dir`` for snapshots,
    of which they keep the ``keep_snapshots`` newest complete steps, 0: all; remote shards
    prune by their own ``--keep-snapshots``). ``storage``, ``storage_dir``: where in-process
    shards keep their tables (``ams.shard.store.ShardStore``: "memory", or "mmap" files under
    ``storage_dir``, reopened by the next client there once ``close`` closed them); remote
    shards choose theirs with ``--storage``. ``shared_memory``: rows to and from a shard on
    this host bypass the socket through a buffer both map (``ams.dataplane.shm``; never with TLS);
    False: always in the frames. ``timeout``: seconds each call of a remote shard has, its
    retries included (snapshots and restores get more for large tables:
    ``ShardedClient.snapshot``); ``ready_timeout``: how long to wait for the shards to
    serve."""
    if (addresses is None) == (local_shards is None):
        raise InvalidArgument("give either addresses=[...] or local_shards=N")
    if local_shards is not None:
        if not isinstance(local_shards, int) or local_shards < 1:
            raise InvalidArgument(f"local_shards={local_shards!r} must be an integer >= 1")
        root = Path(data_dir) if data_dir is not None else None
        local: list[LocalShard] = []
        try:
            for s in range(local_shards):
                local.append(LocalShard(s, local_shards, root, keep_snapshots, storage,
                                        storage_dir))
        except AmsError:
            for shard in local:  # let a later client open their storage dirs
                shard.close()
            raise
        return ShardedClient(local)
    if storage != "memory" or storage_dir is not None:
        raise InvalidArgument("storage and storage_dir are for local_shards; remote shards "
                              "choose theirs with 'xcls serve shard --storage'")
    if isinstance(addresses, str):
        addresses = [a for a in addresses.split(",") if a]
    if not addresses:
        raise InvalidArgument("addresses: need at least one host:port")
    for address in addresses:  # a typo fails now, not after the wait for the shards
        parse_address(address)
    return join_shards(list(addresses), token=token, tls_ca=tls_ca, timeout=timeout,
                       ready_timeout=ready_timeout, shared_memory=shared_memory)


def join_shards(shards: Sequence[str | ShardBackend], *, token: str | None = None,
                tls_ca: bytes | None = None, timeout: float = 60.0,
                ready_timeout: float = 30.0, shared_memory: bool = True) -> ShardedClient:
    """A client over ``shards[i]`` = shard i: a ``host:port`` of a shard server, or a shard
    held in this process (``ams.client.local.LocalShard``), as in collective mode, where each worker
    holds its own slice and reaches the others' over gRPC. The remote ones must be serving
    as shard i of ``len(shards)``; their incarnations are learned now."""
    remote = any(isinstance(s, str) for s in shards)
    # one buffer for all shards: each writes its rows of a pull straight into the result
    arena = SharedArena.create() if remote and shared_memory and tls_ca is None else None
    backends = [RemoteShard(s, token=token, tls_ca=tls_ca, timeout=timeout, arena=arena)
                if isinstance(s, str) else s for s in shards]
    client = ShardedClient(backends, arena)

    def first_contact(i: int) -> dict | None:
        backend = backends[i]
        if not isinstance(backend, RemoteShard):
            return None
        backend.wait_ready(ready_timeout)
        return backend.stats()

    try:
        layout = client._fan_out(first_contact)
    except AmsError:
        client.close()
        raise
    for i, info in enumerate(layout):
        if info is None:
            continue
        if info["shard_id"] != i or info["num_shards"] != len(backends):
            client.close()
            raise InvalidArgument(
                f"addresses[{i}]={shards[i]} is shard {info['shard_id']} of "
                f"{info['num_shards']}, expected shard {i} of {len(backends)}: list the shards "
                "in order, all of them")
        # first contact: from now on every call expects this process of the shard
        backends[i].incarnation = info["incarnation"] or None
        backends[i].data_port = info["data_port"] or None
    client._fan_out(lambda i: backends[i].open_data_connection()
                    if isinstance(backends[i], RemoteShard) else None)
    return client

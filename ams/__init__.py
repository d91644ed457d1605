"""AMS: the sharded model server for class-weight rows and their optimizer state.

    import ams
    client = ams.connect(["127.0.0.1:7001", "127.0.0.1:7002"])   # gRPC shards
    client = ams.connect(local_shards=2)                           # the same API, in process

The client (and with it grpc) is imported on first use, so the pure modules (``ams.store``,
``ams.optim``, ``ams.sharding``, ``ams.graph``) load without grpc.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ams.errors import AmsError
from ams.store import ShardStore, TableSpec

if TYPE_CHECKING:
    from ams.client import ShardedClient, connect

__all__ = ["AmsError", "ShardStore", "ShardedClient", "TableSpec", "connect"]


def __getattr__(name: str) -> Any:
    if name in ("connect", "ShardedClient"):
        from ams import client

        return getattr(client, name)
    raise AttributeError(f"module 'ams' has no attribute {name!r}")

"""AMS: the sharded model server for class-weight rows and their optimizer state.

    import ams
    client = ams.connect(["127.0.0.1:7001", "127.0.0.1:7002"])   # gRPC shards
    client = ams.connect(local_shards=2)                           # the same API, in process

The client (and with it grpc) and the store (and with it torch) are imported on first use, so the
pure modules (``ams.shard``, ``ams.sharding``, ``ams.graph``) load without grpc, and ``ams.errors``
loads without torch (the command line checks its flags before torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ams.errors import AmsError

if TYPE_CHECKING:
    from ams.client.connect import connect
    from ams.client.sharded import ShardedClient
    from ams.shard.spec import TableSpec
    from ams.shard.store import ShardStore

__all__ = ["AmsError", "ShardStore", "ShardedClient", "TableSpec", "connect"]

# The public names imported on first use, and the module each lives in.
_LAZY = {"connect": "ams.client.connect", "ShardedClient": "ams.client.sharded",
         "ShardStore": "ams.shard.store", "TableSpec": "ams.shard.spec"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ams' has no attribute {name!r}")

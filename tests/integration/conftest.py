"""Real shard processes (``python -m xcls serve shard``, through ``xcls.shards``) on 127.0.0.1
for integration tests."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest

from xcls.shards import ShardProcess, shard_processes


class ClusterFactory:
    """``factory(num_shards, extra_args, data_dir, **options)`` -> serving ShardProcesses
    (options: those of ``xcls.shards.shard_processes``); ``close`` stops them all."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.stack = ExitStack()

    def __call__(self, num_shards: int, extra: list[str] | None = None,
                 data_dir: Path | None = None, **options: object) -> list[ShardProcess]:
        d = data_dir or self.base_dir
        return self.stack.enter_context(shard_processes(
            num_shards, data_dir=d, extra_args=extra or (), log_dir=d, **options))

    def close(self) -> None:
        self.stack.close()


@pytest.fixture
def shard_cluster(tmp_path):
    """Shard processes for one test, stopped after it."""
    factory = ClusterFactory(tmp_path)
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def module_cluster(tmp_path_factory):
    """Shard processes shared by a module's tests (for tests that leave state unchanged)."""
    factory = ClusterFactory(tmp_path_factory.mktemp("cluster"))
    yield factory
    factory.close()

"""What ``ShardedClient`` needs of one shard, whether it lies in another process
(``ams.client.remote.RemoteShard``) or in this one (``ams.client.local.LocalShard``), and the
check every client call makes of the ids it is given."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from ams.errors import InvalidArgument
from ams.shard.spec import TableSpec
from ams.wire.pieces import PushPieces


class ShardBackend(Protocol):
    """What the client needs from one shard; ids are always owned by that shard."""

    def create_table(self, spec: TableSpec) -> bool: ...
    def table_specs(self) -> dict[str, TableSpec]: ...
    piece_bytes: int
    """Bytes of rows one pull or push piece carries (``ShardedClient`` cuts the pieces)."""

    def pull(self, table: str, pieces: Sequence[torch.Tensor],
             into: tuple[torch.Tensor, torch.Tensor | None]) -> None: ...
    def push(self, table: str, pieces: PushPieces, lr: float, client_id: str,
             decay_clock: float | None) -> list[bool]: ...
    def scan(self, table: str, block_rows: int | None
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...
    # timeout: the seconds a remote shard has for the call (None: as many as its tables need,
    # RemoteShard.snapshot); a shard in this process has nobody to wait for
    def snapshot(self, step: int, timeout: float | None = None) -> str: ...
    def restore(self, step: int | None, timeout: float | None = None) -> tuple[int, str]: ...
    def stats(self) -> dict: ...
    def neighbors(self, table: str, ids: torch.Tensor
                  ) -> tuple[torch.Tensor | None, torch.Tensor]: ...
    def set_neighbors(self, table: str, ids: torch.Tensor, offsets: torch.Tensor | None,
                      neighbors: torch.Tensor, version: int, step: int,
                      replace_all: bool) -> int: ...
    def take_touched(self, table: str, max_ids: int | None) -> torch.Tensor: ...
    def learn_incarnation(self) -> str: ...
    def close(self) -> None: ...


def check_ids(ids: torch.Tensor) -> torch.Tensor:
    """``ids`` as the int64 CPU tensor of shape (n,) every client call takes; InvalidArgument
    when it is not an integer tensor of shape (n,)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point() \
            or ids.is_complex() or ids.dtype == torch.bool:
        got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids)
        raise InvalidArgument(f"ids: need an integer tensor of shape (n,), got {got}")
    return ids.to(device="cpu", dtype=torch.int64)

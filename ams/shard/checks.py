"""What the store checks of a request before it touches any state: ids in range and owned
by this shard, gradients of the right shape, a reply within the message limit, and a push
whose result would not be finite. Each refusal is a typed error with a message a person can
act on."""

from __future__ import annotations

import torch

from ams import sharding
from ams.dtypes import DTYPE_NAMES
from ams.errors import IdOutOfRange, InvalidArgument, RequestTooLarge, shorten
from ams.shard import rowcopy
from ams.shard.optim import MAX_RATE, all_finite
from ams.shard.spec import TableSpec, nonnegative


def owned_positions(ids: torch.Tensor, spec: TableSpec, shard_id: int, num_shards: int,
                    max_ids: int, field_name: str = "ids") -> torch.Tensor:
    """The local positions (int64 (n,)) of ``ids``: int64 (n,), at most ``max_ids``, each in
    the table and owned by shard ``shard_id`` of ``num_shards``."""
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids)
        raise InvalidArgument(f"{field_name}: need an int64 tensor of shape (n,), got {got}")
    if ids.numel() > max_ids:
        raise RequestTooLarge(f"{field_name}: {ids.numel()} ids in one request, the limit is "
                              f"{max_ids}; split the request")
    if ids.numel() == 0:
        return ids
    check_in_table(ids, spec, field_name)
    if num_shards > 1:
        foreign = sharding.shard_of(ids, num_shards) != shard_id
        if bool(foreign.any()):
            bad = int(ids[foreign][0])
            raise IdOutOfRange(f"{field_name}: id {bad} belongs to shard {bad % num_shards}, "
                               f"this is shard {shard_id} of {num_shards}")
    return sharding.local_index(ids, num_shards)


def check_in_table(ids: torch.Tensor, spec: TableSpec, field_name: str = "ids") -> None:
    """``IdOutOfRange`` unless every id (int64 (n,)) is a row of ``spec``'s table."""
    if ids.numel() == 0:
        return
    lo, hi = rowcopy.bounds(ids)
    if lo < 0 or hi >= spec.num_rows:
        raise IdOutOfRange(
            f"{field_name}: id {lo if lo < 0 else hi} is outside table {shorten(spec.name)} "
            f"(num_rows={spec.num_rows}, valid ids 0..{spec.num_rows - 1})")


def check_finite_grads(grads: torch.Tensor) -> None:
    """``InvalidArgument`` naming the first row of ``grads`` (float (n, dim)) that holds a NaN
    or an infinity."""
    if all_finite(grads):
        return
    # One look at the rows that are not finite: gradients in a client's shared buffer
    # (ams.dataplane.shm) may be rewritten by the client between two looks.
    bad = (~torch.isfinite(grads)).any(dim=1).nonzero()
    if bad.numel():
        raise InvalidArgument(f"grads: row {int(bad[0, 0])} has a non-finite value (nan or inf)")


def check_grads(grads: torch.Tensor, n: int, spec: TableSpec) -> None:
    """``grads`` must be a float tensor of shape (n, dim)."""
    if not isinstance(grads, torch.Tensor):
        raise InvalidArgument(f"grads: need a float tensor of shape ({n}, {spec.dim}), got "
                              f"{type(grads).__name__}")
    check_grads_shape(grads.dtype, tuple(grads.shape), n, spec)


def check_grads_shape(dtype: torch.dtype | None, shape: tuple[int, ...], n: int,
                      spec: TableSpec) -> None:
    """``check_grads`` of gradients announced but not received yet: of ``dtype`` (None: no
    gradients) and ``shape``, so that a data plane checks a push against its table before
    it allocates the gradients' memory."""
    if dtype is None or not dtype.is_floating_point:
        raise InvalidArgument(f"grads: need a float tensor of shape ({n}, {spec.dim}), got "
                              f"{dtype}")
    if shape != (n, spec.dim):
        raise InvalidArgument(f"grads: shape {shape}, need ({n}, {spec.dim}) for {n} ids of "
                              f"table {shorten(spec.name)}")


def check_reply(nbytes: int, limit: int, what: str, bytes_per_row: int, unit: str) -> None:
    """``RequestTooLarge`` when a reply of ``nbytes`` would exceed ``limit`` bytes, telling the
    caller how many ``unit`` fit (at ``bytes_per_row`` each)."""
    if nbytes <= limit:
        return
    fit = max(1, limit // max(1, bytes_per_row))
    raise RequestTooLarge(
        f"{what} makes a {nbytes}-byte reply, over the {limit}-byte message limit; split the "
        f"request (about {fit} {unit} fit in one reply)")


def refuse_non_finite(spec: TableSpec, found: tuple[str, int] | None, lr: float,
                      grads: torch.Tensor, class_ids: torch.Tensor) -> None:
    """``InvalidArgument`` naming the first non-finite gradient row of the push, or else the
    first row the update would have made non-finite (``found``, from
    ``RowUpdate.first_non_finite``: what and an index into ``class_ids``, int64 (m,), the
    updated classes); nothing when ``found`` is None. A non-finite gradient always makes the
    update non-finite, so ``grads`` is looked at only then."""
    if found is None:
        return
    check_finite_grads(grads)
    what, index = found
    kind = "row" if what == "rows" else "momentum"
    raise InvalidArgument(
        f"push refused: the {kind} of class {int(class_ids[index])} in table "
        f"{shorten(spec.name)} would become non-finite (over the range of "
        f"{DTYPE_NAMES[spec.dtype]} rows, {DTYPE_NAMES[spec.state_dtype]} state) at lr={lr}; "
        "nothing was changed. Lower the learning rate or clip the gradients")


def checked_rates(spec: TableSpec, lr: float, decay_clock: float | None
                  ) -> tuple[float, float | None, bool]:
    """A push's ``lr`` and ``decay_clock`` checked for ``spec``: (lr, decay_clock, whether the
    push takes the decay clock, which needs a clock and weight decay). ``InvalidArgument``
    for a negative or non-finite rate or clock, and for lr x weight_decay >= 1 with a clock."""
    lr = nonnegative("lr", lr, MAX_RATE)
    clocked = decay_clock is not None and spec.weight_decay > 0
    if decay_clock is not None:
        decay_clock = nonnegative("decay_clock", decay_clock)
        if clocked and lr * spec.weight_decay >= 1:
            raise InvalidArgument(f"lr={lr} x weight_decay={spec.weight_decay} must stay below "
                                  "1 for the decay clock")
    return lr, decay_clock, clocked

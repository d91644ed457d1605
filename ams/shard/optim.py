"""Server-side sparse optimizers: the update touches exactly the pushed rows and their state.

Pure torch. The state lives next to the row (same local position in a tensor of the same
shape), so a pull of W never needs the state and a push reads both with one gather each.

Weight decay and rows that sit out. The dense optimizer shrinks every row by ``1 - lr*wd`` in
every step, gradient or not; a sparse push only reaches the active rows. So a table keeps a
*decay clock*: ``D_t = sum over steps s < t of -log(1 - lr_s * wd)``, which the trainer sends
with each push, and each row remembers the clock it was last brought up to. A row that sat out
steps is first multiplied by ``exp(row_clock - D_t)``, exactly the decay those steps would have
applied; with momentum 0 the rows then equal dense ``torch.optim.SGD`` on the whole table.

The update of CPU rows runs in ams/shard/_kernels.c, one pass over the pushed rows, where the
install compiled it (it needs a C compiler), and in torch and numpy otherwise; the two give the
same values up to float32 rounding (tests/test_optim.py). Rows on a GPU (collective placement's
slice, ``workers.device_slice``) take the torch path on their device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ams.shard import rowcopy

try:
    import ams.shard._kernels as _kernels
except ImportError:  # not compiled: a source tree, or a host without a C compiler
    _kernels = None

# The dtype codes of ams/shard/_kernels.c
_KERNEL_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_UNCHECKED = ("unchecked", -1)
# The largest lr or weight decay an update takes: both enter its float32 arithmetic as factors.
MAX_RATE = float(torch.finfo(torch.float32).max)


def step_decay(lr: float, weight_decay: float) -> float:
    """How far one SGD step advances the decay clock: ``-log(1 - lr * weight_decay)`` >= 0."""
    return -math.log1p(-lr * weight_decay)


def all_finite(values: torch.Tensor) -> bool:
    """Whether every value of a float tensor is finite. A finite sum proves it (a nan or an
    inf anywhere makes the sum non-finite) at a fraction of ``torch.isfinite``'s cost on CPU;
    only a sum that overflows or is non-finite takes the elementwise check."""
    if values.numel() == 0:
        return True
    if bool(torch.isfinite(values.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(values).all())


def catch_up_factors(row_clock: torch.Tensor, clock: float) -> torch.Tensor:
    """Decay owed by rows last brought up to ``row_clock`` (float64 (m,)) at clock ``clock``:
    float64 (m,) factors ``exp(row_clock - clock)``, at most 1 (a row ahead of the clock owes
    nothing)."""
    return torch.exp((row_clock - clock).clamp(max=0.0))


@dataclass(frozen=True)
class RowUpdate:
    """The new values of the pushed rows, computed but not yet written to the table.

    positions: int64 (m,) unique local positions; rows: (m, dim) in the table's row dtype;
    state: (m, dim) in the state dtype, or None when there is no momentum (nothing to write).
    """

    positions: torch.Tensor
    rows: torch.Tensor
    state: torch.Tensor | None
    # what first_non_finite answers, when the compiled update found it while computing
    checked: tuple[str, int] | None = field(default=_UNCHECKED, repr=False)

    def first_non_finite(self) -> tuple[str, int] | None:
        """("rows" or "state", index into ``positions``) of the first non-finite value, as
        stored (after rounding to the table's dtypes: float16 overflows at 65504), or None
        when every value is finite."""
        if self.checked is not _UNCHECKED:
            return self.checked
        for what, values in (("rows", self.rows), ("state", self.state)):
            if values is None or all_finite(values):
                continue
            bad = ~torch.isfinite(values).all(dim=1)
            if bool(bad.any()):
                return what, int(bad.nonzero()[0, 0])
        return None


class SparseMomentumSGD:
    """Momentum SGD with L2 weight decay on a subset of rows, equal to ``torch.optim.SGD``
    (dampening 0, no Nesterov) restricted to those rows:

        v <- momentum * v + (g + weight_decay * w);   w <- w - lr * v

    With momentum 0 there is no v: the state tensor has no columns and is left alone.
    Low-precision rows and state are widened to float32 for the arithmetic and rounded once.

    A step whose stored result would not be finite is refused whole. ``step`` updates the
    rows where they are; ``compute`` returns the new values (``RowUpdate``) and ``commit``
    writes them, for a caller that writes them elsewhere (a table whose pushes move rows).
    """

    def __init__(self, momentum: float, weight_decay: float) -> None:
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)

    def compute(self, rows: torch.Tensor, state: torch.Tensor, positions: torch.Tensor,
                grads: torch.Tensor, lr: float, catch_up: torch.Tensor | None = None
                ) -> RowUpdate:
        """The rows and state after one step; ``rows`` and ``state`` are only read.

        rows: (n_local, dim) rows of the shard; state: (n_local, dim) momentum, or
        (n_local, 0) when momentum is 0; positions: int64 (m,) unique local positions;
        grads: float32 (m, dim), already summed over repeated ids; lr: float; catch_up:
        float64 (m,) decay factors the rows owe for steps they sat out (``catch_up_factors``),
        applied before the step, or None.
        """
        if _kernels is not None and rows.device.type == "cpu":
            return self._compiled_update(False, rows, state, positions, grads, lr, catch_up)
        w = _gather(rows, positions).to(torch.float32)
        if catch_up is not None:
            w.mul_(catch_up.to(torch.float32)[:, None])
        g = grads.to(torch.float32)  # the caller's tensor when it is float32: not written
        new_state = None
        if self.momentum:
            # v <- g + momentum * v + weight_decay * w in the gathered copy of v: two passes
            # and no temporary, where building g + weight_decay * w first takes a third pass
            # and a fresh (m, dim) tensor
            v = _gather(state, positions).to(torch.float32)
            g = torch.add(g, v, alpha=self.momentum, out=v)
            if self.weight_decay:
                g.add_(w, alpha=self.weight_decay)
            new_state = g.to(state.dtype)
        elif self.weight_decay:
            g = torch.add(g, w, alpha=self.weight_decay)
        w.sub_(g, alpha=lr)
        return RowUpdate(positions, w.to(rows.dtype), new_state)

    def step(self, rows: torch.Tensor, state: torch.Tensor, positions: torch.Tensor,
             grads: torch.Tensor, lr: float, catch_up: torch.Tensor | None = None
             ) -> tuple[str, int] | None:
        """One step on the rows at ``positions`` (arguments as ``compute``), written in place.
        Returns None, or, where a stored value would not be finite, what
        ``RowUpdate.first_non_finite`` names, and then ``rows`` and ``state`` are unchanged."""
        if _kernels is None or rows.device.type != "cpu":
            update = self.compute(rows, state, positions, grads, lr, catch_up)
            found = update.first_non_finite()
            if found is None:
                self.commit(rows, state, update)
            return found
        old = self._compiled_update(True, rows, state, positions, grads, lr, catch_up)
        if old.checked is not None:  # rare: put back the rows and state it saved
            self.commit(rows, state, old)
        return old.checked

    def _compiled_update(self, in_place: bool, rows: torch.Tensor, state: torch.Tensor,
                         positions: torch.Tensor, grads: torch.Tensor, lr: float,
                         catch_up: torch.Tensor | None) -> RowUpdate:
        """One pass of ams/shard/_kernels.c: ``compute`` (in_place False: the new values), or
        ``step`` (True: the table updated, the old values returned, and where the first
        non-finite value is). The kernel reads and writes raw memory, so every tensor it
        touches is checked here to be a contiguous CPU tensor of the right shape and dtype,
        and every position to be in range."""
        n, dim = rows.shape
        m = positions.numel()
        with_state = bool(self.momentum)
        tensors = [rows, positions, grads] + ([state] if with_state else [])
        if catch_up is not None:
            tensors.append(catch_up)
        if (any(t.device.type != "cpu" for t in tensors) or rows.dtype not in _KERNEL_DTYPES
                or (with_state and state.dtype not in _KERNEL_DTYPES) or dim == 0):
            raise ValueError(f"the compiled update takes CPU float32, float16 or bfloat16 rows, "
                             f"got {rows.dtype} on {rows.device}")
        if not rows.is_contiguous() or (with_state and not state.is_contiguous()):
            raise ValueError("the compiled update needs contiguous rows and state")
        if with_state and tuple(state.shape) != (n, dim):
            raise ValueError(f"state {tuple(state.shape)} does not match rows {(n, dim)}")
        if positions.dtype != torch.int64 or positions.dim() != 1:
            raise ValueError("positions: need an int64 tensor of shape (m,)")
        if m:
            lo, hi = rowcopy.bounds(positions)
            if lo < 0 or hi >= n:
                raise ValueError(f"positions out of range for {n} rows")
        positions = positions.contiguous()
        grads = grads.to(torch.float32).contiguous()
        if tuple(grads.shape) != (m, dim):
            raise ValueError(f"grads {tuple(grads.shape)}, need {(m, dim)}")
        if catch_up is not None:
            catch_up = catch_up.to(torch.float64).contiguous()
            if tuple(catch_up.shape) != (m,):
                raise ValueError(f"catch_up {tuple(catch_up.shape)}, need {(m,)}")
        new_rows = rows.new_empty((m, dim))
        new_state = state.new_empty((m, dim)) if with_state else None
        bad_row, bad_state = _kernels.momentum_sgd(
            in_place, rows.data_ptr(), _KERNEL_DTYPES[rows.dtype],
            state.data_ptr() if with_state else 0,
            _KERNEL_DTYPES[state.dtype] if with_state else 0,
            positions.data_ptr(), m, dim, grads.data_ptr(),
            catch_up.data_ptr() if catch_up is not None else 0,
            self.momentum, self.weight_decay, float(lr),
            new_rows.data_ptr(), new_state.data_ptr() if with_state else 0)
        checked = ("rows", bad_row) if bad_row >= 0 else \
            ("state", bad_state) if bad_state >= 0 else None
        return RowUpdate(positions, new_rows, new_state, checked)

    @staticmethod
    def commit(rows: torch.Tensor, state: torch.Tensor, update: RowUpdate) -> None:
        """Write ``update`` (from ``compute`` on these tensors) into ``rows`` and ``state``."""
        if update.state is not None:
            _scatter(state, update.positions, update.state)
        _scatter(rows, update.positions, update.rows)


# rowcopy (numpy) for CPU tensors: torch's index kernels are several times slower for these
# copies on a busy CPU (ams/shard/rowcopy.py); torch's own on any other device
def _gather(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    if rows.device.type == "cpu":
        return rowcopy.gather(rows, positions)
    return rows.index_select(0, positions)


def _scatter(out: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
    if out.device.type == "cpu":
        rowcopy.scatter(out, positions, rows)
    elif out.shape[1]:
        out.index_copy_(0, positions, rows)

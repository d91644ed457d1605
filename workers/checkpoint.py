"""Worker checkpoints: backbone, optimizer, step, data position, written atomically.

Layout: ``OUT/checkpoints/step-000000001200/{worker.pt, rank-00000.pt, ...}``. ``worker.pt``
holds what all ranks share (backbone and optimizer state, step, data position); ``rank-R.pt``
what is private to rank R (the selection generator and the batches it had already prepared),
which makes a resumed run continue bit-identically with the same worker count, and is ignored
when the count changes. A directory is written under a temporary name and renamed, so a
checkpoint exists whole or not at all; the AMS snapshot of the same step completes the cut.

Both files hold plain containers (dicts, lists, tuples) of tensors, ints, floats, strings, bools
and None, and are read with ``torch.load(weights_only=True)``: opening a checkpoint never runs
code that a crafted file carries, whoever wrote it.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_STEP_RE = re.compile(r"^step-(\d{12})$")


class CheckpointError(Exception):
    """A checkpoint file that cannot be loaded: unreadable, truncated, not a torch file, or
    holding objects other than tensors and plain containers (refused, never constructed)."""


def checkpoint_dir(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"step-{step:012d}"


def _staging_dir(out_dir: Path, step: int) -> Path:
    """Where every rank writes its part before rank 0 publishes the checkpoint."""
    final = checkpoint_dir(out_dir, step)
    return final.with_name(final.name + ".staging")


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_shared(out_dir: Path, step: int, state: dict) -> Path:
    """Rank 0: write ``worker.pt`` of checkpoint ``step`` and publish the directory."""
    final = checkpoint_dir(out_dir, step)
    staging = _staging_dir(out_dir, step)
    staging.mkdir(parents=True, exist_ok=True)
    _atomic_save(state, staging / "worker.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    return final


def clear_staging(out_dir: Path, step: int) -> None:
    """Rank 0, before any rank writes checkpoint ``step``: remove what an interrupted attempt
    left in its staging directory (a rank file of another worker count would be published
    with this one's, and replayed by a resume with that count)."""
    shutil.rmtree(_staging_dir(out_dir, step), ignore_errors=True)


def save_rank(out_dir: Path, step: int, rank: int, state: dict) -> None:
    """Every rank: its private part; written into the staging directory before rank 0
    publishes (the trainer orders the two with a barrier)."""
    staging = _staging_dir(out_dir, step)
    staging.mkdir(parents=True, exist_ok=True)
    _atomic_save(state, staging / f"rank-{rank:05d}.pt")


def latest_step(out_dir: Path) -> int | None:
    """The newest published checkpoint's step, or None."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return None
    steps = sorted((int(m.group(1)) for p in root.iterdir() if (m := _STEP_RE.match(p.name))
                    and (p / "worker.pt").exists()), reverse=True)
    return steps[0] if steps else None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _position(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2 and all(map(_count, value))


def _of(*kinds: type) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, kinds)


# What a resume reads from each file: its name, what it must be, and the check that it is.
Fields = dict[str, tuple[str, Callable[[Any], bool]]]
SHARED_FIELDS: Fields = {
    "step": ("a non-negative integer", _count),
    "position": ("an (epoch, samples) pair of non-negative integers", _position),
    "backbone": ("a dict of tensors", _of(dict)),
    "optimizer": ("a dict", _of(dict)),
}
RANK_FIELDS: Fields = {
    "prepared": ("a list", _of(list)),
    "selector_rng": ("a tensor or None", _of(torch.Tensor, type(None))),
}


def _check_fields(state: dict, path: Path, fields: Fields) -> None:
    for name, (what, fits) in fields.items():
        if name not in state:
            raise CheckpointError(f"checkpoint {path}: has no field {name!r}")
        if not fits(state[name]):
            raise CheckpointError(f"checkpoint {path}: field {name!r} must be {what}, got "
                                  f"{type(state[name]).__name__}")


def load(out_dir: Path, step: int, rank: int) -> tuple[dict, dict | None]:
    """(shared state, this rank's state or None when that file is absent); CheckpointError
    naming the file when one cannot be loaded (:func:`read_state`) or lacks a field a resume
    reads (``SHARED_FIELDS``, ``RANK_FIELDS``)."""
    d = checkpoint_dir(out_dir, step)
    shared = read_state(d / "worker.pt")
    _check_fields(shared, d / "worker.pt", SHARED_FIELDS)
    rank_path = d / f"rank-{rank:05d}.pt"
    private = read_state(rank_path) if rank_path.exists() else None
    if private is not None:
        _check_fields(private, rank_path, RANK_FIELDS)
    return shared, private


def read_state(path: Path) -> dict:
    """One checkpoint file's dict, loaded without running anything it carries.

    Raises CheckpointError naming ``path`` when the file cannot be read, is truncated or not a
    torch file, holds objects other than tensors and plain containers, or is not a dict.
    """
    try:
        with warnings.catch_warnings():
            # torch warns about pickle protocols it did not write; the error below says more
            warnings.simplefilter("ignore", UserWarning)
            state = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: cannot read it ({e.strerror})") from None
    except pickle.UnpicklingError:
        raise CheckpointError(
            f"checkpoint {path}: refused, it holds objects other than tensors and plain "
            "containers (a checkpoint of another version, or a crafted file); nothing in it "
            "was run") from None
    except Exception as e:  # torch.load raises many types on truncated or foreign files
        raise CheckpointError(f"checkpoint {path}: not a readable checkpoint, truncated or "
                              f"corrupt ({type(e).__name__})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path}: holds a {type(state).__name__}, expected a "
                              "dict")
    return state


def prune(out_dir: Path, keep: int = 2) -> None:
    """Remove all but the newest ``keep`` checkpoints."""
    root = Path(out_dir) / "checkpoints"
    steps = sorted((p for p in root.iterdir() if _STEP_RE.match(p.name)), reverse=True)
    for old in steps[keep:]:
        shutil.rmtree(old, ignore_errors=True)

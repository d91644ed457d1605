"""Advice to the OS about a mapped table's pages: read these ahead, together.

A copy that faults an mmap table's pages in one after another waits for one disk read at a
time; asked for together (madvise WILLNEED), the reads overlap. ``prefetch_rows`` does that for
the rows of a request whose pages are not all resident, and ``prefetch_slots_ahead`` for the
slots a push will move its rows into. A no-op where there is no glibc.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import os
from collections.abc import Callable

import numpy as np
import torch

from ams.alloc import libc_function
from ams.shard.storage import TableTensors

log = logging.getLogger(__name__)


def prefetch_rows(tensors: TableTensors, positions: torch.Tensor) -> None:
    """Ask the kernel to start reading the pages that hold rows ``positions`` (int64 (m,)) of
    an mmap table, all at once (madvise WILLNEED), before they are copied. A copy that faults
    its pages in one after another waits for one disk read at a time; started together, the
    reads overlap (docs/decisions.md, "Storage").

    Only when some of them are not in memory: a few of the request's row pages are looked up
    first (mincore), and where all are resident, as on a table the page cache holds, nothing
    more is asked (the calls would cost more than the copy). The page cache is the host's,
    so this also reads ahead where several shards together outgrow it though each one alone
    would fit."""
    if (tensors.files is None or positions.numel() == 0
            or tensors.rows.numel() == 0 or libc_function("madvise") is None):
        return
    at = tensors.at(positions)
    row_pages = pages_of(tensors.rows, at)
    if all_resident(tensors.rows, row_pages):
        return
    for tensor in (tensors.rows, tensors.state, tensors.row_clock):
        if tensor.numel() == 0:
            continue
        advise_will_need(tensor, row_pages if tensor is tensors.rows
                         else pages_of(tensor, at))


def prefetch_slots_ahead(tensors: TableTensors, count: int) -> None:
    """Ask the kernel to start reading the pages of the slots a push of ``count`` rows will
    most likely move its rows into (``RowSlots.span_ahead``): one run of pages per tensor,
    which the kernel reads in large requests, where a write into a page missing from memory
    would read it alone (the maps are read at random, ``ams.shard.mapped``)."""
    if (tensors.files is None or tensors.slots is None
            or count == 0):
        return
    start, stop = tensors.slots.span_ahead(count)
    for tensor in (tensors.rows, tensors.state, tensors.row_clock):
        if tensor.numel() and stop > start:
            row_bytes = tensor.stride(0) * tensor.element_size()
            advise_will_need(tensor, torch.arange(start * row_bytes // mmap.PAGESIZE,
                                                  (stop * row_bytes - 1) // mmap.PAGESIZE + 1))


def advise_will_need(tensor: torch.Tensor, pages: torch.Tensor) -> None:
    """madvise(WILLNEED) on ``pages`` (int64 (p,) page numbers within ``tensor``'s mapping,
    which must be page aligned, as a mapped table's tensors are), one range per run of
    consecutive pages in that order: the kernel starts reading them and returns. A no-op
    where there is no glibc."""
    if pages.numel() == 0:
        return
    breaks = torch.nonzero(pages[1:] != pages[:-1] + 1).view(-1) + 1
    firsts = torch.cat([pages[:1], pages[breaks]])
    lasts = torch.cat([pages[breaks - 1], pages[-1:]])
    starts = (firsts * mmap.PAGESIZE).numpy().astype(np.uint64) + np.uint64(tensor.data_ptr())
    advise_ranges(starts, ((lasts - firsts + 1) * mmap.PAGESIZE).numpy().astype(np.uint64),
                  mmap.MADV_WILLNEED)


# ranges one process_madvise(2) call takes at most (the kernel's UIO_MAXIOV)
_IOV_MAX = 1024
# pids whose process_madvise(2) failed: they use one madvise(2) a range from then on
_no_process_madvise: set[int] = set()


def advise_ranges(starts: np.ndarray, lengths: np.ndarray, advice: int) -> None:
    """madvise(``advice``) on the ranges [starts[i], starts[i] + lengths[i]) of this process
    (uint64 (r,) each, page aligned): one process_madvise(2) call per ``_IOV_MAX`` ranges
    where the kernel takes it (5.10 and later), else one madvise(2) a range. A pull's
    read-ahead asks for hundreds of scattered pages, and a call from Python for each costs
    more CPU than the kernel spends on the resident ones. A no-op where there is no glibc."""
    pid = os.getpid()
    done = 0 if pid in _no_process_madvise else _process_madvise(pid, starts, lengths, advice)
    madvise = libc_function("madvise")
    if madvise is None:
        return
    for start, length in zip(starts[done:].tolist(), lengths[done:].tolist(), strict=True):
        madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice)


def _process_madvise(pid: int, starts: np.ndarray, lengths: np.ndarray, advice: int) -> int:
    """Ask for the ranges (as ``advise_ranges``) by process_madvise(2) with this process's
    own pidfd; returns how many of them, in order, were asked for. Fewer than all when the
    kernel refuses (too old, or not allowed): ``pid`` then asks one range at a time."""
    process_madvise = _process_madvise_function()
    pidfd = _own_pidfd(pid)
    if process_madvise is None or pidfd is None:
        _no_process_madvise.add(pid)
        return 0
    iovecs = np.stack([starts, lengths], axis=1)  # struct iovec {base, len} each, (r, 2)
    for first in range(0, len(iovecs), _IOV_MAX):
        part = iovecs[first:first + _IOV_MAX]
        if process_madvise(pidfd, ctypes.c_void_p(part.ctypes.data),
                           ctypes.c_size_t(len(part)), advice, 0) < 0:
            log.debug("process_madvise refused (errno %d): madvise one range at a time",
                      ctypes.get_errno())
            _no_process_madvise.add(pid)
            return first
    return len(iovecs)


@functools.cache
def _process_madvise_function() -> Callable[..., int] | None:
    """glibc's process_madvise, returning ssize_t, or None where there is none."""
    function = libc_function("process_madvise")
    if function is not None:
        function.restype = ctypes.c_ssize_t
    return function


@functools.cache
def _own_pidfd(pid: int) -> int | None:
    """A pidfd of this process (``pid``, so that a forked child opens its own), or None
    where the kernel has no pidfd_open(2)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


# pages of a request looked up before its read-ahead: if the page cache lacks a share p of
# the table, all of them are found resident with probability (1 - p)^8
_RESIDENCY_PROBES = 8


def pages_of(tensor: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 (p,) ascending: the pages of ``tensor``'s mapping that rows ``positions`` touch."""
    row_bytes = tensor.stride(0) * tensor.element_size()
    first = positions * row_bytes // mmap.PAGESIZE
    last = (positions * row_bytes + row_bytes - 1) // mmap.PAGESIZE
    return torch.unique(torch.cat([first, last]))


def all_resident(tensor: torch.Tensor, pages: torch.Tensor) -> bool:
    """Whether up to ``_RESIDENCY_PROBES`` of ``pages`` (int64 (p,) of ``tensor``'s
    mapping), spread over them, are all in memory (mincore). False where mincore is
    missing or fails: the read-ahead is then always asked for."""
    mincore = libc_function("mincore")
    if mincore is None:
        return False
    # evenly spaced over the request, never the same page twice (steps are at least 1 apart)
    picks = pages[torch.linspace(0, pages.numel() - 1, min(_RESIDENCY_PROBES, pages.numel()))
                  .round().long()]
    status = ctypes.c_ubyte()
    base = tensor.data_ptr()
    for page in picks.tolist():
        if mincore(ctypes.c_void_p(base + page * mmap.PAGESIZE), mmap.PAGESIZE,
                   ctypes.byref(status)) != 0 or not status.value & 1:
            return False
    return True


def resident_pages(tensor: torch.Tensor) -> torch.Tensor:
    """bool (pages,): which pages of ``tensor``'s mapping (page aligned, as a mapped table's
    tensors are) are in memory, by one mincore(2) over the whole mapping. OSError where
    mincore is missing or fails."""
    mincore = libc_function("mincore")
    if mincore is None:
        raise OSError(errno.ENOSYS, "mincore: no glibc")
    nbytes = tensor.numel() * tensor.element_size()
    status = (ctypes.c_ubyte * -(-nbytes // mmap.PAGESIZE))()
    if mincore(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(nbytes), status) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return torch.frombuffer(status, dtype=torch.uint8).bitwise_and(1).bool()

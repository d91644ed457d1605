"""Keep large buffers in the process heap instead of returning them to the OS.

Pull replies and push requests are megabytes each, and so are a training step's activations
and gradients. glibc serves such sizes with fresh mmap() pages and unmaps them on free, so
every call or step page-faults its buffers in again: a large share of loopback throughput, and
of a CPU training step's time (in kernel time). Raising the mmap and trim thresholds makes
freed buffers reusable.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import mmap
import warnings
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

_HUGE_PAGE = 2 << 20
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False
# The trim threshold in force: glibc's default until keep_large_buffers raises it.
_trim_threshold = 128 << 10
# A free of at least this size makes glibc check its arena's top against the trim threshold.
_PROBE_BYTES = 128 << 10
# Blocks below this come from the heap, where a freed one is reused: 32 MiB is the most glibc's
# mallopt takes on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX; it refuses more).
MMAP_THRESHOLD = 32 << 20
# Free memory at the heap's top is returned to the OS only past this: 1 GiB keeps the buffers of
# the requests a process serves or sends at once for the next ones.
TRIM_THRESHOLD = 1 << 30


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, looked up once (``find_library`` searches the linker's cache), or None
    where there is none."""
    lib = ctypes.util.find_library("c")
    if not lib:
        return None
    try:
        return ctypes.CDLL(lib, use_errno=True)
    except OSError:
        return None


def libc_function(name: str) -> Callable[..., int] | None:
    """glibc's function ``name``, or None where there is no glibc."""
    return getattr(_libc(), name, None)


def keep_large_buffers() -> bool:
    """Tune glibc malloc (``MMAP_THRESHOLD``, ``TRIM_THRESHOLD``) once per process; returns
    False where there is no glibc (a no-op)."""
    global _done, _trim_threshold
    if _done:
        return True
    mallopt = libc_function("mallopt")
    if mallopt is None:
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    log.debug("malloc_tuned ok=%s mmap_threshold=%d trim_threshold=%d", ok, MMAP_THRESHOLD,
              TRIM_THRESHOLD)
    _done = ok
    if ok:
        _trim_threshold = TRIM_THRESHOLD
    return ok


def release_free_memory() -> None:
    """Hand the calling thread's and every arena's free pages back to the OS now.

    For one-off scratch, such as a table's initialization or a restore's pieces: the
    thresholds of ``keep_large_buffers`` would keep it as buffers for the next requests, and a
    shard's resident memory would stay above its tables until traffic reused it. glibc's
    ``malloc_trim`` frees the free chunks of every arena but not the top of a thread's own
    arena, which shrinks only when a free finds it above the trim threshold: so the threshold
    is lowered for one malloc and free on this thread (the one that made the scratch). A no-op
    where there is no glibc.
    """
    functions = [libc_function(name) for name in ("mallopt", "malloc", "free", "malloc_trim")]
    if None in functions:
        return
    mallopt, malloc, free, trim = functions
    malloc.argtypes, malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    free.argtypes = [ctypes.c_void_p]
    mallopt(_M_TRIM_THRESHOLD, _PROBE_BYTES)
    try:
        free(malloc(_PROBE_BYTES))
        trim(0)
    finally:
        mallopt(_M_TRIM_THRESHOLD, _trim_threshold)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype)`` in fresh private anonymous memory advised onto
    transparent huge pages.

    A pull or push touches rows at random across the table, one 4 KiB page per row, and on small
    pages each of those reads misses the TLB as well as the cache; on 2 MiB pages the gathers of a
    pull run faster (docs/decisions.md, "In-memory tables are private memory on transparent huge
    pages"). Where the kernel runs huge pages in ``madvise`` mode (the common default) only advised
    memory gets them; a kernel without them refuses the advice, and the memory serves on small
    pages. The kernel hands the pages over zeroed when first touched, so nothing is written here and
    an untouched region costs no memory.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < 2 * _HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    # private: the kernel's huge-page setting for shared anonymous memory (``shmem_enabled``)
    # is commonly ``never``, and Python's anonymous mmap is shared unless asked otherwise
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # EINVAL where the kernel was built without transparent huge pages
        log.debug("huge_page_advice_refused bytes=%d", nbytes)
    with warnings.catch_warnings():  # the tensor owns the region (frombuffer keeps it alive)
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(region, dtype=dtype).view(shape)

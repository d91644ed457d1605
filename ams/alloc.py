"""Keep large message buffers in the process heap instead of returning them to the OS.

Pull replies and push requests are megabytes each. glibc serves such sizes with fresh mmap()
pages and unmaps them on free, so every call page-faults its buffers in again, a large share of
loopback throughput. Raising the mmap and trim thresholds makes freed buffers reusable.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_large_buffers(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Tune glibc malloc once per process; returns False where there is no glibc (a no-op)."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    log.debug("malloc_tuned ok=%s mmap_threshold=%d trim_threshold=%d", ok, mmap_threshold,
              trim_threshold)
    _done = ok
    return ok

"""SIGTERM during training: stop at the next step boundary that every rank agrees on.

A scheduler, ``docker stop`` or torchrun shutting its group down sends SIGTERM and, after a
grace period, SIGKILL. Stopping at once would lose every step since the last checkpoint, and
ranks that stop at different steps would leave checkpoints no resume can combine. So the
handler only records the request; at each step boundary the ranks take the max of their flags
(one tiny all-reduce), and all of them stop, checkpoint, after the same step.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch

from workers.distributed import group_max

# The exit code of a worker that stopped on SIGTERM after checkpointing (128 + SIGTERM, as a
# shell reports a process that the signal ended).
EXIT_TERMINATED = 128 + signal.SIGTERM


class TerminationRequest:
    """Records SIGTERM while installed (a context manager; a no-op off the main thread, where
    Python cannot install handlers), and goes on recording it after the context once one
    came, so that the process ends as the stop says rather than by a second signal."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: object = None
        self._installed = False

    def __enter__(self) -> TerminationRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._record)
            self._installed = True
        return self

    def __exit__(self, *exc: object) -> None:
        # Once a stop was asked for, a second SIGTERM must not kill the process on its way out
        # before it says where it stopped: torchrun sends one to the ranks still running when
        # the first has exited 143.
        if self._installed and not self.requested:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def agreed(self, world: int, device: torch.device) -> bool:
        """Whether any rank has been asked to stop; every rank of the group must call it at
        the same step (a collective when ``world`` > 1)."""
        return bool(group_max(int(self.requested), world, device))

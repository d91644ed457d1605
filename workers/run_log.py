"""A run's metrics on disk: one CSV per kind of row (train, eval, graph) under the run's
directory, mirrored to TensorBoard when it is installed."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any


class RunLog:
    """Appends metric rows to ``out_dir/{kind}.csv``; only the writing rank (``enabled``)
    touches the disk, so every rank may call :meth:`record`."""

    def __init__(self, out_dir: Path, enabled: bool = True) -> None:
        self.out_dir = Path(out_dir)
        self.enabled = enabled
        self._tensorboard: Any = None  # None: not tried yet; False: not installed

    def record(self, kind: str, row: dict) -> None:
        """Append ``row`` (must contain ``step``) to ``{kind}.csv`` and its numbers to
        TensorBoard as ``{kind}/{key}``; a None is an empty CSV cell."""
        if not self.enabled:
            return
        path = self.out_dir / f"{kind}.csv"
        new = not path.exists()
        with open(path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(row))
            if new:
                writer.writeheader()
            writer.writerow(row)
        board = self._board()
        if board:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    board.add_scalar(f"{kind}/{key}", value, row["step"])

    def _board(self) -> Any:
        if self._tensorboard is None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tensorboard = SummaryWriter(str(self.out_dir / "tensorboard"))
            except ImportError:  # TensorBoard is optional; the CSV is always written
                self._tensorboard = False
        return self._tensorboard

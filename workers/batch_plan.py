"""Which samples each data-parallel rank trains on, and the loader that reads them.

The plan is a function of (seed, epoch, position) only, so a resumed run continues with exactly
the samples it had not yet seen, whatever the number of workers it resumes with.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from workers.data.errors import DatasetError, unwrap_worker_error

# One loaded batch: sample ids int64 (B,), images uint8 (B, C, H, W), labels int64 (B,).
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class BatchPlan:
    """Each epoch is a seeded permutation of all samples; global batch g of epoch e covers
    permutation entries [g·B_e·W, (g+1)·B_e·W) and rank r takes its r-th slice of B_e. The
    position saved in a checkpoint is (epoch, samples consumed in the epoch), so a resumed run
    — with the same or a different worker count W — continues with exactly the samples not yet
    seen.

    batch_size: the per-rank batch B, or the growing batch of each epoch (``[B_0, B_1, ...]``;
    epochs past the list keep its last entry; the fast continuous convergence strategy grows
    the batch at the start of every epoch).
    """

    def __init__(self, num_samples: int, batch_size: int | Sequence[int], rank: int,
                 world: int, seed: int) -> None:
        sizes = [batch_size] if isinstance(batch_size, int) else list(batch_size)
        if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0
                            for b in sizes):
            raise ValueError(f"batch sizes must be positive integers, got {batch_size!r}")
        self.num_samples, self.batch_sizes = num_samples, sizes
        self.rank, self.world, self.seed = rank, world, seed
        if num_samples < max(sizes) * world:
            raise ValueError(f"the dataset has {num_samples} samples, fewer than one global "
                             f"batch ({max(sizes)} x {world} workers)")

    @property
    def batch_size(self) -> int:
        """The per-rank batch of the first epoch."""
        return self.batch_sizes[0]

    @property
    def steps_per_epoch(self) -> int:
        """The steps of the first epoch (of every epoch, without a growing batch)."""
        return self.steps_in_epoch(0)

    def batch_size_at(self, epoch: int) -> int:
        """The per-rank batch of ``epoch``."""
        return self.batch_sizes[min(epoch, len(self.batch_sizes) - 1)]

    def steps_in_epoch(self, epoch: int) -> int:
        return self.num_samples // (self.batch_size_at(epoch) * self.world)

    def run_steps(self, epochs: int, max_steps: int = 0) -> int:
        """The steps of a run of ``epochs`` epochs, cut at ``max_steps`` where that is > 0."""
        total = sum(self.steps_in_epoch(e) for e in range(epochs))
        return min(total, max_steps) if max_steps else total

    def epoch_of_steps(self, epochs: int) -> list[int]:
        """The epoch of each step of a run of ``epochs`` epochs."""
        return [e for e in range(epochs) for _ in range(self.steps_in_epoch(e))]

    def batches(self, epoch: int, consumed: int) -> Iterator[list[int]]:
        """This rank's sample ids of each remaining global batch of ``epoch``, starting
        ``consumed`` samples into it."""
        order = torch.randperm(self.num_samples,
                               generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))
        size = self.batch_size_at(epoch)
        whole = size * self.world
        for start in range(consumed, self.steps_in_epoch(epoch) * whole, whole):
            mine = start + self.rank * size
            yield order[mine:mine + size].tolist()

    def advance(self, position: tuple[int, int]) -> tuple[int, int]:
        """The (epoch, consumed) position after one more global batch from ``position``."""
        epoch, consumed = position
        whole = self.batch_size_at(epoch) * self.world
        consumed += whole
        if consumed >= self.steps_in_epoch(epoch) * whole:
            return epoch + 1, 0
        return epoch, consumed

    def loader(self, dataset: Dataset, epoch: int, consumed: int,
               num_workers: int) -> Iterator[Batch]:
        """The batches of ``batches(epoch, consumed)`` read from ``dataset``
        (``dataset[i]`` -> (id, image, label)) by ``num_workers`` loader processes. A
        ``DatasetError`` a loader process raises comes out with its own one-line message, as
        it would from this process, not torch's report of the worker's traceback."""
        loaded = iter(DataLoader(dataset, batch_sampler=_BatchList(list(self.batches(epoch,
                                                                                    consumed))),
                                 num_workers=num_workers, collate_fn=collate,
                                 persistent_workers=False))
        while True:
            try:
                batch = next(loaded)
            except StopIteration:
                return
            except DatasetError as e:
                raise unwrap_worker_error(e) from None
            yield batch


class _BatchList(Sampler):
    """A batch sampler over batches fixed in advance."""

    def __init__(self, batches: list[list[int]]) -> None:
        self._batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches)

    def __len__(self) -> int:
        return len(self._batches)


def collate(items: list) -> Batch:
    """Stack ``(id, image, label)`` samples into one :data:`Batch`."""
    ids, images, labels = zip(*items, strict=True)
    return torch.stack(ids), torch.stack(images), torch.stack(labels)

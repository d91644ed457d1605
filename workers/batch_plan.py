"""Which samples each data-parallel rank trains on, and the loader that reads them.

The plan is a function of (seed, epoch, position) only, so a resumed run continues with exactly
the samples it had not yet seen, whatever the number of workers it resumes with.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

# One loaded batch: sample ids int64 (B,), images uint8 (B, C, H, W), labels int64 (B,).
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class BatchPlan:
    """Each epoch is a seeded permutation of all samples; global batch g covers permutation
    entries [g·B·W, (g+1)·B·W) and rank r takes its r-th slice of B. The position saved in a
    checkpoint is (epoch, samples consumed in the epoch), so a resumed run — with the same or
    a different worker count W — continues with exactly the samples not yet seen.
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int, world: int,
                 seed: int) -> None:
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world, self.seed = rank, world, seed
        self.global_batch = batch_size * world
        if num_samples < self.global_batch:
            raise ValueError(f"the dataset has {num_samples} samples, fewer than one global "
                             f"batch ({batch_size} x {world} workers)")

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def batches(self, epoch: int, consumed: int) -> Iterator[list[int]]:
        """This rank's sample ids of each remaining global batch of ``epoch``, starting
        ``consumed`` samples into it."""
        order = torch.randperm(self.num_samples,
                               generator=torch.Generator().manual_seed(self.seed * 100003 + epoch))
        for start in range(consumed, self.steps_per_epoch * self.global_batch,
                           self.global_batch):
            mine = start + self.rank * self.batch_size
            yield order[mine:mine + self.batch_size].tolist()

    def advance(self, position: tuple[int, int]) -> tuple[int, int]:
        """The (epoch, consumed) position after one more global batch from ``position``."""
        epoch, consumed = position
        consumed += self.global_batch
        if consumed >= self.steps_per_epoch * self.global_batch:
            return epoch + 1, 0
        return epoch, consumed

    def loader(self, dataset: Dataset, epoch: int, consumed: int,
               num_workers: int) -> Iterator[Batch]:
        """The batches of ``batches(epoch, consumed)`` read from ``dataset``
        (``dataset[i]`` -> (id, image, label)) by ``num_workers`` loader processes."""
        return iter(DataLoader(dataset, batch_sampler=_BatchList(list(self.batches(epoch,
                                                                                  consumed))),
                               num_workers=num_workers, collate_fn=collate,
                               persistent_workers=False))


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

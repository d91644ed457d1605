"""workers.batch_plan: a growing batch covers every sample once per epoch, and a resumed plan
(other worker count included) continues with exactly the unseen samples."""

from __future__ import annotations

import pytest

from workers.batch_plan import BatchPlan

N = 100


def epoch_batches(sizes, world: int, epoch: int, consumed: int = 0) -> list[list[list[int]]]:
    """Per step, each rank's sample ids."""
    plans = [BatchPlan(N, sizes, r, world, seed=4) for r in range(world)]
    return [list(step) for step in zip(*(p.batches(epoch, consumed) for p in plans),
                                       strict=True)]


def test_a_growing_batch_covers_each_epoch_once_at_its_size():
    sizes, world = [5, 10, 20], 2
    plan = BatchPlan(N, sizes, 0, world, seed=4)
    assert [plan.batch_size_at(e) for e in range(5)] == [5, 10, 20, 20, 20]
    assert [plan.steps_in_epoch(e) for e in range(4)] == [10, 5, 2, 2]
    assert plan.epoch_of_steps(3) == [0] * 10 + [1] * 5 + [2] * 2
    for epoch in range(4):
        steps = epoch_batches(sizes, world, epoch)
        assert len(steps) == plan.steps_in_epoch(epoch)
        seen = [i for step in steps for part in step for i in part]
        assert all(len(part) == plan.batch_size_at(epoch) for step in steps for part in step)
        assert len(seen) == len(set(seen)) == plan.steps_in_epoch(epoch) * world * \
            plan.batch_size_at(epoch)


def test_a_resume_with_another_worker_count_sees_the_rest_of_the_epoch():
    sizes = [4, 8]
    two = BatchPlan(N, sizes, 0, 2, seed=4)
    position = (0, 0)
    for _ in range(13):  # into epoch 1: 12 steps of 2 x 4, then one of 2 x 8
        position = two.advance(position)
    assert position == (1, 16)
    done = [i for step in epoch_batches(sizes, 2, 1)[:1] for part in step for i in part]
    rest = [i for step in epoch_batches(sizes, 1, 1, position[1]) for part in step for i in part]
    whole = [i for step in epoch_batches(sizes, 2, 1) for part in step for i in part]
    assert len(done) + len(rest) == 96 and sorted(done + rest) == sorted(whole)


@pytest.mark.parametrize("sizes", [[], [4, 0], [4, -2], [True]])
def test_bad_batch_sizes_are_refused(sizes):
    with pytest.raises(ValueError, match="positive integers"):
        BatchPlan(N, sizes, 0, 1, seed=0)


def test_a_batch_larger_than_the_dataset_is_refused():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        BatchPlan(N, [10, 60], 0, 2, seed=0)

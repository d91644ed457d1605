"""Row slots (ams.shard.slots): a bijection of rows onto slots that pushes keep, and a cursor that
puts each push's rows next to each other."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ams.shard.slots import SPARE_SLOTS, RowSlots, slot_capacity

ROWS_PER_PAGE = 16  # 256-byte rows (128 float16) on a 4 KiB page


def check_bijection(slots: RowSlots) -> None:
    """Every row has its own slot, and the free mask is exactly the slots no row holds."""
    assert np.unique(slots.slot_of).shape[0] == slots.owned
    held = np.zeros(slots.capacity, dtype=bool)
    held[slots.slot_of] = True
    assert np.array_equal(held, slots.used)


def test_identity_holds_row_p_in_slot_p():
    slots = RowSlots.identity(10, slot_capacity(10))
    assert slots.capacity == 10 + int(np.ceil(10 * SPARE_SLOTS))
    assert torch.equal(slots.lookup(torch.tensor([0, 9, 3])), torch.tensor([0, 9, 3]))
    check_bijection(slots)


def test_relocate_takes_free_slots_in_order_from_the_cursor_and_frees_the_old_ones():
    slots = RowSlots.identity(8, 12)  # free: 8, 9, 10, 11
    new = slots.relocate(torch.tensor([1, 5, 6]))
    assert new.tolist() == [8, 9, 10]
    assert slots.lookup(torch.tensor([1, 5, 6, 0])).tolist() == [8, 9, 10, 0]
    check_bijection(slots)
    # slot 11 is left ahead of the cursor, then it wraps: 1, 5, 6 and now 2's are free
    new = slots.relocate(torch.tensor([2, 3]))
    assert new.tolist() == [11, 1]
    assert slots.cursor == 2
    check_bijection(slots)


def test_no_spare_slot_still_relocates_into_the_freed_ones():
    slots = RowSlots.identity(5, 5)  # a table of the layout without spare slots
    new = slots.relocate(torch.tensor([4, 0]))
    assert sorted(new.tolist()) == [0, 4]
    check_bijection(slots)


def test_random_pushes_keep_a_bijection_and_dirty_fewer_pages_than_in_place():
    """At steady state a push of m random rows writes them into fewer pages than the pages
    the rows came from (what a push in place dirties), counted by brute force."""
    owned, m = 100_000, 768
    slots = RowSlots.identity(owned, slot_capacity(owned))
    g = torch.Generator().manual_seed(0)
    in_place, moved = [], []
    for step in range(400):  # about three sweeps of the cursor
        positions = torch.randperm(owned, generator=g)[:m].sort().values
        old = slots.lookup(positions)
        new = slots.relocate(positions)
        assert new.unique().numel() == m
        if step >= 200:
            in_place.append((old // ROWS_PER_PAGE).unique().numel())
            moved.append((new // ROWS_PER_PAGE).unique().numel())
    check_bijection(slots)
    # the free density ahead of the cursor tends to 2s / (1 + s): 0.4 at s = 0.25, so about
    # 6.4 rows a page against 1 for random rows in place
    assert np.mean(moved) < np.mean(in_place) / 4


@pytest.mark.parametrize("slot_of,capacity,cursor,message", [
    (np.array([0, 0, 1]), 4, 0, "share a slot"),
    (np.array([0, 4]), 4, 0, r"slots must be in \[0, 4\)"),
    (np.array([-1, 2]), 4, 0, r"slots must be in \[0, 4\)"),
    (np.array([0, 1, 2]), 2, 0, "3 rows in 2 slots"),
    (np.array([0, 1]), 4, 5, "cursor 5"),
    (np.array([[0, 1]]), 4, 0, "1-D integer"),
    (np.array([0.0, 1.0]), 4, 0, "1-D integer"),
])
def test_malformed_slot_maps_are_refused(slot_of, capacity, cursor, message):
    with pytest.raises(ValueError, match=message):
        RowSlots(slot_of, capacity, cursor)

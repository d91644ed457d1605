"""Where each row of a table in mapped files lives: row slots, so that a push writes its rows
next to each other. Pure numpy and torch: no I/O.

A push to a table in mapped files makes every page it writes dirty, and the kernel pays for
each such page twice: a write fault when a clean page is first written (the file system's
``page_mkwrite``) and a write to the disk later. Rows of a few hundred bytes pushed in place
at random ids dirty a page each, so on a table larger than RAM a step costs as many random
page writes as it pushes rows.

So an mmap table keeps more slots than rows (``SPARE_SLOTS`` more) and a push moves every row
it updates into a free slot. Free slots are taken in address order by a cursor that sweeps the
files and wraps around, so one push's rows land next to each other, several to a page, and
the pages they dirty lie in one run, which the kernel writes back in order. The slots the rows
left are free for the cursor's next sweep. With a share ``s`` of spare slots, the cursor finds
free slots ahead of it at a density of about ``2s / (1 + s)`` once it has swept the files once
(a slot freed uniformly at random waited on average half a sweep), against ``1/rows per page``
for pushes in place.

What it costs: the spare slots' disk, and the rows spread over that many more pages, so a
page cache of a given size holds a smaller share of them; the pages ahead of the cursor hold
live rows beside the free slots, so they are read before they are written (in order, ahead of
time: ``ams.shard.storage.prefetch_slots_ahead``); and in RAM, the mapping ``slot_of`` (position ->
slot) and a free-slot mask (1 byte per slot). The old row is read to be updated anyway.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# Spare slots as a share of a shard's rows: the files grow by this share, and a push dirties
# about (1 + s) / (2 s) times fewer pages than its rows' count when rows are much smaller
# than a page (module docstring).
SPARE_SLOTS = 0.25
# slots looked at per step of the cursor's search for free ones (at least); the search is
# over a bool mask, so a chunk costs a few microseconds
_SEARCH_CHUNK = 1 << 16


def slot_capacity(owned: int) -> int:
    """Slots of a slotted table of ``owned`` rows: the rows and ``SPARE_SLOTS`` more."""
    return owned + math.ceil(owned * SPARE_SLOTS)


def slot_dtype(capacity: int) -> np.dtype:
    """int32 where every slot number fits it (half the RAM of int64), else int64."""
    return np.dtype(np.int32) if capacity <= np.iinfo(np.int32).max else np.dtype(np.int64)


class RowSlots:
    """The slot of each row of one shard's table and the free slots' cursor.

    ``slot_of``: (owned,) integer array, slot of local position p; every slot in
    [0, capacity), none twice. ``cursor``: the slot in [0, capacity] where the search for free
    slots starts. Not thread-safe: its table's lock guards it, as it guards the rows.
    ``ValueError`` for a mapping that breaks those rules.
    """

    def __init__(self, slot_of: np.ndarray, capacity: int, cursor: int) -> None:
        if slot_of.ndim != 1 or not np.issubdtype(slot_of.dtype, np.integer):
            raise ValueError(f"slot map: need a 1-D integer array, got {slot_of.dtype} "
                             f"{slot_of.shape}")
        owned = slot_of.shape[0]
        if not owned <= capacity or not 0 <= cursor <= capacity:
            raise ValueError(f"slot map: {owned} rows in {capacity} slots, cursor {cursor}")
        if owned and (int(slot_of.min()) < 0 or int(slot_of.max()) >= capacity):
            raise ValueError(f"slot map: slots must be in [0, {capacity}), got "
                             f"{int(slot_of.min())}..{int(slot_of.max())}")
        self.slot_of = slot_of.astype(slot_dtype(capacity), copy=False)
        self.used = np.zeros(capacity, dtype=bool)
        self.used[self.slot_of] = True
        if int(np.count_nonzero(self.used)) != owned:
            raise ValueError("slot map: two rows share a slot")
        self.cursor = cursor

    @classmethod
    def identity(cls, owned: int, capacity: int) -> RowSlots:
        """Row p in slot p, the spare slots after the rows: a table as created or restored
        (its rows are written in position order), whose first pushes fill the spare slots."""
        return cls(np.arange(owned, dtype=slot_dtype(capacity)), capacity, owned)

    @property
    def owned(self) -> int:
        return self.slot_of.shape[0]

    @property
    def capacity(self) -> int:
        return self.used.shape[0]

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        """Slots of local ``positions`` (int64 (m,) in [0, owned)): int64 (m,)."""
        return torch.from_numpy(self.slot_of[positions.numpy()].astype(np.int64))

    def relocate(self, positions: torch.Tensor) -> torch.Tensor:
        """Move the rows at ``positions`` (int64 (m,), unique, in [0, owned)) to new slots and
        return them: int64 (m,), ascending where ``positions`` ascend. Their old slots are
        free from now on (a caller reads the old rows before, and writes the new ones
        after)."""
        index = positions.numpy()
        self.used[self.slot_of[index]] = False
        new = self._take(index.shape[0])
        self.used[new] = True
        self.slot_of[index] = new
        return torch.from_numpy(new.astype(np.int64))

    def _take(self, count: int) -> np.ndarray:
        """The first ``count`` free slots from the cursor on, wrapping at the end; the cursor
        moves past the last one. Frees always precede a take of as many, so they exist."""
        found: list[np.ndarray] = []
        need, start = count, self.cursor
        chunk = max(_SEARCH_CHUNK, 4 * count)
        while need:
            if start >= self.capacity:
                start = 0
            stop = min(start + chunk, self.capacity)
            free = np.flatnonzero(~self.used[start:stop])[:need]
            if free.shape[0]:
                found.append(free + start)
                need -= free.shape[0]
                self.cursor = start + int(free[-1]) + 1
            start = stop
        return np.concatenate(found) if found else np.empty(0, dtype=np.int64)

    def span_ahead(self, count: int) -> tuple[int, int]:
        """Slots [start, stop) the next take of ``count`` rows most likely writes, from the
        cursor on (not wrapped): where to read ahead the pages a push will write into."""
        # twice the span at the table's mean free density: the density ahead of the cursor
        # is higher, so this covers the next take and about as much of the one after
        density = max(1, self.capacity - self.owned) / max(1, self.capacity)
        return self.cursor, min(self.capacity, self.cursor + math.ceil(2 * count / density))

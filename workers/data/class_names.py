"""Class names that are only numbers, kept as a count: a dataset's and an export's."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload


@dataclass(frozen=True)
class NumberedClasses(Sequence[str]):
    """The names of classes known only by number: class id ``i`` is named ``str(i)``.

    A .rec import of a hundred million classes would otherwise hold a hundred million names in
    memory and in its metadata; this one is stored as ``null`` and costs nothing.
    """

    count: int

    def __len__(self) -> int:
        return self.count

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [str(i) for i in range(*index.indices(self.count))]
        i = operator.index(index)
        if not -self.count <= i < self.count:
            raise IndexError(f"class id {i} outside [0, {self.count})")
        return str(i % self.count)

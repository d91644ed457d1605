"""Class names as a dataset's metadata and an export's ``classes.json`` store them."""

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


def class_names_to_json(names: Sequence[str]) -> list[str] | None:
    """The JSON value stored for ``names``: the list, or ``null`` for ``NumberedClasses``."""
    return None if isinstance(names, NumberedClasses) else list(names)


def class_names_from_json(value: object, count: int) -> list[str] | NumberedClasses:
    """Read back what ``class_names_to_json`` stored for ``count`` classes.

    Raises ValueError saying what the value must be; callers add the file it came from.
    """
    if value is None:
        return NumberedClasses(count)
    if (not isinstance(value, list) or len(value) != count
            or not all(isinstance(name, str) for name in value)):
        raise ValueError(f"must be a list of {count} class names (strings), or null (numbered)")
    return value

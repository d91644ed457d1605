"""What a settings field's annotation carries besides its type: the values it admits, and how it
is written out.

A field of ``workers.settings`` is declared ``batch_size: Annotated[int, POSITIVE] = 256``;
``xcls.config`` reads the marks when it loads a config and refuses a value that a constraint
(``Range``, ``Each``, ``Rule``) does not admit, in one line naming the dotted key, the value and
what is allowed. A field whose type is a ``StrEnum`` admits its members' values, and holds the
member once loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """Admits numbers above ``gt`` (or from ``ge``) and below ``lt`` (or up to ``le``); a bound
    left None does not apply."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def problem(self, value: float) -> str | None:
        """What is wrong with ``value`` ("must be > 0"); None when the range admits it."""
        if ((self.gt is None or value > self.gt) and (self.ge is None or value >= self.ge)
                and (self.lt is None or value < self.lt) and (self.le is None or value <= self.le)):
            return None
        return f"must be {self}"

    def __str__(self) -> str:
        low = f"({self.gt}" if self.gt is not None else f"[{self.ge}" if self.ge is not None \
            else None
        high = f"{self.lt})" if self.lt is not None else f"{self.le}]" if self.le is not None \
            else None
        if low and high:
            return f"in {low}, {high}"
        if low:
            return f"> {self.gt}" if self.gt is not None else f">= {self.ge}"
        return f"< {self.lt}" if self.lt is not None else f"at most {self.le}"


POSITIVE = Range(gt=0)
NON_NEGATIVE = Range(ge=0)


@dataclass(frozen=True)
class Each:
    """Admits a list whose every item ``item`` admits; ``noun`` names an item in the message
    ("every batch must be > 0")."""

    item: Range
    noun: str

    def problem(self, value: list) -> str | None:
        """What is wrong with the first item ``item`` refuses; None when it admits them all."""
        for v in value:
            if (problem := self.item.problem(v)) is not None:
                return f"every {self.noun} {problem}"
        return None


@dataclass(frozen=True)
class Rule:
    """Admits the values ``test`` accepts; ``says`` is what the others are told ("expected
    host:port")."""

    test: Callable[[Any], bool]
    says: str

    def problem(self, value: Any) -> str | None:
        """``says`` when ``test`` refuses ``value``, None otherwise."""
        return None if self.test(value) else self.says


Constraint = Range | Each | Rule


@dataclass(frozen=True)
class OrEmpty:
    """The empty string is admitted besides what the other marks admit; the field's
    documentation says what it stands for ("empty: same as dtype")."""


OR_EMPTY = OrEmpty()


@dataclass(frozen=True)
class UrlPasswordSecret:
    """The password part of this URL field is a secret: wherever a config is written out
    (config.toml, exports, 'config print') it reads ``***``."""


URL_PASSWORD_SECRET = UrlPasswordSecret()

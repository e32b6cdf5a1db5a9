"""Allowed ranges of numeric settings, declared next to each dataclass field.

A field says what it accepts where it is defined, beside its docstring::

    dim: int = field(default=64, metadata=at_least(1))
    \"\"\"Hidden size of the residual stream.\"\"\"

and :func:`range_problems` walks any tree of dataclasses and returns every value outside its
field's range, with the key as the user types it (``model.dim``). The CLI refuses the first one
before any process starts; library classes (the model arguments, the parallelize options) declare
their ranges the same way, so the CLI schema that composes them inherits them.

A ``null`` passes wherever the field's type allows None; a list is checked element by element;
a float must be finite. Torch-free and Hydra-free.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Iterator
from typing import Any, NamedTuple

RANGE_KEY = "fsdp_cli.range"


class Range(NamedTuple):
    """``low <= value <= high`` (either bound open or absent), or one of ``also``.

    (A named tuple rather than a dataclass: every config-only command creates this type, and a
    frozen dataclass costs ten times as much to define.)"""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    """The lower bound itself is excluded (``> 0``)."""
    high_open: bool = False
    also: tuple[Any, ...] = ()
    """Other accepted values (``"auto"``)."""
    hint: str | None = None

    def accepts(self, value: Any) -> bool:
        if any(value is a or (type(value) is type(a) and value == a) for a in self.also):
            return True
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        """``1 or more``, ``> 0``, ``in [0, 1)``, ``0..4294967295``; with the extra values."""
        if self.low is not None and self.high is not None:
            if self.low_open or self.high_open:
                text = f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}{')' if self.high_open else ']'}"
            else:
                text = f"{_num(self.low)}..{_num(self.high)}"
        elif self.low is not None:
            text = f"> {_num(self.low)}" if self.low_open else f"{_num(self.low)} or more"
        elif self.high is not None:
            text = f"< {_num(self.high)}" if self.high_open else f"{_num(self.high)} or less"
        else:
            text = "any finite number"
        extra = ", ".join(str(a) for a in self.also)
        return f"{text}, or {extra}" if extra else text

    def problem(self) -> str:
        """What a value outside the range is told (the wording the CLI's errors have always used)."""
        if self.high is None and self.low is not None and not self.also:
            if self.low_open and self.low == 0:
                return "must be positive"
            if not self.low_open and self.low == 0:
                return "must be a finite number >= 0"
            if not self.low_open:
                return f"must be at least {_num(self.low)}"
        return f"must be {self.describe()}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def at_least(low: float, *, also: tuple[Any, ...] = (), hint: str | None = None) -> dict[str, Range]:
    """``low`` or more (field metadata)."""
    return {RANGE_KEY: Range(low=low, also=also, hint=hint)}


def positive(*, hint: str | None = None) -> dict[str, Range]:
    """Greater than 0 (field metadata)."""
    return {RANGE_KEY: Range(low=0, low_open=True, hint=hint)}


def between(
    low: float, high: float, *, high_open: bool = False, low_open: bool = False, hint: str | None = None
) -> dict[str, Range]:
    """Within [low, high] (each end open when asked) (field metadata)."""
    return {RANGE_KEY: Range(low=low, high=high, low_open=low_open, high_open=high_open, hint=hint)}


def field_range(field: dataclasses.Field[Any]) -> Range | None:
    return field.metadata.get(RANGE_KEY)


class RangeProblem(NamedTuple):
    key: str
    value: Any
    range: Range
    nullable: bool

    def allowed(self) -> str:
        text = self.range.describe()
        return f"{text}, or null" if self.nullable else text


def range_problems(node: Any, prefix: str = "") -> Iterator[RangeProblem]:
    """Every field value under ``node`` (a dataclass instance) outside its declared range."""
    hints = typing.get_type_hints(type(node))
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            yield from range_problems(value, prefix=f"{key}.")
            continue
        rng = field_range(f)
        if rng is None:
            continue
        nullable = accepts_none(hints.get(f.name))
        if value is None and nullable:
            continue
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if not all(rng.accepts(v) for v in values):
            yield RangeProblem(key, value, rng, nullable)


def accepts_none(hint: Any) -> bool:
    if hint is Any:
        return False
    return type(None) in typing.get_args(hint) if _is_union(hint) else hint is type(None)


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def is_numeric(hint: Any) -> bool:
    """int or float (optionally None, or a list of them); bool is not a number here."""
    if _is_union(hint):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return len(args) == 1 and is_numeric(args[0])
    if typing.get_origin(hint) in (list, tuple):
        return all(is_numeric(a) for a in typing.get_args(hint) if a is not Ellipsis)
    return hint in (int, float)

"""The one checked reader for numbers that come from files: finite, in range, of the right type.

Why one reader: a number read from a file someone else wrote (a run's metrics, a fleet's FLOP/s, a
checkpoint's step) used to be checked where it was used, when it was.  Each place missed a case: an
integer past 1e308 (`float()` raises OverflowError), a subnormal loss (`math.log` of it is fine, but
`1 / x` is infinite and a chart's axis divides by a span of 0), a subnormal FLOP/s (ZeroDivisionError in
the step cost model), `true` where a count belongs (bool is an int in Python), a list where a number
belongs (TypeError).  Every reader now asks this module, which says in words what is wrong, so each
caller turns the answer into a diagnostic (a fleet) or a note (a run's report) and never a traceback.
"""
from __future__ import annotations

import math
import sys
from typing import Any

from vgraph.base.diagnostics import quote

__all__ = ["NumberError", "checked_number", "number_or_none", "is_number", "SMALLEST_NORMAL"]

SMALLEST_NORMAL = sys.float_info.min  # 2.2e-308: below it (and above 0) a float is subnormal


class NumberError(ValueError):
    """What is wrong with a value that should be a number, in words a message can quote."""


def checked_number(value: Any, what: str = "value", *, integer: bool = False, low: float | None = None,
                   high: float | None = None) -> int | float:
    """`value` if it is a number `what` may be, else NumberError saying why.

    A number is an int or a float, never a bool or a string; `integer` asks for an int (3.0 is not
    one: a file that writes a step as 3.0 was not written by us).  A float must be finite and not
    subnormal (0 is fine); an int must fit a float when no `high` bounds it.  `low` and `high` are
    inclusive bounds.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        kind = "true/false" if isinstance(value, bool) else type(value).__name__
        raise NumberError(f"{what} must be {'an integer' if integer else 'a number'}, got {kind} "
                          f"{quote(value, 40)}")
    if isinstance(value, float):
        if integer:
            raise NumberError(f"{what} must be an integer, got {quote(value, 40)}")
        if not math.isfinite(value):
            raise NumberError(f"{what} must be finite, got {value!r}")
        if value != 0 and abs(value) < SMALLEST_NORMAL:
            raise NumberError(f"{what} {value!r} is subnormal (closer to 0 than any normal float); "
                              f"no measurement or setting is that small")
    elif high is None and abs(value) > sys.float_info.max:  # int beyond every float: float(value) overflows
        raise NumberError(f"{what} has {len(str(abs(value)))} digits; beyond any float")
    if low is not None and value < low:
        raise NumberError(f"{what} must be at least {low:g}, got {_shown(value)}")
    if high is not None and value > high:
        raise NumberError(f"{what} must be at most {high:g}, got {_shown(value)}")
    return value


def number_or_none(value: Any, *, integer: bool = False, low: float | None = None,
                   high: float | None = None) -> int | float | None:
    """`checked_number`'s value, or None where it would refuse (a reader that skips what it cannot use)."""
    try:
        return checked_number(value, integer=integer, low=low, high=high)
    except NumberError:
        return None


def is_number(value: Any) -> bool:
    """Whether `value` is a usable number: int or float, not bool, finite, not subnormal, within float."""
    return number_or_none(value) is not None


def _shown(value: int | float) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} digits)"

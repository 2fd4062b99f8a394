"""Argument checks shared by the config, the draft views, the torch-free planner and calibration:
``ValueError`` naming the value, never ``assert`` (a bottom-level module: it imports nothing of the library)."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_int", "check_number", "is_int"]


def is_int(value: Any) -> bool:
    """True for an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """Return ``value`` if it is an int (not a bool) ``>= minimum``, else raise ``ValueError``."""
    if type(value) is int and value >= minimum:  # the common case first: the planner checks in its loops
        return value
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
    return value


def check_number(name: str, value: Any, *, allow_zero: bool = False) -> float:
    """Return ``value`` if it is a finite number ``> 0`` (``>= 0`` with ``allow_zero``), else raise ``ValueError``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and (value >= 0 if allow_zero else value > 0)):
        raise ValueError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value!r}.")
    return float(value)

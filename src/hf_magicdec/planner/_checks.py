"""Argument checks shared by the cost model: ``ValueError`` naming the value, never ``assert``."""

from __future__ import annotations

import math
from typing import Any

from ..checks import check_int

__all__ = ["check_int", "check_number"]


def check_number(name: str, value: Any, *, allow_zero: bool = False) -> float:
    """Return ``value`` if it is a finite number ``> 0`` (``>= 0`` with ``allow_zero``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and (value >= 0 if allow_zero else value > 0)):
        raise ValueError(f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value!r}.")
    return float(value)

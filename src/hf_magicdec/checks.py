"""The one int check, shared by :class:`~hf_magicdec.MagicDecConfig`, the draft views and the
torch-free planner (a bottom-level module: it imports nothing of the library)."""

from __future__ import annotations

from typing import Any

__all__ = ["check_int", "is_int"]


def is_int(value: Any) -> bool:
    """True for an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """Return ``value`` if it is an int (not a bool) ``>= minimum``, else raise ``ValueError``."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
    return value

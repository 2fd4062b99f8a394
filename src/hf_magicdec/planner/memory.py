"""The acceptance memory: ``(draft key, budget) -> (accepted, drafted)`` per live model, over this
process's generations, for the next plan. Keyed by the model through weak references (entries die
with it, never inherited through a reused ``id()``), at most :data:`MAX_ENTRIES_PER_MODEL` per model
(least recently used dropped). Draft keys (:func:`draft_key`): ``snapkv``, ``<view>@<format>`` for
quantized weights, ``model:<draft model>#<serial>:<view>`` for a separate draft model.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from typing import Any

__all__ = ["MAX_ENTRIES_PER_MODEL", "draft_key", "forget_acceptance", "observed_acceptance", "record_acceptance"]

MAX_ENTRIES_PER_MODEL = 64

_OBSERVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Serial numbers naming models in draft keys: never reused.
_SERIALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NEXT_SERIAL = itertools.count(1)
_LOCK = threading.Lock()


def _model_key(model: Any) -> str:
    """A name for ``model`` that no other model of this process ever gets (a serial number, not ``id()``)."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    with _LOCK:
        try:
            serial = _SERIALS.get(model)
            if serial is None:
                serial = _SERIALS[model] = next(_NEXT_SERIAL)
        except TypeError:  # not weak-referenceable: a name of its own, not remembered
            serial = f"u{next(_NEXT_SERIAL)}"
    return f"{name}#{serial}"


def draft_key(draft: str, draft_model: Any = None, draft_weights: str = "full") -> str:
    """The name α is recorded and planned under (see the module docstring)."""
    if draft_model is not None:
        return f"model:{_model_key(draft_model)}:{draft}"
    return draft if draft_weights in ("full", "auto") else f"{draft}@{draft_weights}"


def record_acceptance(model: Any, draft: str, budget: int, accepted: int, drafted: int) -> None:
    """Remember what a finished generation measured."""
    if drafted <= 0:
        return
    key = (draft, budget)
    with _LOCK:
        try:
            memory = _OBSERVED.get(model)
            if memory is None:
                memory = _OBSERVED[model] = OrderedDict()
        except TypeError:  # not weak-referenceable: nothing is remembered for it
            return
        a, d = memory.pop(key, (0, 0))
        memory[key] = (a + accepted, d + drafted)
        while len(memory) > MAX_ENTRIES_PER_MODEL:
            memory.popitem(last=False)


def observed_acceptance(model: Any, draft: str, budget: int) -> float | None:
    """What earlier generations of this model measured for this draft key and budget, or None."""
    with _LOCK:
        try:
            memory = _OBSERVED.get(model)
        except TypeError:
            return None
        a, d = memory.get((draft, budget), (0, 0)) if memory is not None else (0, 0)
    return a / d if d else None


def forget_acceptance(model: Any = None) -> None:
    """Drop the acceptance memory of ``model`` (all models when None): plans start from the prior again."""
    with _LOCK:
        if model is None:
            _OBSERVED.clear()
        else:
            _OBSERVED.pop(model, None)

"""Draft views: which part of the KV cache the draft attends to.

Add a policy by subclassing :class:`DraftView` and calling :func:`register_view`.
"""

from __future__ import annotations

from .base import DraftView, ScoreContext
from .dynamic import DynamicView
from .full import FullView
from .snapkv import SnapKVView, snapkv_scores
from .streamingllm import StreamingLLMView

_VIEWS: dict[str, DraftView] = {}


def register_view(view: DraftView) -> DraftView:
    """Make ``view`` available as ``draft=view.name``. Returns it (usable as a decorator on instances)."""
    if not view.name:
        raise ValueError(f"{type(view).__name__} must set a non-empty `name`.")
    _VIEWS[view.name] = view
    return view


def get_view(name: str) -> DraftView:
    """The registered view called ``name``."""
    try:
        return _VIEWS[name]
    except KeyError:
        raise ValueError(f"Unknown draft view {name=!r}; choose one of {sorted(_VIEWS)}.") from None


def available_views() -> tuple[str, ...]:
    """Names of the registered draft views."""
    return tuple(_VIEWS)


for _view in (StreamingLLMView(), SnapKVView(), FullView(), DynamicView()):
    register_view(_view)

__all__ = [
    "DraftView",
    "DynamicView",
    "FullView",
    "ScoreContext",
    "SnapKVView",
    "StreamingLLMView",
    "available_views",
    "get_view",
    "register_view",
    "snapkv_scores",
]

"""Draft views: which part of the KV cache the draft attends to.

A view is a small frozen dataclass owning its options, e.g. ``SnapKV(window=16)``. The registry
maps names to view classes (or to instances whose fields are then the defaults), so that
``draft="snapkv", window=16`` and ``draft=SnapKV(window=16)`` mean the same.

Add a policy by subclassing :class:`DraftView` (a ``@dataclass(frozen=True)`` whose fields are its
options) and calling :func:`register_view`.
"""

from __future__ import annotations

import dataclasses
import difflib

from .attended import AttendedPages, AttendedPageSelection
from .base import DraftView, RowState, ScoreContext, ViewCache
from .dynamic import DynamicPages, PageSelection
from .full import FullKV
from .snapkv import SnapKV, snapkv_scores
from .streamingllm import StreamingLLM

# name -> a DraftView subclass (built with the options get_view receives) or an instance (its
# fields are the defaults, get_view replaces the ones it receives).
_VIEWS: dict[str, type[DraftView] | DraftView] = {}


def _view_class(entry: type[DraftView] | DraftView) -> type[DraftView]:
    return entry if isinstance(entry, type) else type(entry)


def register_view(view: type[DraftView] | DraftView) -> type[DraftView] | DraftView:
    """Make ``view`` available as ``draft=view.name``.

    Parameters
    ----------
    view : a :class:`DraftView` subclass or instance
        A class: ``get_view(name, **options)`` builds ``view(**options)``. An instance: its fields
        are the defaults and ``get_view`` replaces the options it is given.

    Returns
    -------
    ``view`` (so that it can decorate a class).
    """
    cls = _view_class(view)
    if not issubclass(cls, DraftView):
        raise TypeError(f"register_view takes a DraftView subclass or instance, got {view!r}.")
    if not cls.name:
        raise ValueError(f"{cls.__name__} must set a non-empty `name`.")
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__} must be a dataclass (its fields are its options).")
    _VIEWS[cls.name] = view
    return view


def get_view(name: str, **options) -> DraftView:
    """The registered view called ``name``, with ``options`` (its dataclass fields; the others
    keep their defaults).

    Raises
    ------
    ValueError
        For an unknown name, an option the view does not have, or a bad option value.
    """
    try:
        entry = _VIEWS[name]
    except (KeyError, TypeError):
        raise ValueError(f"Unknown draft view {name=!r}; choose one of {sorted(_VIEWS)}.") from None
    own = _view_class(entry).option_names()
    wrong = sorted(set(options) - set(own))
    if wrong:
        raise ValueError(f"The {name!r} draft view has no option(s) {wrong}{likely_names(wrong, own)}; its options: "
                         f"{sorted(own)}.")
    if isinstance(entry, type):
        return entry(**options)
    return dataclasses.replace(entry, **options) if options else entry


def likely_names(wrong, known) -> str:
    """``" (did you mean 'window'?)"`` for the names of ``wrong`` close to one of ``known``, else ``""``."""
    guesses = {w: difflib.get_close_matches(w, list(known), n=1, cutoff=0.75) for w in wrong}
    pairs = {w: m[0] for w, m in guesses.items() if m}
    if len(pairs) == 1 and len(guesses) == 1:
        return f" (did you mean {next(iter(pairs.values()))!r}?)"
    return f" (did you mean {', '.join(f'{m!r} for {w!r}' for w, m in pairs.items())}?)" if pairs else ""


def view_option_names(name: str | None = None) -> tuple[str, ...]:
    """The options of the registered view ``name``, or (None) of every registered view."""
    if name is not None:
        if name not in _VIEWS:
            raise ValueError(f"Unknown draft view {name=!r}; choose one of {sorted(_VIEWS)}.")
        return _view_class(_VIEWS[name]).option_names()
    return tuple(dict.fromkeys(o for entry in _VIEWS.values() for o in _view_class(entry).option_names()))


def available_views() -> tuple[str, ...]:
    """Names of the registered draft views."""
    return tuple(_VIEWS)


for _view in (StreamingLLM, SnapKV, FullKV, DynamicPages, AttendedPages):
    register_view(_view)

__all__ = [
    "AttendedPageSelection",
    "AttendedPages",
    "DraftView",
    "DynamicPages",
    "FullKV",
    "PageSelection",
    "RowState",
    "ScoreContext",
    "SnapKV",
    "StreamingLLM",
    "ViewCache",
    "available_views",
    "get_view",
    "likely_names",
    "register_view",
    "snapkv_scores",
    "view_option_names",
]

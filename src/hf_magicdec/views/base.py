"""The draft-view interface.

A draft view decides which cached tokens the draft attends to. Every view has the same layout
per layer, row and KV head::

    [ static selection (``static_slots``) | rolling recent window (``window_slots``) ]

The static part is chosen once after prefill by :meth:`DraftView.score` (higher score = kept);
the rolling window starts with the last prompt tokens and then receives the *target* KV of every
committed token, evicting the oldest, so the budget never grows however long the generation.
Selection (masking, top-k, gather) is generic and lives in :mod:`hf_magicdec.engine.cache`: a new policy
is one small subclass that only scores tokens.

A view is a small frozen dataclass that owns its options (``SnapKV(window=16)``): its fields are
its options, validated in ``__post_init__``; its geometry takes the budget and γ explicitly and
needs no torch, so the planner asks the view itself which (budget, γ) fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Sequence

import torch

from ..checks import is_int
from ..defaults import MAX_GAMMA


def require_int(name: str, value: Any) -> None:
    """Raise ``ValueError`` (naming ``name`` and the bad value) unless ``value`` is an int; for the
    ``__post_init__`` of views."""
    if not is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")


def check_sizes(budget: Any, gamma: Any) -> None:
    """Raise ``ValueError`` unless ``budget >= 1`` and ``0 <= gamma <= MAX_GAMMA`` are ints."""
    if not is_int(budget) or budget < 1:
        raise ValueError(f"draft_budget must be an int >= 1, got {budget!r}.")
    if not is_int(gamma) or not 0 <= gamma <= MAX_GAMMA:
        raise ValueError(f"gamma must be an int in [0, {MAX_GAMMA}], got {gamma!r}.")


class ViewCache(Protocol):
    """What a view with per-row state reads of the engine's cache
    (:class:`~hf_magicdec.engine.cache.MagicDecCache`), and the one write it may ask for.

    Attributes
    ----------
    geometry : the draft views' slot layout (``static_slots``, ``static_count [B]``,
        ``static_candidates [B]`` …; :class:`~hf_magicdec.engine.cache.DraftGeometry`).
    pad, lengths : ``[B]`` left padding and committed slots of each row.
    layers : per layer, ``keys`` / ``values`` ``[B, Hkv, capacity, D]`` (the full KV).
    layer_groups : the layers whose buffers are stacked together (same device and head shape), as
        lists of layer indices: one :meth:`replace_static_group` serves a whole group.
    """

    geometry: Any
    pad: torch.Tensor
    lengths: torch.Tensor
    layers: Sequence[Any]
    layer_groups: Sequence[Sequence[int]]

    def replace_static(self, layer_idx: int, slots: torch.Tensor, where: torch.Tensor, start: int = 0) -> None:
        """View slots ``[start, start + n)`` of layer ``layer_idx`` take the full KV at ``slots
        [B, Hkv, n]`` where ``where`` holds."""

    def replace_static_group(self, group: int, slots: torch.Tensor, where: torch.Tensor, start: int = 0) -> None:
        """As :meth:`replace_static` for every layer of ``layer_groups[group]`` at once: ``slots
        [L, B, Hkv, n]`` in the group's layer order, ``where`` broadcastable to ``[B, Hkv, n]``."""

    def full_layout(self, rows: torch.Tensor) -> None:
        """Rows (``[B]`` bool) whose static part holds fewer than its slots (their prompt fitted the
        view) get the full layout: the window its own slots with the latest tokens; the static part
        is then the caller's to fill (``replace_static``)."""


class RowState:
    """Per-row state kept beside the engine's cache (a view's page summaries or chosen pages, the
    refresh policy's query rings), attached with ``cache.attach(state)``. The cache calls every
    method below at the moment its docstring names; the defaults do nothing, so a row state
    overrides only what it needs."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Rows left the batch: keep only ``rows [b']`` (indices into the current rows, in order)."""

    def on_draft_query(self, cache: "ViewCache", layer_idx: int, query: torch.Tensor, scaling: float | None) -> None:
        """Before the attention of layer ``layer_idx`` in a draft forward: ``query [B, H, q, D]``."""

    def on_verify_query(self, cache: "ViewCache", layer_idx: int, query: torch.Tensor,
                        scaling: float | None) -> None:
        """Before the attention of layer ``layer_idx`` in a verify forward: ``query [B, H, q, D]``."""

    def verify_page_size(self, num_tokens: int) -> int:
        """Pages of keys whose attention mass the verify forward of ``num_tokens`` tokens should
        emit (0: none); asked once per verify forward."""
        return 0

    def on_verify_mass(self, cache: "ViewCache", layer_idx: int, mass: torch.Tensor) -> None:
        """The attention mass ``[B, Hkv, pages]`` (fp32) layer ``layer_idx``'s verify attention emitted."""

    def on_commit(self, cache: "ViewCache") -> None:
        """After every commit of verified tokens."""


@dataclass
class ScoreContext:
    """What a view may look at when scoring one layer's prompt tokens.

    Attributes
    ----------
    keys : torch.Tensor
        ``[batch, kv_heads, prompt_slots, head_dim]`` post-RoPE prompt keys (left padding
        included; padded slots are never selected).
    valid : torch.Tensor
        ``[batch, prompt_slots]`` bool, True where the slot holds a real prompt token.
    queries : torch.Tensor | None
        ``[batch, heads, window, head_dim]`` post-RoPE queries of the last ``window`` prompt
        positions, when the view asked for them (:meth:`DraftView.observation_window`).
    scaling : float
        The attention softmax scale (1/√head_dim for most models).
    """

    keys: torch.Tensor
    valid: torch.Tensor
    queries: torch.Tensor | None
    scaling: float


@dataclass(frozen=True)
class DraftView:
    """Base class of draft views: a frozen dataclass whose fields are the view's options.

    Subclasses are ``@dataclass(frozen=True)``, set :attr:`name`, validate their fields in
    ``__post_init__`` and implement :meth:`static_slots`, :meth:`window_slots` and :meth:`score`;
    :meth:`check` adds the view's own constraints on the budget. Register them with
    :func:`hf_magicdec.register_view` to use them as ``draft="<name>"``.
    """

    name: ClassVar[str] = ""
    #: True for views that re-select their static part from each draft step's query (the state
    #: :meth:`prepare` returns does it, before every draft attention).
    query_aware: ClassVar[bool] = False
    #: True for views that re-choose their static part themselves during generation (query-aware
    #: views, the verification-guided view): refresh_every / refresh_below do not apply to them.
    reselects: ClassVar[bool] = False

    # ------------------------------------------------------------------ options
    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The view's options: its dataclass fields."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    def options(self) -> dict[str, Any]:
        """``{option: value}`` of this view."""
        return {name: getattr(self, name) for name in self.option_names()}

    # ------------------------------------------------------------------ geometry (torch-free)
    def check(self, budget: int, gamma: int) -> None:
        """Raise ``ValueError`` if this view cannot hold ``budget`` tokens with ``gamma`` draft tokens
        per step (the rolling window must take the γ + 1 tokens a step commits)."""
        check_sizes(budget, gamma)
        window = self.window_slots(budget, gamma, prompt_len=0, max_new_tokens=0)
        if window < gamma + 1:
            raise ValueError(
                f"The {self.name!r} draft view keeps a rolling window of {window} tokens, which must hold at "
                f"least gamma + 1 = {gamma + 1} tokens: raise draft_budget or lower gamma."
            )

    def fits(self, budget: int, gamma: int) -> bool:
        """Whether :meth:`check` accepts ``(budget, gamma)``."""
        try:
            self.check(budget, gamma)
        except ValueError:
            return False
        return True

    def bounded_budget(self, budget: int, gamma: int, context: int) -> int:
        """``budget``, or, when it exceeds the ``context`` a call can ever hold (prompt slots + new
        tokens), the smallest budget from ``context`` up that this view accepts: a view that large
        already holds every token, so a larger one only allocates memory."""
        if budget <= context:
            return budget
        bounded = context
        while bounded < budget and not self.fits(bounded, gamma):
            bounded += 1
        return bounded

    def static_slots(self, budget: int, prompt_len: int) -> int:
        """Number of statically selected tokens per row and KV head."""
        raise NotImplementedError

    def window_slots(self, budget: int, gamma: int, prompt_len: int, max_new_tokens: int) -> int:
        """Size of the rolling recent window per row and KV head."""
        raise NotImplementedError

    def observation_window(self) -> int:
        """How many trailing prompt queries :meth:`score` needs (0: none)."""
        return 0

    # ------------------------------------------------------------------ selection (torch)
    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """Score prompt tokens for the static part.

        Returns
        -------
        torch.Tensor
            ``[batch, kv_heads, prompt_slots]`` finite scores; the top ``static_slots`` candidates
            (excluding padding and the tokens already in the rolling window) are kept.
        """
        raise NotImplementedError

    def prepare(self, cache: ViewCache, prompt_slots: int):
        """Called once after the views are built (``cache``: the engine's cache, read as
        :class:`ViewCache` says). A view that keeps per-row state returns it as an object with ``select_rows(rows)``
        (and, for a query-aware view, ``on_draft_query(cache, layer_idx, query [B, H, 1, D],
        scaling)``, called before each draft attention, which rewrites the static part through
        ``cache.replace_static``); the cache keeps it aligned with its rows. Default: None."""
        return None

"""The draft-view interface.

A draft view decides which cached tokens the draft attends to. Every view has the same layout
per layer, row and KV head::

    [ static selection (``static_slots``) | rolling recent window (``window_slots``) ]

The static part is chosen once after prefill by :meth:`DraftView.score` (higher score = kept);
the rolling window starts with the last prompt tokens and then receives the *target* KV of every
committed token, evicting the oldest, so the budget never grows however long the generation.
Selection (masking, top-k, gather) is generic and lives in :mod:`hf_magicdec.cache`: a new policy
is one small subclass that only scores tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from ..config import MagicDecConfig


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
        positions, when the view asked for them (:attr:`DraftView.observation_window`).
    scaling : float
        The attention softmax scale (1/√head_dim for most models).
    config : MagicDecConfig
        The generation's configuration.
    """

    keys: torch.Tensor
    valid: torch.Tensor
    queries: torch.Tensor | None
    scaling: float
    config: "MagicDecConfig"


class DraftView:
    """Base class of draft views. Subclasses set :attr:`name` and implement :meth:`score`."""

    name: ClassVar[str] = ""
    #: True for views that re-select their static part from each draft step's query (:meth:`refill`).
    query_aware: ClassVar[bool] = False

    def check_config(self, config: "MagicDecConfig") -> None:
        """Raise ``ValueError`` if ``config`` cannot describe this view."""
        window = self.window_slots(config, prompt_len=0, max_new_tokens=0)
        if window < config.gamma + 1:
            raise ValueError(
                f"The {self.name!r} draft view keeps a rolling window of {window} tokens, which must hold at "
                f"least gamma + 1 = {config.gamma + 1} tokens: raise draft_budget or lower gamma."
            )

    def static_slots(self, config: "MagicDecConfig", prompt_len: int) -> int:
        """Number of statically selected tokens per row and KV head."""
        raise NotImplementedError

    def window_slots(self, config: "MagicDecConfig", prompt_len: int, max_new_tokens: int) -> int:
        """Size of the rolling recent window per row and KV head."""
        raise NotImplementedError

    def observation_window(self, config: "MagicDecConfig") -> int:
        """How many trailing prompt queries :meth:`score` needs (0: none)."""
        return 0

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """Score prompt tokens for the static part.

        Returns
        -------
        torch.Tensor
            ``[batch, kv_heads, prompt_slots]`` finite scores; the top ``static_slots`` candidates
            (excluding padding and the tokens already in the rolling window) are kept.
        """
        raise NotImplementedError

    def prepare(self, cache, config: "MagicDecConfig", prompt_slots: int) -> None:
        """Called once after the views are built: precompute what :meth:`refill` needs (per-row
        tensors go in ``cache.row_state``, which follows ``select_rows``). Default: nothing."""

    def refill(self, cache, layer_idx: int, query: torch.Tensor, scaling: float | None) -> None:
        """Query-aware views only: rewrite layer ``layer_idx``'s static part from the draft step's
        ``query`` (``[B, H, 1, D]``), called by the attention function before the draft attention."""

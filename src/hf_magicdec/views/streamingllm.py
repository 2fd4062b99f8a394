"""StreamingLLM draft view (Xiao et al., 2023, arXiv 2309.17453): attention sinks + recent window."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..defaults import DEFAULT_SINK_TOKENS
from .base import DraftView, ScoreContext, check_sizes, require_int


@dataclass(frozen=True)
class StreamingLLM(DraftView):
    """Keep the first ``sink_tokens`` prompt tokens and the ``draft_budget - sink_tokens`` most
    recent tokens. Keys keep their original RoPE positions (sliced from the target cache).

    Parameters
    ----------
    sink_tokens : int
        The first tokens of the prompt that always stay in the view (>= 0).
    """

    name = "streamingllm"

    sink_tokens: int = DEFAULT_SINK_TOKENS

    def __post_init__(self) -> None:
        require_int("sink_tokens", self.sink_tokens)
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got sink_tokens={self.sink_tokens}.")

    def check(self, budget: int, gamma: int) -> None:
        check_sizes(budget, gamma)
        if self.sink_tokens >= budget:
            raise ValueError(
                f"streamingllm needs draft_budget > sink_tokens, got draft_budget={budget} and "
                f"sink_tokens={self.sink_tokens}."
            )
        super().check(budget, gamma)

    def static_slots(self, budget: int, prompt_len: int) -> int:
        return self.sink_tokens

    def window_slots(self, budget: int, gamma: int, prompt_len: int, max_new_tokens: int) -> int:
        return budget - self.sink_tokens

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        batch, kv_heads, slots, _ = ctx.keys.shape
        # Earliest tokens score highest: the sinks.
        order = -torch.arange(slots, device=ctx.keys.device, dtype=torch.float32)
        return order.expand(batch, kv_heads, slots)



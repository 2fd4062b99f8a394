"""StreamingLLM draft view (Xiao et al., 2023, arXiv 2309.17453): attention sinks + recent window."""

from __future__ import annotations

import torch

from .base import DraftView, ScoreContext


class StreamingLLMView(DraftView):
    """Keep the first ``sink_tokens`` prompt tokens and the ``draft_budget - sink_tokens`` most
    recent tokens. Keys keep their original RoPE positions (sliced from the target cache)."""

    name = "streamingllm"

    def check_config(self, config) -> None:
        if config.sink_tokens >= config.draft_budget:
            raise ValueError(
                f"streamingllm needs draft_budget > sink_tokens, got {config.draft_budget=} and {config.sink_tokens=}."
            )
        super().check_config(config)

    def static_slots(self, config, prompt_len: int) -> int:
        return config.sink_tokens

    def window_slots(self, config, prompt_len: int, max_new_tokens: int) -> int:
        return config.draft_budget - config.sink_tokens

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        batch, kv_heads, slots, _ = ctx.keys.shape
        # Earliest tokens score highest: the sinks.
        order = -torch.arange(slots, device=ctx.keys.device, dtype=torch.float32)
        return order.expand(batch, kv_heads, slots)

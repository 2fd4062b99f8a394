"""The ``full`` draft view: the draft sees the whole cache. Every draft token must be accepted
(up to floating-point ties), which makes it the end-to-end sanity check of the engine."""

from __future__ import annotations

from dataclasses import dataclass

from .base import DraftView


@dataclass(frozen=True)
class FullKV(DraftView):
    """Everything goes into a rolling window large enough to never evict (no options; the budget
    is ignored)."""

    name = "full"

    def static_slots(self, budget: int, prompt_len: int) -> int:
        return 0

    def window_slots(self, budget: int, gamma: int, prompt_len: int, max_new_tokens: int) -> int:
        return max(prompt_len + max_new_tokens + gamma + 1, gamma + 1)



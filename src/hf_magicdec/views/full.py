"""The ``full`` draft view: the draft sees the whole cache. Every draft token must be accepted
(up to floating-point ties), which makes it the end-to-end sanity check of the engine."""

from __future__ import annotations

from .base import DraftView


class FullView(DraftView):
    """Everything goes into a rolling window large enough to never evict."""

    name = "full"

    def check_config(self, config) -> None:
        return None

    def static_slots(self, config, prompt_len: int) -> int:
        return 0

    def window_slots(self, config, prompt_len: int, max_new_tokens: int) -> int:
        return max(prompt_len + max_new_tokens + config.gamma + 1, config.gamma + 1)

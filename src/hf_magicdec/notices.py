"""What a call decided that changes what the user gets, said where they see it.

Decisions that alter speed or memory but never the tokens (the planner chose plain decoding, the
draft weights, a quantized draft was built) are logged at INFO; the ones a user would otherwise believe did
not happen are also said once as a :class:`MagicDecWarning` (a ``UserWarning``), which Python
shows once per place and message, so a training loop that repeats the same call sees it once.
Silence them with ``warnings.filterwarnings("ignore", category=hf_magicdec.MagicDecWarning)``.
"""

from __future__ import annotations

import warnings

__all__ = ["MagicDecWarning", "notice"]


class MagicDecWarning(UserWarning):
    """A decision of ``speculative="magicdec"`` that the user should see (fallback to plain
    decoding, options that were not used, a one-time cost)."""


def notice(message: str, stacklevel: int = 3) -> None:
    """Say ``message`` as a :class:`MagicDecWarning`."""
    warnings.warn(message, MagicDecWarning, stacklevel=stacklevel)

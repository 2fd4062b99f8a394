"""What a call decided that changes what the user gets, said where they see it.

Decisions that alter speed or memory but never the tokens (the planner chose plain decoding, the
draft weights, a quantized draft was built) are logged at INFO; the ones a user would otherwise believe did
not happen are also said once as a :class:`MagicDecWarning` (a ``UserWarning``), which Python
shows once per place and message, so a training loop that repeats the same call sees it once.
Silence them with ``warnings.filterwarnings("ignore", category=hf_magicdec.MagicDecWarning)``.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import warnings

__all__ = ["MagicDecWarning", "notice"]


class MagicDecWarning(UserWarning):
    """A decision of ``speculative="magicdec"`` that the user should see (fallback to plain
    decoding, options that were not used, a one-time cost)."""


def notice(message: str) -> None:
    """Say ``message`` as a :class:`MagicDecWarning`, attributed to the caller's own line: the first
    frame outside this package, transformers, torch and the standard library (where
    ``model.generate`` was called), not a line of the machinery between."""
    warnings.warn(message, MagicDecWarning, stacklevel=_caller_level())


def _internal_dirs() -> tuple[str, ...]:
    dirs = [os.path.dirname(os.path.abspath(__file__)), sysconfig.get_paths()["stdlib"]]
    for name in ("transformers", "torch"):
        module = sys.modules.get(name)
        if getattr(module, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(module.__file__)))
    return tuple(os.path.join(d, "") for d in dirs)


def _caller_level() -> int:
    """``warnings.warn``'s stack level, from :func:`notice`, of the first frame outside :func:`_internal_dirs`
    (the outermost frame if every one is inside)."""
    internal = _internal_dirs()
    frame, level = sys._getframe(2), 2  # notice's caller
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(internal):
        frame, level = frame.f_back, level + 1
    return level

"""Per-token acceptance α: the prior used when it was not measured, and how callers pass it
(measure it with :func:`hf_magicdec.calibration.probe_acceptance` or ``out.speculation.acceptance_rate``)."""

from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = ["default_acceptance", "resolve_acceptance", "BASE_ACCEPTANCE", "DRAFT_MODEL_ACCEPTANCE",
           "DRAFT_MODEL_PREFIX", "QUANTIZED_ACCEPTANCE_DROP", "ATTENDED_PROMPT_LEAD", "ATTENDED_WRITTEN_SHARE",
           "WEIGHTS_SEPARATOR"]

#: α at a budget ≥ 256 and a context ≤ 4K (SmolLM2-135M on Shakespeare;
#: docs/cost_model.md, "Where the constants come from").
BASE_ACCEPTANCE = {"streamingllm": 0.80, "snapkv": 0.85, "attended": 0.93}
#: ``attended``'s lead over SnapKV where the context is all prompt (measured 0.04-0.07; same source).
ATTENDED_PROMPT_LEAD = 0.05
_OTHER = 0.80  # views without their own prior (user-registered ones)
#: Share of the context written by the generation from which ``attended`` gets its full prior (same source).
ATTENDED_WRITTEN_SHARE = 0.25
#: α of a separate draft model ~3x smaller with its full cache (Qwen2.5-Coder-0.5B for 1.5B; same source).
DRAFT_MODEL_ACCEPTANCE = 0.70
DRAFT_MODEL_PREFIX = "model:"
#: Prior drop of α of a self-draft on quantized linear layers (SmolLM2-135M, batch 8, SnapKV; same source).
QUANTIZED_ACCEPTANCE_DROP = {"int8": 0.06, "fp16": 0.0, "int4": 0.10}
WEIGHTS_SEPARATOR = "@"
_REF_BUDGET = 256
_REF_CONTEXT = 4096
_PER_BUDGET_HALVING = 0.05
# MagicDec §4: StreamingLLM-512 on Llama-3.1-8B drops 0.84 → 0.79 from 4K to 64K context.
_PER_CONTEXT_DOUBLING = 0.0125
_FLOOR, _CEIL = 0.05, 0.99


def default_acceptance(draft: str, budget: int, context: float, prompt_len: float | None = None) -> float:
    """Prior per-token acceptance α of view ``draft`` at budget K and context S (tokens; ``prompt_len``
    P of them the prompt, None: all): ``base(draft) − 0.05·log2(256 / K)⁺ − 0.0125·log2(S / 4096)⁺``
    clipped to [0.05, 0.99], ``base`` from :data:`BASE_ACCEPTANCE` (0.80 for other views); ``attended``
    rises from SnapKV's + 0.05 to 0.93 as the generation writes a quarter of the context. 0.99 for a
    view holding the whole context (K ≥ S) or ``full``. ``"<view>@<format>"`` (quantized self-draft):
    minus :data:`QUANTIZED_ACCEPTANCE_DROP`; ``"model:<view>"`` (a separate draft model): × 0.70 / 0.99.
    docs/cost_model.md §4. ValueError for a budget or context <= 0 or a negative ``prompt_len``.
    """
    if not budget > 0:
        raise ValueError(f"budget must be > 0, got {budget=!r}.")
    if not context > 0:
        raise ValueError(f"context must be > 0, got {context=!r}.")
    if prompt_len is not None and not prompt_len >= 0:
        raise ValueError(f"prompt_len must be >= 0 tokens, got {prompt_len=!r}.")
    if WEIGHTS_SEPARATOR in draft:
        view, fmt = draft.rsplit(WEIGHTS_SEPARATOR, 1)
        alpha = default_acceptance(view, budget, context, prompt_len) - QUANTIZED_ACCEPTANCE_DROP.get(fmt, 0.0)
        return min(_CEIL, max(_FLOOR, alpha))
    if draft.startswith(DRAFT_MODEL_PREFIX):
        view = draft[len(DRAFT_MODEL_PREFIX):]
        return DRAFT_MODEL_ACCEPTANCE * default_acceptance(view, budget, context, prompt_len) / _CEIL
    if draft == "full" or budget >= context:
        return _CEIL
    alpha = BASE_ACCEPTANCE.get(draft, _OTHER)
    if draft == "attended":
        written = 0.0 if prompt_len is None else max(0.0, context - prompt_len) / context
        lead = BASE_ACCEPTANCE["attended"] - BASE_ACCEPTANCE["snapkv"]
        alpha = BASE_ACCEPTANCE["snapkv"] + ATTENDED_PROMPT_LEAD
        alpha += (lead - ATTENDED_PROMPT_LEAD) * min(1.0, written / ATTENDED_WRITTEN_SHARE)
    alpha -= _PER_BUDGET_HALVING * max(0.0, math.log2(_REF_BUDGET / budget))
    alpha -= _PER_CONTEXT_DOUBLING * max(0.0, math.log2(context / _REF_CONTEXT))
    return min(_CEIL, max(_FLOOR, alpha))


AcceptanceLike = Any  # None | float | Mapping[str | (str, int), float] | Callable[[str, int, float], float]


def _check_alpha(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"acceptance must be a number in [0, 1], got {value!r} ({where}).")
    return float(value)


def resolve_acceptance(acceptance: AcceptanceLike, draft: str, budget: int, context: float,
                       prompt_len: float | None = None) -> float:
    """α in [0, 1] for one candidate (context in tokens) from ``acceptance``: None, the prior
    (:func:`default_acceptance`, given ``prompt_len``); a number for every candidate; a mapping keyed
    by ``(draft, budget)`` or ``draft`` (the more specific wins, missing keys: the prior); or a callable
    ``f(draft, budget, context) -> α``. ValueError for a supplied α outside [0, 1]."""
    if acceptance is None:
        return default_acceptance(draft, budget, context, prompt_len)
    if callable(acceptance):
        return _check_alpha(acceptance(draft, budget, context), f"returned for {draft}/{budget}")
    if isinstance(acceptance, Mapping):
        for key in ((draft, budget), draft):
            if key in acceptance:
                return _check_alpha(acceptance[key], f"key {key!r}")
        return default_acceptance(draft, budget, context, prompt_len)
    return _check_alpha(acceptance, "scalar")


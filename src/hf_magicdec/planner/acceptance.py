"""Per-token acceptance α: a documented default when it was not measured, and how users pass it.

The default is a prior, not a measurement: measure α on your own prompts (a short
``generate(..., speculative=..., return_dict_in_generate=True)`` gives
``.speculation.acceptance_rate``; :func:`hf_magicdec.calibration.probe_acceptance` does
this) and pass it to the planner.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

__all__ = ["default_acceptance", "resolve_acceptance", "BASE_ACCEPTANCE", "DRAFT_MODEL_ACCEPTANCE",
           "DRAFT_MODEL_PREFIX", "QUANTIZED_ACCEPTANCE_DROP", "ATTENDED_PROMPT_LEAD", "ATTENDED_WRITTEN_SHARE",
           "WEIGHTS_SEPARATOR"]

#: α at a budget of 256 tokens or more and a context of 4K tokens or less. ``attended`` (the view
#: chosen by the verify pass's attention) earns its lead where the generation wrote much of the
#: context (a choice made at prefill goes stale; the verifier's follows): 0.986 (SnapKV 0.863,
#: StreamingLLM 0.924) at 8 × 256-token prompts with 512 new tokens, budget 128, and 0.976 (SnapKV
#: 0.815) at 8 × 256 → 1,024, budget 256 (SmolLM2-135M on Shakespeare, scripts/view_acceptance.py,
#: docs/benchmarks.md). Where the context is the prompt it was level with SnapKV: with int8 draft
#: weights at budget 256 and 128 new tokens, 0.912 vs 0.884 at 8 × 1K, 0.892 vs 0.928 at 8 × 2K,
#: 0.797 vs 0.801 over four batches of 8 × 4K, 0.897 vs 0.858 at 8 × 7,936 (at budget 128 and
#: 8 × 1K it led, 0.818 vs 0.697: a prior on the share alone misses that). Those prompt-only figures
#: predate ``attended`` choosing from the first verification; since then it leads SnapKV there too
#: (over eight batches, budget 256: 0.889 vs 0.836 at 8 × 4K fp16, 0.883 vs 0.829 over eight more,
#: 0.836 vs 0.787 int8, 0.819 vs 0.747 at 8 × 2K fp16; docs/benchmarks.md, "Choosing from the first
#: verification"). So its prior is SnapKV's plus :data:`ATTENDED_PROMPT_LEAD` where the context is
#: the prompt, 0.93 once the generation wrote :data:`ATTENDED_WRITTEN_SHARE` of the context or more,
#: in proportion between (see :func:`default_acceptance`).
BASE_ACCEPTANCE = {"streamingllm": 0.80, "snapkv": 0.85, "attended": 0.93}
#: ``attended``'s lead over SnapKV where the context is all prompt, as measured there: 0.05 at 8 × 4K
#: with either weight format, 0.07 at 8 × 2K, 0.04 at 8 × 7,936 with γ adapted (where it took 7 % less
#: decode time over four batches, more than at 4K).
ATTENDED_PROMPT_LEAD = 0.05
_OTHER = 0.80  # views without their own prior (user-registered ones)
#: Share of the context written by the generation from which ``attended`` gets its full prior. Nothing
#: was measured between a few per cent (the prompt's lead) and a half (the full lead); a quarter keeps
#: the choice measured right at 8 × 256 → 512 (``attended`` 1.43x plain decoding, SnapKV 1.16x),
#: which a half would hand to SnapKV.
ATTENDED_WRITTEN_SHARE = 0.25
#: α of a separate small draft model with its full cache (``draft="model:full"``): a prior for a
#: same-family model about 3x smaller (Qwen2.5-Coder-0.5B drafting for 1.5B measured 0.80 at 4K and
#: 0.64 at 16K on Shakespeare, docs/benchmarks.md). A compressed draft-model view scales it by the
#: view's own prior / 0.99.
DRAFT_MODEL_ACCEPTANCE = 0.70
DRAFT_MODEL_PREFIX = "model:"
#: A self-draft reading quantized copies of the linear layers (``"snapkv@int8"``) drafts from slightly
#: perturbed logits. Prior drop of α against the full-weight draft, as measured on SmolLM2-135M,
#: batch 8, SnapKV, γ = 3 (docs/benchmarks.md): CPU int8 (per-channel weights, activations quantized
#: per call to 7 bits, about 2e-2 relative error per layer) lost 0.054-0.075 at 2K-4K; fp16 weights
#: (2e-4 relative) lost nothing measurable; int4 (weight-only, GPU) is not measured yet and
#: assumed worse than int8. Replaced by the measured α after the first generation, as for every view.
QUANTIZED_ACCEPTANCE_DROP = {"int8": 0.06, "fp16": 0.0, "int4": 0.10}
WEIGHTS_SEPARATOR = "@"
_REF_BUDGET = 256
_REF_CONTEXT = 4096
_PER_BUDGET_HALVING = 0.05
# MagicDec §4: StreamingLLM-512 self-speculation on Llama-3.1-8B drops 0.84 → 0.79 from 4K to 64K
# context, i.e. about 0.0125 per doubling.
_PER_CONTEXT_DOUBLING = 0.0125
_FLOOR, _CEIL = 0.05, 0.99


def default_acceptance(draft: str, budget: int, context: float, prompt_len: float | None = None) -> float:
    """Prior per-token acceptance α of a draft view.

    ``α = base(draft) − 0.05·log2(256 / K)⁺ − 0.0125·log2(S / 4096)⁺``, clipped to
    [0.05, 0.99], where ``base`` is 0.80 for ``streamingllm``, 0.85 for ``snapkv`` (which beats
    StreamingLLM at the same budget in MagicDec §4) and 0.80 for other views; for ``attended``,
    SnapKV's 0.85 plus 0.05 + 0.03·min(1, w / 0.25), where ``w = (S − P) / S`` is the share of the
    context the generation wrote (measured 0.04–0.07 above SnapKV where the context is the prompt,
    0.93 and above on long generations); ``K`` is the budget and ``S`` the context. So α is flat for
    budgets ≥ 256, loses 0.05 per halving below, and falls slowly with context. A view that holds
    the whole context (``K ≥ S``) or the ``full`` sanity view sees everything: 0.99. A self-draft
    on quantized weights (``"<view>@int8"``, ``"<view>@fp16"``, ``"<view>@int4"``) loses
    ``QUANTIZED_ACCEPTANCE_DROP`` (0.06, 0, 0.10) from its view's prior. A separate draft model
    (``draft="model:<view>"``) gets ``DRAFT_MODEL_ACCEPTANCE`` (0.70) times its view's prior / 0.99.

    Parameters
    ----------
    draft : str
        View name.
    budget : int
        Draft budget K, tokens.
    context : float
        Context length S, tokens.
    prompt_len : float, optional
        Tokens of that context that were the prompt, P (None: all of it, nothing generated yet).

    Returns
    -------
    float
        α in [0.05, 0.99].

    Raises
    ------
    ValueError
        If ``budget`` or ``context`` is not positive, or ``prompt_len`` is negative.
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
    """α for one candidate from what the user passed.

    Parameters
    ----------
    acceptance : None, float, Mapping or callable
        ``None``: :func:`default_acceptance`. A number: the same α everywhere. A mapping keyed
        by ``(draft, budget)`` or by ``draft`` (the more specific key wins; missing keys fall
        back to the default). A callable ``f(draft, budget, context) -> α``.
    draft, budget, context :
        The candidate (context in tokens).
    prompt_len : float, optional
        Tokens of the context that were the prompt (for the default; a callable is not given it).

    Returns
    -------
    float
        α in [0, 1].

    Raises
    ------
    ValueError
        If a supplied α is outside [0, 1].
    """
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


"""Ω(γ, α) = (1 − α^(γ+1)) / (1 − α), the speedup Ω / (γ·T_D/T_T + T_V/T_T) (MagicDec §3; the γ
draft steps are summed, each attending to a slightly longer view) and the critical context length."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

from ..checks import check_int
from .acceptance import DRAFT_MODEL_PREFIX, WEIGHTS_SEPARATOR, AcceptanceLike, resolve_acceptance
from .hardware import HardwareSpec
from .modelspec import ModelSpec
from .roofline import draft_steps, target_step, verify_step
from .selection import choice_seconds, selection_seconds

__all__ = ["omega", "speedup", "best_gamma_of", "Estimate", "estimate", "critical_length"]


def omega(gamma: int, alpha: float) -> float:
    """Expected tokens committed per verification, Ω(γ, α) = (1 − α^(γ+1)) / (1 − α) (γ + 1 at α = 1),
    for γ ≥ 0 draft tokens and acceptance α in [0, 1] (else ValueError). ``omega(3, 0.5) == 1.875``."""
    check_int("gamma", gamma, 0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}.")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup(gamma: int, alpha: float, t_target: float, t_draft_total: float, t_verify: float) -> float:
    """Predicted speedup over plain decoding, ``Ω(γ, α) · T_T / (t_draft_total + T_V)``; times in seconds:
    ``t_target`` a plain step, ``t_draft_total`` all γ draft steps (>= 0), ``t_verify`` a verification."""
    for name, value in (("t_target", t_target), ("t_verify", t_verify)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {value!r}.")
    if not t_draft_total >= 0:
        raise ValueError(f"t_draft_total must be >= 0 seconds, got {t_draft_total!r}.")
    return omega(gamma, alpha) * t_target / (t_draft_total + t_verify)


def best_gamma_of(speedups: dict[int, float], off_below: float | None = None) -> tuple[int, float]:
    """``(γ, speedup)`` of the largest speedup in ``{γ: speedup}`` (first on a tie); ``(0, 1.0)``
    (plain decoding) where that is below ``off_below`` (None: never)."""
    gamma = max(speedups, key=speedups.get)
    if off_below is not None and speedups[gamma] < off_below:
        return 0, 1.0
    return gamma, speedups[gamma]


@dataclass(frozen=True)
class Estimate:
    """One candidate (view name, budget, γ) priced at one (batch, context): α, Ω (tokens per
    verification), T_T, mean T_D over the γ draft steps and T_V (seconds), predicted speedup."""

    draft: str
    draft_budget: int
    gamma: int
    acceptance: float
    omega: float
    t_target: float
    t_draft: float
    t_verify: float
    speedup: float
    draft_model: str | None = None  # name of a separate draft model's spec; None: self-speculation
    draft_weights: str = "full"  # the self-draft's linear layers: "full", "int8", "fp16" or "int4"


def estimate(model: ModelSpec, hardware: HardwareSpec, *, batch: int, context: int, draft: Any, budget: int,
             gamma: int, acceptance: AcceptanceLike = None, t_target: float | None = None,
             draft_model: ModelSpec | None = None, draft_weights: str = "full",
             prompt_len: float | None = None) -> Estimate:
    """The :class:`Estimate` of one candidate at ``batch`` rows and ``context`` tokens (S; the search
    uses the mean over the generation).

    ``draft``: a view object (read duck-typed: ``name``, ``query_aware``/``page_size``/``reselects``
    for selection costs) or a name (a static view); α comes from ``acceptance``
    (:func:`~.acceptance.resolve_acceptance`) under its name, ``"model:<view>"`` with a separate
    ``draft_model`` spec (whose forwards are the draft steps) or ``"<view>@<format>"`` with quantized
    ``draft_weights`` (``"int8"``, ``"fp16"``, ``"int4"``: the draft reads those bytes). ``budget``: K,
    tokens. ``t_target``: a precomputed T_T. ``prompt_len``: tokens of the context that were the prompt
    (for the prior; None: all of it).
    """
    view_name = getattr(draft, "name", draft)
    name = view_name if draft_model is None else DRAFT_MODEL_PREFIX + view_name
    if draft_weights != "full":
        if draft_model is not None:
            raise ValueError(f"draft_weights={draft_weights!r} applies to self-speculation, not to a draft model.")
        name += WEIGHTS_SEPARATOR + draft_weights
        draft_model_spec = model.with_weights(draft_weights)
    else:
        draft_model_spec = draft_model
    alpha = resolve_acceptance(acceptance, name, budget, context, prompt_len)
    tt = target_step(model, hardware, batch, context).seconds if t_target is None else t_target
    drafter = model if draft_model_spec is None else draft_model_spec
    td_total = draft_steps(drafter, hardware, batch, context, budget, gamma)
    # Query-aware views (dynamic) re-select every step; views chosen by the verifier (attended) pay at verification.
    td_total += gamma * selection_seconds(drafter, hardware, batch, context, budget, draft)
    tv = verify_step(model, hardware, batch, context, gamma).seconds
    tv += choice_seconds(drafter, hardware, batch, context, budget, draft, gamma + 1)
    return Estimate(draft=view_name, draft_budget=budget, gamma=gamma, acceptance=alpha, omega=omega(gamma, alpha),
                    t_target=tt, t_draft=td_total / gamma, t_verify=tv, speedup=speedup(gamma, alpha, tt, td_total, tv),
                    draft_model=None if draft_model is None else draft_model.name, draft_weights=draft_weights)


def critical_length(model: ModelSpec, hardware: HardwareSpec, batch: int, *, draft: Any = "streamingllm",
                    budget: int = 512, gammas: Iterable[int] = range(1, 9), acceptance: AcceptanceLike = None,
                    threshold: float = 1.0, max_context: int = 1 << 20) -> float:
    """Shortest context (tokens, a float) from which the best γ's speedup reaches ``threshold`` at
    ``batch`` rows, ``math.inf`` if not up to ``max_context``. Scans from ``budget + 1`` in steps of
    ×√2 and bisects the first crossing to 1 %, assuming the speedup rises with context (the draft's KV
    is fixed). ``draft``, ``acceptance`` as in :func:`estimate`; ``gammas`` must not be empty."""
    gammas = tuple(gammas)
    if not gammas:
        raise ValueError("gammas must not be empty.")

    def pays(s: int) -> bool:  # at the best γ
        tt = target_step(model, hardware, batch, s).seconds
        return best_gamma_of({g: estimate(model, hardware, batch=batch, context=s, draft=draft, budget=budget, gamma=g,
                                          acceptance=acceptance, t_target=tt).speedup for g in gammas})[1] >= threshold

    low = budget + 1
    if pays(low):
        return float(low)
    prev, s = low, low
    while s < max_context:
        s = min(max_context, int(math.ceil(s * math.sqrt(2))))
        if pays(s):
            hi, lo = s, prev
            while hi - lo > max(1, lo // 100):
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if pays(mid) else (mid, hi)
            return float(hi)
        prev = s
    return math.inf

"""Expected tokens per verification Ω(γ, α), predicted speedup, and the critical context length.

MagicDec §3::

    Ω(γ, α) = (1 − α^(γ+1)) / (1 − α)                       (γ + 1 when α = 1)
    speedup = Ω(γ, α) / (γ·T_D/T_T + T_V/T_T)

where ``γ·T_D`` is the time of the γ draft steps (each attends to a slightly longer view, so
we sum them instead of multiplying one by γ).
"""

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
    """Expected tokens committed per verification step, Ω(γ, α).

    Parameters
    ----------
    gamma : int
        Draft tokens per step γ ≥ 0.
    alpha : float
        Per-token acceptance α in [0, 1].

    Returns
    -------
    float
        ``(1 − α^(γ+1)) / (1 − α)``, or ``γ + 1`` when α = 1; between 1 and γ + 1.

    Raises
    ------
    ValueError
        If γ < 0 or α outside [0, 1].

    Examples
    --------
    >>> omega(3, 0.5)
    1.875
    """
    check_int("gamma", gamma, 0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}.")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup(gamma: int, alpha: float, t_target: float, t_draft_total: float, t_verify: float) -> float:
    """Predicted decode speedup of speculation over plain decoding.

    Parameters
    ----------
    gamma, alpha :
        Draft length and per-token acceptance.
    t_target : float
        T_T, seconds per plain decode step.
    t_draft_total : float
        Seconds of all γ draft steps of one speculation step (γ·T_D).
    t_verify : float
        T_V, seconds per verification.

    Returns
    -------
    float
        ``Ω(γ, α) · T_T / (t_draft_total + T_V)``.

    Raises
    ------
    ValueError
        If a time is not positive.
    """
    for name, value in (("t_target", t_target), ("t_verify", t_verify)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0 seconds, got {value!r}.")
    if not t_draft_total >= 0:
        raise ValueError(f"t_draft_total must be >= 0 seconds, got {t_draft_total!r}.")
    return omega(gamma, alpha) * t_target / (t_draft_total + t_verify)


def best_gamma_of(speedups: dict[int, float], off_below: float | None = None) -> tuple[int, float]:
    """``(γ, speedup)`` of the largest predicted speedup in ``{γ: speedup}`` (the first such γ on a
    tie); ``(0, 1.0)``, plain decoding, where that is below ``off_below`` (None: never). The one
    best-γ choice: the step-time schedule's (:func:`.schedule.best_gamma`) and
    :func:`critical_length`'s."""
    gamma = max(speedups, key=speedups.get)
    if off_below is not None and speedups[gamma] < off_below:
        return 0, 1.0
    return gamma, speedups[gamma]


@dataclass(frozen=True)
class Estimate:
    """One candidate (draft view, budget, γ) evaluated at one (batch, context).

    Attributes
    ----------
    draft : str
        The view's name.
    draft_budget : int
    gamma : int
    acceptance : float
        α used.
    omega : float
        Ω(γ, α), tokens per verification.
    t_target : float
        T_T, seconds.
    t_draft : float
        Mean T_D over the γ draft steps, seconds.
    t_verify : float
        T_V, seconds.
    speedup : float
        Predicted speedup.
    """

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
    """Predict the speedup of one candidate at one operating point.

    Parameters
    ----------
    model, hardware :
        What runs where.
    batch : int
        Rows B.
    context : int
        Context S, tokens (use the mean over the generation).
    draft : draft view or str
        The draft view (:mod:`hf_magicdec.views`, read duck-typed: ``name``, and ``query_aware`` /
        ``page_size`` for the selection cost of query-aware views) or a name (a static view): α
        is looked up by its name.
    budget : int
        Draft budget K, tokens.
    gamma : int
        γ.
    acceptance : see :func:`~hf_magicdec.planner.acceptance.resolve_acceptance`
    t_target : float, optional
        Precomputed T_T (it does not depend on the candidate).
    draft_model : ModelSpec, optional
        A separate draft model: its forwards are the draft steps (its weights plus ``budget``
        tokens of its own KV), and α is looked up as ``"model:<draft>"``.
    draft_weights : str
        The self-draft's linear layers: ``"full"``, or quantized copies (``"int8"``, ``"fp16"``, ``"int4"``):
        the draft steps read those bytes, and α is looked up as ``"<draft>@<format>"``.
    prompt_len : float, optional
        Tokens of ``context`` that were the prompt, for the prior α
        (:func:`~hf_magicdec.planner.acceptance.default_acceptance`; None: all of it).

    Returns
    -------
    Estimate
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
    """Shortest context above which speculation pays at this batch size.

    Scans contexts from ``budget + 1`` upwards in steps of ×√2, then bisects the first crossing
    of ``threshold`` to within 1 %. Assumes the best speedup over γ rises with context, which
    holds while T_T is growing faster than T_D (it does: the draft's KV is fixed).

    Parameters
    ----------
    model, hardware, batch :
        Operating point.
    draft, budget, gammas, acceptance :
        Candidates (the best γ at each context counts); ``draft`` as in :func:`estimate`.
    threshold : float
        Speedup that counts as "pays" (1.0: break-even).
    max_context : int
        Give up above this many tokens.

    Returns
    -------
    float
        The context (tokens, as a float) or ``math.inf`` when speculation never pays up to
        ``max_context``.

    Raises
    ------
    ValueError
        If ``gammas`` is empty.
    """
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

"""γ as a function of the live batch and the context a generation has reached.

Long generations from short prompts start where speculation does not pay and grow into where it
does: γ is chosen per step, γ = 0 being plain decoding on MagicDec's cache (speedup 1), and a switch
between 0 and γ > 0 needs the speedup to clear 1 by :data:`SWITCH_MARGIN`. The planner prices a
candidate by this schedule over the generation (:func:`scheduled_speedup`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .hardware import HardwareSpec
from .modelspec import ModelSpec
from .roofline import draft_step, target_step, verify_step
from .selection import choice_seconds, selection_seconds
from .speculation import best_gamma_of, omega

__all__ = ["CONTEXT_POINTS", "PLAIN_PROBE_STEPS", "SWITCH_MARGIN", "StepModel", "best_gamma", "context_points",
           "scheduled_speedup"]

#: Points of a generation the planner evaluates the schedule at.
CONTEXT_POINTS = 8
#: How far above (below) 1 the predicted speedup must be to switch speculation on (off).
SWITCH_MARGIN = 0.03
#: A greedy schedule decodes its first PLAIN_PROBE_STEPS steps plainly, timing them
#: (:class:`~.gamma.CostProbe`); the planner prices them.
PLAIN_PROBE_STEPS = 3


def context_points(prompt: int, new_tokens: int, points: int = CONTEXT_POINTS) -> list[int]:
    """Mid-points of ``points`` equal parts of a generation from ``prompt`` to ``prompt + new_tokens``."""
    if new_tokens <= 1:
        return [max(prompt, 1)]
    return [max(1, int(round(prompt + new_tokens * (i + 0.5) / points))) for i in range(points)]


def best_gamma(alpha: float, draft_ratio: float, verify_ratio: dict[int, float], allow_off: bool,
               current: int | None = None) -> tuple[int, float]:
    """``(γ, predicted speedup)`` maximising Ω(γ, α) / (γ·T_D/T_T + T_V(γ)/T_T) over ``verify_ratio``'s
    γs; with ``allow_off``, γ = 0 (speedup 1) where that does not clear 1, with hysteresis around
    ``current`` (None: no hysteresis)."""
    alpha = min(alpha, 0.999)
    values = {g: omega(g, alpha) / (g * draft_ratio + verify_ratio[g]) for g in verify_ratio}
    threshold = 1.0 if current is None else (1.0 + SWITCH_MARGIN if current == 0 else 1.0 - SWITCH_MARGIN)
    return best_gamma_of(values, threshold if allow_off else None)


@dataclass(frozen=True)
class StepModel:
    """Step-time ratios of one configuration (target ``spec`` on ``hardware``; ``drafter``: the spec the
    draft steps run; ``budget`` K; ``view`` for its selection cost; the ``gammas`` considered) as
    functions of the live batch and the context."""

    spec: ModelSpec
    hardware: HardwareSpec
    drafter: ModelSpec
    budget: int
    view: Any
    gammas: tuple[int, ...]
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    def ratios(self, batch: int, context: int) -> tuple[float, float, dict[int, float]]:
        """``(T_T seconds, T_D/T_T, {γ: T_V(γ)/T_T})`` at ``batch`` rows and ``context`` tokens,
        memoised per batch and 64-token bucket of context (a step's schedule asks every step)."""
        key = (batch, context // 64)
        hit = self._memo.get(key)
        if hit is None:
            ctx, hw = max(64 * key[1] + 32, 1), self.hardware
            tt = target_step(self.spec, hw, batch, ctx).seconds
            held = min(self.budget, ctx)  # a view larger than the context holds the context
            td = draft_step(self.drafter, hw, batch, ctx, held).seconds
            td += selection_seconds(self.drafter, hw, batch, ctx, self.budget, self.view)
            hit = self._memo[key] = (tt, td / tt, {  # T_V and the verifier's choice, per verification
                g: (verify_step(self.spec, hw, batch, ctx, g).seconds
                    + choice_seconds(self.drafter, hw, batch, ctx, self.budget, self.view, g + 1)) / tt
                for g in self.gammas})
        return hit

    def __getstate__(self):  # broadcast to other ranks without the memo
        return {k: v for k, v in self.__dict__.items() if k != "_memo"}

    def __setstate__(self, state):
        self.__dict__.update(state, _memo={})


def scheduled_speedup(model: StepModel, batch: int, points: list[int], alpha: Callable[[int], float],
                      allow_off: bool, new_tokens: int = 0, setup_seconds: float = 0.0) -> tuple[float, list[int]]:
    """Predicted speedup of a generation whose steps at the context ``points`` follow the schedule
    (time-weighted: each point stands for an equal share of the new tokens), and γ at each point.
    ``alpha(context)``: the acceptance there. With ``new_tokens``, the call's first
    :data:`PLAIN_PROBE_STEPS` steps decode plainly (where γ > 0 somewhere) and ``setup_seconds`` of
    one-time work (building a quantized draft) are paid once."""
    plain = spec_time = 0.0
    gammas = []
    for context in points:
        tt, draft_ratio, verify_ratio = model.ratios(batch, context)
        gamma, value = best_gamma(alpha(context), draft_ratio, verify_ratio, allow_off)
        plain += tt
        spec_time += tt / value
        gammas.append(gamma)
    if new_tokens and any(gammas):
        warm_up = min(PLAIN_PROBE_STEPS, new_tokens) / new_tokens  # share of the steps decoded plainly
        step = new_tokens / len(points)  # steps each point stands for
        spec_time = warm_up * plain + (1 - warm_up) * spec_time + setup_seconds / step
    return plain / spec_time, gammas

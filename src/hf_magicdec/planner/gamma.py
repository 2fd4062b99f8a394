"""Adaptive γ: re-pick the draft length after every verification from the acceptance observed so far,
and, for a schedule, from the live batch and the context the generation has reached."""

from __future__ import annotations

from .schedule import StepModel, best_gamma

__all__ = ["GammaController"]

#: Drafted tokens' worth of confidence in the prior when blending it with what was observed.
PRIOR_WEIGHT = 32
#: A schedule measures the acceptance rather than assume it: until PROBE_TOKENS tokens were drafted,
#: where the blended α keeps speculation off, γ is chosen from the acceptance observed so far
#: blended with an optimistic PROBE_ALPHA instead of the prior (at the prior's weight), so that a
#: prior that is too low cannot keep speculation off all call long without ever seeing evidence
#: against itself, and one unlucky first step (a sampled 11 of 16 drafted tokens, where the call
#: went on to accept 0.94) does not end the probe. A probe that does not pay costs a step or two:
#: nothing accepted then says off too.
PROBE_ALPHA = 0.95
PROBE_TOKENS = 4 * PRIOR_WEIGHT


class GammaController:
    """Adaptive γ: before each step, the γ in ``[1, max_gamma]`` maximising the predicted speedup
    Ω(γ, α̂) / (γ·T_D/T_T + T_V(γ)/T_T), where α̂ blends the prior α with the acceptance observed
    so far in this generation (all rows pooled, so every row and rank takes the same γ).

    Parameters
    ----------
    gamma : int
        Starting γ (the plan's).
    max_gamma : int
        Largest γ allowed (the draft view's rolling window must hold γ + 1 tokens).
    alpha : float
        Prior α (the plan's).
    draft_ratio : float, optional
        T_D / T_T, fixed.
    verify_ratio : dict[int, float], optional
        T_V(γ) / T_T for γ in ``1..max_gamma``, fixed.
    step_model : StepModel, optional
        The ratios as functions of the live batch and the context, instead of fixed ones: γ then
        follows the context (:mod:`.schedule`).
    allow_off : bool
        γ may be 0 (plain decoding on MagicDec's cache) where speculation does not pay, switching
        with hysteresis (:data:`.schedule.SWITCH_MARGIN`). Until the observed acceptance outweighs
        the prior, a schedule probes (:data:`PROBE_TOKENS`).
    """

    def __init__(self, gamma: int, max_gamma: int, alpha: float, draft_ratio: float | None = None,
                 verify_ratio: dict[int, float] | None = None, *, step_model: StepModel | None = None,
                 allow_off: bool = False):
        if step_model is None and (draft_ratio is None or verify_ratio is None):
            raise ValueError("GammaController needs draft_ratio and verify_ratio, or a step_model.")
        self.gamma = min(gamma, max_gamma)
        self.max_gamma = max_gamma
        self.prior = alpha
        self.draft_ratio = draft_ratio
        self.verify_ratio = verify_ratio
        self.step_model = step_model
        self.allow_off = allow_off
        self.accepted = 0
        self.drafted = 0

    @property
    def alpha(self) -> float:
        return (self.accepted + PRIOR_WEIGHT * self.prior) / (self.drafted + PRIOR_WEIGHT)

    def update(self, accepted: int, drafted: int, batch: int | None = None, context: int | None = None) -> int:
        """Add one step's pooled counts; returns the γ for the next step (at ``batch`` live rows and
        ``context`` tokens per row, for a step model; ignored with fixed ratios)."""
        self.accepted += accepted
        self.drafted += drafted
        if not drafted and not self.allow_off:
            return self.gamma  # no new evidence (the call before the first step): keep the starting γ
        if self.step_model is not None and batch:
            _, draft_ratio, verify_ratio = self.step_model.ratios(batch, max(int(context or 1), 1))
        elif self.step_model is not None:
            return self.gamma  # nothing alive here: keep γ (an idle rank follows the others' counts)
        else:
            draft_ratio, verify_ratio = self.draft_ratio, self.verify_ratio
        verify_ratio = {g: v for g, v in verify_ratio.items() if g <= self.max_gamma}
        gamma, _ = best_gamma(self.alpha, draft_ratio, verify_ratio, self.allow_off, self.gamma)
        if gamma == 0 and self.allow_off and self.drafted < PROBE_TOKENS:  # probe: 0 where that does not pay
            probed = (self.accepted + PRIOR_WEIGHT * PROBE_ALPHA) / (self.drafted + PRIOR_WEIGHT)
            gamma, _ = best_gamma(probed, draft_ratio, verify_ratio, True)
        self.gamma = gamma
        return self.gamma

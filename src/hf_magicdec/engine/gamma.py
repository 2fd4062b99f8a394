"""γ policies: how many tokens the next speculation step drafts.

A policy has a ``gamma`` (the γ of the next step) and answers one question after every step,
:meth:`after_step`, with the step's counts read in the step's one host read (so it adds none of
its own): accepted and drafted tokens, rows alive and their tokens. γ = 0 is a step of plain
decoding (a schedule turns speculation off where it does not pay). Under ``synced_gpus`` every rank
asks it every iteration, idle ranks with zero counts, so that all ranks agree on γ. Adaptive γ is
:class:`GammaController` (the policy, on the planner's step-time model) with an optional
:class:`CostProbe` (the model checked against the call's step times).
"""

from __future__ import annotations

import bisect

from ..planner.schedule import PLAIN_PROBE_STEPS, StepModel, best_gamma

__all__ = ["AdaptiveGamma", "CostProbe", "FixedGamma", "GammaController", "OFF_REASONS"]

# Why each value: docs/cost_model.md, "Where the constants come from".
#: Drafted tokens' worth of confidence in the prior when blending it with what was observed.
PRIOR_WEIGHT = 32
#: A schedule probes: until PROBE_TOKENS tokens were drafted, where the blended α keeps speculation
#: off, γ is chosen from the acceptance observed blended with an optimistic PROBE_ALPHA instead.
PROBE_ALPHA = 0.95
PROBE_TOKENS = 4 * PRIOR_WEIGHT
#: A schedule given step times decodes its first PLAIN_PROBE_STEPS steps plainly (:mod:`.schedule`),
#: then scales the speculative cost by what it measured (:class:`CostProbe`), at COST_PRIOR_STEPS
#: steps' confidence.
COST_PRIOR_STEPS = 2
#: Off on evidence, a schedule speculates again for REPROBE_STEPS steps after REPROBE_AFTER plain
#: steps, and after twice as many each time a re-probe ends off again; not with fewer than
#: REPROBE_AFTER tokens per row left to generate, too few to pay a re-probe back.
REPROBE_AFTER = 16
REPROBE_STEPS = 4


#: Why a controller chose γ = 0 (``GammaController.reason``), in the words a run summary shows.
OFF_REASONS = {
    "timing": "timing plain steps to check the cost model",
    "context": "the context is still too short for drafts to pay",
    "costs": "this call's step times say speculating is slower here",
    "acceptance": "the acceptance observed so far does not pay",
}


class CostProbe:
    """The cost model checked against this call's step times: after :data:`PLAIN_PROBE_STEPS` plain
    steps, :attr:`factor` scales the predicted speculative cost (the first step of each kind is not counted).
    Medians of measured / predicted per kind: one step slowed by other work on the machine does not
    move the factor (it would double a mean over three plain steps)."""

    def __init__(self) -> None:
        self.steps = {False: 0, True: 0}  # plain (False) and speculative (True) steps seen
        # measured / predicted after the first step of each kind, kept sorted: the median of a call's
        # thousands of steps is read every step
        self._ratios: dict[bool, list[float]] = {False: [], True: []}

    @property
    def timing_plain(self) -> bool:
        """Whether the next step is one of the first plain steps, which time the plain cost."""
        return self.steps[False] < PLAIN_PROBE_STEPS

    def record(self, speculative: bool, seconds: float, predicted: float) -> None:
        self.steps[speculative] += 1
        if self.steps[speculative] > 1 and predicted > 0 and seconds > 0:
            bisect.insort(self._ratios[speculative], seconds / predicted)

    @property
    def factor(self) -> float:
        """median(plain measured / predicted) / median(speculative measured / predicted), shrunk
        towards 1 by :data:`COST_PRIOR_STEPS` (1.0 until both kinds of step were measured)."""
        plain, spec = self._ratios[False], self._ratios[True]
        if not plain or not spec:
            return 1.0
        return (_median(plain) / _median(spec)) ** (len(spec) / (len(spec) + COST_PRIOR_STEPS))


def _median(ordered: list[float]) -> float:
    """The median of a sorted, non-empty list."""
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class GammaController:
    """Adaptive γ: before each step, the γ in ``[1, max_gamma]`` maximising Ω(γ, α̂) / (γ·T_D/T_T +
    T_V(γ)/T_T), α̂ blending the prior ``alpha`` with the acceptance observed so far (rows pooled: every
    row and rank takes the same γ), the ratios from ``step_model`` at the live batch and context.
    ``allow_off``: γ may be 0 where speculation does not pay (with hysteresis; probing while the prior
    dominates, re-probing when off on evidence). ``measure_costs`` (with ``allow_off``): :meth:`update`
    gets each step's wall time and a :class:`CostProbe` corrects the ratios. ``end``: the context per
    row where the call ends (prompt + ``max_new_tokens``; None: unknown): near it γ is at most the
    tokens left - 1 and no re-probe starts.
    """

    def __init__(self, gamma: int, max_gamma: int, alpha: float, *, step_model: StepModel,
                 allow_off: bool = False, measure_costs: bool = False, end: int | None = None):
        self.gamma = min(gamma, max_gamma)
        self.max_gamma = max_gamma
        self.prior = alpha
        self.step_model = step_model
        self.allow_off = allow_off
        self.end = end
        self.accepted = 0
        self.drafted = 0
        self.probe = CostProbe() if measure_costs and allow_off else None
        self._at: tuple[int, int] | None = None  # (batch, context) the last γ was chosen for
        # Re-probes: plain steps decided on evidence since speculation last ran, the number that
        # triggers the next re-probe, and the speculative steps the running re-probe has left.
        self._off_steps = 0
        self._reprobe_after = REPROBE_AFTER
        self._reprobe_left = 0
        #: Why the last γ chosen is 0 (a key of :data:`OFF_REASONS`), "" when it is not.
        self.reason = ""

    @property
    def alpha(self) -> float:
        return (self.accepted + PRIOR_WEIGHT * self.prior) / (self.drafted + PRIOR_WEIGHT)

    @property
    def cost_factor(self) -> float:
        """:attr:`CostProbe.factor` (1.0 without a probe)."""
        return self.probe.factor if self.probe is not None else 1.0

    def _record(self, seconds: float) -> None:
        """The step just run (at ``self.gamma``, chosen for ``self._at``) took ``seconds``."""
        if self._at is None:
            return
        gamma = self.gamma
        tt, draft_ratio, verify_ratio = self.step_model.ratios(*self._at)
        if gamma and gamma not in verify_ratio:
            return
        self.probe.record(gamma > 0, seconds, tt if not gamma else tt * (gamma * draft_ratio + verify_ratio[gamma]))

    def update(self, accepted: int, drafted: int, batch: int | None = None, context: int | None = None,
               seconds: float | None = None) -> int:
        """Add one step's pooled counts and its wall ``seconds`` (None before the first step); returns the
        γ for the next step, at ``batch`` live rows and ``context`` tokens per row."""
        self.accepted += accepted
        self.drafted += drafted
        if self.probe is not None and seconds is not None:
            self._record(seconds)
        if (not drafted and not self.allow_off) or not batch:
            # No new evidence (the call before the first step), or nothing alive here (an idle rank
            # follows the others' counts): keep γ.
            return self.gamma
        self._at = (batch, max(int(context or 1), 1))
        _, draft_ratio, verify_ratio = self.step_model.ratios(*self._at)
        verify_ratio = {g: v for g, v in verify_ratio.items() if g <= self.max_gamma}
        model = draft_ratio, verify_ratio
        if self.probe is not None:
            if self.probe.timing_plain:  # time plain steps first
                self.gamma, self.reason = 0, "timing"
                return 0
            factor = self.cost_factor
            draft_ratio, verify_ratio = draft_ratio / factor, {g: v / factor for g, v in verify_ratio.items()}
        gamma, _ = best_gamma(self.alpha, draft_ratio, verify_ratio, self.allow_off, self.gamma)
        if gamma == 0 and self.allow_off and self.drafted < PROBE_TOKENS:  # probe: 0 where that does not pay
            probed = (self.accepted + PRIOR_WEIGHT * PROBE_ALPHA) / (self.drafted + PRIOR_WEIGHT)
            gamma, _ = best_gamma(probed, draft_ratio, verify_ratio, True)
        if self.allow_off:
            gamma = self._reprobe(gamma, *model, draft_ratio, verify_ratio)
        left = self._tokens_left()
        if gamma and left is not None:
            gamma = min(gamma, max(1, left - 1))  # the verify adds a token of its own
        self.gamma = gamma
        self.reason = self._why_off(*model) if gamma == 0 else ""
        return self.gamma

    def _why_off(self, model_draft: float, model_verify: dict[int, float]) -> str:
        """Why γ is 0 (a key of :data:`OFF_REASONS`), from the cost model's own ratios."""
        if not best_gamma(PROBE_ALPHA, model_draft, model_verify, True)[0]:
            return "context"
        if self.probe is not None and best_gamma(self.alpha, model_draft, model_verify, True)[0]:
            return "costs"
        return "acceptance"

    def _reprobe(self, gamma: int, model_draft: float, model_verify: dict[int, float],
                 draft_ratio: float, verify_ratio: dict[int, float]) -> int:
        """``gamma``, or a re-probe's best γ > 0 after :data:`REPROBE_AFTER` (doubling) plain steps off on
        evidence; ``model_*``: the cost model's ratios, the others as measured."""
        if gamma:
            self._off_steps = self._reprobe_left = 0
            return gamma
        if not self._reprobe_left:
            if not best_gamma(PROBE_ALPHA, model_draft, model_verify, True)[0]:
                return 0  # off because the context is still short, not on evidence: nothing to re-check
            self._off_steps += 1
            if self._off_steps <= self._reprobe_after or self._near_end():
                return 0
            self._off_steps, self._reprobe_left = 0, REPROBE_STEPS
        self._reprobe_left -= 1  # a re-probe runs its steps whatever the evidence says meanwhile
        if not self._reprobe_left:
            self._reprobe_after *= 2  # were it to end off again, the next one waits twice as long
        return best_gamma(self.alpha, draft_ratio, verify_ratio, False)[0]

    def _tokens_left(self) -> int | None:
        """Tokens per row left to generate at the context of this step (None: the end is unknown). The
        context counts the KV of the committed tokens; the last token emitted has none yet."""
        if self.end is None or self._at is None:
            return None
        return self.end - self._at[1] - 1

    def _near_end(self) -> bool:
        """Whether fewer than :data:`REPROBE_AFTER` tokens per row are left at the context of this step."""
        left = self._tokens_left()
        return left is not None and left < REPROBE_AFTER


class FixedGamma:
    """γ stays as configured."""

    controller = None

    def __init__(self, gamma: int):
        self.gamma = gamma
        #: Why γ is 0 (an :data:`OFF_REASONS` key, or "asked"), "" when it is not.
        self.reason = "asked" if gamma == 0 else ""

    def after_step(self, accepted: int, drafted: int, alive: int = 0, context: int = 0,
                   seconds: float | None = None) -> int:
        return self.gamma


class AdaptiveGamma:
    """γ re-chosen after every step by ``controller`` (``update(accepted, drafted) -> γ``, e.g.
    :class:`GammaController`) from the acceptance pooled over rows and,
    through ``lockstep``, over ranks."""

    def __init__(self, controller, lockstep):
        self.controller, self.lockstep = controller, lockstep
        self.gamma = controller.gamma

    def after_step(self, accepted: int, drafted: int, alive: int = 0, context: int = 0,
                   seconds: float | None = None) -> int:
        """``accepted`` draft tokens of ``drafted`` (γ × rows that drafted) in the last step;
        ``alive`` rows left, with ``context`` tokens in all (their mean is the context γ is chosen
        for, when it follows the context); ``seconds``: the step's wall time (None before the
        first step). Under ``synced_gpus`` the ranks' times are summed like the counts: the
        controller uses them only in ratios, where the number of ranks cancels."""
        micros = [] if seconds is None else [round(seconds * 1e6)]
        accepted, drafted, alive, context, *micros = self.lockstep.pool(accepted, drafted, alive, context, *micros)
        seconds = micros[0] / 1e6 if micros else None
        self.gamma = self.controller.update(accepted, drafted, alive, context // alive if alive else 0, seconds)
        return self.gamma

    @property
    def reason(self) -> str:
        """Why γ is 0 (an :data:`OFF_REASONS` key), "" when it is not."""
        return self.controller.reason

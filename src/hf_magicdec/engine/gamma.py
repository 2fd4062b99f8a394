"""γ policies: how many tokens the next speculation step drafts.

A policy has a ``gamma`` (the γ of the next step) and answers one question after every step,
:meth:`after_step`, with the step's counts read in the step's one host read (so it adds none of
its own): accepted and drafted tokens, rows alive and their tokens. γ = 0 is a step of plain
decoding (a schedule turns speculation off where it does not pay). Under ``synced_gpus`` every rank asks it every iteration, idle ranks with zero
counts, so that all ranks agree on γ.
"""

from __future__ import annotations

__all__ = ["AdaptiveGamma", "FixedGamma"]


class FixedGamma:
    """γ stays as configured."""

    controller = None

    def __init__(self, gamma: int):
        self.gamma = gamma
        #: Why γ is 0 (``planner.gamma.OFF_REASONS`` key, or "asked"), "" when it is not.
        self.reason = "asked" if gamma == 0 else ""

    def after_step(self, accepted: int, drafted: int, alive: int = 0, context: int = 0,
                   seconds: float | None = None) -> int:
        return self.gamma


class AdaptiveGamma:
    """γ re-chosen after every step by ``controller`` (``update(accepted, drafted) -> γ``, e.g.
    :class:`hf_magicdec.planner.gamma.GammaController`) from the acceptance pooled over rows and,
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
        """Why γ is 0 (a ``planner.gamma.OFF_REASONS`` key), "" when it is not."""
        return self.controller.reason

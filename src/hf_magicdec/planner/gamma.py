"""Adaptive γ: re-pick the draft length after every verification from the acceptance observed so far."""

from __future__ import annotations

from .speculation import omega

__all__ = ["GammaController"]

#: Drafted tokens' worth of confidence in the prior when blending it with what was observed.
PRIOR_WEIGHT = 32


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
    draft_ratio : float
        T_D / T_T.
    verify_ratio : dict[int, float]
        T_V(γ) / T_T for γ in ``1..max_gamma``.
    """

    def __init__(self, gamma: int, max_gamma: int, alpha: float, draft_ratio: float, verify_ratio: dict[int, float]):
        self.gamma = min(gamma, max_gamma)
        self.max_gamma = max_gamma
        self.prior = alpha
        self.draft_ratio = draft_ratio
        self.verify_ratio = verify_ratio
        self.accepted = 0
        self.drafted = 0

    @property
    def alpha(self) -> float:
        return (self.accepted + PRIOR_WEIGHT * self.prior) / (self.drafted + PRIOR_WEIGHT)

    def update(self, accepted: int, drafted: int) -> int:
        """Add one step's pooled counts; returns the γ for the next step."""
        self.accepted += accepted
        self.drafted += drafted
        alpha = min(self.alpha, 0.999)

        def value(g: int) -> float:
            return omega(g, alpha) / (g * self.draft_ratio + self.verify_ratio[g])

        self.gamma = max(range(1, self.max_gamma + 1), key=value)
        return self.gamma

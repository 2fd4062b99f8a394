"""What ``generate(..., speculative="magicdec", return_dict_in_generate=True)`` returns."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from transformers.generation.utils import GenerateDecoderOnlyOutput

from .gamma import OFF_REASONS


def _runs(values: list) -> list[tuple[int, int, object]]:
    """``values`` (one per step) as runs of equal values ``(first step, last step, value)``,
    1-based and inclusive."""
    runs: list[tuple[int, int, object]] = []
    for step, value in enumerate(values, start=1):
        if runs and runs[-1][2] == value:
            runs[-1] = (runs[-1][0], step, value)
        else:
            runs.append((step, step, value))
    return runs


@dataclass
class SpeculationStats:
    """Per-row speculation statistics of one generation.

    Attributes
    ----------
    accepted_lengths : list[list[int]]
        For each row, the number of draft tokens accepted at each of its verification steps
        (0..γ of that step). A row emits ``accepted + 1`` tokens per step.
    row_gammas : list[list[int]]
        For each row, the γ of each of its verification steps (constant unless γ adapts).
    gamma : int
        Draft tokens per step as configured (the starting γ when it adapts).
    gamma_trace : list[int]
        γ of every verification step, in order.
    adaptive_gamma : bool
        Whether γ was re-chosen during generation.
    draft : str
        Draft view name.
    draft_budget : int
        Tokens per layer, row and KV head in the draft view (static + rolling window).
    draft_model : str or None
        The separate draft model that drafted (its name), or None for self-speculation.
    draft_weights : str
        Weights of the self-draft's forwards: ``"full"``, ``"int8"``, ``"fp16"`` or ``"int4"``
        (:mod:`hf_magicdec.engine.draft_weights`).
    draft_weight_bytes : int
        Bytes of the quantized copy of the linear layers the draft read (0 for ``"full"``): memory
        held beside the model while it lives.
    steps : int
        Steps run, each one verify forward of the working batch (the batch shrinks as rows
        finish); a γ = 0 step is a plain decoding step. Counts per row are "row-steps".
    step_seconds : list[float]
        Wall time of every step (its draft and verify phases), in order; see the timers below.
    off_reasons : list[str]
        Why each step's γ was 0, in order ("" for a drafting step): a key of
        :data:`hf_magicdec.engine.gamma.OFF_REASONS`, or ``"asked"`` (``gamma=0``).
    refreshes : int
        Times the static part of the draft view was re-selected (``refresh_every`` /
        ``refresh_below``; see :mod:`hf_magicdec.engine.refresh`).
    plan : dict or None
        The planner's decision (:class:`hf_magicdec.planner.Plan` as a dict) when fields were
        left ``"auto"``.
    prefill_seconds, decode_seconds, draft_seconds, verify_seconds : float or None
        Wall-clock split (host timers; on CUDA only meaningful with ``HF_MAGICDEC_PROFILE=1``,
        which synchronises the device at each boundary). None when not measured: a call the
        planner sent to stock decoding.
    """

    accepted_lengths: list[list[int]] = field(default_factory=list)
    gamma: int = 0
    draft: str = ""
    draft_budget: int = 0
    draft_model: str | None = None
    draft_weights: str = "full"
    draft_weight_bytes: int = 0
    steps: int = 0
    prefill_seconds: float | None = 0.0
    decode_seconds: float | None = 0.0
    draft_seconds: float | None = 0.0
    verify_seconds: float | None = 0.0
    row_gammas: list[list[int]] = field(default_factory=list)
    gamma_trace: list[int] = field(default_factory=list)
    adaptive_gamma: bool = False
    plan: dict | None = None
    refreshes: int = 0
    step_seconds: list[float] = field(default_factory=list)
    off_reasons: list[str] = field(default_factory=list)

    def _drafted(self, row: int) -> int:
        if self.row_gammas and self.row_gammas[row]:
            return sum(self.row_gammas[row])
        return len(self.accepted_lengths[row]) * self.gamma

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens, over all rows and steps (α estimate)."""
        drafted = sum(self._drafted(r) for r in range(len(self.accepted_lengths)))
        return sum(sum(r) for r in self.accepted_lengths) / drafted if drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens a row emits per verification step (Ω in the paper)."""
        steps = sum(len(r) for r in self.accepted_lengths)
        return sum(sum(r) + len(r) for r in self.accepted_lengths) / steps if steps else 0.0

    @property
    def mean_gamma(self) -> float:
        """Mean γ over verification steps."""
        return sum(self.gamma_trace) / len(self.gamma_trace) if self.gamma_trace else float(self.gamma)

    def row_acceptance_rate(self, row: int) -> float:
        """Acceptance rate of one row."""
        drafted = self._drafted(row)
        return sum(self.accepted_lengths[row]) / drafted if drafted else 0.0

    def _row_steps(self):
        """``(accepted, γ)`` of every row-step."""
        for r, row in enumerate(self.accepted_lengths):
            gammas = self.row_gammas[r] if self.row_gammas and self.row_gammas[r] else [self.gamma] * len(row)
            yield from zip(row, gammas)

    def histogram(self) -> list[int]:
        """Row-steps that drafted (γ > 0) and accepted 0, 1, …, γ_max of their drafts, over all
        rows; plain row-steps (γ = 0) are counted apart (:attr:`plain_row_steps`), so that bucket 0
        holds only rejected drafts."""
        top = max([self.gamma] + self.gamma_trace + [n for r in self.accepted_lengths for n in r])
        counts = [0] * (top + 1)
        for n, gamma in self._row_steps():
            if gamma:
                counts[n] += 1
        return counts

    @property
    def plain_row_steps(self) -> int:
        """Row-steps decoded plainly (γ = 0): one token each, nothing drafted."""
        return sum(1 for _, gamma in self._row_steps() if not gamma)

    def measured_speedup(self) -> float | None:
        """Time per token of this call's plain steps over that of its speculative steps, per row
        (from :attr:`step_seconds`); None without both kinds of step. The plain steps ran at
        other contexts (usually earlier, shorter ones), so this is the call's own estimate of the
        speedup over plain decoding, not a measurement against a separate plain call."""
        if len(self.step_seconds) != len(self.gamma_trace):
            return None
        plain = [t for t, g in zip(self.step_seconds, self.gamma_trace) if g == 0]
        speculative = sum(t for t, g in zip(self.step_seconds, self.gamma_trace) if g)
        row_steps = [(n, g) for n, g in self._row_steps() if g]
        if not plain or not speculative or not row_steps:
            return None
        tokens_per_step = sum(n + 1 for n, _ in row_steps) / len(row_steps)  # per row
        # The median plain step: there are few of them, and one slowed by other work would double a mean.
        return statistics.median(plain) / (speculative / (len(self.step_seconds) - len(plain))) * tokens_per_step

    def schedule(self) -> list[tuple[int, int, int]]:
        """γ over the generation as runs ``(first step, last step, γ)`` (1-based, inclusive):
        γ = 0 steps decoded plainly on MagicDec's cache (a schedule that waits for the context to
        grow, or that turned speculation off)."""
        return _runs(self.gamma_trace)

    def _off_runs(self) -> str:
        """Runs of plain steps with the reason for each, ``"steps 1-3: timing ...; 4-63: ..."``."""
        words = dict(OFF_REASONS, asked="gamma=0 was asked for")
        runs = [run for run in _runs(self.off_reasons) if run[2]]  # "": a drafting step
        shown = "; ".join(f"steps {a}-{b}: {words.get(r, r)}" for a, b, r in runs[:6])
        return shown + (" ..." if len(runs) > 6 else "")

    @property
    def speculated(self) -> bool:
        """Whether the engine ran (False: the planner sent the call to stock decoding)."""
        return self.decode_seconds is not None

    def as_dict(self) -> dict:
        """A flat dict for logs and benchmark rows (timings None when not measured)."""
        return {
            "draft": self.draft,
            "draft_budget": self.draft_budget,
            "draft_model": self.draft_model,
            "draft_weights": self.draft_weights,
            "draft_weight_bytes": self.draft_weight_bytes,
            "gamma": self.gamma,
            "adaptive_gamma": self.adaptive_gamma,
            "mean_gamma": round(self.mean_gamma, 3),
            "steps": self.steps,
            "refreshes": self.refreshes,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_step": round(self.tokens_per_step, 4),
            "accepted_histogram": self.histogram(),
            "plain_row_steps": self.plain_row_steps,
            "measured_speedup": self.measured_speedup(),
            "gamma_schedule": self.schedule(),
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
        }

    def summary(self) -> str:
        """What the call did, in a few readable lines (``as_dict()`` for the numbers)."""
        if not self.speculated:
            reason = (self.plan or {}).get("reason", "")
            return f"plain decoding with stock generate (the planner's choice{': ' + reason if reason else ''}); " \
                   "timings not measured"
        weights = "" if self.draft_weights == "full" else f", {self.draft_weights} draft weights"
        drafter = f" on draft model {self.draft_model}" if self.draft_model else ""
        gamma = f"gamma adaptive (start {self.gamma}, mean {self.mean_gamma:.2f})" if self.adaptive_gamma \
            else f"gamma {self.gamma}"
        plain = sum(1 for g in self.gamma_trace if g == 0)
        lines = [f"{self.draft}/{self.draft_budget}{drafter}{weights}, {gamma}"]
        if self.plan and self.plan.get("predicted_speedup") is not None:
            # The decode steps' prediction is what "measured" below compares with; a one-time build
            # of quantized draft weights is part of the call's, not of the steps'.
            call = self.plan["predicted_speedup"]
            decode = self.plan.get("predicted_decode_speedup", call)
            built = "" if abs(decode - call) < 0.005 else f" ({call:.2f}x with the one-time build of its draft weights)"
            lines.append(f"planned: {self.plan.get('draft')}/{self.plan.get('draft_budget')}, gamma "
                         f"{self.plan.get('gamma')} at the mean context, predicted "
                         f"{decode:.2f}x over plain decoding{built}")
        lines.append(f"{self.steps} steps of the batch ({plain} plain, {self.steps - plain} speculative); per "
                     f"row-step: acceptance {self.acceptance_rate:.3f} of drafted tokens, {self.tokens_per_step:.2f} "
                     f"tokens; drafting row-steps that accepted 0..gamma drafts {self.histogram()}"
                     + (f", plain row-steps {self.plain_row_steps}" if self.plain_row_steps else ""))
        runs = self.schedule()
        if len(runs) > 1 or (runs and runs[0][2] == 0):
            shown = ", ".join(f"{a}-{b}: {g}" for a, b, g in runs[:12]) + (" ..." if len(runs) > 12 else "")
            lines.append(f"gamma by step: {shown}")
        if any(self.off_reasons):
            lines.append(f"gamma 0 because: {self._off_runs()}")
        measured = self.measured_speedup()
        if measured is not None:
            lines.append(f"measured: {measured:.2f}x over this call's plain steps (time per token per row)")
        if self.refreshes:
            lines.append(f"view re-selected {self.refreshes} times")
        lines.append(f"prefill {self.prefill_seconds:.2f} s, decode {self.decode_seconds:.2f} s "
                     f"(draft {self.draft_seconds:.2f} s, verify {self.verify_seconds:.2f} s)")
        return "\n".join(lines)


@dataclass
class MagicDecOutput(GenerateDecoderOnlyOutput):
    """:class:`transformers.generation.GenerateDecoderOnlyOutput` plus ``speculation``.

    ``scores`` / ``logits`` hold one ``[B, V]`` tensor per generated position, as stock
    ``generate`` returns them; entries of a row after it finished are ``-inf`` (stock computes
    them on padding tokens). ``past_key_values`` is a transformers cache laid out as stock
    ``generate`` returns it (a ``DynamicCache``, or the ``StaticCache`` passed in): ``[B, Hkv,
    S - 1, D]`` per layer for sequences of ``S`` tokens (every token but the last; rows that ended
    early hold their pad tokens' KV after their end, as stock computes it; nothing of rejected
    drafts), which stock ``generate`` and MagicDec both continue from (``docs/cache_reuse.md``).
    """

    speculation: SpeculationStats | None = None

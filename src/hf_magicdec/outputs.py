"""What ``generate(..., speculative="magicdec", return_dict_in_generate=True)`` returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers.generation.utils import GenerateDecoderOnlyOutput


@dataclass
class SpeculationStats:
    """Per-row speculation statistics of one generation.

    Attributes
    ----------
    accepted_lengths : list[list[int]]
        For each row, the number of draft tokens accepted at each of its verification steps
        (0..gamma). A row emits ``accepted + 1`` tokens per step.
    gamma : int
        Draft tokens per step.
    draft : str
        Draft view name.
    draft_budget : int
        Tokens per layer, row and KV head in the draft view (static + rolling window).
    steps : int
        Verification forwards run (the batch shrinks as rows finish).
    prefill_seconds, decode_seconds, draft_seconds, verify_seconds : float
        Wall-clock split (host timers; on CUDA only meaningful with ``HF_MAGICDEC_PROFILE=1``,
        which synchronises the device at each boundary).
    """

    accepted_lengths: list[list[int]] = field(default_factory=list)
    gamma: int = 0
    draft: str = ""
    draft_budget: int = 0
    steps: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens, over all rows and steps (α estimate)."""
        drafted = sum(len(r) for r in self.accepted_lengths) * self.gamma
        return sum(sum(r) for r in self.accepted_lengths) / drafted if drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens a row emits per verification step (Ω in the paper)."""
        steps = sum(len(r) for r in self.accepted_lengths)
        return sum(sum(r) + len(r) for r in self.accepted_lengths) / steps if steps else 0.0

    def row_acceptance_rate(self, row: int) -> float:
        """Acceptance rate of one row."""
        lengths = self.accepted_lengths[row]
        return sum(lengths) / (len(lengths) * self.gamma) if lengths else 0.0

    def histogram(self) -> list[int]:
        """Count of steps that accepted 0, 1, …, gamma draft tokens (all rows)."""
        counts = [0] * (self.gamma + 1)
        for row in self.accepted_lengths:
            for n in row:
                counts[n] += 1
        return counts

    def summary(self) -> dict:
        """A flat dict for logs and benchmark rows."""
        return {
            "draft": self.draft,
            "draft_budget": self.draft_budget,
            "gamma": self.gamma,
            "steps": self.steps,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_step": round(self.tokens_per_step, 4),
            "accepted_histogram": self.histogram(),
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
        }


@dataclass
class MagicDecOutput(GenerateDecoderOnlyOutput):
    """:class:`transformers.generation.GenerateDecoderOnlyOutput` plus ``speculation``.

    ``scores`` / ``logits`` hold one ``[B, V]`` tensor per generated position, as stock
    ``generate`` returns them; entries of a row after it finished are ``-inf`` (stock computes
    them on padding tokens). ``past_key_values`` is ``None``: the ragged cache is not reusable.
    """

    speculation: SpeculationStats | None = None

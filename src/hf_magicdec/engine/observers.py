"""What watches the loop without being part of it: statistics, the streamer, per-step scores and
logits, and the acceptance memory.

An :class:`Observer` gets four calls per generation: :meth:`~Observer.on_prompt` (before prefill),
:meth:`~Observer.on_prefilled` (first token chosen, draft views built), :meth:`~Observer.on_tokens`
(after every emission: the first token, then each verification's accepted + 1 tokens) and
:meth:`~Observer.on_step` (after every verification), then :meth:`~Observer.on_end`.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch

from .outputs import SpeculationStats

__all__ = ["AcceptanceRecorder", "Observer", "Observers", "ScoresRecorder", "StatsRecorder", "StreamerObserver",
           "profile_sync"]


def profile_sync(device: torch.device) -> None:
    """Make host timings honest on CUDA when ``HF_MAGICDEC_PROFILE=1`` (a sync per timed phase)."""
    if device.type == "cuda" and os.environ.get("HF_MAGICDEC_PROFILE") == "1":
        torch.cuda.synchronize(device)


class Observer:
    """Base class: every method is a no-op."""

    def on_prompt(self, input_ids: torch.Tensor) -> None:
        """Before prefill, with the ``[B, P]`` prompts."""

    def on_prefilled(self) -> None:
        """After prefill, the first token and the draft views."""

    def on_tokens(self, rows: torch.Tensor, tokens: torch.Tensor, emitted: torch.Tensor, scores: torch.Tensor,
                  logits: torch.Tensor) -> None:
        """Working rows ``rows [b]`` (original indices) emitted ``tokens[r, :emitted[r]]``; ``scores`` and
        ``logits`` ``[b, w, V]`` are the processed scores and raw logits they were chosen from."""

    def on_step(self, rows: torch.Tensor, accepted: torch.Tensor, gamma: int, draft_seconds: float,
                verify_seconds: float) -> None:
        """One verification: ``accepted [b]`` drafts of ``gamma`` per working row (``rows`` is -1
        for a finished row that compiled steps keep in the batch)."""

    def on_end(self) -> None:
        """The generation is over (also when nothing was generated)."""


class Observers(Observer):
    """Several observers, called in order."""

    def __init__(self, *observers: Observer):
        self.items = [o for o in observers if o is not None]

    def on_prompt(self, input_ids):
        for o in self.items:
            o.on_prompt(input_ids)

    def on_prefilled(self):
        for o in self.items:
            o.on_prefilled()

    def on_tokens(self, rows, tokens, emitted, scores, logits):
        for o in self.items:
            o.on_tokens(rows, tokens, emitted, scores, logits)

    def on_step(self, rows, accepted, gamma, draft_seconds, verify_seconds):
        for o in self.items:
            o.on_step(rows, accepted, gamma, draft_seconds, verify_seconds)

    def on_end(self):
        for o in self.items:
            o.on_end()


class StatsRecorder(Observer):
    """Fills :class:`~hf_magicdec.SpeculationStats`: per-row accepted lengths and γ, phase times,
    and why a step's γ was 0 (``gamma_policy.reason`` when the step starts: the decision that chose
    its γ)."""

    def __init__(self, stats: SpeculationStats, device: torch.device, gamma_policy=None):
        self.stats, self.device, self.gamma_policy = stats, device, gamma_policy
        self._t, self._prefilled = 0.0, False
        # Per-step rows and accepted counts stay on the device; read once at the end (no sync per step).
        self._rows: list[torch.Tensor] = []
        self._accepted: list[torch.Tensor] = []

    def _elapsed(self) -> float:
        profile_sync(self.device)
        now, start = time.perf_counter(), self._t
        self._t = now
        return now - start

    def on_prompt(self, input_ids):
        self._elapsed()

    def on_prefilled(self):
        self.stats.prefill_seconds = self._elapsed()
        self._prefilled = True

    def on_step(self, rows, accepted, gamma, draft_seconds, verify_seconds):
        stats = self.stats
        stats.draft_seconds += draft_seconds
        stats.verify_seconds += verify_seconds
        stats.steps += 1
        stats.gamma_trace.append(gamma)
        stats.step_seconds.append(draft_seconds + verify_seconds)
        stats.off_reasons.append(getattr(self.gamma_policy, "reason", "") if gamma == 0 else "")
        self._rows.append(rows)
        self._accepted.append(accepted)

    def on_end(self):
        if self._prefilled:
            self.stats.decode_seconds = self._elapsed()
        if self._rows:
            rows, accepted = torch.cat(self._rows).tolist(), torch.cat(self._accepted).tolist()
            gammas = [g for g, r in zip(self.stats.gamma_trace, self._rows) for _ in range(r.shape[0])]
            for orig, n, g in zip(rows, accepted, gammas):
                if orig < 0:  # a finished row kept in a compiled batch
                    continue
                self.stats.accepted_lengths[orig].append(n)
                self.stats.row_gammas[orig].append(g)
            self._rows, self._accepted = [], []


class StreamerObserver(Observer):
    """Feeds a transformers streamer as stock ``generate`` does: the prompt, then each row-0 token."""

    def __init__(self, streamer):
        self.streamer = streamer

    def on_prompt(self, input_ids):
        self.streamer.put(input_ids.cpu())

    def on_tokens(self, rows, tokens, emitted, scores, logits):
        if emitted.numel():
            self.streamer.put(tokens[0, : int(emitted[0])].cpu())

    def on_end(self):
        self.streamer.end()


class ScoresRecorder(Observer):
    """Keeps each row's processed scores and / or raw logits (``output_scores`` / ``output_logits``)."""

    def __init__(self, batch: int, scores: bool, logits: bool):
        self.want_scores, self.want_logits = scores, logits
        self.scores: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        self.logits: list[list[torch.Tensor]] = [[] for _ in range(batch)]

    def on_tokens(self, rows, tokens, emitted, scores, logits):
        for r, (orig, k) in enumerate(zip(rows.tolist(), emitted.tolist())):
            if self.want_scores:
                self.scores[orig].extend(scores[r, :k].unbind(0))
            if self.want_logits:
                self.logits[orig].extend(logits[r, :k].unbind(0))

    @staticmethod
    def assemble(per_row: list[list[torch.Tensor]], steps: int) -> tuple[torch.Tensor, ...] | None:
        """Stock ``generate``'s layout: one ``[B, V]`` tensor per generated position (``-inf`` for
        rows that had already stopped)."""
        if not any(per_row) or steps == 0:
            return None
        ref = next(t for r in per_row for t in r)
        out = []
        for k in range(steps):
            col = ref.new_full((len(per_row), ref.shape[-1]), float("-inf"))
            for b, r in enumerate(per_row):
                if k < len(r):
                    col[b] = r[k]
            out.append(col)
        return tuple(out)


class AcceptanceRecorder(Observer):
    """At the end, hands the generation's pooled acceptance to ``record(accepted, drafted)`` (the
    planner's acceptance memory)."""

    def __init__(self, stats: SpeculationStats, record: Callable[[int, int], Any]):
        self.stats, self.record = stats, record

    def on_end(self):
        drafted = sum(sum(g) for g in self.stats.row_gammas)
        if drafted:
            self.record(sum(sum(a) for a in self.stats.accepted_lengths), drafted)

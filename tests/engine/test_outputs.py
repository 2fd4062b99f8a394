"""The run summary speaks the plan's words: plain steps apart from rejected drafts, every count
per step or per row-step, the planned speedup beside the one the call measured on itself."""

from __future__ import annotations

import pytest

from hf_magicdec.engine.outputs import SpeculationStats


def _stats() -> SpeculationStats:
    # Two rows: 2 plain steps (γ 0), then 2 steps at γ 3. Row 0 accepts 3 and 0, row 1 accepts 3 and 3.
    return SpeculationStats(accepted_lengths=[[0, 0, 3, 0], [0, 0, 3, 3]], row_gammas=[[0, 0, 3, 3], [0, 0, 3, 3]],
                            gamma=3, gamma_trace=[0, 0, 3, 3], adaptive_gamma=True, draft="snapkv", draft_budget=64,
                            steps=4, step_seconds=[0.1, 0.1, 0.2, 0.2], decode_seconds=0.6,
                            plan={"draft": "snapkv", "draft_budget": 64, "gamma": 3, "predicted_speedup": 1.4})


def test_plain_row_steps_are_not_rejected_drafts():
    s = _stats()
    assert s.histogram() == [1, 0, 0, 3]  # one drafting row-step rejected everything, three accepted all
    assert s.plain_row_steps == 4
    assert s.acceptance_rate == pytest.approx(9 / 12)


def test_measured_speedup_from_the_calls_own_steps():
    s = _stats()
    # Plain: 0.1 s per token per row. Speculative: 0.2 s per step for (4 + 1 + 4 + 4) / 4 tokens per row-step.
    assert s.measured_speedup() == pytest.approx(0.1 / (0.2 / (13 / 4)))
    text = s.summary()
    assert "4 steps of the batch (2 plain, 2 speculative)" in text
    assert "per row-step: acceptance 0.750" in text and "[1, 0, 0, 3], plain row-steps 4" in text
    assert "predicted 1.40x over plain decoding" in text and "measured: 1.62x" in text
    assert SpeculationStats(gamma_trace=[3], step_seconds=[0.1], accepted_lengths=[[2]]).measured_speedup() is None
    # A plan that priced a one-time build: the steps' prediction first, the call's beside it.
    s.plan = dict(s.plan, predicted_speedup=1.25, predicted_decode_speedup=1.4)
    assert "predicted 1.40x over plain decoding (1.25x with the one-time build of its draft weights)" in s.summary()


def test_the_summary_says_why_gamma_was_zero():
    s = _stats()
    s.off_reasons = ["timing", "context", "", ""]
    text = s.summary()
    assert "gamma 0 because: steps 1-1: timing plain steps to check the cost model; steps 2-2: the context is " \
           "still too short" in text
    s.off_reasons = ["asked", "asked", "", ""]
    assert "steps 1-2: gamma=0 was asked for" in s.summary()

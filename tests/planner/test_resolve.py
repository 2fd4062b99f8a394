"""``"auto"`` fields: the planner picks draft view, budget and γ per call or decodes plainly, and
adaptive γ re-picks γ each step; outputs stay identical to ``generate`` in every case."""

from __future__ import annotations

import pytest
import torch

from conftest import ragged_prompts
from hf_magicdec import MagicDecConfig, MagicDecOutput
from hf_magicdec.engine.gamma import GammaController
from hf_magicdec.resolve import resolve

class _Ratios:
    """A step model whose ratios do not depend on batch or context."""

    def __init__(self, draft=0.3, verify=0.05):
        self.fixed = (1.0, draft, {g: 1.0 + verify * g for g in range(1, 9)})

    def ratios(self, batch, context):
        return self.fixed


RATIOS = dict(step_model=_Ratios())
AT = dict(batch=8, context=100)


def test_config_auto_fields_and_validation():
    cfg = MagicDecConfig()
    assert not cfg.is_resolved and cfg.planner_may_decline and cfg.adaptive
    assert MagicDecConfig.from_any(draft_budget=64, sink_tokens=4).adaptive  # gamma auto -> adapts
    assert not MagicDecConfig.from_any(gamma=3).adaptive and not MagicDecConfig.from_any(gamma=3).planner_may_decline
    assert MagicDecConfig.from_any(gamma=3, adaptive_gamma=True).adaptive and not MagicDecConfig.from_any(gamma=0).adaptive
    for bad, fragment in ((dict(gamma="3"), "gamma"), (dict(draft_budget=0), "draft_budget"),
                          (dict(max_gamma=0), "max_gamma"), (dict(hardware="tpu"), "tpu"),
                          (dict(adaptive_gamma="yes"), "adaptive_gamma"), (dict(draft="auto-ish"), "auto-ish")):
        with pytest.raises(ValueError, match=fragment):
            MagicDecConfig.from_any(**bad)


def test_gamma_controller_follows_acceptance():
    high = GammaController(2, 8, 0.7, **RATIOS)
    for _ in range(20):
        g = high.gamma
        high.update(accepted=8 * g, drafted=8 * g, **AT)  # everything accepted
    assert high.gamma == 8
    low = GammaController(6, 8, 0.7, **RATIOS)
    for _ in range(20):
        low.update(accepted=0, drafted=8 * low.gamma, **AT)  # nothing accepted
    assert low.gamma == 1
    capped = GammaController(12, 5, 0.99, **RATIOS)
    assert capped.gamma == 5 and capped.update(5, 5, **AT) <= 5


def test_gamma_controller_says_why_it_turned_speculation_off():
    """reason: "" while drafting; "acceptance" when what was observed does not pay; "context"
    when not even an optimistic acceptance would (drafts cost nearly a plain step)."""
    low = GammaController(3, 8, 0.7, **RATIOS, allow_off=True)
    assert low.reason == ""
    for _ in range(40):
        low.update(accepted=0, drafted=8 * max(low.gamma, 1), **AT)
    assert low.gamma == 0 and low.reason == "acceptance"
    costly = GammaController(3, 8, 0.7, step_model=_Ratios(draft=0.95, verify=0.3), allow_off=True)
    costly.update(accepted=8, drafted=8, **AT)
    assert costly.gamma == 0 and costly.reason == "context"


def test_planner_declines_short_prompts_and_decodes_as_stock(tiny_models):
    model = tiny_models("llama-gqa3")
    ids, mask = ragged_prompts(batch=3, length=30, seed=2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=None)
    reference = model.generate(**kwargs)
    res = resolve(MagicDecConfig(), model, 3, 30, 10)
    assert res.config is None and res.plan is not None and not res.plan.speculate
    out = model.generate(**kwargs, speculative="magicdec", return_dict_in_generate=True)
    assert isinstance(out, MagicDecOutput) and torch.equal(out.sequences, reference)
    assert out.speculation.steps == 0 and "plain" in out.speculation.draft
    assert out.speculation.plan["speculate"] is False


@pytest.mark.parametrize("draft,extra", [("streamingllm", dict(sink_tokens=2)), ("snapkv", dict(window=6))])
def test_auto_gamma_adapts_and_stays_identical(tiny_models, draft, extra):
    model = tiny_models("qwen2-gqa7")
    ids, mask = ragged_prompts(batch=4, length=48, seed=5)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None)
    reference = model.generate(**kwargs)
    out = model.generate(**kwargs, speculative="magicdec", draft=draft, draft_budget=24, return_dict_in_generate=True,
                         **extra)
    assert torch.equal(out.sequences, reference)
    s = out.speculation
    assert s.adaptive_gamma and s.plan is not None and len(s.gamma_trace) == s.steps
    window = 24 - 2 if draft == "streamingllm" else max(6, 24 // 4)
    assert all(1 <= g <= min(8, window - 1) for g in s.gamma_trace)
    assert sum(s.histogram()) + s.plain_row_steps == sum(len(r) for r in s.accepted_lengths)
    assert 0 <= s.acceptance_rate <= 1


def test_adaptive_gamma_with_explicit_start_and_sampling_is_reproducible(tiny_models):
    model = tiny_models("llama-gqa3")
    ids, mask = ragged_prompts(batch=3, length=40, seed=9)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=True, top_k=20,
                  eos_token_id=None, speculative="magicdec", draft_budget=16, sink_tokens=2, gamma=2,
                  adaptive_gamma=True, return_dict_in_generate=True)
    torch.manual_seed(3)
    a = model.generate(**kwargs)
    torch.manual_seed(3)
    b = model.generate(**kwargs)
    assert torch.equal(a.sequences, b.sequences) and a.speculation.gamma_trace == b.speculation.gamma_trace
    assert a.speculation.gamma_trace[0] == 2


def test_explicit_hardware_preset_reaches_the_planner(tiny_models):
    model = tiny_models("llama-gqa3")
    res = resolve(MagicDecConfig.from_any(hardware="h100", draft_budget=16, sink_tokens=2), model, 2, 64, 16)
    assert res.plan.hardware.startswith("H100") and res.config.is_resolved and res.config.draft_budget == 16


def test_top_level_plan_uses_the_models_device_model(tiny_models):
    import hf_magicdec

    model = tiny_models("llama-gqa3")
    p = hf_magicdec.plan(model, batch_size=4, prompt_len=2048, new_tokens=64)
    assert p.hardware.startswith("cpu") and p.batch_size == 4
    q = hf_magicdec.plan(model.config, batch_size=4, prompt_len=2048, new_tokens=64, draft_budget=256)
    assert q.hardware.startswith("H100") and all(e.draft_budget == 256 for e in q.runner_ups)


def test_adaptive_start_above_max_gamma_is_clamped(tiny_models):
    model = tiny_models("llama-gqa3")
    ids, mask = ragged_prompts(batch=2, length=40, seed=4)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    reference = model.generate(**kwargs)
    cfg = MagicDecConfig.from_any(draft="streamingllm", draft_budget=24, sink_tokens=2, gamma=6, adaptive_gamma=True,
                         max_gamma=3)
    out = model.generate(**kwargs, speculative=cfg, return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)
    assert max(out.speculation.gamma_trace) <= 3


@pytest.mark.parametrize("fields", [
    dict(draft="auto", draft_budget=4, sink_tokens=2, gamma="auto"),     # window of 2: γ must shrink to 1
    dict(draft="auto", draft_budget=40, sink_tokens=48, gamma=1),        # streamingllm cannot: another view
])
def test_auto_fields_fit_the_explicit_ones(tiny_models, fields):
    """The planner's choice never breaks the user's explicit fields (found by the fuzzer)."""
    model = tiny_models("llama-gqa3")
    ids, mask = ragged_prompts(batch=3, length=5, seed=2, min_len=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None)
    out = model.generate(**kwargs, speculative="magicdec", return_dict_in_generate=True, **fields)
    assert torch.equal(out.sequences, model.generate(**kwargs))


def test_no_view_fits_explicit_fields_is_refused_before_any_forward(tiny_models):
    model = tiny_models("llama-gqa3")
    ids, mask = ragged_prompts(batch=2, length=8, seed=2)
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(ValueError, match="No draft view and gamma fit"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, speculative="magicdec",
                           draft="auto", draft_budget=3, sink_tokens=16, recent_window=21, gamma=2)
    finally:
        handle.remove()
    assert calls == []


def test_adaptive_gamma_ends_where_the_longest_rank_ends(tiny_models):
    """Under ``synced_gpus`` each rank has its own prompt and ``max_new_tokens``, and every rank must
    take the same γ: the controller's end is the largest over the ranks, not this rank's."""
    from hf_magicdec.api import _gamma_policy
    from hf_magicdec.parallel.lockstep import LOCAL

    class OtherRankEndsLater:  # agree_min over two ranks, the other's call ending at context 200
        def agree_min(self, value: int) -> int:
            return min(value, -200) if value < 0 else value

    model = tiny_models("qwen2-gqa7")
    config = MagicDecConfig.from_any(draft="streamingllm", draft_budget=24, sink_tokens=2)  # γ adaptive
    resolution = resolve(config, model, 4, 48, 40)
    assert resolution.config.adaptive
    assert _gamma_policy(resolution.config, 48, 40, LOCAL, resolution)[0].controller.end == 48 + 40
    assert _gamma_policy(resolution.config, 48, 40, OtherRankEndsLater(), resolution)[0].controller.end == 200

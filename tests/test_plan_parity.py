"""What a user sees is what happens (issue 29): the plan ``hf_magicdec.plan`` shows is the plan the
call runs, seeded sampling with the defaults is reproducible within a process, a draft budget is
bounded by what the call can hold, and the decisions are said."""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_magicdec
from conftest import make_model, ragged_prompts
from hf_magicdec import MagicDecWarning
from hf_magicdec.engine.cache import MagicDecCache


@pytest.fixture(scope="module")
def model():
    return make_model("llama-gqa3")


#: (batch, prompt, new tokens, options): declined by the planner, planned in part, explicit, γ = 0.
WORKLOADS = [
    (2, 150, 12, {}),
    (3, 300, 12, {}),
    (3, 300, 12, {"draft_budget": 64}),
    (2, 300, 12, {"gamma": 2}),
    (2, 200, 12, {"draft": "streamingllm", "draft_budget": 32, "sink_tokens": 4}),
    (2, 200, 12, {"draft": "snapkv", "draft_budget": 96, "gamma": 3}),
    (2, 200, 12, {"gamma": 0, "draft_budget": 64}),
    (2, 300, 12, {"hardware": "h100", "draft_weights": "full", "draft_budget": 128}),
]


@pytest.mark.parametrize("batch,prompt,new,options", WORKLOADS)
def test_the_plan_shown_is_the_plan_the_call_runs(model, batch, prompt, new, options):
    p = hf_magicdec.plan(model, batch_size=batch, prompt_len=prompt, new_tokens=new, **options)
    ids, mask = ragged_prompts(batch, prompt, seed=batch + prompt)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MagicDecWarning)
        out = model.generate(**kwargs, speculative="magicdec", return_dict_in_generate=True, **options)
    s = out.speculation
    assert torch.equal(out.sequences, model.generate(**kwargs))
    ran = (s.draft, s.draft_budget, s.gamma, s.draft_weights)
    if p.speculate:
        assert s.speculated and s.steps > 0, p.summary()
        assert ran == (p.draft, p.draft_budget, p.gamma, p.draft_weights), (ran, p.summary())
    elif p.gamma == 0:  # plain decoding on MagicDec's own cache
        assert s.speculated and s.gamma == 0 and s.acceptance_rate == 0.0
    else:
        assert not s.speculated, p.summary()
    if s.plan is not None:  # the call recorded the plan it ran: the same one
        assert s.plan == p.to_dict()


def test_plan_of_a_config_on_a_device_is_the_models_plan(model):
    workload = dict(batch_size=3, prompt_len=300, new_tokens=12, draft_budget=64)
    by_model = hf_magicdec.plan(model, **workload)
    by_config = hf_magicdec.plan(model.config, device="cpu", dtype=model.dtype, **workload)
    assert (by_config.draft, by_config.draft_budget, by_config.gamma, by_config.draft_weights, by_config.speculate) \
        == (by_model.draft, by_model.draft_budget, by_model.gamma, by_model.draft_weights, by_model.speculate)
    # Without a device, a preset: full-precision draft weights only.
    assert hf_magicdec.plan(model.config, hardware="h100", **workload).draft_weights == "full"
    with pytest.raises(ValueError, match="draft_budget"):
        hf_magicdec.plan(model, batch_size=2, prompt_len=64, new_tokens=4, draft_budget=0)


def test_seeded_sampling_with_the_defaults_is_reproducible_within_a_process(model):
    """The plan (γ, view, draft weights) does not move with what earlier calls measured unless
    asked (acceptance_memory=True), so the same seed draws the same tokens on every call."""
    ids, mask = ragged_prompts(2, 200, seed=11)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=True, temperature=0.7, top_p=0.9,
                  eos_token_id=None, speculative="magicdec", draft_budget=48, return_dict_in_generate=True)
    runs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MagicDecWarning)
        for _ in range(3):  # the first call records its acceptance: the later ones must not use it
            torch.manual_seed(0)
            runs.append(model.generate(**kwargs))
    assert all(torch.equal(r.sequences, runs[0].sequences) for r in runs[1:])
    assert all(r.speculation.plan == runs[0].speculation.plan for r in runs[1:])
    # Opting in plans with what the calls measured (so the plan may move).
    remembered = hf_magicdec.plan(model, batch_size=2, prompt_len=200, new_tokens=24, draft_budget=48,
                                  acceptance_memory=True)
    prior = hf_magicdec.plan(model, batch_size=2, prompt_len=200, new_tokens=24, draft_budget=48)
    assert prior.acceptance != remembered.acceptance


def test_an_oversized_budget_allocates_only_what_the_call_can_hold(model, monkeypatch):
    built = []
    original = MagicDecCache.build_draft_views

    def recording(self, view, budget, *args, **kwargs):
        built.append(budget)
        original(self, view, budget, *args, **kwargs)
        built.append(self.geometry.total_slots)

    monkeypatch.setattr(MagicDecCache, "build_draft_views", recording)
    ids, mask = ragged_prompts(2, 40, seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None)
    with pytest.warns(MagicDecWarning, match=r"draft_budget=100000 holds the whole context .* sized to 56 slots"):
        out = model.generate(**kwargs, speculative="magicdec", draft="streamingllm", draft_budget=100000, gamma=3,
                             return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(**kwargs))
    assert built[0] == 56 and built[1] <= 40 + 16 + 3 + 1  # not 100,000 slots per row, layer and head
    assert out.speculation.draft_budget == 56


def test_a_fallback_says_so_and_reports_nothing_as_measured(model):
    ids, mask = ragged_prompts(2, 30, seed=4)
    with pytest.warns(MagicDecWarning, match="decodes this call with stock generate") as said:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                             speculative="magicdec", return_dict_in_generate=True)
    # Said at the line that called generate, not inside transformers or this package.
    assert [w.filename for w in said.list if w.category is MagicDecWarning] == [__file__]
    s = out.speculation
    assert not s.speculated and s.decode_seconds is None and s.draft_seconds is None
    assert "not measured" in s.summary() and s.as_dict()["decode_seconds"] is None


def test_stats_summary_is_text_and_as_dict_the_numbers(model):
    ids, mask = ragged_prompts(2, 60, seed=5)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=None,
                         speculative="magicdec", draft="streamingllm", draft_budget=24, sink_tokens=2, gamma=2,
                         return_dict_in_generate=True)
    text = out.speculation.summary()
    assert isinstance(text, str) and text.startswith("streamingllm/24, gamma 2") and "acceptance" in text
    numbers = out.speculation.as_dict()
    assert numbers["draft_budget"] == 24 and numbers["steps"] == out.speculation.steps

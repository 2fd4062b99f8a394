"""A separate small draft model (``draft_model=``): lossless greedy and sampling at any batch size,
with its cache full or compressed by any view, and its per-row bookkeeping checked against the
draft model's own greedy continuation."""

from __future__ import annotations

import copy

import pytest
import torch
from scipy import stats

from conftest import ARCHS, EOS, make_model, ragged_prompts
from test_sampling import _first_tokens_distribution

from hf_magicdec.engine import loop

VIEWS = {
    "full": dict(draft_budget=64),
    "streamingllm": dict(draft_budget=16, sink_tokens=4),
    "snapkv": dict(draft_budget=24, window=8),
    "dynamic": dict(draft_budget=32, sink_tokens=4, page_size=4),
}


def _perturbed_copy(model, scale=0.004, seed=0):
    """A draft that agrees with the target most of the time, not always (acceptance ~0.3-0.9)."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.model.layers[-1].parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return draft


@pytest.fixture(scope="module")
def pairs():
    cache = {}

    def get(arch):
        if arch not in cache:
            target = make_model(arch, seed=0, layers=2)
            cache[arch] = (target, _perturbed_copy(target))
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_identical_with_draft_model(pairs, arch, view, gamma):
    target, draft = pairs(arch)
    ids, mask = ragged_prompts(batch=5, length=40, seed=gamma)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=None)
    reference = target.generate(**kwargs)
    out = target.generate(**kwargs, speculative="magicdec", draft=view, gamma=gamma, draft_model=draft,
                          return_dict_in_generate=True, **VIEWS[view])
    assert torch.equal(reference, out.sequences), f"{arch}/{view}/gamma={gamma}"
    assert 0.0 < out.speculation.acceptance_rate < 1.0  # mixed rounds: some all-accepted, some not


def test_rows_finishing_at_eos_with_draft_model(pairs):
    target, draft = pairs("qwen2-gqa7")
    ids, mask = ragged_prompts(batch=6, length=32, seed=9)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=EOS,
                  repetition_penalty=1.3)
    reference = target.generate(**kwargs)
    out = target.generate(**kwargs, speculative="magicdec", draft="snapkv", gamma=3, draft_model=draft,
                          **VIEWS["snapkv"])
    assert torch.equal(reference, out)


def test_draft_tokens_are_the_draft_models_own_greedy_continuation(pairs, monkeypatch):
    """The bookkeeping truth: with its full cache, every round's drafts are exactly what the draft
    model alone would generate greedily from the committed prefix, after full and partial acceptance."""
    target, draft = pairs("llama-gqa3")
    ids, mask = ragged_prompts(batch=3, length=24, seed=4)
    rounds = []
    original = loop.Engine._draft

    def recording(self, b, ctx, pending, positions, gamma):
        drafts, probs = original(self, b, ctx, pending, positions, gamma)
        seq_len = b.seq_len[b.rows]
        for r, row in enumerate(b.rows.tolist()):
            prefix = b.tokens.tokens[row, : int(seq_len[r])].clone()
            rounds.append((row, prefix, drafts[r].clone()))
        return drafts, probs

    monkeypatch.setattr(loop.Engine, "_draft", recording)
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None,
                          speculative="magicdec", draft="full", draft_budget=64, gamma=3, draft_model=draft,
                          return_dict_in_generate=True)
    accepted = [n for row in out.speculation.accepted_lengths for n in row]
    assert 3 in accepted and min(accepted) < 3  # both kinds of rounds happened
    pad = (mask == 0).sum(1)
    for row, prefix, drafts in rounds:
        real = prefix[int(pad[row]):][None]
        alone = draft.generate(input_ids=real, attention_mask=torch.ones_like(real), max_new_tokens=3,
                               do_sample=False, eos_token_id=None)[0, real.shape[1]:]
        assert torch.equal(alone, drafts), (row, alone.tolist(), drafts.tolist())


def test_identical_draft_model_accepts_everything(pairs):
    target, _ = pairs("mistral-mha")
    twin = copy.deepcopy(target)
    ids, mask = ragged_prompts(batch=4, length=30, seed=1)
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None,
                          speculative="magicdec", draft="full", draft_budget=64, gamma=4, draft_model=twin,
                          return_dict_in_generate=True)
    assert out.speculation.acceptance_rate == 1.0


def test_sampling_with_draft_model_matches_exact_distribution():
    target = make_model("llama-gqa3", seed=4, vocab_size=12)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.2)
    draft = _perturbed_copy(target, scale=0.2, seed=3)
    prompt = torch.randint(3, 12, (24,), generator=torch.Generator().manual_seed(0))
    rows = 4000
    exact = _first_tokens_distribution(target, prompt, 3)
    torch.manual_seed(7)
    out = target.generate(input_ids=prompt.expand(rows, -1).clone(), max_new_tokens=3, do_sample=True, top_k=0,
                          eos_token_id=None, speculative="magicdec", draft="streamingllm", draft_budget=8,
                          sink_tokens=2, gamma=2, draft_model=draft, return_dict_in_generate=True)
    assert out.speculation.acceptance_rate < 0.95
    new = out.sequences[:, 24:]
    for k in range(3):
        observed = torch.bincount(new[:, k], minlength=12).double().numpy()
        expected = (exact[k] / exact[k].sum() * rows).numpy()
        assert stats.chisquare(observed, expected).pvalue > 1e-3, k


def test_bad_draft_models_are_refused_before_any_forward(pairs):
    target, _ = pairs("llama-gqa3")
    ids, mask = ragged_prompts(batch=2, length=16, seed=0)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, speculative="magicdec", draft="full",
                  draft_budget=32, gamma=2)
    other_vocab = make_model("llama-gqa3", seed=1, vocab_size=64)
    with pytest.raises(ValueError, match="share the target's vocabulary: its LM head has 64 rows"):
        target.generate(**kwargs, draft_model=other_vocab)
    with pytest.raises(ValueError, match="draft_model is the target model itself"):
        target.generate(**kwargs, draft_model=target)
    with pytest.raises(ValueError, match="share the target's vocabulary"):  # assistant_model= is draft_model=
        target.generate(**kwargs, assistant_model=other_vocab)
    with pytest.raises(ValueError, match="refresh_every / refresh_below re-select the target's own draft view"):
        target.generate(**{**kwargs, "draft": "snapkv", "draft_budget": 12}, window=4, refresh_every=4,
                        draft_model=_perturbed_copy(target))


# ---------------------------------------------------------------- planning
def _specs():
    import json
    from pathlib import Path

    from hf_magicdec.planner.modelspec import ModelSpec

    llama = json.loads((Path(__file__).parents[1] / "configs" / "llama-3.1-8b.json").read_text())
    small = {**llama, "num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 8192,
             "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64}  # Llama-3.2-1B's shape
    return ModelSpec.from_config(llama, name="llama-8b"), ModelSpec.from_config(small, name="llama-1b")


def test_planner_weighs_the_draft_model_against_self_speculation():
    from hf_magicdec.planner import SearchSpace, Workload, search_plan
    from hf_magicdec.views import get_view

    def plan(spec, acceptance=None, **space):  # the search, with the default views
        space = SearchSpace(drafts=(get_view("streamingllm"), get_view("snapkv")),
                            draft_model_drafts=(get_view("full"), get_view("streamingllm"), get_view("snapkv")),
                            **space)
        return search_plan(spec, Workload(4, 8192, 256), "h100", space, acceptance=acceptance)

    target, small = _specs()
    good_small = plan(target, draft_model=small,
                      acceptance={"model:full": 0.95, "model:streamingllm": 0.9, "model:snapkv": 0.9,
                                  "streamingllm": 0.3, "snapkv": 0.3})
    assert good_small.draft_model == "llama-1b" and good_small.speculate
    poor_small = plan(target, draft_model=small,
                      acceptance={"model:full": 0.05, "model:streamingllm": 0.05, "model:snapkv": 0.05})
    assert poor_small.draft_model is None  # self-speculation with the prior wins
    only_small = plan(target, draft_model=small, self_speculation=False)
    assert only_small.draft_model == "llama-1b"
    # A compressed draft-model cache is cheaper to read than its full cache at long context.
    full = [e for e in (only_small, *only_small.runner_ups) if e.draft == "full"]
    assert full and all(e.draft_budget == 8192 + 128 for e in full)


def test_generate_plans_the_draft_model_mode(pairs):
    """With every field auto, generate plans both modes (and may decline both); with a view and γ
    given, the planner only sizes the draft model's view."""
    target, draft = pairs("llama-gqa3")
    ids, mask = ragged_prompts(batch=3, length=40, seed=6)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None)
    reference = target.generate(**kwargs)
    out = target.generate(**kwargs, speculative="magicdec", draft="full", gamma=3, draft_model=draft,
                          return_dict_in_generate=True)
    assert torch.equal(reference, out.sequences)
    assert out.speculation.draft_model is not None and out.speculation.plan["draft_model"] is not None
    auto_out = target.generate(**kwargs, speculative="magicdec", draft_model=draft, return_dict_in_generate=True)
    assert torch.equal(reference, auto_out.sequences)
    assert auto_out.speculation.plan is not None  # a decision was recorded, whichever mode won

"""Continuing from a cache and returning one: ``generate(past_key_values=cache, speculative="magicdec")``.

Against stock ``generate`` given a copy of the same cache: identical greedy tokens (and seeded
sampling with drafting off), a returned cache with stock's layout and values (rows that ended early
included), a multi-turn chat alternating plain and speculative turns identical to all-plain turns,
and a cache that does not fit refused before any forward. Tiny fp32 models, a few seconds in all.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, StaticCache

from conftest import ARCHS, PAD, make_model, ragged_prompts
from hf_magicdec.planner import forget_acceptance

NEW = 10
SPEC = dict(speculative="magicdec", draft_budget=12, gamma=3)
VIEWS = {"snapkv": dict(window=8), "dynamic": dict(sink_tokens=1, page_size=4, recent_window=7),
         "streamingllm": dict(sink_tokens=2)}


@pytest.fixture
def models(tiny_models):
    return tiny_models  # conftest's session-wide tiny models (every call here sets view, budget and γ)


def _prefilled(model, ids, mask, cached: int, cache=None):
    """A cache holding the first ``cached`` tokens of every row, filled by a plain forward (with the
    positions ``generate`` gives left-padded rows: a plain forward would count the padding)."""
    cache = cache if cache is not None else DynamicCache(config=model.config)
    positions = (mask[:, :cached].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        model(input_ids=ids[:, :cached], attention_mask=mask[:, :cached], position_ids=positions, past_key_values=cache)
    return cache


def _eos_in_some_rows(model, kwargs, cache) -> int:
    """A token that stock greedy emits in row 0 only (early), so rows end at different lengths."""
    plain = model.generate(**kwargs, past_key_values=copy.deepcopy(cache))
    new = plain.sequences[:, kwargs["input_ids"].shape[1]:]
    for tok in new[0, 1:NEW - 2].tolist():
        if not any(tok in row.tolist() for row in new[1:]):
            return tok
    pytest.skip("no token ends row 0 alone")


def _assert_same_cache(reference, ours, sequences):
    assert ours.get_seq_length() == reference.get_seq_length() == sequences.shape[1] - 1
    for a, b in zip(reference.layers, ours.layers):
        torch.testing.assert_close(b.keys, a.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(b.values, a.values, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("draft", ["snapkv", "dynamic"])
def test_greedy_identical_to_stock_from_the_same_cache(models, arch, draft):
    model = models(arch)
    ids, mask = ragged_prompts(batch=3, length=36, seed=5)
    cache = _prefilled(model, ids, mask, cached=30)  # the suffix (6) is shorter than SnapKV's window (8)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                  return_dict_in_generate=True, eos_token_id=None)
    kwargs["eos_token_id"] = _eos_in_some_rows(model, kwargs, cache)
    stock = model.generate(**kwargs, past_key_values=copy.deepcopy(cache))
    mine = copy.deepcopy(cache)
    out = model.generate(**kwargs, past_key_values=mine, draft=draft, **SPEC, **VIEWS[draft])
    assert torch.equal(stock.sequences, out.sequences)
    assert (out.sequences[0, -1] == PAD) and (out.sequences[1:, -1] != PAD).any(), "rows should end ragged"
    assert out.past_key_values is mine, "like stock, the cache passed in is the one extended and returned"
    assert out.speculation.steps > 0, "the engine ran (not the planner's plain decoding)"
    _assert_same_cache(stock.past_key_values, out.past_key_values, out.sequences)


def test_draft_views_cover_the_whole_context(models):
    """Continuing from a cache drafts exactly as prefilling everything: the same views (SnapKV's
    observation queries re-run over cached tokens), so the same acceptance at every step."""
    model = models("llama-gqa3")
    ids, mask = ragged_prompts(batch=3, length=36, seed=7)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                  return_dict_in_generate=True, draft="snapkv", window=8, **SPEC)
    forget_acceptance(model)  # both calls plan from the same (empty) acceptance memory
    whole = model.generate(**kwargs)
    forget_acceptance(model)
    continued = model.generate(**kwargs, past_key_values=_prefilled(model, ids, mask, cached=32))
    assert torch.equal(whole.sequences, continued.sequences)
    assert whole.speculation.accepted_lengths == continued.speculation.accepted_lengths


def test_static_cache_is_extended_in_place(models):
    model = models("qwen2-gqa7")
    ids, mask = ragged_prompts(batch=2, length=30, seed=7)

    def static():
        return _prefilled(model, ids, mask, 24, StaticCache(config=model.config, max_cache_len=64))

    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                  return_dict_in_generate=True)
    stock = model.generate(**kwargs, past_key_values=static())
    mine = static()
    out = model.generate(**kwargs, past_key_values=mine, draft="streamingllm", sink_tokens=2, **SPEC)
    assert torch.equal(stock.sequences, out.sequences) and out.past_key_values is mine
    assert int(mine.get_seq_length()) == int(stock.past_key_values.get_seq_length()) == out.sequences.shape[1] - 1
    for a, b in zip(stock.past_key_values.layers, mine.layers):
        torch.testing.assert_close(b.keys, a.keys, atol=1e-4, rtol=1e-4)


def test_multi_turn_chat_alternating_plain_and_speculative(models):
    """Turn after turn, each continuing from the last turn's returned cache: MagicDec / plain /
    MagicDec gives exactly the all-plain conversation (rows end at different lengths), so each kind
    of turn continues from the other's cache."""
    model = models("mistral-mha")
    ids, mask = ragged_prompts(batch=3, length=24, seed=8)
    turns = [torch.randint(3, 100, (3, 5), generator=torch.Generator().manual_seed(t)) for t in range(2)]
    eos = _eos_in_some_rows(model, dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                        return_dict_in_generate=True, eos_token_id=None), DynamicCache())

    def chat(speculative_turns):
        seq, m, cache, history = ids, mask, DynamicCache(), []
        for t in range(3):
            extra = dict(draft="snapkv", window=4, **SPEC) if t in speculative_turns else {}
            out = model.generate(input_ids=seq, attention_mask=m, past_key_values=cache, max_new_tokens=NEW,
                                 do_sample=False, eos_token_id=eos, return_dict_in_generate=True, **extra)
            history.append(out.sequences)
            if t < 2:
                grown = out.sequences.shape[1] - seq.shape[1] + turns[t].shape[1]
                seq = torch.cat([out.sequences, turns[t]], dim=1)
                m = torch.cat([m, m.new_ones((m.shape[0], grown))], dim=1)
                cache = out.past_key_values
        return history

    plain = chat(())
    assert any((turn[:, -1] == PAD).any() for turn in plain), "some row should end early"
    for a, b in zip(plain, chat((0, 2))):
        assert torch.equal(a, b)


def test_returned_cache_continues_in_stock_and_magicdec(models):
    """A MagicDec call without a cache returns one that stock generate and MagicDec both continue
    from; a cache from stock generate continues in MagicDec."""
    model = models("llama-gqa3")
    ids, mask = ragged_prompts(batch=2, length=20, seed=9)
    first = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None,
                 return_dict_in_generate=True)
    spec = model.generate(**first, draft="streamingllm", sink_tokens=2, **SPEC)
    plain = model.generate(**first)
    assert torch.equal(spec.sequences, plain.sequences) and isinstance(spec.past_key_values, DynamicCache)
    _assert_same_cache(plain.past_key_values, spec.past_key_values, spec.sequences)
    follow = torch.randint(3, 100, (2, 4), generator=torch.Generator().manual_seed(1))
    nxt = dict(input_ids=torch.cat([spec.sequences, follow], 1), max_new_tokens=6, do_sample=False, eos_token_id=None,
               attention_mask=torch.cat([mask, mask.new_ones((2, 10))], 1))
    reference = model.generate(**nxt)  # no cache at all
    assert torch.equal(reference, model.generate(**nxt, past_key_values=copy.deepcopy(spec.past_key_values)))
    assert torch.equal(reference, model.generate(**nxt, past_key_values=copy.deepcopy(plain.past_key_values),
                                                 draft="streamingllm", sink_tokens=2, **SPEC))


def test_passed_cache_is_extended_without_return_dict(models):
    """Like stock, a cache passed in holds the conversation afterwards even when only tokens are
    returned (transformers' chat-loop pattern passes the same object turn after turn)."""
    model = models("llama-gqa3")
    ids = torch.randint(3, 100, (1, 16), generator=torch.Generator().manual_seed(2))
    stock_cache, mine = DynamicCache(), DynamicCache()
    kwargs = dict(input_ids=ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    stock = model.generate(**kwargs, past_key_values=stock_cache)
    out = model.generate(**kwargs, past_key_values=mine, draft="streamingllm", sink_tokens=2, **SPEC)
    assert torch.equal(stock, out) and mine.get_seq_length() == stock_cache.get_seq_length() == out.shape[1] - 1


def test_seeded_sampling_from_a_cache_draws_like_stock(models):
    """With drafting off (γ = 0) the engine consumes the RNG as stock sampling does: same seed, same tokens."""
    model = models("qwen2-gqa7")
    ids, mask = ragged_prompts(batch=3, length=26, seed=10)
    cache = _prefilled(model, ids, mask, cached=20)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=40,
                  eos_token_id=None)
    torch.manual_seed(3)
    stock = model.generate(**kwargs, past_key_values=copy.deepcopy(cache))
    torch.manual_seed(3)
    ours = model.generate(**kwargs, past_key_values=copy.deepcopy(cache), speculative="magicdec", gamma=0)
    assert torch.equal(stock, ours)


def test_planner_counts_the_whole_context(models):
    model = models("llama-gqa3")
    ids, mask = ragged_prompts(batch=2, length=40, seed=11)
    out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=_prefilled(model, ids, mask, 36),
                         max_new_tokens=4, speculative="magicdec", return_dict_in_generate=True, eos_token_id=None)
    assert out.speculation.plan["prompt_len"] == 40


def _other_depth():
    return make_model("llama-gqa3", layers=3)


@pytest.mark.parametrize("problem,match", [
    ("batch", "holds 2 rows and input_ids has 3"),
    ("covers_all", "pass the whole sequences"),
    ("new_tokens_only", "with the cached tokens included"),
    ("layers", "it has 3 layers and the model 2"),
    ("short_static", "max_cache_len >= 45"),
    ("heads", "layer 0 holds 4 KV heads and the model has 2"),
])
def test_mismatched_cache_refused_before_any_forward(models, problem, match):
    model = models("llama-gqa3")
    ids, mask = ragged_prompts(batch=3, length=36, seed=12)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **SPEC)
    if problem == "batch":
        kwargs["past_key_values"] = _prefilled(model, ids[:2], mask[:2], 30)
    elif problem == "covers_all":
        kwargs["past_key_values"] = _prefilled(model, ids, mask, 36)
    elif problem == "new_tokens_only":
        kwargs["past_key_values"] = _prefilled(model, ids, mask, 30)
        kwargs["input_ids"] = ids[:, 30:]  # stock's other form: only the new tokens, the mask over everything
    elif problem == "layers":
        kwargs["past_key_values"] = _prefilled(_other_depth(), ids, mask, 30)
    elif problem == "short_static":
        kwargs["past_key_values"] = _prefilled(model, ids, mask, 30, StaticCache(config=model.config,
                                                                                  max_cache_len=40))
    else:
        kwargs["past_key_values"] = _prefilled(models("mistral-mha"), ids, mask, 30)
    calls = []
    # A hook, not a patched forward: the model is shared by the session and must be left as it was.
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            model.generate(**kwargs)
    finally:
        handle.remove()
    assert not calls, "a forward ran before the error"


def test_assistant_model_is_the_draft_model(models):
    model = models("llama-gqa3")
    draft = make_model("llama-gqa3", seed=1)
    ids, mask = ragged_prompts(batch=2, length=24, seed=13)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None,
                  return_dict_in_generate=True, speculative="magicdec", draft="full", gamma=2)
    via_assistant = model.generate(**kwargs, assistant_model=draft)
    assert via_assistant.speculation.draft_model == model.generate(**kwargs, draft_model=draft).speculation.draft_model
    assert torch.equal(via_assistant.sequences, model.generate(**{k: kwargs[k] for k in list(kwargs)[:5]}))
    model.generate(**kwargs, assistant_model=draft, draft_model=draft)  # the same model twice is fine
    with pytest.raises(ValueError, match="both assistant_model= and draft_model="):
        model.generate(**kwargs, assistant_model=draft, draft_model=make_model("llama-gqa3", seed=2))

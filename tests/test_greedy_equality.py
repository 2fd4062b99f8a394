"""The heart of the suite: greedy speculative output is token-identical to ``model.generate``.

fp32, tiny random-weight Llama / Qwen2 / Mistral (GQA ratios 3, 7, 1), batches mixing prompt
lengths with left padding, gamma in {1, 3, 6}, every draft view, budgets smaller and larger than
the prompt, EOS in some rows, logits processors on.
"""

from __future__ import annotations

import pytest
import torch

from conftest import ARCHS, EOS, ragged_prompts
from hf_magicdec import available_views
from hf_magicdec.views import get_view

# Options per view for a budget of 16 (a view not listed runs with its defaults).
DRAFTS = {
    "streamingllm": dict(sink_tokens=4),
    "snapkv": dict(window=8),
    "dynamic": dict(sink_tokens=1, page_size=4, recent_window=7),
    "attended": dict(sink_tokens=1, page_size=4, window=8),
    "full": dict(),
    "recent-only": dict(static_tokens=3),  # the user's view (tests/conftest.py)
}
# Every registered view (the user's from conftest.py included), with a budget smaller than the
# prompt and one larger than prompt + new tokens ("full" has no budget).
# (attended holds everything at the large budget, as every view does there: the small budget is its case.)
VIEW_CASES = [(d, b) for d in available_views()
              for b in (("-",) if d == "full" else ("small",) if d == "attended" else ("small", "large"))]
COMPRESSING = [d for d in available_views() if d != "full"]


def _assert_same(reference, speculative, context=""):
    if not torch.equal(reference, speculative):
        diff = (reference != speculative).nonzero()
        raise AssertionError(
            f"{context}: speculative output differs from generate at (row, col) {diff[:5].tolist()}\n"
            f"generate:    {reference[diff[0, 0]].tolist()}\nspeculative: {speculative[diff[0, 0]].tolist()}"
        )


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("draft,budget", VIEW_CASES)
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_identical(tiny_models, arch, draft, gamma, budget):
    model = tiny_models(arch)
    ids, mask = ragged_prompts(batch=4, length=48, seed=gamma)
    # small: the view holds a third of the longest prompt; large: prompt + new tokens fit.
    draft_budget = 16 if budget == "small" else 200
    if not get_view(draft, **DRAFTS.get(draft, {})).fits(draft_budget, gamma):
        pytest.skip(f"{draft} with {DRAFTS.get(draft, {})} does not fit budget {draft_budget}, gamma {gamma}")
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None)
    reference = model.generate(**kwargs)
    out = model.generate(
        **kwargs,
        speculative="magicdec",
        draft=draft,
        draft_budget=draft_budget,
        gamma=gamma,
        return_dict_in_generate=True,
        **DRAFTS.get(draft, {}),
    )
    _assert_same(reference, out.sequences, f"{arch}/{draft}/gamma={gamma}/{budget}")
    if budget != "small":
        # The draft sees exactly what the target sees: every draft token must be accepted.
        assert out.speculation.acceptance_rate == 1.0
    else:
        assert out.speculation.acceptance_rate < 1.0  # the view really is compressed


def _eos_for(model, kwargs):
    """A token that greedy emits early in row 0 but not in every row: EOS in some rows."""
    plain = model.generate(**{**kwargs, "eos_token_id": [EOS]})
    new = plain[:, kwargs["input_ids"].shape[1] :]
    early = set(new[:, :4].flatten().tolist())  # min_new_tokens suppresses EOS there
    for tok in new[0, 4:14].tolist():
        rows_with = sum(int(tok in row.tolist()) for row in new)
        if tok not in early and rows_with < new.shape[0]:
            return tok
    raise AssertionError("test setup: found no token to act as EOS in some rows")


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("draft", COMPRESSING)
def test_greedy_identical_with_eos_and_processors(tiny_models, arch, draft):
    model = tiny_models(arch)
    ids, mask = ragged_prompts(batch=5, length=40, seed=11)
    kwargs = dict(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=30,
        do_sample=False,
        pad_token_id=0,
        repetition_penalty=1.3,
        no_repeat_ngram_size=3,
        min_new_tokens=4,
        bad_words_ids=[[5], [7, 8]],
    )
    eos = _eos_for(model, kwargs)
    kwargs["eos_token_id"] = [eos, EOS]
    reference = model.generate(**kwargs)
    assert (reference[:, ids.shape[1] :] == eos).any(), "test setup: no row hit EOS"
    for gamma in (1, 4):
        out = model.generate(**kwargs, speculative="magicdec", draft=draft, draft_budget=20, gamma=gamma,
                             **DRAFTS.get(draft, {}))
        _assert_same(reference, out, f"{arch}/{draft}/gamma={gamma}/eos+processors")


@pytest.mark.parametrize("processors", [dict(min_new_tokens=9), dict(min_length=49),
                                        dict(min_new_tokens=6, min_length=50)])
def test_greedy_identical_with_length_processors_on_the_device(tiny_models, processors):
    """``min_new_tokens`` / ``min_length`` beside an EOS are applied per position from its own row
    length, on the device (ragged rows: each reaches the bound at its own step)."""
    model = tiny_models("llama-gqa3")
    ids, mask = ragged_prompts(batch=5, length=40, seed=11)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    plain = model.generate(**kwargs, eos_token_id=None)
    eos = int(plain[0, 40 + 2])  # row 0 emits it early: the processors must hide it there
    kwargs["eos_token_id"] = [eos, EOS]
    reference = model.generate(**kwargs, **processors)
    assert not torch.equal(reference, model.generate(**kwargs)), "test setup: the processors must change the output"
    for gamma in (1, 4):
        out = model.generate(**kwargs, **processors, speculative="magicdec", draft="streamingllm", draft_budget=20,
                             sink_tokens=2, gamma=gamma)
        _assert_same(reference, out, f"{processors}/gamma={gamma}")


@pytest.mark.parametrize("arch", ["llama-gqa3"])
def test_greedy_identical_long_batch(tiny_models, arch):
    """More rows than before, long enough generations that the rolling window wraps many times."""
    model = tiny_models(arch)
    ids, mask = ragged_prompts(batch=9, length=64, seed=3, min_len=5)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=80, do_sample=False, eos_token_id=None)
    reference = model.generate(**kwargs)
    for draft, extra in (("streamingllm", dict(sink_tokens=2)), ("snapkv", dict(window=6)),
                         ("dynamic", dict(sink_tokens=1, page_size=2, recent_window=6)),
                         ("snapkv", dict(window=6, refresh_every=5))):
        out = model.generate(**kwargs, speculative="magicdec", draft=draft, draft_budget=16, gamma=3, **extra)
        _assert_same(reference, out, f"long/{draft}")


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize(
    "draft,refresh",
    [("snapkv", dict(refresh_every=4)), ("snapkv", dict(refresh_below=0.99)), ("streamingllm", dict(refresh_every=4))],
    ids=["snapkv-every4", "snapkv-below0.99", "streamingllm-every4"],
)
def test_greedy_identical_with_refresh(tiny_models, arch, draft, refresh):
    """Re-selecting the static part during generation (hf_magicdec.engine.refresh) changes nothing in the output."""
    model = tiny_models(arch)
    ids, mask = ragged_prompts(batch=4, length=48, seed=7)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None)
    reference = model.generate(**kwargs)
    out = model.generate(**kwargs, speculative="magicdec", draft=draft, draft_budget=16, gamma=3,
                         return_dict_in_generate=True, **DRAFTS[draft], **refresh)
    _assert_same(reference, out.sequences, f"{arch}/{draft}/{refresh}")
    assert out.speculation.refreshes > 0


def test_unpadded_batch_and_single_row(tiny_models):
    model = tiny_models("qwen2-gqa7")
    ids = torch.randint(3, 128, (3, 33), generator=torch.Generator().manual_seed(5))
    ref = model.generate(input_ids=ids, max_new_tokens=17, do_sample=False)
    out = model.generate(input_ids=ids, max_new_tokens=17, do_sample=False, speculative="magicdec", gamma=2,
                         draft_budget=20, sink_tokens=2)
    _assert_same(ref, out, "unpadded")
    ref1 = model.generate(input_ids=ids[:1], max_new_tokens=17, do_sample=False)
    out1 = model.generate(input_ids=ids[:1], max_new_tokens=17, do_sample=False, speculative="magicdec",
                          draft_budget=20, sink_tokens=2, gamma=3)
    _assert_same(ref1, out1, "batch 1")


def test_prefill_chunking_is_exact(tiny_models):
    """Chunked prefill (chunks smaller than the prompt, not dividing it) gives the same tokens."""
    model = tiny_models("llama-gqa3")
    ids, mask = ragged_prompts(batch=3, length=50, seed=8)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, speculative="magicdec",
        prefill_chunk_size=7, draft="snapkv", draft_budget=30, window=8,
    )
    _assert_same(ref, out, "chunked prefill")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_gamma_zero_is_plain_decoding_on_our_cache(tiny_models, arch):
    """gamma=0 (the benchmark's own-AR baseline) drafts nothing and equals generate, EOS included."""
    model = tiny_models(arch)
    ids, mask = ragged_prompts(batch=4, length=40, seed=21)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0,
                  eos_token_id=[EOS], repetition_penalty=1.2)
    reference = model.generate(**kwargs)
    out = model.generate(**kwargs, speculative="magicdec", gamma=0, draft="snapkv", return_dict_in_generate=True)
    _assert_same(reference, out.sequences, f"{arch}/gamma=0")
    stats = out.speculation
    assert stats.tokens_per_step == 1.0 and stats.acceptance_rate == 0.0
    assert stats.plain_row_steps == sum(map(len, stats.accepted_lengths)) and not any(stats.histogram())
    assert stats.measured_speedup() is None  # no speculative step to compare

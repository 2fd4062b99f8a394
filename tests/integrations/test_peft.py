"""PEFT LoRA models through MagicDec: ``PeftModelForCausalLM.generate`` reaches the routing (it
calls the base model's ``generate``), and the engine then runs the model with its LoRA layers, so
greedy output is identical to the PeftModel's own stock ``generate``. The self-draft on quantized
weights (``draft_weights="int8"`` / ``"fp16"``, or chosen by the planner under ``"auto"``) copies
the model's linear layers: it must either carry the adapters or be refused, with a reason, before
any forward.
"""

from __future__ import annotations

import re

import pytest
import torch

peft = pytest.importorskip("peft")

from conftest import make_model, ragged_prompts
from integration_utils import ModelState, counting_forwards

SPEC = {"speculative": "magicdec", "draft": "streamingllm", "draft_budget": 16, "sink_tokens": 4, "gamma": 3}



def lora_model(seed: int = 0, lora_dropout: float = 0.0):
    """A tiny Llama with LoRA adapters on q/v that change its greedy output everywhere."""
    base = make_model("llama-gqa3")
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=lora_dropout,
                             init_lora_weights=False)
    return peft.get_peft_model(base, config).eval()


def inputs(batch: int = 3, length: int = 40, new: int = 16):
    ids, mask = ragged_prompts(batch, length, seed=3)
    return {"input_ids": ids, "attention_mask": mask, "max_new_tokens": new, "eos_token_id": None, "do_sample": False}


def _speculated(out, draft: str = "streamingllm") -> bool:
    s = out.speculation
    return s.draft == draft and sum(len(r) for r in s.accepted_lengths) > 0


def test_adapters_change_the_output():
    """The premise of this file: with the adapters disabled the model generates something else."""
    model, kw = lora_model(), inputs()
    with_adapters = model.generate(**kw)
    with model.disable_adapter():
        without = model.generate(**kw)
    assert not torch.equal(with_adapters, without)


def test_lora_model_identical_to_its_stock_generate():
    model, kw = lora_model(), inputs()
    stock = model.generate(**kw)
    before = ModelState.of(model)
    out = model.generate(**kw, **SPEC, return_dict_in_generate=True)
    assert _speculated(out), out.speculation
    assert torch.equal(out.sequences, stock)
    before.assert_same(ModelState.of(model), "LoRA model")


def test_lora_model_in_training_mode_identical_to_its_stock_generate():
    """What TRL does with a PEFT model: generate in training mode (``lora_dropout=0``)."""
    model, kw = lora_model(), inputs()
    model.train()
    stock = model.generate(**kw)
    before = ModelState.of(model)
    out = model.generate(**kw, **SPEC, return_dict_in_generate=True)
    assert _speculated(out)
    assert torch.equal(out.sequences, stock)
    before.assert_same(ModelState.of(model), "LoRA model in training mode")


def test_lora_dropout_in_training_mode_is_refused_before_any_forward():
    model = lora_model(lora_dropout=0.1).train()
    before = ModelState.of(model)
    with counting_forwards(model.get_base_model()) as forwards, \
            pytest.raises(NotImplementedError, match=r"(?i)training mode.*dropout.*eval\(\)"):
        model.generate(**inputs(), **SPEC)
    assert forwards[0] == 0
    before.assert_same(ModelState.of(model), "refused LoRA model")


def _quantized_kernel_available(fmt: str) -> bool:
    """Whether this machine runs ``fmt`` draft weights at all (asked on a plain model)."""
    try:
        make_model("llama-gqa3").generate(**inputs(batch=1, new=2), **SPEC, draft_weights=fmt)
    except ValueError as exc:
        if "not available" in str(exc):
            return False
        raise
    return True


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("fmt", ["int8", "fp16"])
def test_quantized_draft_carries_the_adapters_or_is_refused(fmt, mode):
    """Either refused before any forward with a message naming the adapters, or identical output
    with an acceptance that shows the quantized draft drafts *with* the adapters: with the ``full`` view the
    draft differs from the target only by the quantized weights (a plain model accepts > 0.95
    there), while a quantized draft without the adapters would draft the base model, which agrees with the
    adapted one on no token of this prompt batch. In training mode (TRL) the model's flags, the
    adapters' included, stay as they were."""
    if not _quantized_kernel_available(fmt):
        pytest.skip(f"no {fmt} draft kernel on this machine")
    model, kw = lora_model(), inputs()
    model.train(mode == "train")
    stock = model.generate(**kw)
    before = ModelState.of(model)
    try:
        with counting_forwards(model.get_base_model()) as forwards:
            out = model.generate(**kw, speculative="magicdec", draft="full", gamma=3, draft_weights=fmt,
                                 return_dict_in_generate=True)
    except (ValueError, NotImplementedError) as exc:
        assert re.search(r"(?i)adapter|lora|peft", str(exc)), f"refused without naming the adapters: {exc}"
        assert forwards[0] == 0, "refused only after a forward"
    else:
        assert out.speculation.draft_weights == fmt
        assert torch.equal(out.sequences, stock)
        assert out.speculation.acceptance_rate > 0.9, out.speculation.acceptance_rate
    before.assert_same(ModelState.of(model), f"LoRA model, draft_weights={fmt}")


def test_auto_draft_weights_on_a_lora_model_identical_to_stock():
    """The default ``draft_weights="auto"``: with the view and budget explicit and γ left to the
    planner, the planner also picks the draft weights (on this CPU preset: a quantized draft where a
    kernel exists). Whatever it picks, a LoRA model must generate exactly as its stock generate."""
    if not (_quantized_kernel_available("int8") or _quantized_kernel_available("fp16")):
        pytest.skip("no quantized draft kernel on this machine: the planner can only pick full weights")
    model, kw = lora_model(), inputs(length=64)
    stock = model.generate(**kw)
    out = model.generate(**kw, speculative="magicdec", draft="streamingllm", draft_budget=16, sink_tokens=4,
                         hardware="cpu", return_dict_in_generate=True)
    assert torch.equal(out.sequences, stock)

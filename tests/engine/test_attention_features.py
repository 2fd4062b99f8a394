"""Attention features are honoured or refused, never dropped.

* logit soft-capping (Gemma 2 ``softcap``) and attention sinks (gpt-oss ``s_aux``) against the
  models' own eager attention, in the PyTorch twin and the Triton kernel (interpreter on CPU);
* end to end on tiny Gemma 2 / gpt-oss models where the feature changes the greedy tokens;
* keywords MagicDec does not implement are refused before any forward;
* while a model is switched to ``"magicdec"``, a forward that is not the engine's computes
  exactly what the model's own implementation computes.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM, LlamaForCausalLM
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.llama import modeling_llama

from conftest import PAD, make_model, ragged_prompts
from hf_magicdec.engine import attention
from hf_magicdec import kernels
from hf_magicdec.kernels import Segments, reference

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=PAD, bos_token_id=1,
              eos_token_id=2)


class _Module(torch.nn.Module):
    """Just enough of an attention module for the models' eager functions."""

    def __init__(self, heads, kv_heads, head_dim, sinks=None):
        super().__init__()
        self.num_key_value_groups = heads // kv_heads
        self.head_dim = head_dim
        self.sinks = sinks
        self.eval()


def _case(group, q_len, seed=0, batch=3, kv_heads=2, length=37, head_dim=16):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, kv_heads * group, q_len, head_dim, generator=g) * 3
    key = torch.randn(batch, kv_heads, length, head_dim, generator=g) * 3
    value = torch.randn(batch, kv_heads, length, head_dim, generator=g)
    # Ragged rows with left padding, causal inside the query block (a verify step).
    pad = torch.tensor([0, 5, 11])[:batch]
    end = torch.tensor([length, length - 4, length - 9])[:batch]
    segments = Segments.causal(pad, end)
    return query, key, value, segments


def _additive(mask):
    return torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_softcap_matches_gemma2_eager(group, q_len, backend):
    query, key, value, segments = _case(group, q_len, seed=group * 10 + q_len)
    mask = segments.mask(q_len, key.shape[2])
    softcap = 0.5  # logits are ~±30 before the cap: it bites
    want, _ = modeling_gemma2.eager_attention_forward(
        _Module(query.shape[1], key.shape[1], 16), query, key, value, _additive(mask), scaling=0.25, softcap=softcap
    )
    if backend == "torch":
        got = reference.segment_attention(query, key, value, segments, 0.25, softcap=softcap)
    else:
        got = kernels._triton().segment_attention(query, key, value, segments, 0.25, softcap=softcap, num_splits=2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    uncapped = reference.segment_attention(query, key, value, segments, 0.25)
    assert not torch.allclose(uncapped, want, atol=1e-2)  # the cap really changes the result


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("backend", ["torch", "triton-1", "triton-2"])
def test_sinks_match_gpt_oss_eager(group, q_len, backend):
    query, key, value, segments = _case(group, q_len, seed=group * 7 + q_len)
    query = query / 3  # moderate logits, so a sink of a few units matters
    mask = segments.mask(q_len, key.shape[2])
    sinks = torch.linspace(-1.0, 4.0, query.shape[1])
    want, _ = modeling_gpt_oss.eager_attention_forward(
        _Module(query.shape[1], key.shape[1], 16, sinks), query, key, value, _additive(mask), scaling=0.25
    )
    if backend == "torch":
        got = reference.segment_attention(query, key, value, segments, 0.25, sinks=sinks)
    else:
        splits = int(backend[-1])
        got = kernels._triton().segment_attention(query, key, value, segments, 0.25, sinks=sinks, num_splits=splits)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(reference.segment_attention(query, key, value, segments, 0.25), want, atol=1e-2)


def test_prefill_path_accepts_additive_float_masks():
    """Models that turn the mask into an additive float one get the same result as with bool."""
    query, key, value, segments = _case(3, 5)
    mask = segments.mask(5, key.shape[2])
    torch.testing.assert_close(
        reference.gqa_attention(query, key, value, _additive(mask), 0.25),
        reference.gqa_attention(query, key, value, mask, 0.25),
    )


def _gemma2(seed=0):
    torch.manual_seed(seed)
    config = Gemma2Config(**COMMON, attn_logit_softcapping=0.05, final_logit_softcapping=None, sliding_window=512)
    model = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # logits far beyond the cap
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
        model.lm_head.weight.mul_(2.0)  # mild: Gemma's norms make sharp argmaxes insensitive to attention
    return model


def _gpt_oss(seed=0):
    torch.manual_seed(seed)
    config = GptOssConfig(**{**COMMON, "intermediate_size": 64}, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=512)
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-2.0, 3.0, layer.self_attn.sinks.numel()))
        model.lm_head.weight.mul_(8.0)
    return model


def _generate_pair(model, **options):
    ids, mask = ragged_prompts(batch=3, length=24, seed=1)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None,
                  pad_token_id=PAD)
    return model.generate(**kwargs), model.generate(**kwargs, speculative="magicdec", **options)


@pytest.mark.parametrize("build,feature", [(_gemma2, "softcap"), (_gpt_oss, "s_aux")])
@pytest.mark.parametrize("draft", ["streamingllm", "snapkv"])
def test_feature_models_identical_to_generate(build, feature, draft, monkeypatch):
    model = build()
    options = dict(draft=draft, draft_budget=8, gamma=3, **({"sink_tokens": 2} if draft == "streamingllm" else
                                                              {"window": 4}))
    stock, spec = _generate_pair(model, **options)
    assert torch.equal(stock, spec)
    # The feature bites: dropping it (the old behaviour) changes the tokens, so this test can fail.
    real = attention.magicdec_attention_forward

    def dropping(*args, **kwargs):
        kwargs.pop(feature, None)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "magicdec_attention_forward", dropping)
    from transformers import AttentionInterface

    AttentionInterface.register(attention.ATTENTION_NAME, dropping)
    try:
        _, dropped = _generate_pair(model, **options)
    finally:
        AttentionInterface.register(attention.ATTENTION_NAME, real)
    assert not torch.equal(stock, dropped)


class _SparseAttention(modeling_llama.LlamaAttention):
    """A Llama attention that passes a keyword MagicDec does not implement."""

    def forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
        attention_interface = modeling_llama.eager_attention_forward
        return attention_interface(self, hidden_states, hidden_states, hidden_states, attention_mask,
                                   indices=None, **kwargs)


def _count_forwards(model):
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_unknown_attention_keyword_refused_before_any_forward():
    model = make_model("llama-gqa3")
    for layer in model.model.layers:
        layer.self_attn.__class__ = _SparseAttention
    calls = _count_forwards(model)
    ids, mask = ragged_prompts(batch=2, length=12)
    before = model.config._attn_implementation
    with pytest.raises(NotImplementedError, match="indices"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, speculative="magicdec")
    assert calls == [] and model.config._attn_implementation == before


def test_unknown_runtime_keyword_refused():
    query, key, value, segments = _case(1, 1)

    from hf_magicdec.engine.cache import CacheOptions

    class Forward:  # the open forward of a verify step: its key ranges
        def segments(self, device):
            return segments

        def layer_of(self, key, default):
            return default

        def before_attention(self, *args):
            pass

        def mass_page_size(self, layer_idx):  # no verification-guided view: no attention mass
            return 0

    class Cache:
        options = CacheOptions(position_limit=100)
        forward = Forward()

    module = _Module(2, 2, 16)
    module.layer_idx = 0
    with pytest.raises(NotImplementedError, match="some_new_feature"):
        attention.magicdec_attention_forward(module, query, key, value, None, magicdec_cache=Cache(),
                                             some_new_feature=1.0)
    with pytest.raises(NotImplementedError, match="sliding window"):
        attention.magicdec_attention_forward(module, query, key, value, None, magicdec_cache=Cache(),
                                             sliding_window=64)
    attention.magicdec_attention_forward(module, query, key, value, None, magicdec_cache=Cache(),
                                         sliding_window=100)  # the whole generation fits: honoured


def test_training_mode_with_dropout_refused():
    model = make_model("llama-gqa3", attention_dropout=0.1, hidden_dropout=0.1).train()
    has_dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    ids, mask = ragged_prompts(batch=2, length=12)
    if has_dropout:
        with pytest.raises(NotImplementedError, match="eval"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, speculative="magicdec")
    model.eval()


@pytest.mark.parametrize("build", [_gemma2, lambda: make_model("llama-gqa3")], ids=["gemma2-eager", "llama-sdpa"])
def test_foreign_forward_while_switched_uses_original_attention(build):
    """A plain forward on a switched model (another thread's `generate`) is unaffected."""
    model = build()
    ids, mask = ragged_prompts(batch=3, length=20, seed=3)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        original = model.config._attn_implementation
        with attention.switched(model), attention.switched(model):  # nested: reference-counted
            assert model.config._attn_implementation == attention.ATTENTION_NAME
            got = model(input_ids=ids, attention_mask=mask).logits
        assert model.config._attn_implementation == original
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert isinstance(model, (Gemma2ForCausalLM, LlamaForCausalLM))

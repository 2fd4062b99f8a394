"""Public API: routing, configuration paths, parity features of ``generate``, errors, restoration."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationConfig,
    StoppingCriteria,
    StoppingCriteriaList,
    T5Config,
    T5ForConditionalGeneration,
    TextStreamer,
)
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerationMixin

import hf_magicdec
from hf_magicdec import MagicDecConfig, MagicDecOutput

from conftest import EOS, VOCAB, make_model, ragged_prompts


# Explicit settings: the engine runs (with everything left "auto", the planner may decode plainly).
ENGINE = dict(draft_budget=12, sink_tokens=2, gamma=3)


@pytest.fixture()

def llama(tiny_models):
    return tiny_models("llama-gqa3")


@pytest.fixture()
def batch():
    return ragged_prompts(batch=3, length=30, seed=21)


def _gen(model, ids, mask, **kwargs):
    base = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    base.update(kwargs)
    return model.generate(**base)


# ---------------------------------------------------------------- routing
def test_routing_is_a_no_op_without_speculative(llama, batch):
    ids, mask = batch
    with_routing = _gen(llama, ids, mask, repetition_penalty=1.1)
    hf_magicdec.disable()
    try:
        stock = _gen(llama, ids, mask, repetition_penalty=1.1)
    finally:
        hf_magicdec.enable()
    assert torch.equal(with_routing, stock)


def test_signature_is_untouched_and_enable_disable_idempotent(llama, batch):
    assert hf_magicdec.is_enabled()
    routed_sig = inspect.signature(GenerationMixin.generate)
    hf_magicdec.disable()
    hf_magicdec.disable()
    try:
        assert not hf_magicdec.is_enabled()
        assert inspect.signature(GenerationMixin.generate) == routed_sig
        ids, mask = batch
        with pytest.raises(ValueError, match="speculative"):  # HF's own unknown-kwarg error
            _gen(llama, ids, mask, speculative="magicdec")
    finally:
        hf_magicdec.enable()
        hf_magicdec.enable()
    assert hf_magicdec.is_enabled()
    wrapped = GenerationMixin.generate
    hf_magicdec.enable()
    assert GenerationMixin.generate is wrapped  # no double wrapping


def test_no_patch_environment_variable():
    code = "import hf_magicdec, sys; sys.exit(0 if not hf_magicdec.is_enabled() else 1)"
    env = {"HF_MAGICDEC_NO_PATCH": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


def test_custom_generate_path_without_patching(llama, batch):
    ids, mask = batch
    ref = _gen(llama, ids, mask)
    out = _gen(llama, ids, mask, custom_generate=hf_magicdec.generate, gamma=3, draft="snapkv", draft_budget=16, window=4)
    assert torch.equal(ref, out)


def test_config_object_and_dict(llama, batch):
    ids, mask = batch
    ref = _gen(llama, ids, mask)
    cfg = MagicDecConfig.from_any(draft="streamingllm", draft_budget=12, sink_tokens=2, gamma=3)
    out = _gen(llama, ids, mask, speculative=cfg, return_dict_in_generate=True)
    assert torch.equal(ref, out.sequences)
    assert out.speculation.draft_budget == 12 and out.speculation.gamma == 3
    out = _gen(llama, ids, mask, speculative={"method": "magicdec", "draft": "snapkv", "draft_budget": 14, "window": 4},
               return_dict_in_generate=True)
    assert torch.equal(ref, out.sequences) and out.speculation.draft == "snapkv"


def test_generation_config_round_trip_routes(tmp_path, llama, batch):
    ids, mask = batch
    ref = _gen(llama, ids, mask)
    gc = GenerationConfig(
        speculative={"method": "magicdec", "draft": "snapkv", "draft_budget": 16, "window": 4, "gamma": 2},
        max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=EOS,
    )
    gc.save_pretrained(tmp_path)
    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert loaded.speculative["draft"] == "snapkv"
    out = llama.generate(input_ids=ids, attention_mask=mask, generation_config=loaded, return_dict_in_generate=True)
    assert isinstance(out, MagicDecOutput) and out.speculation.gamma == 2
    assert torch.equal(ref, out.sequences)
    # A model saved with `speculative` in its generation_config.json routes on load.
    saved_model = make_model("llama-gqa3")
    hf_magicdec.set_default_speculation(saved_model, gamma=3, draft_budget=12, sink_tokens=2)
    saved_model.save_pretrained(tmp_path / "model")
    reloaded = type(saved_model).from_pretrained(tmp_path / "model").eval()
    assert reloaded.generation_config.speculative["gamma"] == 3
    out = reloaded.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, return_dict_in_generate=True)
    assert isinstance(out, MagicDecOutput) and out.speculation.gamma == 3
    assert torch.equal(out.sequences, _gen(saved_model, ids, mask, speculative=None))


# ---------------------------------------------------------------- parity features
def test_max_length_exact(llama, batch):
    ids, mask = batch
    ref = llama.generate(input_ids=ids, attention_mask=mask, max_length=37, do_sample=False)
    out = llama.generate(input_ids=ids, attention_mask=mask, max_length=37, do_sample=False, speculative="magicdec",
                         gamma=6, draft="full")
    assert ref.shape[1] == 37 and torch.equal(ref, out)


def test_num_return_sequences(llama, batch):
    ids, mask = batch
    torch.manual_seed(0)
    out = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=True,
                         num_return_sequences=3, speculative="magicdec", **ENGINE)
    assert out.shape == (9, 38)
    assert torch.equal(out[0, :30], out[2, :30]) and torch.equal(out[3, :30], ids[1])


def test_scores_and_logits_match_stock(llama, batch):
    ids, mask = batch
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, repetition_penalty=1.2,
                  return_dict_in_generate=True, output_scores=True, output_logits=True)
    ref = llama.generate(**kwargs)
    out = llama.generate(**kwargs, speculative="magicdec", gamma=3, draft_budget=12, sink_tokens=2)
    assert torch.equal(ref.sequences, out.sequences)
    assert len(out.scores) == len(ref.scores) == len(out.logits)
    for a, b, la, lb in zip(ref.scores, out.scores, ref.logits, out.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
    stats = out.speculation
    assert len(stats.accepted_lengths) == 3 and all(len(r) > 0 for r in stats.accepted_lengths)
    assert 0.0 <= stats.acceptance_rate <= 1.0 and 1.0 <= stats.tokens_per_step <= 4.0
    assert sum(stats.histogram()) + stats.plain_row_steps == sum(len(r) for r in stats.accepted_lengths)


class _Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.chunks.append("end")


def test_streamer_batch_one(llama):
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    stock, spec = _Collect(), _Collect()
    ref = llama.generate(input_ids=ids, max_new_tokens=15, do_sample=False, streamer=stock)
    out = llama.generate(input_ids=ids, max_new_tokens=15, do_sample=False, streamer=spec, speculative="magicdec",
                         gamma=4, draft="full")
    assert torch.equal(ref, out)
    flat = lambda chunks: [t for c in chunks if c != "end" for t in c]  # noqa: E731
    assert flat(stock.chunks) == flat(spec.chunks) and spec.chunks[-1] == "end"
    assert len(spec.chunks) < len(stock.chunks)  # several tokens per verification step


def test_streamer_batch_two_raises_hf_error(llama, batch):
    ids, mask = batch

    class _Tok:
        def decode(self, *a, **k):
            return ""

    with pytest.raises(ValueError, match="TextStreamer only supports batch size 1"):
        _gen(llama, ids, mask, streamer=TextStreamer(_Tok()), speculative="magicdec", **ENGINE)


class _StopOnToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("with_eos", [True, False])
def test_user_stopping_criteria(llama, batch, with_eos):
    ids, mask = batch
    plain = _gen(llama, ids, mask, max_new_tokens=20, eos_token_id=None)
    token = int(plain[0, 30 + 6])
    kwargs = dict(max_new_tokens=20, stopping_criteria=StoppingCriteriaList([_StopOnToken(token)]))
    kwargs["eos_token_id"] = EOS if with_eos else None
    if not with_eos:
        kwargs["pad_token_id"] = None
    ref = _gen(llama, ids, mask, **kwargs)
    out = _gen(llama, ids, mask, speculative="magicdec", gamma=4, draft_budget=12, sink_tokens=2, **kwargs)
    assert torch.equal(ref, out)
    if with_eos:  # row 0 stopped at (or before) new token 6 and was padded after it
        assert ref.shape[1] > 37 and (ref[0, 37:] == 0).all()
    else:  # stock keeps generating flagged rows until every row is flagged
        assert token in ref[0, 30:37].tolist()


def _char_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(ord("a"), ord("a") + VOCAB - 3)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def test_stop_strings(llama, batch):
    ids, mask = batch
    tokenizer = _char_tokenizer()
    plain = _gen(llama, ids, mask, max_new_tokens=20)
    stop = tokenizer.decode(plain[1, 30 + 5 : 30 + 7])
    ref = _gen(llama, ids, mask, max_new_tokens=20, stop_strings=[stop], tokenizer=tokenizer)
    out = _gen(llama, ids, mask, max_new_tokens=20, stop_strings=[stop], tokenizer=tokenizer,
               speculative="magicdec", gamma=5, draft="full")
    assert torch.equal(ref, out)
    assert ref.shape[1] < 50 or (ref[1, 37:] == 0).all()


def test_hybrid_sliding_model_within_window(batch):
    """Gemma 3 (sliding + global layers) works when the whole generation fits in the window."""
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=64,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=256)
    model = Gemma3ForCausalLM(cfg).eval()
    ids, mask = batch
    ref = _gen(model, ids, mask, max_new_tokens=20)
    out = _gen(model, ids, mask, max_new_tokens=20, speculative="magicdec", draft_budget=12, sink_tokens=2)
    assert torch.equal(ref, out)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        _gen(model, ids, mask, max_new_tokens=60, speculative="magicdec")


# ---------------------------------------------------------------- errors, raised before any forward
@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(num_beams=2), ValueError, "beam search"),
        (dict(prompt_lookup_num_tokens=3), ValueError, "prompt lookup"),
        (dict(gamma=-1), ValueError, "gamma"),
        (dict(gamma=2.5), ValueError, "gamma"),
        (dict(draft="quest"), ValueError, "Unknown draft view"),
        (dict(draft_budget=8, sink_tokens=8), ValueError, "sink_tokens"),
        (dict(draft="snapkv", draft_budget=16, window=32), ValueError, "window"),
        (dict(draft_budget=6, sink_tokens=2, gamma=4), ValueError, "gamma \\+ 1"),
        (dict(speculative="medusa"), ValueError, "speculative"),
        (dict(speculative={"method": "magicdec", "budget": 3}), ValueError, "Unknown MagicDec option"),
        # a near-miss of an option is named with the likely name, by the chosen view when it is one of its own
        (dict(draft="snapkv", draft_budget=16, windw=4), ValueError,
         r"'snapkv' draft view has no option\(s\) \['windw'\] \(did you mean 'window'\?\)"),
        (dict(gama=2), ValueError, r"Unknown MagicDec option 'gama' \(did you mean 'gamma'\?\)"),
        (dict(output_attentions=True, return_dict_in_generate=True), NotImplementedError, "attentions"),
    ],
)
def test_invalid_settings_raise(llama, batch, kwargs, error, match, monkeypatch):
    ids, mask = batch
    calls = []
    monkeypatch.setattr(llama, "forward", lambda *a, **k: calls.append(1))
    kwargs.setdefault("speculative", "magicdec")
    with pytest.raises(error, match=match):
        _gen(llama, ids, mask, **kwargs)
    assert not calls, "a forward ran before the error"


def test_assistant_model_is_taken_as_draft_model(llama, batch):
    """assistant_model= names the draft model (tests/test_cache_reuse.py runs one); the target itself is refused as such."""
    ids, mask = batch
    with pytest.raises(ValueError, match="draft_model is the target model itself"):
        _gen(llama, ids, mask, speculative="magicdec", assistant_model=llama)


def test_right_padding_refused(llama, batch):
    ids, mask = batch
    with pytest.raises(ValueError, match="left padding"):
        _gen(llama, ids, mask.flip(1), speculative="magicdec")


def test_unsupported_models_refused(batch):
    ids, mask = batch
    bloom = BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=2)).eval()
    with pytest.raises(NotImplementedError, match="AttentionInterface"):
        _gen(bloom, ids, mask, speculative="magicdec")
    t5 = T5ForConditionalGeneration(
        T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, decoder_start_token_id=0)
    ).eval()
    with pytest.raises(NotImplementedError, match="encoder-decoder"):
        t5.generate(input_ids=ids, max_new_tokens=4, speculative="magicdec")
    mistral = make_model("mistral-mha", sliding_window=16)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        _gen(mistral, ids, mask, speculative="magicdec")


# ---------------------------------------------------------------- nothing lost on failure
class _Boom(StoppingCriteria):
    def __init__(self, exc):
        self.exc, self.calls = exc, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        if self.calls > 2:
            raise self.exc
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_failure_restores_model(llama, batch, exc):
    ids, mask = batch
    attn_before = llama.config._attn_implementation
    gc_before = llama.generation_config.to_dict()
    with pytest.raises(type(exc)):
        _gen(llama, ids, mask, speculative="magicdec", stopping_criteria=StoppingCriteriaList([_Boom(exc)]), **ENGINE)
    assert llama.config._attn_implementation == attn_before
    assert llama.generation_config.to_dict() == gc_before
    # And the model still generates exactly as before.
    assert torch.equal(_gen(llama, ids, mask), _gen(llama, ids, mask, speculative="magicdec", **ENGINE))


def test_shared_prefill_reuses_one_prefill_and_changes_nothing(llama, monkeypatch):
    from hf_magicdec import shared_prefill
    from hf_magicdec.engine import loop

    ids, mask = ragged_prompts(batch=3, length=40, seed=13)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                  speculative="magicdec")
    configs = [dict(draft="snapkv", draft_budget=16, window=6, gamma=3), dict(draft="streamingllm", draft_budget=12,
               sink_tokens=2, gamma=2), dict(draft="snapkv", draft_budget=20, window=4, gamma=3)]
    plain = [llama.generate(**kwargs, **c) for c in configs]
    calls = []
    original = loop.prefill
    monkeypatch.setattr(loop, "prefill", lambda *a, **k: calls.append(1) or original(*a, **k))
    with shared_prefill():
        shared = [llama.generate(**kwargs, **c) for c in configs]
        llama.generate(**{**kwargs, "input_ids": ids.flip(0), "attention_mask": mask.flip(0)}, **configs[0])
    assert all(torch.equal(a, b) for a, b in zip(plain, shared))
    assert len(calls) == 2  # the first config's prefill served the other two; other prompts computed anew
    llama.generate(**kwargs, **configs[0])
    assert len(calls) == 3  # nothing is kept outside the block


def test_every_config_field_is_a_generate_keyword(tiny_models):
    """max_gamma and hardware reach MagicDecConfig through model.generate like the other fields."""
    model = tiny_models("llama-gqa3")
    ids = torch.randint(3, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    out = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                         speculative="magicdec", draft="streamingllm", draft_budget=24, sink_tokens=4, gamma="auto",
                         max_gamma=2, hardware="h100", return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(input_ids=ids, max_new_tokens=12, do_sample=False,
                                                     eos_token_id=None))
    assert out.speculation.gamma_trace and max(out.speculation.gamma_trace) <= 2
    assert "H100" in out.speculation.plan["hardware"]
    with pytest.raises(ValueError, match="max_gamma must be in"):
        model.generate(input_ids=ids, max_new_tokens=4, speculative="magicdec", max_gamma=0)

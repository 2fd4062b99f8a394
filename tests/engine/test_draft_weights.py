"""Quantized self-draft (``draft_weights=``): lossless, the target untouched, priced by the planner."""

from __future__ import annotations

import functools
import gc

import pytest
import torch
from scipy import stats
from torch import nn

import hf_magicdec
from conftest import ARCHS, make_model, ragged_prompts
from hf_magicdec import MagicDecConfig
from hf_magicdec.engine import draft_weights as dw
from hf_magicdec.planner import ModelSpec, default_acceptance
from hf_magicdec.planner import SearchSpace, Workload, search_plan as plan
from hf_magicdec.planner.roofline import draft_step
from hf_magicdec.planner.hardware import get_hardware
from hf_magicdec.views import get_view

CPU = torch.device("cpu")
# fp16 draft weights need fbgemm (x86 CPUs); ARM CPUs (QNNPACK) have int8 only.
needs_fp16 = pytest.mark.skipif("fp16" not in dw.supported_formats(CPU), reason="no fbgemm fp16 kernel on this CPU")


def _generate(model, ids, mask, **kwargs):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                          eos_token_id=None, **kwargs)


@pytest.mark.parametrize("arch,draft,fmt", [*((a, "snapkv", "int8") for a in ARCHS),
                                            ("llama-gqa3", "streamingllm", "int8"), ("mistral-mha", "dynamic", "int8"),
                                            pytest.param("qwen2-gqa7", "snapkv", "fp16", marks=needs_fp16),
                                            pytest.param("mistral-mha", "streamingllm", "fp16", marks=needs_fp16)])
def test_compressed_draft_is_lossless(tiny_models, arch, draft, fmt):
    model = tiny_models(arch)
    ids, mask = ragged_prompts(batch=4, length=48, seed=1)
    reference = _generate(model, ids, mask)
    options = {"snapkv": dict(window=8), "streamingllm": dict(sink_tokens=4),
               "dynamic": dict(sink_tokens=1, page_size=4, recent_window=7)}[draft]
    out = _generate(model, ids, mask, speculative="magicdec", draft=draft, draft_budget=16, gamma=3,
                    draft_weights=fmt, return_dict_in_generate=True, **options)
    assert torch.equal(out.sequences, reference)
    assert out.speculation.draft_weights == fmt and out.speculation.draft_weight_bytes > 0


def test_target_never_runs_quantized_and_is_left_as_it_was():
    """Prefill and verification call the model's own linear layers; only draft forwards call the
    quantized draft's. The model's modules, weights and state_dict are unchanged."""
    model = make_model("llama-gqa3", seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    types = {n: type(m) for n, m in model.named_modules()}
    ids, mask = ragged_prompts(batch=3, length=40, seed=2)
    calls = {"target": 0, "quantized": 0}
    handle = model.lm_head.register_forward_hook(lambda *a: calls.__setitem__("target", calls["target"] + 1))
    draft = dw.quantized_draft(model, "int8").module
    draft_handle = draft.lm_head.register_forward_hook(
        lambda *a: calls.__setitem__("quantized", calls["quantized"] + 1))
    try:
        out = _generate(model, ids, mask, speculative="magicdec", draft="streamingllm", draft_budget=12,
                        sink_tokens=2, gamma=2, draft_weights="int8", prefill_chunk_size=1000,
                        return_dict_in_generate=True)
    finally:
        handle.remove()
        draft_handle.remove()
    s = out.speculation
    assert calls["target"] == 1 + s.steps  # one prefill forward + one verification per step
    assert calls["quantized"] == sum(s.gamma_trace) if s.gamma_trace else calls["quantized"] == 2 * s.steps
    assert {n: type(m) for n, m in model.named_modules()} == types
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_quantized_draft_shares_everything_but_the_linear_layers_and_is_cached():
    model = make_model("qwen2-gqa7", seed=3)
    draft = dw.quantized_draft(model, "int8")
    assert dw.quantized_draft(model, "int8") is draft
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert draft.linears == len(linears) and draft.nbytes > 0
    assert not any(type(m) is nn.Linear for m in draft.module.modules())
    assert draft.module.model.embed_tokens.weight is model.model.embed_tokens.weight
    assert draft.module.model.norm.weight is model.model.norm.weight
    assert draft.module.config is model.config
    # An in-place update of the model's weights makes a new quantized draft (stale drafts would only cost
    # acceptance).
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    assert dw.quantized_draft(model, "int8") is not draft


def test_quantized_draft_is_freed_with_the_model():
    model = make_model("llama-gqa3", seed=5)
    dw.quantized_draft(model, "int8")
    assert model in dw._QUANTIZED
    count = len(dw._QUANTIZED)
    del model
    gc.collect()
    assert len(dw._QUANTIZED) == count - 1


@pytest.mark.parametrize("fmt", ["int8", pytest.param("fp16", marks=needs_fp16)])
def test_compressed_draft_samples_the_target_distribution(fmt):
    """Seeded sampling with a quantized draft: emitted tokens follow the model's own distribution
    (two-sample chi-square against stock sampling of the 2nd and 3rd generated tokens)."""
    model = make_model("llama-gqa3", seed=4, vocab_size=12)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.2)
    prompt = torch.randint(3, 12, (24,), generator=torch.Generator().manual_seed(0))
    rows = 2000
    kwargs = dict(input_ids=prompt.expand(rows, -1).clone(), max_new_tokens=3, do_sample=True, top_k=0,
                  temperature=1.0, eos_token_id=None)
    torch.manual_seed(7)
    stock = model.generate(**kwargs)[:, 24:]
    torch.manual_seed(8)
    out = model.generate(**kwargs, speculative="magicdec", draft_budget=8, sink_tokens=2, gamma=2,
                         draft_weights=fmt, return_dict_in_generate=True)
    assert out.speculation.draft_weights == fmt
    new = out.sequences[:, 24:]
    for k in (1, 2):
        table = torch.stack([torch.bincount(stock[:, k], minlength=12), torch.bincount(new[:, k], minlength=12)])
        table = table[:, table.sum(0) > 0].numpy()
        assert stats.chi2_contingency(table).pvalue > 1e-3


@pytest.mark.parametrize("kwargs,match", [
    (dict(draft_weights="int4"), "not available on cpu"),
    (dict(draft_weights="int9"), "draft_weights must be one of"),
])
def test_unavailable_formats_are_refused_before_any_forward(kwargs, match):
    model = make_model("llama-gqa3", seed=1)
    ids, mask = ragged_prompts(batch=2, length=20, seed=1)
    calls = []
    handle = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            _generate(model, ids, mask, speculative="magicdec", draft="snapkv", draft_budget=8, window=4, gamma=2,
                      **kwargs)
    finally:
        handle.remove()
    assert not calls


def test_quantized_draft_with_a_draft_model_or_hooked_model_is_refused():
    model = make_model("llama-gqa3", seed=1)
    small = make_model("llama-gqa3", seed=2)
    with pytest.raises(ValueError, match="separate model"):
        dw.check_draft_weights(model, "int8", CPU, draft_model=small)
    layer = model.model.layers[0]
    layer.forward = functools.partial(type(layer).forward, layer)  # a patched forward, as accelerate's hooks leave
    with pytest.raises(ValueError, match="patched forward"):
        dw.check_draft_weights(model, "int8", CPU)
    assert dw.feasible_formats(model, CPU) == ()


def test_auto_weights_fall_back_to_full_where_quantizing_cannot_help():
    model = make_model("llama-gqa3", seed=1)
    ids, mask = ragged_prompts(batch=2, length=30, seed=1)
    full_view = _generate(model, ids, mask, speculative="magicdec", draft="full", gamma=2, return_dict_in_generate=True)
    assert full_view.speculation.draft_weights == "full" and full_view.speculation.acceptance_rate == 1.0
    own_ar = _generate(model, ids, mask, speculative="magicdec", draft="streamingllm", draft_budget=8, sink_tokens=2,
                       gamma=0,
                       return_dict_in_generate=True)
    assert own_ar.speculation.draft_weights == "full" and own_ar.speculation.draft_weight_bytes == 0


# --------------------------------------------------------------------------- the planner

LLAMA_8B = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
            "intermediate_size": 14336, "vocab_size": 128256, "torch_dtype": "float32"}


def test_quantized_draft_reads_a_quarter_of_the_weight_bytes():
    spec = ModelSpec.from_config(LLAMA_8B)
    hw = get_hardware("cpu")
    full = draft_step(spec, hw, 8, 4096, 256)
    int8 = draft_step(spec.with_weights("int8"), hw, 8, 4096, 256)
    assert int8.groups["linear"].bytes == pytest.approx(full.groups["linear"].bytes / 4)
    assert int8.groups["lm_head"].bytes == pytest.approx(full.groups["lm_head"].bytes / 4)
    assert int8.groups["attention"].bytes == full.groups["attention"].bytes  # the KV view is read as before
    assert int8.seconds < full.seconds
    assert spec.with_weights("int8").key() == spec.key()  # calibrations are per shape, not per format


def test_quantized_acceptance_prior_is_below_the_views():
    view = default_acceptance("snapkv", 256, 4096)
    assert default_acceptance("snapkv@int8", 256, 4096) == pytest.approx(view - 0.06)
    assert default_acceptance("snapkv@fp16", 256, 4096) == pytest.approx(view)  # measured: no loss
    assert default_acceptance("snapkv@int4", 256, 4096) < default_acceptance("snapkv@int8", 256, 4096)


def test_int8_layers_match_torch_ao_dynamic_quantization():
    """Built a few layers at once with their scales computed directly, every int8 layer of the quantized
    draft computes what torch.ao's dynamically quantized linear (``from_float`` with the per-channel
    dynamic qconfig) computes from the same weights, to the bit."""
    import warnings

    from torch.ao.nn.quantized.dynamic import Linear as AoLinear
    from torch.ao.quantization import per_channel_dynamic_qconfig

    model = make_model("llama-gqa3", seed=4)
    draft = dw.quantized_draft(model, "int8")
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    pairs = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    built = dict(draft.module.named_modules())
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # torch.ao's quantized modules are deprecated upstream
        for name, linear in pairs:
            linear.qconfig = per_channel_dynamic_qconfig
            reference = AoLinear.from_float(linear)
            del linear.qconfig
            inputs = x if linear.in_features == x.shape[1] else torch.randn(5, linear.in_features)
            assert torch.equal(built[name](inputs), reference(inputs)), name


@needs_fp16
def test_fp16_quantized_draft_halves_the_weight_bytes_and_keeps_the_logits():
    """fp16 weights, fp32 math: the quantized draft's logits stay within fp16 rounding of the model's,
    where int8's 7-bit activations move them far more (what costs int8 its acceptance)."""
    model = make_model("llama-gqa3", seed=9)
    fp16, int8 = dw.quantized_draft(model, "fp16"), dw.quantized_draft(model, "int8")
    weights = sum(m.weight.numel() for m in model.modules() if type(m) is nn.Linear)
    assert fp16.nbytes == 2 * weights and fp16.linears == int8.linears
    ids = torch.randint(3, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, half, quant = (m(input_ids=ids).logits for m in (model, fp16.module, int8.module))
    err = lambda x: ((x - ref).norm() / ref.norm()).item()
    assert err(half) < 2e-3 and err(half) * 10 < err(quant)


def test_planner_weighs_full_and_int8_weights():
    views = [get_view("snapkv")]
    workload = Workload(8, 4096, 128)
    p = plan(LLAMA_8B, workload, "cpu", SearchSpace(drafts=views, draft_weights=("full", "int8")))
    assert p.draft_weights == "int8"  # on a bandwidth-bound CPU, a quarter of the weight bytes wins
    assert MagicDecConfig.from_any(p).draft_weights == "int8"
    only_full = plan(LLAMA_8B, workload, "cpu", SearchSpace(drafts=views))
    assert only_full.draft_weights == "full" and p.predicted_speedup > only_full.predicted_speedup
    # If the measured acceptance of the quantized draft collapses, full weights win again.
    poor = plan(LLAMA_8B, workload, "cpu", SearchSpace(drafts=views, draft_weights=("full", "int8")),
                acceptance={"snapkv@int8": 0.3, "snapkv": 0.85})
    assert poor.draft_weights == "full"


def test_generate_with_auto_weights_remembers_the_quantized_acceptance():
    model = make_model("llama-gqa3", seed=6)
    hf_magicdec.planner.forget_acceptance(model)
    ids, mask = ragged_prompts(batch=2, length=40, seed=3)
    _generate(model, ids, mask, speculative="magicdec", draft="snapkv", draft_budget=8, window=4, gamma=2,
              draft_weights="int8")
    assert hf_magicdec.planner.observed_acceptance(model, "snapkv@int8", 8) is not None
    assert hf_magicdec.planner.observed_acceptance(model, "snapkv", 8) is None


@pytest.mark.parametrize("per_layer", [0.0, 1e-3, 3e-3])
def test_calibration_fits_the_quantized_kernels_rate_and_per_layer_time(per_layer):
    """fit_quantized recovers the rate and the per-layer host time that generated the quantized
    draft timings; the calibrated hardware then carries both, and a saved calibration keeps them."""
    from hf_magicdec.calibration import Calibration, Measurement, fit_quantized

    spec = ModelSpec.from_config(LLAMA_8B)
    hw = get_hardware("cpu").replace(peak_flops={"float32": 100e9}, format_flops={"int8": 3e11},
                                      format_overhead={"int8": per_layer})
    rows = [Measurement("draft", b, 1, k + 1, 1, 0.0, "int8") for b in (1, 8, 32) for k in (128, 512)]
    rows = [Measurement(**{**m.__dict__, "seconds": m.predict(spec, hw)}) for m in rows]
    rate, fitted_per_layer = fit_quantized(spec, rows, get_hardware("cpu"))["int8"]
    assert rate == pytest.approx(3e11, rel=0.05)
    assert fitted_per_layer == pytest.approx(per_layer, rel=0.1, abs=1e-4)
    cal = Calibration(model="m", spec=spec, device="cpu", dtype="float32", bandwidth=20e9, flops=100e9,
                      overhead=1e-3, overlap=False, measurements=tuple(rows), rel_rms_error=0.0,
                      quantized_flops={"int8": rate}, quantized_overhead={"int8": fitted_per_layer},
                      quantized_build={"int8": 4e-9})
    calibrated = Calibration.from_dict(cal.to_dict()).hardware()
    assert calibrated.format_flops["int8"] == pytest.approx(rate)
    assert calibrated.format_overhead["int8"] == pytest.approx(fitted_per_layer)
    assert calibrated.format_build["int8"] == 4e-9


def test_the_fp16_weight_rate_is_fitted_and_read_apart_from_the_float16_dtype():
    """fp16 *weights* (fbgemm's fp16-weight linear, fp32 math) have their own rate: the fit moves
    it (it once wrote the rate into the float16 dtype's peak, which the planner never reads for fp16
    weights, so every rate fitted equally and the float16 dtype got a nonsense peak)."""
    from hf_magicdec.calibration import Calibration, Measurement, fit_quantized
    from hf_magicdec.planner.roofline import draft_step

    spec = ModelSpec.from_config(LLAMA_8B)
    hw = get_hardware("cpu").replace(format_flops={"fp16": 4e10})
    rows = [Measurement("draft", b, 1, k + 1, 1, 0.0, "fp16") for b in (1, 8, 32) for k in (128, 512)]
    rows = [Measurement(**{**m.__dict__, "seconds": m.predict(spec, hw)}) for m in rows]
    rate, _ = fit_quantized(spec, rows, get_hardware("cpu"))["fp16"]
    assert rate == pytest.approx(4e10, rel=0.05)
    cal = Calibration(model="m", spec=spec, device="cpu", dtype="float32", bandwidth=20e9, flops=100e9,
                      overhead=1e-3, overlap=False, measurements=tuple(rows), rel_rms_error=0.0,
                      quantized_flops={"fp16": rate})
    calibrated = Calibration.from_dict(cal.to_dict()).hardware()
    assert calibrated.peak("float16") == get_hardware("cpu").peak("float16")  # the dtype is untouched
    slow = calibrated.replace(format_flops={"fp16": rate / 10})
    fp16 = spec.with_weights("fp16")
    assert draft_step(fp16, slow, 8, 4096, 256).seconds > 2 * draft_step(fp16, calibrated, 8, 4096, 256).seconds
    with pytest.raises(ValueError, match="weight formats"):
        calibrated.replace(format_flops={"float16": 1e9})


def test_measure_steps_times_the_quantized_draft():
    from hf_magicdec.calibration import measure_steps

    model = make_model("llama-gqa3", seed=1)
    st = measure_steps(model, 2, 64, gammas=(2,), budgets=(16,), draft=get_view("streamingllm", sink_tokens=2),
                       repeats=1,
                       draft_weights="int8")
    assert st.draft_weights == "int8" and set(st.t_draft_quantized) == {16}
    kinds = [(m.kind, m.weights) for m in st.measurements()]
    assert ("draft", "int8") in kinds and ("draft", "full") in kinds


def test_int8_is_refused_on_cpu_once_pytorch_drops_its_quantized_linear(monkeypatch):
    assert "int8" in dw.supported_formats(CPU)
    monkeypatch.setattr(dw, "_cpu_int8_kernel", lambda: False)
    monkeypatch.setattr(dw, "_cpu_op", lambda *names: False)
    assert dw.supported_formats(CPU) == () and dw.feasible_formats(make_model("llama-gqa3"), CPU) == ()
    with pytest.raises(ValueError, match="not available on cpu"):
        dw.check_draft_weights(make_model("llama-gqa3"), "int8", CPU)


def test_a_forward_rebound_to_its_own_module_is_not_a_patch():
    """``monkeypatch.setattr(model, "forward", ...)`` leaves the class's forward bound to the model
    in its ``__dict__`` when undone: not a patch, and the quantized draft must not inherit it (it would run the
    model's full-weight forward)."""
    model = make_model("llama-gqa3", seed=7)
    model.forward = model.forward  # what monkeypatch's undo leaves behind
    dw.check_draft_weights(model, "int8", CPU)
    draft = dw.quantized_draft(model, "int8").module
    assert "forward" not in vars(draft)
    calls = []
    handle = model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    try:
        draft(input_ids=torch.tensor([[3, 4, 5]]))
    finally:
        handle.remove()
    assert not calls  # the quantized draft ran its own (quantized) layers
    model.forward = lambda *a, **k: None  # a real patch is still refused
    with pytest.raises(ValueError, match="patched forward"):
        dw.check_draft_weights(model, "int8", CPU)

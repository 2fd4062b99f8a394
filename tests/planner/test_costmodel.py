"""Cost model: hand-computed roofline cases, monotonic properties, planner decisions, the fit,
and (one small test) calibration on a tiny random-weight model.

Everything except the calibration smoke test is pure Python and runs in milliseconds.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

import hf_magicdec
from hf_magicdec import MagicDecConfig
from hf_magicdec.planner import (
    HardwareSpec,
    ModelSpec,
    SearchSpace,
    Workload,
    critical_length,
    default_acceptance,
    draft_step,
    draft_steps,
    estimate,
    get_hardware,
    omega,
    resolve_acceptance,
    speedup,
    target_step,
    verify_step,
)
import hf_magicdec.planner as planner_package
from hf_magicdec import calibration as cal
from hf_magicdec.calibration.fit import fit, nnls
from hf_magicdec.planner import search_plan as costmodel_plan
from hf_magicdec.planner.search import DEFAULT_DRAFTS
from hf_magicdec.views import available_views, get_view

CONFIGS = Path(__file__).parents[1] / "configs"
LLAMA = json.loads((CONFIGS / "llama-3.1-8b.json").read_text())
QWEN = json.loads((CONFIGS / "qwen2.5-7b.json").read_text())
H100 = get_hardware("h100")
A100 = get_hardware("a100")
#: The cpu preset without its row curve: a fit that has only the roofline to go on.
_NO_CURVE = get_hardware("cpu").replace(linear_rows=())


DEFAULT_VIEWS = tuple(get_view(name) for name in DEFAULT_DRAFTS)


def plan(model, workload, hardware="h100", space=None, **options):
    """The planner over the default views (it takes view objects, never names) unless ``space`` says."""
    space = SearchSpace(drafts=DEFAULT_VIEWS) if space is None else space
    return costmodel_plan(model, workload, hardware, space, **options)


def llama_spec() -> ModelSpec:
    return ModelSpec.from_config(LLAMA, name="llama-3.1-8b")


def best_over_gamma(spec, hw, batch, context, draft="snapkv", budget=512, gammas=range(1, 9)):
    tt = target_step(spec, hw, batch, context).seconds
    return max((estimate(spec, hw, batch=batch, context=context, draft=draft, budget=budget, gamma=g, t_target=tt)
                for g in gammas), key=lambda e: e.speedup)


# ------------------------------------------------------------------------------------- Ω and speedup


@pytest.mark.parametrize(
    "gamma, alpha, expected",
    [(0, 0.7, 1.0), (3, 0.5, 1.875), (4, 1.0, 5.0), (2, 0.0, 1.0), (1, 0.8, 1.8), (4, 0.8, 3.3616)],
)
def test_omega_hand_values(gamma, alpha, expected):
    assert omega(gamma, alpha) == pytest.approx(expected)


def test_omega_is_continuous_at_alpha_one():
    assert omega(5, 1 - 1e-9) == pytest.approx(omega(5, 1.0), rel=1e-6)


@pytest.mark.parametrize("gamma, alpha", [(-1, 0.5), (2, 1.5), (2, -0.1), (1.5, 0.5), (True, 0.5)])
def test_omega_rejects_bad_values(gamma, alpha):
    with pytest.raises(ValueError, match="gamma|alpha"):
        omega(gamma, alpha)


def test_speedup_hand_value():
    # Ω(1, 0.5) = 1.5 tokens for 0.5 s of drafting + 1 s of verification vs 1 s per plain token.
    assert speedup(1, 0.5, t_target=1.0, t_draft_total=0.5, t_verify=1.0) == pytest.approx(1.0)
    assert speedup(3, 1.0, t_target=1.0, t_draft_total=0.0, t_verify=1.0) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="t_target"):
        speedup(1, 0.5, t_target=0.0, t_draft_total=0.5, t_verify=1.0)


# ------------------------------------------------------------------------------------- roofline by hand

TOY = ModelSpec(name="toy", layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=32,
                dtype="float32")
# 1000 FLOP/s and 1000 B/s: every FLOP and every byte costs 1 ms.
SLOW = HardwareSpec(name="slow", peak_flops={"float32": 1000.0}, bandwidth=1000.0, overhead=0.0)


def test_toy_layer_params():
    # q, o: 2·8·(2·4) = 128; k, v: 2·8·(1·4) = 64; gated MLP: 3·8·16 = 384.
    assert TOY.layer_params == 576
    assert TOY.params == 2 * 576 + 32 * 8 * 2
    assert TOY.kv_bytes_per_token == 2 * 2 * 1 * 4 * 4


def test_toy_target_step_by_hand():
    # B=1, S=10: q=1 query, 11 keys, 1 logit row.
    # linear:    FLOPs 2·576 = 1152 (1.152 s)   bytes 576·4 = 2304 (2.304 s)   -> 2.304 s/layer
    # attention: FLOPs 4·1·11·2·4 = 352         bytes 2·1·(11+1)·4·4 = 384     -> 0.384 s/layer
    # lm_head:   FLOPs 2·32·8 = 512             bytes 32·8·4 = 1024            -> 1.024 s once
    cost = target_step(TOY, SLOW, batch=1, context=10)
    assert cost.groups["linear"].seconds == pytest.approx(2 * 2.304)
    assert cost.groups["attention"].seconds == pytest.approx(2 * 0.384)
    assert cost.groups["lm_head"].seconds == pytest.approx(1.024)
    assert cost.seconds == pytest.approx(6.4)
    assert not cost.groups["linear"].compute_bound


def test_toy_verify_step_by_hand():
    # γ=1: q=2, 12 keys, 2 logit rows.
    # linear:    FLOPs 2·2·576 = 2304 = bytes 2304                           -> 2.304 s/layer
    # attention: FLOPs 4·2·12·8 = 768 (compute-bound) vs bytes 2·(12+2)·16 = 448 -> 0.768 s/layer
    # lm_head:   FLOPs 2·2·32·8 = 1024 = bytes 1024                          -> 1.024 s
    cost = verify_step(TOY, SLOW, batch=1, context=10, gamma=1)
    assert cost.groups["attention"].compute_bound
    assert cost.seconds == pytest.approx(2 * 2.304 + 2 * 0.768 + 1.024)


def test_toy_sum_form_and_overhead():
    # Without compute/memory overlap every group pays both terms; overhead is added once.
    hw = SLOW.replace(overlap=False, overhead=0.5)
    cost = target_step(TOY, hw, batch=1, context=10)
    assert cost.seconds == pytest.approx(2 * (1.152 + 2.304) + 2 * (0.352 + 0.384) + (0.512 + 1.024) + 0.5)


def test_draft_reads_budget_plus_drafted_tokens():
    # Draft step i attends to min(K, S) + i + 1 keys; only the attention group changes.
    d0 = draft_step(TOY, SLOW, batch=1, context=100, budget=10, step=0)
    d2 = draft_step(TOY, SLOW, batch=1, context=100, budget=10, step=2)
    t = target_step(TOY, SLOW, batch=1, context=10)  # 11 keys, like draft step 0 with K=10
    assert d0.seconds == pytest.approx(t.seconds)
    assert d2.groups["attention"].bytes > d0.groups["attention"].bytes
    assert draft_steps(TOY, SLOW, 1, 100, 10, 3) == pytest.approx(
        sum(draft_step(TOY, SLOW, 1, 100, 10, i).seconds for i in range(3)))
    # A budget larger than the context reads only the context.
    assert draft_step(TOY, SLOW, 1, 5, 1000).seconds == pytest.approx(draft_step(TOY, SLOW, 1, 5, 5).seconds)


def test_verify_pays_lm_head_for_every_token():
    spec = llama_spec()
    one = verify_step(spec, H100, 1, 1024, gamma=1).groups["lm_head"].flops
    seven = verify_step(spec, H100, 1, 1024, gamma=6).groups["lm_head"].flops
    assert seven == pytest.approx(one * 7 / 2)
    assert target_step(spec, H100, 1, 1024).groups["lm_head"].flops == pytest.approx(one / 2)


@pytest.mark.parametrize("kwargs", [dict(batch=0, context=1), dict(batch=1, context=-1), dict(batch=1.5, context=1)])
def test_step_rejects_bad_sizes(kwargs):
    with pytest.raises(ValueError, match="batch|context"):
        target_step(TOY, SLOW, **kwargs)


# ------------------------------------------------------------------------------------- tensor parallel


def test_tensor_parallel_reduces_step_times():
    spec = llama_spec()
    for step in (lambda hw: target_step(spec, hw, 32, 8192), lambda hw: verify_step(spec, hw, 32, 8192, 4),
                 lambda hw: draft_step(spec, hw, 32, 8192, 512)):
        times = [step(H100.with_tp(tp)).seconds for tp in (1, 2, 4, 8)]
        assert times == sorted(times, reverse=True)
        assert times[-1] < times[0] / 4  # far better than nothing, short of 8× (all-reduce)
    # The all-reduce term exists only with tp > 1.
    assert target_step(spec, H100, 8, 1024).groups["allreduce"].seconds == 0
    assert target_step(spec, H100.with_tp(8), 8, 1024).groups["allreduce"].seconds > 0


def test_kv_heads_replicate_beyond_tp():
    # 8 KV heads over 16 devices: each device still holds one whole KV head.
    spec = llama_spec()
    kv8 = target_step(spec, H100.with_tp(8), 8, 8192).groups["attention"].bytes
    kv16 = target_step(spec, H100.with_tp(16), 8, 8192).groups["attention"].bytes
    assert kv16 == pytest.approx(kv8)


# ------------------------------------------------------------------------------------- model specs


def test_llama_3_1_8b_spec():
    spec = llama_spec()
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.head_dim) == (32, 4096, 32, 8, 128)
    assert spec.group == 4 and spec.dtype == "bfloat16" and not spec.tied_embeddings and spec.gated_mlp
    assert spec.params == pytest.approx(8.03e9, rel=0.01)
    assert spec.kv_bytes_per_token == 128 * 1024  # 128 KiB per token in bf16


def test_qwen2_5_7b_spec():
    spec = ModelSpec.from_config(QWEN)
    assert (spec.layers, spec.heads, spec.kv_heads, spec.head_dim, spec.group) == (28, 28, 4, 128, 7)
    assert spec.params == pytest.approx(7.6e9, rel=0.01)
    assert spec.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2


def test_spec_from_transformers_config_matches_dict():
    from transformers import LlamaConfig

    fields = {k: v for k, v in LLAMA.items() if k not in ("architectures", "torch_dtype", "rope_scaling")}
    obj = ModelSpec.from_config(LlamaConfig(**fields), dtype="bf16", name="x")
    assert obj == ModelSpec.from_config(LLAMA, name="x")


def test_spec_missing_fields_and_aliases():
    # GPT-2 names, no KV heads (MHA), no head_dim, no intermediate (4·d), ungated MLP.
    gpt2 = ModelSpec.from_config({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12,
                                  "n_inner": None, "vocab_size": 50257, "tie_word_embeddings": True})
    assert (gpt2.kv_heads, gpt2.head_dim, gpt2.intermediate, gpt2.gated_mlp) == (12, 64, 3072, False)
    assert gpt2.dtype == "bfloat16"
    # An explicit head_dim wins over hidden // heads (Gemma/Qwen3 style).
    odd = ModelSpec.from_config({**LLAMA, "head_dim": 256})
    assert odd.head_dim == 256
    # Multimodal configs: the text config is what decodes.
    assert ModelSpec.from_config({"model_type": "llava", "text_config": LLAMA}).layers == 32
    # Multi-query attention flag.
    assert ModelSpec.from_config({**LLAMA, "num_key_value_heads": None, "multi_query": True}).kv_heads == 1


@pytest.mark.parametrize(
    "config, match",
    [
        ({**LLAMA, "num_local_experts": 8}, "num_local_experts"),
        ({k: v for k, v in LLAMA.items() if k != "hidden_size"}, "hidden_size"),
        ({**LLAMA, "num_key_value_heads": 7}, "kv_heads"),
        ({**LLAMA, "torch_dtype": "int3"}, "dtype"),
    ],
)
def test_spec_rejects_bad_configs(config, match):
    with pytest.raises(ValueError, match=match):
        ModelSpec.from_config(config)


# ------------------------------------------------------------------------------------- hardware


def test_hardware_presets_and_validation():
    assert get_hardware("H100").bandwidth == pytest.approx(3.35e12)
    assert get_hardware("h200").bandwidth > get_hardware("h100").bandwidth
    assert get_hardware("a100", tp=4).tp == 4
    assert get_hardware("h100").peak("fp8") > get_hardware("h100").peak("bf16")
    assert get_hardware("a100").peak("fp8") == get_hardware("a100").peak("bf16")  # no fp8 units: bf16 rate
    with pytest.raises(ValueError, match="tpu"):
        get_hardware("tpu")
    with pytest.raises(ValueError, match="bandwidth"):
        HardwareSpec(name="x", peak_flops={"bf16": 1e12}, bandwidth=0)
    with pytest.raises(ValueError, match="tp"):
        HardwareSpec(name="x", peak_flops={"bf16": 1e12}, bandwidth=1e9, tp=0)
    with pytest.raises(ValueError, match="fp32"):
        HardwareSpec(name="x", peak_flops={"bf16": 1e12}, bandwidth=1e9).peak("fp32")


# ------------------------------------------------------------------------------------- acceptance


def test_default_acceptance_values_and_shape():
    assert default_acceptance("streamingllm", 256, 4096) == pytest.approx(0.80)
    assert default_acceptance("snapkv", 1024, 2048) == pytest.approx(0.85)
    # Flat above 256, lower for small budgets, slowly lower for long contexts.
    assert default_acceptance("streamingllm", 128, 4096) == pytest.approx(0.75)
    assert default_acceptance("streamingllm", 64, 4096) < default_acceptance("streamingllm", 128, 4096)
    assert default_acceptance("snapkv", 512, 65536) == pytest.approx(0.85 - 4 * 0.0125)
    # A view holding the whole context accepts (almost) everything.
    assert default_acceptance("streamingllm", 4096, 1000) == pytest.approx(0.99)
    assert 0.05 <= default_acceptance("streamingllm", 1, 10**7) <= 0.99


def test_attended_prior_grows_with_the_share_of_the_context_the_generation_wrote():
    # Where the context is the prompt (measured 0.04-0.07 above SnapKV since it chooses from the first
    # verification), SnapKV's prior plus the prompt's lead; the lead grows with the generated share and
    # is whole from a quarter of the context on (long generations).
    from hf_magicdec.planner.acceptance import ATTENDED_PROMPT_LEAD

    snapkv = default_acceptance("snapkv", 256, 4096)
    on_prompt = snapkv + ATTENDED_PROMPT_LEAD
    assert ATTENDED_PROMPT_LEAD == pytest.approx(0.05)
    assert default_acceptance("attended", 256, 4096) == pytest.approx(on_prompt)  # prompt unknown: all prompt
    assert default_acceptance("attended", 256, 4096, prompt_len=4096) == pytest.approx(on_prompt)
    assert default_acceptance("attended", 256, 4096, prompt_len=3584) == pytest.approx((on_prompt + 0.93) / 2)
    assert default_acceptance("attended", 256, 4096, prompt_len=3072) == pytest.approx(0.93)
    assert default_acceptance("attended", 256, 4096, prompt_len=256) == pytest.approx(0.93)
    assert default_acceptance("attended@int8", 256, 4096, prompt_len=256) == pytest.approx(0.93 - 0.06)
    # The budget moves it as it moves every view.
    assert default_acceptance("attended", 128, 4096) == pytest.approx(on_prompt - 0.05)
    # Other views do not depend on it.
    for view in ("snapkv", "streamingllm"):
        assert default_acceptance(view, 256, 4096, prompt_len=256) == default_acceptance(view, 256, 4096)
    assert resolve_acceptance(None, "attended", 256, 4096, 256) == pytest.approx(0.93)
    assert resolve_acceptance({"snapkv": 0.5}, "attended", 256, 4096, 4096) == pytest.approx(on_prompt)
    with pytest.raises(ValueError, match="prompt_len"):
        default_acceptance("attended", 256, 4096, prompt_len=-1)


def test_resolve_acceptance():
    assert resolve_acceptance(0.7, "snapkv", 256, 4096) == 0.7
    table = {"snapkv": 0.9, ("snapkv", 512): 0.95}
    assert resolve_acceptance(table, "snapkv", 512, 4096) == 0.95
    assert resolve_acceptance(table, "snapkv", 256, 4096) == 0.9
    assert resolve_acceptance(table, "streamingllm", 256, 4096) == default_acceptance("streamingllm", 256, 4096)
    assert resolve_acceptance(lambda d, k, s: k / 1000, "snapkv", 500, 4096) == 0.5
    with pytest.raises(ValueError, match="1.5"):
        resolve_acceptance(1.5, "snapkv", 256, 4096)


# ------------------------------------------------------------------------------------- properties


def test_speedup_rises_with_batch_at_long_context():
    spec = llama_spec()
    for hw in (A100, H100):
        speedups = [best_over_gamma(spec, hw, b, 32768).speedup for b in (1, 2, 4, 8, 16, 32, 64, 128)]
        assert speedups == sorted(speedups)
        assert speedups[-1] > 1.5 * speedups[0]


def test_optimal_gamma_does_not_fall_as_batch_grows():
    spec = llama_spec()
    for context in (8192, 32768):
        gammas = [best_over_gamma(spec, H100, b, context).gamma for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
        assert gammas == sorted(gammas), gammas
        assert gammas[-1] > gammas[0]


def test_verify_costs_about_one_step_when_kv_dominates():
    # MagicDec §1: at long context and large batch T_V/T_T -> 1 and T_D/T_T -> 0.
    spec = llama_spec()
    tt = target_step(spec, H100, 64, 32768).seconds
    assert verify_step(spec, H100, 64, 32768, 4).seconds / tt < 1.15
    assert draft_step(spec, H100, 64, 32768, 512).seconds / tt < 0.15


def test_no_speculation_at_short_context_and_large_batch():
    p = plan(LLAMA, Workload(256, 512, 128), "h100")
    assert not p.speculate
    assert p.predicted_speedup < 1.0
    assert "plain" in p.summary()


def test_paper_anchor_prefill_1024_batch_32_a100_does_not_pay():
    # Measured 0.95× in MagicDec §4; the pure roofline sits at break-even, not a clear gain.
    p = plan(LLAMA, Workload(32, 1024, 96), "a100")
    assert p.predicted_speedup < 1.1


def test_paper_anchor_long_context_large_batch_pays_2_to_3x():
    # The pure roofline predicts 2–3× for 8B models at long context and large batch (§3).
    p = plan(LLAMA, Workload(64, 32768, 128), "h100", tp=8)
    assert p.speculate
    assert 2.0 <= p.predicted_speedup <= 3.5


def test_critical_length_finite_and_decreasing_with_batch():
    spec = llama_spec()
    lengths = [critical_length(spec, H100, b, draft="streamingllm", budget=512) for b in (1, 8, 32, 64)]
    assert all(math.isfinite(n) for n in lengths)
    assert lengths == sorted(lengths, reverse=True)
    # §3: about 1–4K tokens for 7–8B models at large batch on A100/H100.
    assert 512 < lengths[-1] < 4096
    # Speculation really does not pay just below the critical length and pays at it.
    b, n = 32, int(lengths[2])
    assert best_over_gamma(spec, H100, b, n, draft="streamingllm").speedup >= 1.0
    assert best_over_gamma(spec, H100, b, int(n * 0.9), draft="streamingllm").speedup < 1.0
    # Within a short search range at batch 1 it never pays.
    assert critical_length(spec, H100, 1, budget=512, max_context=8192) == math.inf


# ------------------------------------------------------------------------------------- planner


def test_plan_fields_and_config():
    p = plan(LLAMA, Workload(32, 16384, 256), "h100")
    assert p.speculate and p.predicted_speedup > 1
    assert p.context == 16384 + 128
    assert p.t_verify >= p.t_target > p.t_draft > 0
    assert p.gamma in range(1, 9) and p.draft in DEFAULT_DRAFTS
    # Runner-ups: other (draft, budget) pairs, best first, never better than the winner.
    pairs = [(e.draft, e.draft_budget) for e in p.runner_ups]
    assert len(pairs) == len(set(pairs)) and (p.draft, p.draft_budget) not in pairs
    assert [e.speedup for e in p.runner_ups] == sorted((e.speedup for e in p.runner_ups), reverse=True)
    assert all(e.speedup <= p.predicted_speedup for e in p.runner_ups)
    config = MagicDecConfig.from_any(p)
    assert (config.draft_name, config.draft_budget, config.gamma) == (p.draft, p.draft_budget, p.gamma)
    assert json.dumps(p.to_dict())
    with pytest.raises(AttributeError):
        p.gamma = 3  # frozen


def test_plan_skips_budgets_not_below_prompt():
    p = plan(LLAMA, Workload(64, 600, 64), "h100", SearchSpace(drafts=DEFAULT_VIEWS, budgets=(128, 512, 1024)))
    assert all(e.draft_budget < 600 for e in (*p.runner_ups,)) and p.draft_budget < 600
    none = plan(LLAMA, Workload(8, 100, 64), "h100")
    assert not none.speculate and none.draft is None and none.predicted_speedup == 1.0
    with pytest.raises(ValueError, match="no candidate"):
        MagicDecConfig.from_any(none)


def test_plan_acceptance_and_threshold():
    low = plan(LLAMA, Workload(64, 32768, 128), "h100", acceptance=0.3)
    high = plan(LLAMA, Workload(64, 32768, 128), "h100", acceptance=0.95)
    assert high.predicted_speedup > low.predicted_speedup and high.gamma >= low.gamma
    strict = plan(LLAMA, Workload(64, 32768, 128), "h100", min_speedup=100.0)
    assert not strict.speculate and strict.draft is not None


def test_plan_accepts_model_like_objects_and_dtype():
    class FakeModel:
        config = LLAMA
        dtype = "torch.float32"

    p = plan(FakeModel(), Workload(8, 8192, 64), "a100")
    # fp32 on an A100 runs without tensor cores: every step is slower than in bf16.
    q = plan(LLAMA, Workload(8, 8192, 64), "a100")
    assert p.t_target > q.t_target


@pytest.mark.parametrize(
    "call, match",
    [(lambda: plan(LLAMA, Workload(0, 4096, 64)), "batch_size"),
     (lambda: plan(LLAMA, Workload(8, -3, 64)), "prompt_len"),
     (lambda: plan(LLAMA, Workload(8, 4096, 64), "h100", SearchSpace(drafts=DEFAULT_VIEWS, gammas=())), "gammas"),
     (lambda: plan(LLAMA, Workload(8, 4096, 64), "h100", SearchSpace(drafts=DEFAULT_VIEWS, budgets=(0,))), "budget"),
     (lambda: plan(LLAMA, Workload(8, 4096, 64), "tpu"), "tpu")],
)
def test_plan_rejects_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_plan_takes_view_objects():
    with pytest.raises(TypeError, match="view objects"):
        costmodel_plan(LLAMA, Workload(8, 4096, 64), "h100", SearchSpace(drafts=("snapkv",)))
    with pytest.raises(ValueError, match="drafts"):
        costmodel_plan(LLAMA, Workload(8, 4096, 64))


def test_plan_uses_the_views_geometry():
    """A candidate exists exactly where its view fits: the planner asks the view, with its options."""
    wide = get_view("streamingllm", sink_tokens=200)  # fits no budget <= 200
    p = costmodel_plan(LLAMA, Workload(64, 32768, 128), "h100", SearchSpace(drafts=(wide,), budgets=(128, 256),
                                                                         gammas=(2,)))
    assert p.draft_budget == 256 and {e.draft_budget for e in p.runner_ups} <= {256}
    assert p.draft_options == {"sink_tokens": 200}
    assert MagicDecConfig.from_any(p) == hf_magicdec.MagicDecConfig.from_any(draft=wide, draft_budget=256, gamma=p.gamma,
                                                                     draft_weights="full")
    assert json.dumps(p.to_dict())
    none = costmodel_plan(LLAMA, Workload(64, 32768, 128), "h100", SearchSpace(drafts=(wide,), budgets=(128, 200)))
    assert none.draft is None


@pytest.mark.parametrize("name", available_views())
def test_view_fits_agrees_with_config_validation(name):
    """``view.fits`` (what the planner asks) says yes exactly where ``MagicDecConfig`` validates,
    for every registered view (the user's from conftest.py included)."""
    for budget in (1, 16, 17, 20, 32, 33, 40, 64, 128, 256):
        for gamma in (0, 1, 4, 8, 20, 32, 33):
            try:
                hf_magicdec.MagicDecConfig.from_any(draft=name, draft_budget=budget, gamma=gamma)
                ok = True
            except ValueError:
                ok = False
            assert get_view(name).fits(budget, gamma) == ok, (name, budget, gamma)


# ------------------------------------------------------------------------------------- pure Python


def test_pure_modules_do_not_import_torch():
    package = Path(planner_package.__file__).parent
    for path in [*package.glob("*.py"), Path(cal.__file__).parent / "fit.py"]:
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only: lazy imports inside functions are fine
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n.split(".")[0] in ("torch", "transformers", "numpy") for n in names), (path.name, names)
        # Not even lazily: the planner asks the view objects its callers pass.
        assert not any(isinstance(n, ast.ImportFrom) and (n.module or "").endswith("views")
                       for n in ast.walk(tree)), path.name


# ------------------------------------------------------------------------------------- fit


def test_nnls_exact_and_clamped():
    rows = [[1, 0], [0, 1], [1, 1]]
    assert nnls(rows, [1, 2, 3]) == pytest.approx([1, 2])
    # The unconstrained solution has a negative second unknown: NNLS pins it at 0.
    x = nnls([[1, 1], [1, 2]], [1, 0])
    assert x[1] == 0 and x[0] == pytest.approx(0.5)


def _synthetic(spec, hw):
    shapes = [(b, q, s) for b in (1, 4, 8) for q in (1, 2, 5) for s in (256, 2048)]
    return [cal.Measurement("verify", b, q, s + q, q, target_step(spec, hw, b, s).seconds if q == 1
                            else verify_step(spec, hw, b, s, q - 1).seconds) for b, q, s in shapes]


@pytest.mark.parametrize("overlap", [True, False])
def test_fit_recovers_known_rates(overlap):
    spec = ModelSpec(name="small", layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536,
                     vocab=49152, tied_embeddings=True, dtype="float32")
    truth = HardwareSpec(name="t", peak_flops={"float32": 80e9}, bandwidth=12e9, overhead=4e-3, overlap=overlap)
    fitted = fit(spec, _synthetic(spec, truth), base=_NO_CURVE)
    assert fitted.overlap == overlap
    assert fitted.rel_rms_error < 1e-6
    assert fitted.bandwidth == pytest.approx(12e9, rel=1e-3)
    assert fitted.flops == pytest.approx(80e9, rel=1e-3)
    assert fitted.overhead == pytest.approx(4e-3, rel=1e-3)


def test_fit_drops_outliers():
    spec = ModelSpec(name="small", layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536,
                     vocab=49152, dtype="float32")
    truth = HardwareSpec(name="t", peak_flops={"float32": 80e9}, bandwidth=12e9, overhead=4e-3, overlap=False)
    data = _synthetic(spec, truth)
    data[3] = cal.Measurement(**{**data[3].__dict__, "seconds": data[3].seconds * 20})  # another process ran
    fitted = fit(spec, data, base=_NO_CURVE)
    assert fitted.outliers == (3,)
    assert fitted.bandwidth == pytest.approx(12e9, rel=1e-3)
    with pytest.raises(ValueError, match="3 measurements"):
        fit(spec, data[:2])


def test_calibration_round_trip_and_plan(tmp_path):
    spec = ModelSpec(name="small", layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64, intermediate=1536,
                     vocab=49152, dtype="float32")
    truth = HardwareSpec(name="t", peak_flops={"float32": 80e9}, bandwidth=12e9, overhead=4e-3, overlap=False)
    data = tuple(_synthetic(spec, truth))
    f = fit(spec, data, base=_NO_CURVE)
    c = cal.Calibration(model="small", spec=spec, device="cpu-test", dtype="float32", bandwidth=f.bandwidth,
                        flops=f.flops, overhead=f.overhead, overlap=f.overlap, measurements=data,
                        rel_rms_error=f.rel_rms_error)
    path = c.save(tmp_path / "c.json")
    back = cal.Calibration.load(path)
    assert back == c
    assert all(abs(p - m.seconds) / m.seconds < 1e-6 for m, p in back.predictions())
    assert "measured ms" in back.table()
    hw = back.hardware("cpu")
    assert hw.name == "cpu-test (calibrated)" and hw.overhead == pytest.approx(4e-3, rel=1e-3)
    # A CPU runs the twin (attended's mass unfused), a GPU the Triton kernel, whatever the base preset.
    assert not hw.fused_mass and dataclasses.replace(back, device="cuda-h200").hardware("cpu").fused_mass
    p = plan(spec, Workload(8, 4096, 128), "cpu", calibration=back)
    assert p.hardware == "cpu-test (calibrated)"
    assert p.t_target == pytest.approx(target_step(spec, truth, 8, 4160).seconds, rel=1e-3)


def test_calibration_path_under_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_MAGICDEC_CACHE", str(tmp_path))
    spec = llama_spec()
    path = cal.calibration_path("meta-llama/Llama-3.1-8B", spec, "cpu-Xeon 2t", "bf16")
    assert path.parent == tmp_path / "calibration"
    assert path.name == f"llama-3.1-8b-{spec.key()}__cpu-xeon-2t__bfloat16.json"
    assert spec.key() == spec.with_dtype("fp32").key()  # the shape hash ignores the dtype


def test_unreadable_calibration_file_is_named_and_ignored(monkeypatch, tmp_path):
    """A truncated calibration file does not silently turn the plan uncalibrated: the warning names it."""
    from hf_magicdec import MagicDecWarning

    spec = llama_spec()
    path = cal.calibration_path("tiny", spec, cal.device_key("cpu"), "float32", tmp_path)
    assert cal.load_calibration("tiny", spec, "cpu", "float32", tmp_path) is None  # no file: no word
    path.parent.mkdir(parents=True)
    path.write_text('{"model": "tiny", "spec": {"na')
    with pytest.warns(MagicDecWarning, match=rf"Ignoring the calibration file {re.escape(str(path))}: .*JSONDecode"):
        assert cal.load_calibration("tiny", spec, "cpu", "float32", tmp_path) is None


def test_a_calibration_at_another_thread_count_is_named(monkeypatch, tmp_path):
    """A CPU calibration is keyed by torch's thread count: a process with another count plans
    uncalibrated, and says which calibrations it could use with as many threads (the same model,
    shapes, dtype and CPU; another CPU's is not named)."""
    import warnings

    import torch

    from hf_magicdec import MagicDecWarning

    monkeypatch.setenv("HF_MAGICDEC_CACHE", str(tmp_path))
    config = {**LLAMA, "_name_or_path": "tiny"}
    spec = ModelSpec.from_config(config, dtype="float32")
    here, threads = cal.device_key("cpu"), torch.get_num_threads()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MagicDecWarning)  # nothing cached: no word
        assert cal.load_calibration("tiny", spec, "cpu", "float32") is None
    other = here.removesuffix(f"-{threads}t") + f"-{threads + 7}t"
    for device in (other, here.removesuffix(f"-{threads}t") + "-v2-4t", "cpu-another-chip-2t"):
        path = cal.calibration_path("tiny", spec, device, "float32")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    assert cal.other_thread_counts(cal.calibration_path("tiny", spec, here, "float32")) == [other]
    with pytest.warns(MagicDecWarning, match=rf"this process's {threads} torch threads; the cached ones are for "
                                             rf"{re.escape(other)} ") as said:
        p = hf_magicdec.plan(config, batch_size=8, prompt_len=4096, new_tokens=64, device="cpu", dtype="float32")
    assert "uncalibrated" in p.hardware
    assert [w.filename for w in said.list] == [__file__]  # said where hf_magicdec.plan was called


# ------------------------------------------------------------------------------------- calibration smoke


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:calibrating while the machine is busy")
def test_calibrate_smoke_on_tiny_model(tmp_path):
    """Real forwards of a tiny random-weight model through the engine: a few seconds."""
    from conftest import make_model

    from hf_magicdec import calibration

    model = make_model("llama-gqa3")
    steps = calibration.measure_steps(model, 2, 96, gammas=(1, 3), budgets=(32, 64), repeats=1)
    assert steps.t_target > 0 and set(steps.t_verify) == {1, 3} and set(steps.t_draft) == {32, 64}
    assert [m.kind for m in steps.measurements()] == ["target", "verify", "verify", "draft", "draft"]
    lines = []
    result = calibration.calibrate(model, name="tiny", points=((1, 64), (2, 96)), gammas=(1, 3), budgets=(32,),
                                   repeats=1, passes=1, cache_dir=tmp_path, progress=lines.append)
    assert result.bandwidth > 0 and result.flops > 0 and result.overhead >= 0
    # On a CPU the row curve is measured first, said first, and kept (rows 1 .. 128).
    assert result.linear_rows[0] == (1, 1.0) and result.linear_rows[-1][0] == 128
    assert "linear layers' time by rows" in lines[0] and len(lines) == 3 and "B=1" in lines[1]
    import torch

    from hf_magicdec.engine.draft_weights import supported_formats

    # Per point: T_T, T_V(1), T_V(3), T_D(32), and T_D(32) on each CPU quantized draft (int8; fp16 on x86).
    formats = set(supported_formats(torch.device("cpu")))
    assert len(result.measurements) == 2 * (4 + len(formats)) and set(result.quantized_flops) == formats
    path = cal.calibration_path("tiny", result.spec, result.device, result.dtype, tmp_path)
    assert path.is_file()
    # Cached: the second call reads the file instead of measuring.
    assert calibration.calibrate(model, name="tiny", cache_dir=tmp_path) == result
    alpha = calibration.probe_acceptance(model, draft="streamingllm", budget=32, gamma=2, context=64, new_tokens=8)
    assert 0.0 <= alpha <= 1.0
    with pytest.raises(ValueError, match="budget"):
        calibration.probe_acceptance(model, budget=64, context=64)


def test_measure_steps_on_a_sliding_window_model():
    """Timing caches carry no generation length: a model with a sliding window can be timed."""
    from conftest import make_model
    from hf_magicdec import calibration

    model = make_model("mistral-mha", sliding_window=64)
    steps = calibration.measure_steps(model, 2, 96, gammas=(1,), budgets=(32,), repeats=1)
    assert steps.t_target > 0 and steps.t_draft[32] > 0


def test_measure_steps_capacity_must_hold_a_verification():
    """A compiled generate reads its whole (rounded-up) buffer; ``capacity=`` times that, and says
    before any forward when it cannot hold the context and one verification."""
    from conftest import make_model
    from hf_magicdec import calibration

    model = make_model("llama-gqa3")
    with pytest.raises(ValueError, match="capacity must hold.*at least 101; got capacity=100"):
        calibration.measure_steps(model, 2, 96, gammas=(1, 3), budgets=(32,), repeats=1, capacity=100)
    steps = calibration.measure_steps(model, 2, 96, gammas=(3,), budgets=(32,), repeats=1, capacity=256)
    assert steps.t_verify[3] > 0 and steps.t_draft[32] > 0


def test_eager_host_time_per_layer_unless_captured():
    """On a GPU an eager forward pays ~0.3 ms of host time per layer (operator launches); captured
    steps (compile=) do not. The planner must not promise an eager speedup the host cannot deliver."""
    spec = ModelSpec.from_config(LLAMA, dtype="bfloat16")
    captured = get_hardware("h200")
    eager = captured.replace(captured=False)
    extra = target_step(spec, eager, 32, 32768).seconds - target_step(spec, captured, 32, 32768).seconds
    assert extra == pytest.approx(spec.layers * captured.layer_overhead)
    # The draft step is cheap in bytes, so host time weighs most on it: T_D/T_T rises when eager.
    ratio = {hw.captured: draft_step(spec, hw, 32, 32768, 512).seconds / target_step(spec, hw, 32, 32768).seconds
             for hw in (captured, eager)}
    assert ratio[False] > ratio[True] + 0.1
    workload = Workload(32, 32768, 256)
    assert plan(LLAMA, workload, eager).predicted_speedup < plan(LLAMA, workload, captured).predicted_speedup
    # The cpu preset carries its machine's fitted host time per layer; a calibration's fitted
    # per-forward overhead replaces it, not adds to it.
    assert get_hardware("cpu").layer_overhead > 0
    assert cal.Fit(20e9, 75e9, 15e-3, False, 0.03).hardware("cpu", "float32").layer_overhead == 0
    with pytest.raises(ValueError, match="layer_overhead"):
        captured.replace(layer_overhead=-1.0)


def test_resolution_plans_eager_steps_on_cpu(monkeypatch):
    """resolve() tells the planner whether this call's steps are captured (CPU: never by default)."""
    from conftest import make_model

    from hf_magicdec import resolve as resolve_mod

    seen = []
    original = resolve_mod.search_plan
    monkeypatch.setattr(resolve_mod, "search_plan", lambda spec, **kw: seen.append(kw["hardware"]) or original(spec, **kw))
    model = make_model("llama-gqa3")
    resolve_mod.resolve(MagicDecConfig(), model, 2, 512, 32)
    resolve_mod.resolve(MagicDecConfig(compile=True), model, 2, 512, 32)
    assert [hw.captured for hw in seen] == [False, True]


def test_a_kept_forward_cost_is_never_another_devices_or_models():
    """Forward costs are kept per process (a plan prices the same forwards for many candidates): a
    hardware or model that differs in any field, the per-format mappings included (left out of the
    hash; they are read-only), gets its own cost."""
    from hf_magicdec.planner.roofline import forward_cost

    spec, cpu = ModelSpec.from_config(LLAMA, name="llama-3.1-8b"), get_hardware("cpu")
    shape = dict(batch=4, query_tokens=1, kv_tokens=1025, logit_tokens=1)
    base = forward_cost(spec, cpu, **shape).seconds
    assert forward_cost(spec, cpu, **shape).seconds == base
    assert forward_cost(spec, cpu.replace(bandwidth=2 * cpu.bandwidth), **shape).seconds < base
    int8 = spec.with_weights("int8")
    slow = forward_cost(int8, cpu, **shape).seconds
    assert forward_cost(int8, cpu.replace(format_flops={"int8": 1e15}), **shape).seconds < slow
    assert forward_cost(spec.with_dtype("float32"), cpu, **shape).seconds > base  # twice the weight bytes

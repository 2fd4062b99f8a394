"""Small shapes: what a short call or a single row pays besides its steps, and the planner declining
where speculation measured a loss on 2 CPU cores (docs/benchmarks.md)."""

from __future__ import annotations

import dataclasses

import pytest

import hf_magicdec
from hf_magicdec.calibration import calibration_path, device_key
from hf_magicdec.planner import SearchSpace, Workload, get_hardware, search_plan
from hf_magicdec.planner.modelspec import ModelSpec
from hf_magicdec.planner.roofline import draft_step
from hf_magicdec.planner.schedule import PLAIN_PROBE_STEPS, StepModel, context_points, scheduled_speedup
from hf_magicdec.views import get_view

SMOLLM2 = dict(model_type="llama", architectures=["LlamaForCausalLM"], _name_or_path="smollm2-135m",
               num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, torch_dtype="float32",
               max_position_embeddings=8192)


def _xeon_calibration(spec):
    """What ``hf-magicdec plan --model smollm2-135m --calibrate`` fitted on a 2-core Xeon (AVX-512,
    torch 2.13): 33 forwards at batch 1-8, 10.8 % RMS error; the quantized drafts' per-layer times
    refitted from its draft timings, their builds timed on the same machine (2.0 s int8, 2.7 s fp16)."""
    from hf_magicdec.calibration import Calibration

    return Calibration(model="smollm2-135m", spec=spec, device=device_key("cpu"), dtype="float32",
                       bandwidth=15.53e9, flops=100.6e9, overhead=4.08e-3, overlap=False, measurements=(),
                       rel_rms_error=0.108, quantized_flops={"int8": 245.8e9, "fp16": 96.5e9},
                       quantized_overhead={"int8": 0.538e-3, "fp16": 0.375e-3},
                       quantized_build={"int8": 3.7e-9, "fp16": 5.0e-9})


@pytest.mark.parametrize("batch, prompt, new_tokens, measured", [
    (1, 1024, 256, "0.72x the static cache (AMD EPYC); per step 0.87x its own plain steps (Xeon)"),
    (2, 512, 32, "0.84x stock"),
    (1, 256, 16, "1.03x stock"),
])
def test_a_calibrated_plan_declines_where_speculation_measured_no_gain(batch, prompt, new_tokens, measured,
                                                                        tmp_path, monkeypatch):
    """SmolLM2-135M fp32 as generate plans it on a CPU calibrated as the Xeon was, no quantized draft
    built yet: each of these calls measured no gain (``measured``), so the plan is plain decoding.
    Without the per-layer time and the build the same calibration speculated at all three."""
    monkeypatch.setenv("HF_MAGICDEC_CACHE", str(tmp_path))
    spec = ModelSpec.from_config(SMOLLM2)
    cal = _xeon_calibration(spec)
    cal.save(calibration_path("smollm2-135m", spec, device_key("cpu"), "float32"))
    plan = hf_magicdec.plan(SMOLLM2, batch_size=batch, prompt_len=prompt, new_tokens=new_tokens, device="cpu")
    assert "(calibrated)" in plan.hardware and not plan.speculate, (measured, plan.summary())
    # The build it priced, in the plan's own words (a config has no weights: its parameter bytes).
    built = {fmt: spec.params * 4 * rate for fmt, rate in cal.quantized_build.items()}
    assert plan.setup_seconds == pytest.approx(built)
    assert "one-time: building the quantized draft weights (fp16 2.7 s, int8 2.0 s)" in plan.summary()
    # Zeros, not empty: a calibration without them takes the cpu preset's, which has both.
    zero = {"int8": 0.0, "fp16": 0.0}
    bare = dataclasses.replace(cal, quantized_overhead=zero, quantized_build=zero)
    bare.save(calibration_path("smollm2-135m", spec, device_key("cpu"), "float32"))
    free = hf_magicdec.plan(SMOLLM2, batch_size=batch, prompt_len=prompt, new_tokens=new_tokens, device="cpu")
    assert free.speculate and not free.setup_seconds and "one-time" not in free.summary()


def _xeon_calibration_with_rows(spec):
    """What ``hf-magicdec plan --model smollm2-135m --calibrate`` fitted on the same 2-core Xeon with the
    row curve (3.8 % RMS error over its 21 full-precision forwards, 15.9 % without the curve)."""
    from hf_magicdec.calibration import Calibration

    rows = ((1, 1.0), (2, 1.12), (3, 1.12), (4, 2.21), (6, 2.28), (8, 2.70), (12, 3.23), (16, 4.51), (24, 4.86),
            (32, 5.19), (48, 5.77), (64, 5.77), (96, 5.77), (128, 6.26))
    return Calibration(model="smollm2-135m", spec=spec, device=device_key("cpu"), dtype="float32",
                       bandwidth=20.79e9, flops=102.8e9, overhead=16.53e-3, overlap=False, measurements=(),
                       rel_rms_error=0.038, quantized_flops={"int8": 406.8e9, "fp16": 220.7e9},
                       quantized_overhead={"int8": 0.295e-3, "fp16": 0.269e-3},
                       quantized_build={"int8": 3.44e-9, "fp16": 4.76e-9}, linear_rows=rows)


@pytest.mark.parametrize("batch, prompt, new_tokens, speculate, measured", [
    (2, 512, 32, False, "declined: 0.98x own plain decoding; speculating measured 0.74-0.79x"),
    (1, 1024, 64, False, "speculating measured 0.99x the static cache"),
    (1, 256, 16, False, "speculating measured 1.03x stock"),
    (8, 256, 768, True, "1.74x the static cache, 1.49x own plain decoding"),
    (16, 1024, 256, True, "1.81x the static cache, 1.76x own plain decoding"),
])
def test_with_the_row_curve_the_calibrated_plan_speculates_where_it_measured_a_gain(
        batch, prompt, new_tokens, speculate, measured, tmp_path, monkeypatch):
    """SmolLM2-135M fp32 as generate plans it on the Xeon calibrated with the row curve (a 5-token
    verify costs twice a plain step at batch 1 there): plain decoding for the short calls of one or
    two rows, speculation at 8 and 16 rows, as measured (``measured``, docs/benchmarks.md)."""
    monkeypatch.setenv("HF_MAGICDEC_CACHE", str(tmp_path))
    spec = ModelSpec.from_config(SMOLLM2)
    _xeon_calibration_with_rows(spec).save(calibration_path("smollm2-135m", spec, device_key("cpu"), "float32"))
    plan = hf_magicdec.plan(SMOLLM2, batch_size=batch, prompt_len=prompt, new_tokens=new_tokens, device="cpu")
    assert "(calibrated)" in plan.hardware and plan.speculate == speculate, (measured, plan.summary())


def test_a_quantized_draft_pays_its_per_layer_time_at_batch_1():
    """CPU dynamic quantization costs a fixed time per layer: at batch 1 an int8 draft step is not
    4x cheaper than a full-weight one although it reads a quarter of the bytes."""
    spec = ModelSpec.from_config(SMOLLM2)
    hw = _xeon_calibration(spec).hardware()
    full = draft_step(spec, hw, 1, 1024, 256).seconds
    int8 = draft_step(spec.with_weights("int8"), hw, 1, 1024, 256)
    assert int8.groups["overhead"].seconds == pytest.approx(hw.overhead + 30 * hw.format_overhead["int8"])
    assert 0.5 * full < int8.seconds < full
    free = draft_step(spec.with_weights("int8"), hw.replace(format_overhead={}), 1, 1024, 256).seconds
    assert int8.seconds - free == pytest.approx(30 * hw.format_overhead["int8"])


def test_the_schedule_prices_the_plain_warm_up_and_the_one_time_build():
    """The first PLAIN_PROBE_STEPS steps decode plainly and a quantized draft's build is paid once:
    both weigh on a 16-token call and hardly on a 2,048-token one."""
    spec, hw = ModelSpec.from_config(SMOLLM2), get_hardware("cpu")
    model = StepModel(spec, hw, spec, 256, get_view("streamingllm"), tuple(range(1, 5)))

    def speedup(new_tokens, setup=0.0):
        points = context_points(4096, new_tokens)
        return scheduled_speedup(model, 8, points, lambda c: 0.9, True, new_tokens=new_tokens, setup_seconds=setup)[0]

    steady = scheduled_speedup(model, 8, context_points(4096, 16), lambda c: 0.9, True)[0]
    assert steady > 1.0
    short = speedup(16)
    # 3 of 16 steps plain: the time of the rest at the steady speedup plus 3 plain steps.
    assert 1 / short == pytest.approx(PLAIN_PROBE_STEPS / 16 + (1 - PLAIN_PROBE_STEPS / 16) / steady)
    assert speedup(2048) > short
    assert speedup(16, setup=2.0) < short
    assert speedup(2048, setup=2.0) > speedup(16, setup=2.0)


def test_the_build_is_priced_only_while_the_model_has_no_quantized_draft():
    from hf_magicdec.engine.draft_weights import quantized_draft, source_bytes
    from hf_magicdec.resolve import Target, _build_seconds

    from conftest import make_model

    model = make_model("llama-gqa3")  # its own: the quantized draft stays cached beside it
    hw = get_hardware("cpu").replace(format_build={"fp16": 5e-9})
    fresh = _build_seconds(Target.of(model), ("full", "fp16"), hw)
    assert fresh == {"fp16": pytest.approx(source_bytes(model) * hw.format_build["fp16"])}
    built = quantized_draft(model, "fp16")
    assert built.build_seconds > 0
    assert _build_seconds(Target.of(model), ("full", "fp16"), hw) == {}


def test_a_plan_on_a_preset_says_its_rates_are_placeholders(tmp_path, monkeypatch):
    """Its rates, the quantized draft's build it priced, and that a preset without a build rate
    does not price it."""
    monkeypatch.setenv("HF_MAGICDEC_CACHE", str(tmp_path))  # no cached calibration of this machine
    plan = hf_magicdec.plan(SMOLLM2, batch_size=8, prompt_len=4096, new_tokens=128, device="cpu")
    assert "placeholder rates not measured on this device" in plan.summary()
    assert "--calibrate" in plan.summary()
    assert plan.speculate and plan.draft_weights != "full" and set(plan.setup_seconds) == {"int8", "fp16"}
    assert "one-time: building the quantized draft weights (fp16 " in plan.summary()
    # A preset without format_build (the GPU ones) says it does not price the build; the cpu preset,
    # which has one, says nothing of it once the model has its quantized drafts (nothing to build).
    assert plan.unpriced_builds == ()
    gpu = search_plan(ModelSpec.from_config(SMOLLM2), Workload(8, 4096, 128), "h100",
                      SearchSpace(drafts=(get_view("snapkv"),), draft_weights=("full", "int8")))
    assert gpu.unpriced_builds == ("int8",)
    unpriced = dataclasses.replace(plan, setup_seconds={}, unpriced_builds=(plan.draft_weights,))
    assert "one-time" not in dataclasses.replace(plan, setup_seconds={}).summary()
    assert (f"one-time: a model without {plan.draft_weights} draft weights builds them in its first speculating call, "
            "which this preset does not price") in unpriced.summary()


def test_the_decode_speedup_leaves_out_the_one_time_build(tmp_path, monkeypatch):
    """``predicted_speedup`` prices the whole call, the build of the quantized draft included;
    ``predicted_decode_speedup`` the decode steps alone (what a benchmark of decode time measures).
    Without a build the two are one figure; with one, the call's time is the decode's plus the build."""
    monkeypatch.setenv("HF_MAGICDEC_CACHE", str(tmp_path))  # no cached calibration of this machine
    plan = hf_magicdec.plan(SMOLLM2, batch_size=8, prompt_len=4096, new_tokens=128, device="cpu")
    build = plan.setup_seconds[plan.draft_weights]
    assert plan.speculate and build > 0 and plan.predicted_decode_speedup > plan.predicted_speedup
    # The schedule prices each of its context points as an equal share of the new tokens; the
    # plain steps' time is theirs over the call (t_target at the mean context, linear enough here).
    plain = plan.new_tokens * plan.t_target
    assert plain / plan.predicted_speedup == pytest.approx(plain / plan.predicted_decode_speedup + build, rel=0.02)
    assert f"{plan.predicted_decode_speedup:.2f}x over the decode steps alone" in plan.summary()
    # A fixed γ (no schedule): the same relation, exact.
    spec = ModelSpec.from_config(SMOLLM2)
    space = SearchSpace(drafts=(get_view("snapkv"),), budgets=(256,), gammas=(3,), draft_weights=("int8",))
    fixed = search_plan(spec, Workload(8, 4096, 128), "cpu", space, setup_seconds={"int8": 2.0})
    plain = fixed.new_tokens * fixed.t_target
    assert plain / fixed.predicted_speedup == pytest.approx(plain / fixed.predicted_decode_speedup + 2.0)
    # Nothing to build, nothing to leave out; a declined plan and γ = 0 predict 1.
    free = search_plan(spec, Workload(8, 4096, 128), "cpu", space)
    assert free.predicted_decode_speedup == free.predicted_speedup
    assert "over the decode steps alone" not in free.summary()
    off = hf_magicdec.plan(SMOLLM2, batch_size=8, prompt_len=4096, new_tokens=128, device="cpu", gamma=0,
                           draft="snapkv", draft_budget=256)
    assert off.predicted_speedup == off.predicted_decode_speedup == 1.0
    # A declined call builds nothing: its summary leaves the decode steps' line out.
    small = hf_magicdec.plan(SMOLLM2, batch_size=2, prompt_len=512, new_tokens=32, device="cpu")
    assert not small.speculate and small.setup_seconds
    assert "over the decode steps alone" not in small.summary()


def test_a_scheduled_plan_says_what_the_run_will_do(tmp_path, monkeypatch):
    """The default plan is priced by the schedule adaptive γ runs: its summary says so (plain timing
    steps first, then γ re-chosen from the acceptance observed and the context) and lists the γ
    the model expects at each point of the generation."""
    monkeypatch.setenv("HF_MAGICDEC_CACHE", str(tmp_path))  # no cached calibration of this machine
    plan = hf_magicdec.plan(SMOLLM2, batch_size=8, prompt_len=4096, new_tokens=512, device="cpu")
    assert plan.speculate and plan.gamma_by_context, plan.summary()
    contexts = [c for c, _ in plan.gamma_by_context]
    assert contexts == context_points(4096, 512)
    text = plan.summary()
    assert f"first {PLAIN_PROBE_STEPS} steps are plain" in text and "re-chosen every step" in text
    assert ", ".join(f"{c}: {g}" for c, g in plan.gamma_by_context) in text
    # A pinned γ is not a schedule: no such line.
    pinned = hf_magicdec.plan(SMOLLM2, batch_size=8, prompt_len=4096, new_tokens=512, device="cpu",
                              draft="snapkv", draft_budget=256, gamma=3)
    assert pinned.gamma_by_context == () and "run:" not in pinned.summary()


def test_one_slow_plain_step_does_not_move_the_cost_probe():
    """A plain step slowed 6x by other work on the machine (measured: 385 ms among 61-62 ms steps)
    leaves the probe's factor where the steady steps put it."""
    from hf_magicdec.engine.gamma import CostProbe

    def factor(plain_seconds):
        probe = CostProbe()
        for seconds in plain_seconds:
            probe.record(False, seconds, 0.05)
        for _ in range(8):
            probe.record(True, 0.2, 0.1)
        return probe.factor

    steady = factor([0.062, 0.061, 0.062, 0.062])
    assert factor([0.062, 0.061, 0.062, 0.385, 0.062]) == pytest.approx(steady, rel=0.01)

"""Every plan stays what it was: a grid of models × batch × prompt × new tokens × device models
(presets, a device with and without a cached calibration) × options, planned and compared with
the plans recorded in ``plan_grid.json``.

A refactor of the planner must leave this file unchanged. A change meant to move plans rewrites
it on purpose, and the diff shows which plans moved::

    python tests/planner/test_plan_grid.py --write
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
GOLDEN = HERE / "plan_grid.json"
CONFIGS = HERE.parent / "configs"


def _small_llama(name, layers, hidden, heads, kv_heads, intermediate, vocab, tie=True):
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], _name_or_path=name, num_hidden_layers=layers,
                hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                intermediate_size=intermediate, vocab_size=vocab, tie_word_embeddings=tie, torch_dtype="float32",
                max_position_embeddings=131072)


MODELS = {
    "llama-3.1-8b": json.loads((CONFIGS / "llama-3.1-8b.json").read_text()),
    "qwen2.5-7b": json.loads((CONFIGS / "qwen2.5-7b.json").read_text()),
    "smollm2-135m": _small_llama("smollm2-135m", 30, 576, 9, 3, 1536, 49152),
    "qwen-0.5b-shape": _small_llama("qwen-0.5b-shape", 24, 896, 14, 2, 4864, 151936),
}
BATCHES = (1, 8, 64)
PROMPTS = (256, 4096, 32768)
NEW_TOKENS = (16, 2048)
#: Where the device model comes from: a preset for a config, or "generate on this device" (the CPU)
#: without and with a cached calibration.
DEVICES = ("cpu", "h100", "h200", "device", "device+calibration")
OPTIONS = {
    "default": {},
    "snapkv-512": dict(draft="snapkv", draft_budget=512),
    "gamma-2": dict(gamma=2),
}


def _calibration(spec):
    """A fixed calibration of ``spec`` (its rates are made up, not measured; its device named the
    same on every machine)."""
    from hf_magicdec.calibration import Calibration

    return Calibration(model=spec.name, spec=spec, device="cpu-grid", dtype=spec.dtype, bandwidth=11e9,
                       flops=95e9, overhead=3.5e-3, overlap=False, measurements=(), rel_rms_error=0.1,
                       quantized_flops={"int8": 60e9, "fp16": 40e9})


def _round(value):
    if isinstance(value, float):
        return float(f"{value:.9g}") if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {k: _round(v) for k, v in sorted(value.items())}
    if isinstance(value, (list, tuple)):
        return [_round(v) for v in value]
    return value


def _record(plan) -> dict:
    """What a plan decides and predicts (by attribute, so that a refactor may reshape the class)."""
    names = ("speculate", "draft", "draft_budget", "gamma", "draft_weights", "draft_options", "draft_model",
             "predicted_speedup", "acceptance", "tokens_per_step", "t_target", "t_draft", "t_verify", "context",
             "hardware", "reason")
    out = {name: getattr(plan, name) for name in names}
    out["runner_ups"] = [[e.draft, e.draft_budget, e.gamma, e.acceptance, e.speedup] for e in plan.runner_ups]
    return _round(out)


def grid_plans(cache_dir: Path) -> dict[str, dict]:
    import hf_magicdec
    from hf_magicdec.calibration import calibration_path, device_key
    from hf_magicdec.resolve import Target

    out = {}
    for model_name, config in MODELS.items():
        target = Target.of_config(config, "cpu", "float32")
        calibration = _calibration(target.spec)
        for device in DEVICES:
            path = calibration_path(target.name, target.spec, device_key("cpu"), target.spec.dtype, cache_dir)
            if device == "device+calibration":
                calibration.save(path)
            elif path.exists():
                path.unlink()
            for option_name, options in OPTIONS.items():
                for batch in BATCHES:
                    for prompt in PROMPTS:
                        for new in NEW_TOKENS:
                            if device.startswith("device"):
                                kwargs = dict(device="cpu", dtype="float32")
                            else:
                                kwargs = dict(hardware=device, dtype="float32")
                            p = hf_magicdec.plan(config, batch_size=batch, prompt_len=prompt, new_tokens=new,
                                                 **kwargs, **options)
                            out[f"{model_name} {device} {option_name} b{batch} p{prompt} n{new}"] = _record(p)
    return out


@pytest.fixture
def fixed_machine(monkeypatch, tmp_path):
    """The same plans on every machine: the calibration cache in ``tmp_path`` and the CPU's
    quantized formats fixed (they depend on the build of torch)."""
    monkeypatch.setenv("HF_MAGICDEC_CACHE", str(tmp_path))
    import hf_magicdec.resolve as resolve

    monkeypatch.setattr(resolve, "supported_formats", lambda device: ("int8", "fp16"))
    return tmp_path


def test_every_plan_is_unchanged(fixed_machine):
    golden = json.loads(GOLDEN.read_text())
    plans = grid_plans(fixed_machine)
    assert set(plans) == set(golden), "the grid changed: rewrite plan_grid.json on purpose (see the docstring)"
    moved = [key for key in golden if plans[key] != golden[key]]
    first = moved[0] if moved else None
    assert not moved, (f"{len(moved)} of {len(golden)} plans changed, e.g. {first}:\n"
                       f"  was {golden[first]}\n  now {plans[first]}")


def test_the_grid_covers_both_decisions():
    """The recorded grid holds plans that speculate and plans that decline, with several views,
    budgets, γ values and draft weights: a refactor cannot pass it by always answering the same."""
    golden = json.loads(GOLDEN.read_text())
    assert {r["speculate"] for r in golden.values()} == {True, False}
    chosen = [r for r in golden.values() if r["speculate"]]
    assert len({r["draft"] for r in chosen}) >= 2 and len({r["draft_budget"] for r in chosen}) >= 3
    assert len({r["gamma"] for r in chosen}) >= 3 and len({r["draft_weights"] for r in chosen}) >= 2


if __name__ == "__main__" and "--write" in sys.argv:
    import os
    import tempfile

    import hf_magicdec.resolve as _resolve

    _resolve.supported_formats = lambda device: ("int8", "fp16")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["HF_MAGICDEC_CACHE"] = tmp
        plans = grid_plans(Path(tmp))
    lines = (f"{json.dumps(key)}: {json.dumps(plans[key], sort_keys=True, separators=(',', ':'))}"
             for key in sorted(plans))
    GOLDEN.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one plan a line: its diff names the plans that moved
    print(f"wrote {GOLDEN}")

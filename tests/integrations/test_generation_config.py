"""MagicDec settings carried by a ``GenerationConfig``, and plain decoding that says so.

Trainers and pipelines (TRL's ``GRPOTrainer``: ``GenerationConfig(**defaults, **generation_kwargs)``)
hand ``generate`` a generation config built from the user's keywords, so every MagicDec option can
arrive as an attribute of its own: ``GenerationConfig(speculative="magicdec", draft="streamingllm",
draft_budget=32, sink_tokens=4, gamma=3)``. Required:

* such attributes configure MagicDec as the same keywords of ``generate`` would (keywords of the
  call still win), and the generation config passed in is not modified;
* options carried without ``speculative`` are not silently ignored (a warning);
* a call that asked for ``speculative=`` and is decoded with stock code (the planner predicts no
  speedup) says so with a warning, not only in ``out.speculation`` (which callers such as TRL
  never see).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import make_model, ragged_prompts
from transformers import GenerationConfig

import hf_magicdec

SETTINGS = {"draft": "streamingllm", "draft_budget": 16, "sink_tokens": 4, "gamma": 3}


@pytest.fixture(scope="module")
def model():
    return make_model("llama-gqa3")


def _inputs():
    ids, mask = ragged_prompts(3, 40, seed=7)
    return {"input_ids": ids, "attention_mask": mask}


def _config(**extra):
    return GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0, **extra)


def _magicdec_warnings(record) -> list[str]:
    return [str(w.message) for w in record
            if issubclass(w.category, UserWarning) and ("speculative" in str(w.message)
                                                        or "MagicDec" in str(w.message))]


def test_flat_generation_config_options_configure_magicdec(model):
    stock = model.generate(**_inputs(), generation_config=_config())
    config = _config(speculative="magicdec", **SETTINGS)
    out = model.generate(**_inputs(), generation_config=config, return_dict_in_generate=True)
    s = out.speculation
    assert (s.draft, s.draft_budget, s.gamma) == ("streamingllm", 16, 3), s
    assert torch.equal(out.sequences, stock)


def test_keywords_override_generation_config_options(model):
    config = _config(speculative="magicdec", **SETTINGS)
    out = model.generate(**_inputs(), generation_config=config, draft_budget=24, return_dict_in_generate=True)
    s = out.speculation
    assert (s.draft, s.draft_budget, s.gamma) == ("streamingllm", 24, 3), s


def test_nested_generation_config_options_configure_magicdec(model):
    """``GenerationConfig(speculative={...})``: what works today (the recipe's form)."""
    stock = model.generate(**_inputs(), generation_config=_config())
    config = _config(speculative={"method": "magicdec", **SETTINGS})
    out = model.generate(**_inputs(), generation_config=config, return_dict_in_generate=True)
    s = out.speculation
    assert (s.draft, s.draft_budget, s.gamma) == ("streamingllm", 16, 3), s
    assert torch.equal(out.sequences, stock)


@pytest.mark.parametrize("form", ["flat", "nested"])
def test_the_generation_config_passed_in_is_not_modified(model, form):
    config = (_config(speculative="magicdec", **SETTINGS) if form == "flat"
              else _config(speculative={"method": "magicdec", **SETTINGS}))
    before, model_before = config.to_dict(), model.generation_config.to_dict()
    model.generate(**_inputs(), generation_config=config)
    assert config.to_dict() == before
    assert model.generation_config.to_dict() == model_before


def test_options_without_speculative_are_not_silently_ignored(model):
    stock = model.generate(**_inputs(), generation_config=_config())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = model.generate(**_inputs(), generation_config=_config(**SETTINGS))
    assert torch.equal(out, stock)  # still stock generate: speculation was not asked for
    found = _magicdec_warnings(record)
    assert found and all("speculative" in m for m in found), found


@pytest.mark.parametrize("how", ["keyword", "generation_config"])
def test_planner_fallback_to_stock_decoding_is_visible(model, how):
    """All ``"auto"`` on 40-token prompts: the planner chooses plain decoding (every budget it
    considers is at least the prompt). The output is stock's, and a warning says so."""
    stock = model.generate(**_inputs(), generation_config=_config())
    kwargs = ({"generation_config": _config(), "speculative": "magicdec"} if how == "keyword"
              else {"generation_config": _config(speculative="magicdec")})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = model.generate(**_inputs(), **kwargs, return_dict_in_generate=True)
    assert out.speculation.draft.startswith("none"), out.speculation.draft  # the planner's choice, as today
    assert torch.equal(out.sequences, stock)
    found = _magicdec_warnings(record)
    assert any("plain decoding" in m or "stock" in m for m in found), [str(w.message) for w in record]


def test_explicit_settings_never_fall_back_silently(model):
    """With budget and γ explicit the planner may not decline: the engine runs, no fallback."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = model.generate(**_inputs(), generation_config=_config(), speculative="magicdec", **SETTINGS,
                             return_dict_in_generate=True)
    assert out.speculation.draft == "streamingllm"
    assert not [m for m in _magicdec_warnings(record) if "plain decoding" in m or "stock" in m]


@pytest.mark.parametrize("form", ["flat", "nested"])
def test_custom_generate_without_the_routing_reads_generation_config_options(model, form):
    """``custom_generate=hf_magicdec.generate`` with the routing off (``HF_MAGICDEC_NO_PATCH=1``):
    the generation config's settings configure MagicDec as they do through the routing."""
    stock = model.generate(**_inputs(), generation_config=_config())
    config = (_config(speculative="magicdec", **SETTINGS) if form == "flat"
              else _config(speculative={"method": "magicdec", **SETTINGS}))
    hf_magicdec.disable()
    try:
        out = model.generate(**_inputs(), generation_config=config, custom_generate=hf_magicdec.generate,
                             return_dict_in_generate=True)
    finally:
        hf_magicdec.enable()
    s = out.speculation
    assert (s.draft, s.draft_budget, s.gamma) == ("streamingllm", 16, 3), s
    assert torch.equal(out.sequences, stock)


def test_options_as_keywords_without_speculative_are_refused_with_a_hint(model):
    """Stock ``generate`` would refuse ``draft=`` as an unused model kwarg without saying why."""
    with pytest.raises(ValueError, match=r"\['draft', 'gamma'\] are MagicDec options.*speculative='magicdec'"):
        model.generate(**_inputs(), generation_config=_config(), draft="snapkv", gamma=2)


def test_continuous_batching_says_it_does_not_speculate(model):
    """``generate_batch`` / ``init_continuous_batching`` (TRL's ``use_transformers_continuous_batching``)
    run transformers' own paged loop, never ``generate``: a config asking for MagicDec there gets a
    warning naming the path that ran, and one that does not ask gets none."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = _config(speculative="magicdec", **SETTINGS)
    with pytest.warns(hf_magicdec.MagicDecWarning, match="continuous batching.*no speculation") as said:
        model.init_continuous_batching(generation_config=config)
    assert {w.filename for w in said.list} == {__file__}  # the caller's line
    with pytest.warns(hf_magicdec.MagicDecWarning, match=r"MagicDec options \['draft'"):
        model.init_continuous_batching(_config(draft="snapkv"))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model.init_continuous_batching(generation_config=_config())
    assert not _magicdec_warnings(record)

    with pytest.warns(hf_magicdec.MagicDecWarning, match="continuous batching"):
        small = ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=32)  # sized for the test, not the host
        out = model.generate_batch([[5, 6, 7, 8], [9, 10]], generation_config=_config(speculative="magicdec"),
                                   continuous_batching_config=small, max_new_tokens=3, warmup=False)
    assert len(out) == 2


def test_disable_restores_continuous_batching():
    from transformers.generation.utils import GenerationMixin

    assert "init_continuous_batching" in vars(GenerationMixin)
    hf_magicdec.disable()
    try:
        assert "init_continuous_batching" not in vars(GenerationMixin)
    finally:
        hf_magicdec.enable()
    assert "init_continuous_batching" in vars(GenerationMixin)

"""The run-time check of the transformers internals hf-magicdec builds on (hf_magicdec.compat)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import transformers
from transformers import cache_utils
from transformers.generation import utils as generation_utils

from hf_magicdec import compat, routing

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh_check():
    compat._checked.cache_clear()
    yield
    compat._checked.cache_clear()


def test_installed_transformers_has_everything():
    assert compat.missing_internals() == []
    compat.check_transformers()


def test_supported_range_matches_pyproject():
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if re.match(r"transformers\b", d))
    assert spec.replace(" ", "") == "transformers" + compat.SUPPORTED_TRANSFORMERS


def test_moved_internal_names_the_supported_range(monkeypatch):
    monkeypatch.delattr(cache_utils, "CacheLayerMixin")
    with pytest.raises(ImportError) as info:
        compat.check_transformers()
    msg = str(info.value)
    assert "transformers.cache_utils.CacheLayerMixin" in msg
    assert f"transformers{compat.SUPPORTED_TRANSFORMERS}" in msg
    assert transformers.__version__ in msg


def test_generate_without_custom_generate_is_refused(monkeypatch):
    def generate(self, inputs=None, generation_config=None, **kwargs):  # a generate that lost the keyword
        raise AssertionError("never called")

    monkeypatch.setattr(generation_utils.GenerationMixin, "generate", generate)
    assert compat.missing_internals() == ["GenerationMixin.generate(custom_generate=...)"]


def test_routing_install_runs_the_check(monkeypatch):
    was_enabled = routing.is_enabled()
    routing.disable()
    try:
        monkeypatch.delattr(cache_utils, "Cache")
        with pytest.raises(ImportError, match=re.escape(compat.SUPPORTED_TRANSFORMERS)):
            routing.enable()
        assert not routing.is_enabled()  # nothing installed on failure
    finally:
        monkeypatch.undo()
        compat._checked.cache_clear()
        if was_enabled:
            routing.enable()
    assert routing.is_enabled() == was_enabled


def test_cache_kwarg_is_read_as_past_key_values():
    """transformers 5.24 hands decoding methods generate's cache as ``cache=``; the engine reads
    ``past_key_values`` (what 5.23 passes), so both spellings reach it."""
    marker, other = object(), object()
    assert compat.cache_kwarg_to_past_key_values({"cache": marker, "use_cache": True}) == {
        "past_key_values": marker, "use_cache": True}
    assert compat.cache_kwarg_to_past_key_values({"past_key_values": marker}) == {"past_key_values": marker}
    assert compat.cache_kwarg_to_past_key_values({"past_key_values": marker, "cache": other}) == {
        "past_key_values": marker}
    assert compat.cache_kwarg_to_past_key_values({"past_key_values": None, "cache": other}) == {
        "past_key_values": other}


@pytest.mark.parametrize("names", [["past_key_values", "cache_params"], ["cache", "state"]])
def test_stock_decoding_gets_the_cache_under_the_installed_name(monkeypatch, names):
    """A declined call decodes with stock ``_sample``, which reads the cache under the installed
    release's own name (``cache`` from 5.24): handed ``past_key_values`` there, chunked prefill
    refused ("Cannot use prefill chunking without a cache") and a passed prompt cache was ignored."""
    monkeypatch.setattr(generation_utils, "ALL_CACHE_NAMES", names)
    marker = object()
    given = {"past_key_values": marker, "use_cache": True}
    assert compat.past_key_values_to_cache_kwarg(given) == {names[0]: marker, "use_cache": True}
    assert given == {"past_key_values": marker, "use_cache": True}  # a copy: the engine's kwargs unchanged
    round_trip = compat.cache_kwarg_to_past_key_values(compat.past_key_values_to_cache_kwarg(given))
    assert round_trip == given


def test_engine_forwards_pass_the_cache_under_the_models_own_keyword():
    """transformers 5.24 models take ``cache=`` and warn (FutureWarning, removal in 5.40) on
    ``past_key_values=``: the engine's forwards, and what it hands back, use the installed names,
    so a user sees no deprecation warning caused by the library (on 5.23 both are the old name)."""
    import warnings

    import torch

    from hf_magicdec.engine.steps import forward_cache_kwarg
    from conftest import make_model, ragged_prompts

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None): ...

    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs): ...

    assert forward_cache_kwarg(Old()) == "past_key_values" and forward_cache_kwarg(New()) == "cache"
    model = make_model("llama-gqa3")
    ids, mask = ragged_prompts(2, 24)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=r".*past_key_values.*deprecated", category=FutureWarning)
        warnings.filterwarnings("error", message=r".*past_key_values.*deprecated")
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             speculative="magicdec", draft="streamingllm", draft_budget=16, sink_tokens=2,
                             gamma=2, return_dict_in_generate=True)
        cache = getattr(out, compat.generate_cache_name())
    assert cache is not None and cache.get_seq_length() == out.sequences.shape[1] - 1

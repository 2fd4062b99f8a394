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

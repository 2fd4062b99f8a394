"""The transformers-native path: ``hf-magicdec export-hub DIR`` writes a ``custom_generate``
repository, and ``model.generate(custom_generate=DIR, trust_remote_code=True)`` runs MagicDec in a
fresh process that never imported ``hf_magicdec`` itself (so the routing is not installed), with
greedy output identical to stock ``generate`` and to the import path (``speculative=``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from hf_magicdec import MagicDecConfig
from hf_magicdec_bench import cli, hub

from conftest import make_model

OPTIONS = dict(draft="streamingllm", draft_budget=12, gamma=3)

# Runs in a fresh interpreter: builds conftest's tiny Llama (same config, seed and sharpened head)
# without importing conftest, which imports hf_magicdec.
SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    code_only, with_model = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, num_hidden_layers=2, max_position_embeddings=1024, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2, hidden_size=96, intermediate_size=160,
                         num_attention_heads=6, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 2
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 128, (3, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :12] = 0
    mask[2, :5] = 0
    ids[mask == 0] = 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    result = {}
    stock = model.generate(**kw)
    assert "hf_magicdec" not in sys.modules

    # 1. A code-only repository with the defaults in custom_generate/generate.py.
    out = model.generate(**kw, custom_generate=code_only, trust_remote_code=True, return_dict_in_generate=True)
    s = out.speculation
    result["code_only"] = dict(type=type(out).__name__, identical=torch.equal(out.sequences, stock),
                               config=[s.draft, s.draft_budget, s.gamma], steps=s.steps)
    # Per-call keywords override the defaults; a plain tensor unless a dict is asked for.
    out = model.generate(**kw, custom_generate=code_only, trust_remote_code=True, gamma=1,
                         return_dict_in_generate=True)
    result["override_gamma"] = out.speculation.gamma
    result["tensor"] = torch.equal(model.generate(**kw, custom_generate=code_only, trust_remote_code=True), stock)
    result["plain_call_is_stock"] = type(model.generate(**kw, return_dict_in_generate=True)).__name__

    # 2. A repository that holds the model: from_pretrained(trust_remote_code=True) swaps its generate.
    loaded = AutoModelForCausalLM.from_pretrained(with_model, trust_remote_code=True).eval()
    out = loaded.generate(**kw, return_dict_in_generate=True)
    s = out.speculation
    result["with_model"] = dict(type=type(out).__name__, identical=torch.equal(out.sequences, stock),
                                config=[s.draft, s.draft_budget, s.gamma], steps=s.steps)
    plain = loaded.generate(**kw, speculative=None, return_dict_in_generate=True)
    result["off"] = [type(plain).__name__, torch.equal(plain.sequences, stock)]

    # 3. The import path, in the same process, for the same outputs.
    import hf_magicdec
    routed = model.generate(**kw, speculative=hf_magicdec.MagicDecConfig.from_any(**json.loads(sys.argv[3])),
                            return_dict_in_generate=True)
    result["import_path_identical"] = torch.equal(routed.sequences, stock)
    print("RESULT " + json.dumps(result))
""")


def test_export_hub_writes_the_layout(tmp_path, capsys):
    out = tmp_path / "magicdec"
    assert cli.main(["export-hub", str(out), "--draft", "snapkv", "--budget", "64", "--gamma", "2",
                     "--repo-id", "your-name/magicdec"]) == 0
    assert "custom_generate/generate.py" in capsys.readouterr().out
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["README.md", "custom_generate/generate.py", "custom_generate/requirements.txt"]
    requirements = (out / "custom_generate" / "requirements.txt").read_text()
    assert requirements.strip() == hub.REQUIREMENTS.strip() and requirements.startswith("hf-magicdec>=")
    code = (out / "custom_generate" / "generate.py").read_text()
    compile(code, "generate.py", "exec")
    namespace: dict = {}
    exec(code, namespace)  # noqa: S102  (our own generated file)
    assert MagicDecConfig.from_any(namespace["SPECULATIVE"]) == MagicDecConfig.from_any(draft="snapkv", draft_budget=64, gamma=2)
    assert "def generate(" in code and "import hf_magicdec" in code
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n") and "- custom_generate" in card
    assert 'custom_generate="your-name/magicdec", trust_remote_code=True' in card
    assert '"draft_budget": 64' in card
    # Bad settings are refused before anything is written.
    with pytest.raises(SystemExit):
        cli.main(["export-hub", str(tmp_path / "bad"), "--draft", "nope", "--quiet"])
    assert not (tmp_path / "bad").exists()


def test_custom_generate_from_a_local_directory_in_a_fresh_process(tmp_path):
    code_only = hub.export(tmp_path / "code-only", sink_tokens=2, **OPTIONS)
    with_model = hub.export(tmp_path / "with-model", model=make_model("llama-gqa3"), base_model="tiny-llama",
                            sink_tokens=2, **OPTIONS)
    assert (with_model / "generation_config.json").is_file() and (with_model / "custom_generate").is_dir()
    assert "trust_remote_code=True)" in (with_model / "README.md").read_text()
    script = tmp_path / "run.py"
    script.write_text(SCRIPT, encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2"}
    env.pop("HF_MAGICDEC_NO_PATCH", None)
    proc = subprocess.run([sys.executable, str(script), str(code_only), str(with_model),
                           json.dumps({**OPTIONS, "sink_tokens": 2})],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    expected = dict(type="MagicDecOutput", identical=True, config=["streamingllm", 12, 3])
    for key in ("code_only", "with_model"):
        got = result[key]
        assert {k: got[k] for k in expected} == expected, (key, got)
        assert got["steps"] > 0  # it speculated, it did not fall back to plain decoding
    assert result["override_gamma"] == 1
    assert result["off"] == ["GenerateDecoderOnlyOutput", True]
    assert result["tensor"] is True
    assert result["plain_call_is_stock"] == "GenerateDecoderOnlyOutput"  # the routing is a no-op for it
    assert result["import_path_identical"] is True

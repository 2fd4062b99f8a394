"""Triton kernels (run by Triton's CPU interpreter, ``TRITON_INTERPRET=1`` set in conftest) against
an fp64 oracle and their PyTorch twins, the backend switch, and end-to-end equality with
``generate`` with the Triton backend forced.

Shapes hit every branch: one query and γ+1 queries, odd lengths, ranges shorter than a key block,
several key-axis splits (merge kernel) and one, GQA ratios 1/3/7/8, head_dim 64 and 128, batch 1
and 5, rows with left padding.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import ragged_prompts

pytest.importorskip("triton")
assert os.environ.get("TRITON_INTERPRET") == "1", "conftest must select Triton's interpreter before import"

from hf_magicdec import kernels  # noqa: E402
from hf_magicdec.kernels import Segments, reference  # noqa: E402
from hf_magicdec.kernels import triton_kernels as tk  # noqa: E402


def _oracle(query, key, value, segments, scaling):
    group = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    scores = query.double() @ k.transpose(-1, -2) * scaling
    scores = scores.masked_fill(~segments.mask(query.shape[2], key.shape[2]), float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)


def _segments(kind, batch, q_len, kv_len, gen):
    if kind == "verify":  # ragged rows on the full cache, left padding in some
        ends = torch.randint(q_len + 3, kv_len + 1, (batch,), generator=gen)
        ends[0] = kv_len
        pad = torch.randint(0, 3, (batch,), generator=gen)
        return Segments.causal(pad, ends)
    # draft on a compact view: filled prefix (often shorter than one 64-key block) + scratch block
    filled = torch.randint(1, kv_len - 8, (batch,), generator=gen)
    return Segments.prefix_and_block(filled, kv_len - 8, kv_len - 8 + q_len + 2)


SHAPES = [
    # batch, group, kv_heads, q, head_dim, kv_len, kind, splits
    (1, 1, 2, 1, 64, 37, "verify", 1),
    (1, 8, 1, 5, 128, 131, "verify", 3),
    (5, 3, 2, 5, 64, 83, "verify", 2),
    (5, 7, 1, 4, 64, 149, "verify", None),
    (2, 3, 2, 1, 128, 70, "draft", 1),
    (5, 8, 1, 1, 64, 45, "draft", 2),
    (1, 7, 1, 1, 64, 200, "draft", None),
]


@pytest.mark.parametrize("batch,group,kv_heads,q_len,head_dim,kv_len,kind,splits", SHAPES)
def test_segment_attention_matches_oracle_and_twin(batch, group, kv_heads, q_len, head_dim, kv_len, kind, splits):
    gen = torch.Generator().manual_seed(batch * 1000 + group * 100 + kv_len)
    query = torch.randn(batch, kv_heads * group, q_len, head_dim, generator=gen).transpose(1, 2).contiguous()
    query = query.transpose(1, 2)  # [B, H, q, D] non-contiguous, as models hand it over
    key = torch.randn(batch, kv_heads, kv_len, head_dim, generator=gen)
    value = torch.randn(batch, kv_heads, kv_len, head_dim, generator=gen)
    segments = _segments(kind, batch, q_len, kv_len, gen)
    scale = head_dim**-0.5
    want = _oracle(query, key, value, segments, scale)
    got = tk.segment_attention(query, key, value, segments, scale, num_splits=splits)
    twin = reference.segment_attention(query, key, value, segments, scale)
    assert got.shape == twin.shape == (batch, q_len, kv_heads * group, head_dim)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(twin.double(), want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_segment_attention_half_precision(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(3, 6, 4, 64, generator=gen).to(dtype)
    key = torch.randn(3, 2, 97, 64, generator=gen).to(dtype)
    value = torch.randn(3, 2, 97, 64, generator=gen).to(dtype)
    segments = _segments("verify", 3, 4, 97, gen)
    got = tk.segment_attention(query, key, value, segments, 0.125, num_splits=2)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), _oracle(query, key, value, segments, 0.125), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "batch,group,kv_heads,window,head_dim,slots,dtype",
    [(1, 1, 2, 8, 64, 37, torch.float32), (5, 3, 2, 8, 64, 90, torch.float32), (2, 7, 1, 32, 128, 131, torch.float32),
     (2, 8, 1, 16, 64, 70, torch.bfloat16)],
)
def test_snapkv_mass_matches_oracle_and_twin(batch, group, kv_heads, window, head_dim, slots, dtype):
    gen = torch.Generator().manual_seed(slots)
    queries = torch.randn(batch, kv_heads * group, window, head_dim, generator=gen).to(dtype)
    keys = torch.randn(batch, kv_heads, slots, head_dim, generator=gen).to(dtype)
    pad = torch.randint(0, 6, (batch,), generator=gen)
    pad[-1] = slots - window // 2  # a row shorter than the window: its padding queries add nothing
    scale = head_dim**-0.5
    # fp64 oracle straight from the definition: softmax of each window query, summed.
    q = queries.double().reshape(batch, kv_heads, group * window, head_dim)
    logits = q @ keys.double().transpose(-1, -2) * scale
    qslot = slots - window + torch.arange(window).repeat(group)
    kslot = torch.arange(slots)
    allowed = kslot[None, None, None] <= qslot[None, None, :, None]
    allowed = allowed & (kslot[None, None, None] >= pad[:, None, None, None])
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
    probs = torch.where((qslot[None, :] >= pad[:, None])[:, None, :, None], probs, torch.zeros(()))
    want = probs.sum(2)
    got = tk.snapkv_mass(queries, keys, pad, scale)
    twin = reference.snapkv_mass(queries, keys, pad, scale)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(twin.double(), want, rtol=1e-4, atol=1e-5)
    assert torch.isfinite(got).all()


def test_backend_switch(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert kernels.check_backend(cpu) == "torch"  # auto never picks the interpreter
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    assert kernels.check_backend(cpu) == "torch"
    monkeypatch.setenv(kernels.ENV_VAR, "TRITON")
    assert kernels.check_backend(cpu) == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET is not set"):
        kernels.check_backend(cpu)
    monkeypatch.setenv(kernels.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="'cuda' is not one of"):
        kernels.requested_backend()


def test_bad_backend_fails_before_any_forward(tiny_models, monkeypatch):
    model = tiny_models("llama-gqa3")
    calls = []
    handle = model.model.embed_tokens.register_forward_hook(lambda *a: calls.append(1))
    monkeypatch.setenv(kernels.ENV_VAR, "fast")
    ids, mask = ragged_prompts(batch=2, length=16, seed=0)
    try:
        with pytest.raises(ValueError, match="HF_MAGICDEC_KERNELS='fast'"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, speculative="magicdec",
                           draft="streamingllm", draft_budget=8, gamma=2, sink_tokens=2)
    finally:
        handle.remove()
    assert calls == []


@pytest.mark.parametrize("draft,extra", [("streamingllm", dict(sink_tokens=4)), ("snapkv", dict(window=8))])
def test_greedy_identical_with_triton_backend(tiny_models, monkeypatch, draft, extra):
    """The engine's draft and verify attention (and SnapKV scoring) through the Triton kernels."""
    model = tiny_models("llama-gqa3")
    ids, mask = ragged_prompts(batch=3, length=40, seed=5)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None)
    reference_ids = model.generate(**kwargs)
    calls = {"segment_attention": 0, "snapkv_mass": 0}
    for name in calls:
        original = getattr(tk, name)

        def counted(*args, _name=name, _original=original, **kw):
            calls[_name] += 1
            return _original(*args, **kw)

        monkeypatch.setattr(tk, name, counted)
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    out = model.generate(**kwargs, speculative="magicdec", draft=draft, draft_budget=16, gamma=3,
                         return_dict_in_generate=True, **extra)
    assert torch.equal(reference_ids, out.sequences)
    assert 0 < out.speculation.acceptance_rate < 1
    assert calls["segment_attention"] > 0
    assert (calls["snapkv_mass"] > 0) == (draft == "snapkv")


def test_gpu_check_script_runs_on_cpu(tmp_path):
    """scripts/gpu_check.py is run once on a lent GPU; its --smoke mode proves it works before that."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "gpu_check.json"
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
    # One model shape keeps this under half a minute (the GPU run covers both).
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--models", "llama-3.1-8b", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["verdict"]["correctness"] is True
    assert {r["path"] for r in report["kernel"]} == {"triton", "torch_twin", "stock_sdpa"}
    assert {r["model"] for r in report["model"]} == {"llama-3.1-8b"}
    # The quantized draft (int8 on CPU) is timed beside the full-weight one, and the end-to-end
    # comparison with stock static-cache generate ran and decoded the same tokens.
    assert all(r["draft_weights"] == "int8" and r["td_quantized_over_tt"] for r in report["model"] if "graphs" in r
               and "error" not in r)
    e2e = report["end_to_end"]
    # (Smoke shapes decode 8 tokens in milliseconds: the times are noise there, only present.)
    assert e2e["identical"] is True and {"stock_static_decode_s", "magicdec_decode_s"} <= set(e2e)


def test_kernels_are_custom_ops_that_compile_without_graph_breaks():
    """Both kernels are ``torch.library.triton_op`` operators: a ``fullgraph=True`` compile traces
    them as ``hf_magicdec::`` ops (no graph break) and computes what eager computes."""
    import torch._dynamo

    gen = torch.Generator().manual_seed(3)
    query = torch.randn(2, 6, 3, 64, generator=gen)
    key = torch.randn(2, 2, 40, 64, generator=gen)
    value = torch.randn(2, 2, 40, 64, generator=gen)
    segments = _segments("verify", 2, 3, 40, gen)
    window = torch.randn(2, 6, 4, 64, generator=gen)
    pad = torch.tensor([0, 3])

    def both(q, k, v, w):
        return tk.segment_attention(q, k, v, segments, 0.125), tk.snapkv_mass(w, k, pad, 0.125)

    seen = []

    def backend(graph, inputs):
        seen.append(graph)
        return graph.forward

    torch._dynamo.reset()
    compiled = torch.compile(both, backend=backend, fullgraph=True)
    got = compiled(query, key, value, window)
    want = both(query, key, value, window)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    code = "\n".join(g.code for g in seen)
    assert len(seen) == 1 and "hf_magicdec.segment_attention" in code and "hf_magicdec.snapkv_mass" in code

"""Triton kernels (run by Triton's CPU interpreter, ``TRITON_INTERPRET=1`` set in conftest) against
an fp64 oracle and their PyTorch twins, the backend switch, and end-to-end equality with
``generate`` with the Triton backend forced.

Shapes hit every branch: one query and γ+1 queries, odd lengths, ranges shorter than a key block,
several key-axis splits (merge kernel) and one, GQA ratios 1/3/7/8, head_dim 64 and 128, batch 1
and 5, rows with left padding. Also the launch plans (tiles within each device's shared memory,
split count a runtime argument) and the dispatcher's fallbacks to the twin. The same launches
compiled for real GPUs: test_aot_compile.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import ragged_prompts

pytest.importorskip("triton")
assert os.environ.get("TRITON_INTERPRET") == "1", "conftest must select Triton's interpreter before import"

from hf_magicdec import kernels  # noqa: E402
from hf_magicdec.kernels import Segments, launch, reference  # noqa: E402
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


def _oracle_probs(query, key, segments, scaling, softcap=None, sinks=None):
    """fp64 probabilities ``[B, H, q, L]`` from the definition: scale, cap, mask, softmax over
    [keys | sink]; a query that sees nothing gets zeros."""
    group = query.shape[1] // key.shape[1]
    scores = query.double() @ key.double().repeat_interleave(group, dim=1).transpose(-1, -2) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~segments.mask(query.shape[2], key.shape[2]), float("-inf"))
    if sinks is not None:
        sink = sinks.double()[None, :, None, None].expand(*scores.shape[:3], 1)
        return torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    return torch.softmax(scores, -1).nan_to_num(0.0)


def _oracle_mass(probs, kv_heads, page_size):
    """``[B, Hkv, ceil(L / page)]``: the probabilities summed over each KV head's query heads and
    the query positions, then over each page of absolute key slots."""
    batch, heads, q_len, length = probs.shape
    per_key = probs.reshape(batch, kv_heads, heads // kv_heads * q_len, length).sum(2)
    pages = -(-length // page_size)
    per_key = torch.nn.functional.pad(per_key, (0, pages * page_size - length))
    return per_key.reshape(batch, kv_heads, pages, page_size).sum(-1)


def _mass_segments(kind, batch, q_len, kv_len, gen):
    """Verify (range 2 only, ``Segments.causal(pad, lengths + q)``, left padding up to 20 slots, so
    that it crosses pages and key blocks) or the draft layout (both ranges)."""
    if kind == "draft":
        return _segments("draft", batch, q_len, kv_len, gen)
    pad = torch.randint(0, 21, (batch,), generator=gen)
    lengths = pad + torch.randint(q_len + 1, kv_len - q_len - 20, (batch,), generator=gen)
    lengths[0] = kv_len - q_len  # one row fills the cache
    return Segments.causal(pad, lengths + q_len)


MASS_SHAPES = [
    # batch, group, kv_heads, q, head_dim, kv_len, kind, splits, page, dtype, softcap, sinks
    (1, 1, 2, 1, 64, 37, "verify", 1, 16, torch.float32, None, False),
    (5, 3, 2, 5, 64, 83, "verify", 2, 16, torch.float32, None, False),
    (3, 7, 1, 5, 64, 149, "verify", None, 64, torch.float32, None, False),
    (1, 8, 1, 5, 128, 131, "verify", 3, 64, torch.float32, None, True),
    (2, 8, 1, 1, 64, 70, "verify", 1, 16, torch.float32, 30.0, True),
    (2, 3, 2, 5, 64, 97, "verify", 2, 64, torch.float32, 20.0, False),
    (2, 3, 2, 1, 128, 70, "draft", 1, 16, torch.float32, None, False),
    (5, 8, 1, 1, 64, 45, "draft", 2, 64, torch.float32, None, True),
    (3, 7, 1, 5, 64, 97, "draft", 2, 16, torch.float32, 30.0, False),
    # 16-bit: 64-key blocks, so a block holds 4 pages of 16 (several partial sums per block) or one of 64.
    (3, 3, 2, 5, 64, 150, "verify", 2, 16, torch.bfloat16, None, False),
    (2, 8, 1, 5, 64, 130, "verify", 1, 64, torch.bfloat16, 30.0, True),
    (2, 7, 1, 1, 64, 101, "verify", 1, 32, torch.bfloat16, None, False),
    (3, 1, 2, 5, 128, 141, "draft", 3, 16, torch.bfloat16, None, True),
    (1, 3, 2, 5, 64, 200, "verify", 3, 128, torch.float16, None, False),
]


@pytest.mark.parametrize("batch,group,kv_heads,q_len,head_dim,kv_len,kind,splits,page,dtype,softcap,has_sinks",
                         MASS_SHAPES)
def test_attention_mass_per_page_matches_oracle_and_twin(batch, group, kv_heads, q_len, head_dim, kv_len, kind,
                                                         splits, page, dtype, softcap, has_sinks):
    """``page_size > 0``: the Triton kernel (one split and several) and the twin return the same
    output as without it and the attention mass per page of the fp64 oracle: its probabilities
    (soft-capped, sinks in the denominator) summed over each KV head's query heads and positions.
    Each query's probabilities add up to 1 less its sink share; pages outside a row's ranges get
    exactly 0."""
    gen = torch.Generator().manual_seed(batch * 1000 + group * 100 + kv_len + page)
    heads = kv_heads * group
    query = torch.randn(batch, q_len, heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
    key = torch.randn(batch, kv_heads, kv_len, head_dim, generator=gen).to(dtype)
    value = torch.randn(batch, kv_heads, kv_len, head_dim, generator=gen).to(dtype)
    sinks = torch.randn(heads, generator=gen) if has_sinks else None
    segments = _mass_segments(kind, batch, q_len, kv_len, gen)
    scale = head_dim**-0.5
    probs = _oracle_probs(query, key, segments, scale, softcap, sinks)
    want_out = (probs @ value.double().repeat_interleave(group, dim=1)).transpose(1, 2)
    want = _oracle_mass(probs, kv_heads, page)
    out, mass = tk.segment_attention(query, key, value, segments, scale, softcap, sinks, num_splits=splits,
                                     page_size=page)
    twin_out, twin_mass = reference.segment_attention(query, key, value, segments, scale, softcap, sinks, page)
    assert mass.shape == twin_mass.shape == (batch, kv_heads, -(-kv_len // page)) and mass.dtype == torch.float32
    assert out.shape == twin_out.shape == (batch, q_len, heads, head_dim) and out.dtype == dtype
    # The kernel's probabilities are fp32 whatever the input dtype; the twin's bf16 logits are not.
    half = dtype != torch.float32
    torch.testing.assert_close(mass.double(), want, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(twin_mass.double(), want, rtol=1e-2 if half else 1e-5, atol=5e-3 if half else 2e-6)
    tol = {"rtol": 2e-2, "atol": 2e-2} if half else {"rtol": 1e-5, "atol": 2e-6}
    torch.testing.assert_close(out.double(), want_out, **tol)
    torch.testing.assert_close(twin_out.double(), want_out, **tol)
    torch.testing.assert_close(out, tk.segment_attention(query, key, value, segments, scale, softcap, sinks,
                                                         num_splits=splits), rtol=0, atol=1e-2 if half else 1e-6)
    # Each query's probabilities sum to 1 less its sink's share: g * q per KV head without sinks.
    rows = probs.sum(-1).reshape(batch, kv_heads, group * q_len).sum(-1)
    torch.testing.assert_close(mass.sum(-1).double(), rows, rtol=1e-5, atol=1e-5)
    if not has_sinks:
        torch.testing.assert_close(mass.sum(-1), torch.full_like(mass[..., 0], group * q_len), rtol=1e-5, atol=1e-5)
    # Pages no query of the row sees hold exactly 0 (unwalked key blocks included).
    seen = segments.mask(q_len, kv_len)[:, 0].any(1)
    seen = torch.nn.functional.pad(seen, (0, mass.shape[-1] * page - kv_len)).reshape(batch, -1, page).any(-1)
    assert (mass[~seen[:, None, :].expand_as(mass)] == 0).all()


def test_attention_mass_pages_and_splits_agree():
    """The same call at every page size the kernel takes and split count: pages of 16 added up in
    fours are the pages of 64, and one split or four give the same mass."""
    gen = torch.Generator().manual_seed(9)
    query = torch.randn(2, 12, 5, 64, generator=gen).bfloat16()
    key = torch.randn(2, 2, 300, 64, generator=gen).bfloat16()
    segments = _mass_segments("verify", 2, 5, 300, gen)
    by_page = {}
    for page, splits in ((16, 1), (16, 4), (32, 2), (64, 1), (64, 4), (256, 3)):
        _, mass = tk.segment_attention(query, key, key, segments, 0.125, num_splits=splits, page_size=page)
        if page in by_page:
            torch.testing.assert_close(mass, by_page[page], rtol=1e-5, atol=1e-6)
        by_page[page] = mass
    for page in (32, 64, 256):
        fine = torch.nn.functional.pad(by_page[16], (0, by_page[page].shape[-1] * page // 16 - by_page[16].shape[-1]))
        torch.testing.assert_close(fine.reshape(2, 2, -1, page // 16).sum(-1), by_page[page], rtol=1e-5, atol=1e-5)


def test_mass_page_sizes_the_kernel_cannot_serve_take_the_twin(monkeypatch, caplog):
    """Page sizes that are not powers of two >= 16 go to the twin with one log line; the kernel's
    own entry point refuses them; ``page_size=0`` keeps the single-output contract."""
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    monkeypatch.setattr(kernels, "_LOGGED", set())
    gen = torch.Generator().manual_seed(5)
    query, key = torch.randn(2, 6, 3, 32, generator=gen), torch.randn(2, 2, 50, 32, generator=gen)
    segments = _mass_segments("verify", 2, 3, 50, gen)
    assert launch.mass_refusal(16) is None and launch.mass_refusal(1024) is None
    with caplog.at_level("WARNING", logger="hf_magicdec"):
        for page in (48, 48, 8):
            out, mass = kernels.segment_attention(query, key, key, segments, 0.2, page_size=page)
            want_out, want_mass = reference.segment_attention(query, key, key, segments, 0.2, page_size=page)
            torch.testing.assert_close(mass, want_mass)
            torch.testing.assert_close(out, want_out)
    logs = _fallback_logs(caplog)
    assert len(logs) == 2 and "48 keys" in logs[0] and "8 keys" in logs[1]
    with pytest.raises(ValueError, match="powers of two"):
        tk.segment_attention(query, key, key, segments, 0.2, page_size=24)
    with pytest.raises(ValueError, match="page_size must be >= 0"):
        kernels.segment_attention(query, key, key, segments, 0.2, page_size=-1)
    calls = []
    original = tk.segment_attention
    monkeypatch.setattr(tk, "segment_attention", lambda *a, **k: calls.append(k) or original(*a, **k))
    out, mass = kernels.segment_attention(query, key, key, segments, 0.2, page_size=16)  # served by the kernel
    assert calls == [{"page_size": 16}] and mass.shape == (2, 2, 4)
    assert isinstance(kernels.segment_attention(query, key, key, segments, 0.2), torch.Tensor)


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


def test_the_mass_op_compiles_without_graph_breaks():
    """``page_size > 0`` goes through the same ``hf_magicdec::segment_attention`` operator, its
    second output the mass: a ``fullgraph=True`` compile traces it (fake implementation of both
    outputs) and computes what eager computes."""
    import torch._dynamo

    gen = torch.Generator().manual_seed(6)
    query = torch.randn(2, 6, 5, 64, generator=gen)
    key = torch.randn(2, 2, 90, 64, generator=gen)
    segments = _mass_segments("verify", 2, 5, 90, gen)
    sinks = torch.randn(6, generator=gen)

    def verify(q, k):
        out, mass = tk.segment_attention(q, k, k, segments, 0.125, sinks=sinks, page_size=16)
        return out, mass / 2

    seen = []

    def backend(graph, inputs):
        seen.append(graph)
        return graph.forward

    torch._dynamo.reset()
    got = torch.compile(verify, backend=backend, fullgraph=True)(query, key)
    want = verify(query, key)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert got[1].shape == (2, 2, 6)
    assert len(seen) == 1 and "hf_magicdec.segment_attention" in seen[0].code
    with torch._subclasses.fake_tensor.FakeTensorMode():  # the fake implementation's shapes
        fake = torch.ops.hf_magicdec.segment_attention(torch.empty(3, 8, 4, 64), torch.empty(3, 2, 100, 64),
                                                       torch.empty(3, 2, 100, 32), *(torch.empty(3, dtype=torch.int32),) * 4,
                                                       0.1, None, None, 0, 32)
        assert fake[0].shape == (3, 4, 8, 32) and fake[1].shape == (3, 2, 4) and fake[1].dtype == torch.float32


def test_mass_launches_keep_the_plan_and_the_no_mass_launch():
    """Asking for the mass changes no tile, warp or stage of the attention (so the AOT test's
    shared-memory estimate holds), only the ``MASS``/``UNITS`` constexprs, and adds the epilogue;
    the no-mass launch compiles with ``MASS`` off. The partials are sized for whole pages; their
    per-program bases are 64-bit (``mass_blocks`` is checked in the TTIR by the AOT test)."""
    spec = launch.KNOWN_DEVICES["sm_90"]
    seg = torch.zeros(32, dtype=torch.int32, device="meta")
    query = torch.empty(32, 32, 5, 128, dtype=torch.bfloat16, device="meta")
    key = torch.empty(32, 8, 32_773, 128, dtype=torch.bfloat16, device="meta")
    _, _, plain = tk.segment_attention_launches(query, key, key, seg, seg, seg, seg, 0.1, None, None, 0, spec)
    assert plain[0].kwargs["MASS"] is False
    for page, units in ((16, 4), (32, 2), (64, 1), (128, 1)):
        _, mass, made = tk.segment_attention_launches(query, key, key, seg, seg, seg, seg, 0.1, None, None, 0, spec,
                                                      page)
        *attention, epilogue = made
        assert [m.grid for m in attention] == [p.grid for p in plain] and epilogue.kernel is tk._page_mass_kernel
        assert {k: v for k, v in attention[0].kwargs.items() if k not in ("MASS", "UNITS")} == {
            k: v for k, v in plain[0].kwargs.items() if k not in ("MASS", "UNITS")}
        assert attention[0].kwargs["UNITS"] == epilogue.kwargs["UNITS"] == units
        assert all(m.kwargs["MASS"] for m in attention)
        pages = -(-32_773 // page)
        blocks = -(-pages * page // 64)
        assert epilogue.args[0].shape == (32 * 8, blocks, units + 1, 4 * 5)  # U sums and the max per block
        assert mass.shape == (32, 8, pages) and attention[0].args[attention[0].kernel.arg_names.index("mass_blocks")] == blocks


def _served(dtype, head_dim: int, rows: int, spec) -> bool:
    """The documented limits (docs/kernels.md): 128 packed rows, except at head_dim 256: 64 rows in
    fp16/bf16 on 99 KiB devices, and in fp32 32 rows on 99 KiB devices and 64 on the A100."""
    if head_dim <= 128 or spec.shared_memory > 200_000:
        return rows <= 128
    small = spec.shared_memory < 150_000
    if dtype != torch.float32:
        return rows <= (64 if small else 128)
    return rows <= (32 if small else 64)


@pytest.mark.parametrize("device", sorted(launch.KNOWN_DEVICES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_tiles_fit_every_device_within_the_documented_limits(device, dtype):
    """The plans find tiles within each device's shared memory for every head width and packed
    query tile within the documented limits, and refuse the rest (with a reason) so that the
    dispatcher uses the twin; tests/kernels/test_aot_compile.py checks the tiles with the compiler."""
    spec = launch.KNOWN_DEVICES[device]
    elem = torch.empty((), dtype=dtype).element_size()
    for head_dim in (64, 80, 96, 128, 256):
        for group, q_len in ((1, 1), (4, 4), (2, 9), (7, 9), (8, 8), (8, 16)):
            query = torch.empty(1, 8 * group, q_len, head_dim, dtype=dtype, device="meta")
            key = torch.empty(1, 8, 300, head_dim, dtype=dtype, device="meta")
            reason = launch.segment_attention_refusal(query, key, key, spec)
            if not _served(dtype, head_dim, group * q_len, spec):
                assert reason is not None and "shared memory" in reason
                continue
            assert reason is None
            plan = launch.plan_segment_attention(1, 8, group, q_len, head_dim, head_dim, 300, dtype, spec)
            assert plan.block_m >= group * q_len and plan.block_d >= head_dim
            assert launch.segment_shared(plan.block_m, plan.block_n, plan.block_d, plan.block_dv, elem,
                                         plan.num_stages, spec) <= spec.shared_memory
        queries = torch.empty(1, 32, 32, head_dim, dtype=dtype, device="meta")
        keys = torch.empty(1, 8, 300, head_dim, dtype=dtype, device="meta")
        assert launch.snapkv_refusal(queries, keys, spec) is None


def test_split_count_is_not_a_compile_time_constant():
    """Batch and length change the split count during a generation: it reaches the kernels as a
    runtime argument, so no new variant is compiled (constexprs equal for any split count)."""
    spec = launch.KNOWN_DEVICES["sm_90"]
    seg = torch.zeros(4, dtype=torch.int32)
    constexprs = set()
    for batch, kv_len in ((1, 70_000), (1, 3_000), (4, 700), (4, 70)):
        query = torch.empty(batch, 32, 5, 128, dtype=torch.bfloat16, device="meta")
        key = torch.empty(batch, 8, kv_len, 128, dtype=torch.bfloat16, device="meta")
        _, _, made = tk.segment_attention_launches(query, key, key, seg[:batch], seg[:batch], seg[:batch], seg[:batch],
                                                   0.1, None, None, 0, spec)
        constexprs.add(tuple(sorted(made[0].kwargs.items())))
        splits = made[0].args[made[0].kernel.arg_names.index("num_splits")]
        assert made[0].grid[1] == splits and (len(made) == 2) == (splits > 1)  # the merge iff several
    assert len(constexprs) == 1


def _fallback_logs(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "hf_magicdec" and "PyTorch twin" in r.getMessage()]


def test_calls_the_kernels_cannot_serve_take_the_twin_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    monkeypatch.setattr(kernels, "_LOGGED", set())
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(2, 4, 3, 16, generator=gen, dtype=torch.float64)  # fp64: no kernel takes it
    key = torch.randn(2, 2, 20, 16, generator=gen, dtype=torch.float64)
    segments = _segments("verify", 2, 3, 20, gen)
    calls = []
    monkeypatch.setattr(tk, "segment_attention", lambda *a, **k: calls.append(1))
    with caplog.at_level("WARNING", logger="hf_magicdec"):
        for _ in range(3):
            got = kernels.segment_attention(query, key, key, segments, 0.25)
    torch.testing.assert_close(got, reference.segment_attention(query, key, key, segments, 0.25))
    assert calls == []
    assert len(_fallback_logs(caplog)) == 1 and "torch.float64" in _fallback_logs(caplog)[0]


def test_a_launch_the_compiler_refuses_falls_back_once_and_is_remembered(monkeypatch, caplog):
    """Should a device's shared memory be smaller than the plan expected, Triton raises
    OutOfResources at the first launch: the call (and every later one like it) takes the twin."""
    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    monkeypatch.setattr(kernels, "_LOGGED", set())
    monkeypatch.setattr(kernels, "_REFUSED", {})
    calls = []

    def out_of_resources(*args, **kwargs):
        calls.append(1)
        raise tk.OutOfResources(300_000, 232_448, "shared memory")

    monkeypatch.setattr(tk, "snapkv_mass", out_of_resources)
    gen = torch.Generator().manual_seed(2)
    queries, keys = torch.randn(1, 4, 8, 32, generator=gen), torch.randn(1, 2, 40, 32, generator=gen)
    pad = torch.tensor([3])
    with caplog.at_level("WARNING", logger="hf_magicdec"):
        for _ in range(3):
            got = kernels.snapkv_mass(queries, keys, pad, 0.2)
    torch.testing.assert_close(got, reference.snapkv_mass(queries, keys, pad, 0.2))
    assert calls == [1]
    assert len(_fallback_logs(caplog)) == 1 and "out of resource" in _fallback_logs(caplog)[0]


def test_the_dispatch_compiles_without_graph_breaks_kernels_and_fallback(monkeypatch):
    """The dispatcher's checks (refusals, remembered compiler refusals, the fallback's log) trace
    under ``fullgraph=True``: the kernels as their operators, a refused call as the twin."""
    import torch._dynamo

    monkeypatch.setenv(kernels.ENV_VAR, "triton")
    gen = torch.Generator().manual_seed(4)
    key = torch.randn(2, 2, 40, 64, generator=gen)
    segments = _segments("verify", 2, 3, 40, gen)
    seen = []

    def backend(graph, inputs):
        seen.append(graph)
        return graph.forward

    def attend(q, k):
        return kernels.segment_attention(q, k, k, segments, 0.125)

    for dtype, op in ((torch.float32, "hf_magicdec.segment_attention"), (torch.float64, None)):
        torch._dynamo.reset()
        query, k = torch.randn(2, 6, 3, 64, generator=gen, dtype=dtype), key.to(dtype)
        got = torch.compile(attend, backend=backend, fullgraph=True)(query, k)
        torch.testing.assert_close(got, reference.segment_attention(query, k, k, segments, 0.125))
        code = seen[-1].code
        assert (op in code) if op else "hf_magicdec" not in code

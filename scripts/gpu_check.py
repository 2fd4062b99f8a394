#!/usr/bin/env python
"""One short GPU run: Triton kernel correctness in bf16/fp16, kernel bandwidth, and the step-time
ratios the cost model rests on, for real model shapes. Writes one JSON file.

Needs only torch, triton and transformers: no package installs, no downloads. Models are
random-weight builds of real configs (``tests/configs/``, a few KB); ``hf_magicdec`` is imported
from this checkout's ``src/``.

    python scripts/gpu_check.py --out gpu_check.json                 # on a GPU: the whole grid
    python scripts/gpu_check.py --budget-s 360 --models llama-3.1-8b --batches 32 --contexts 32768 \
        --graph-gammas 4 --graph-budgets 512 --out gpu_check.json    # one lent call (scripts/gpu_run.sh)
    TRITON_INTERPRET=1 python scripts/gpu_check.py --smoke --out x.json   # on CPU: checks the script

The JSON is rewritten after every measurement (``"complete": false`` until the end, with the
verdict of what is measured so far), so a run stopped by a timeout still leaves its figures;
``--budget-s`` starts no further measurement once that many seconds have passed. The headline
shape (batch 32 × the longest context, eager then captured) and the end-to-end comparison run
first, the rest of the grid after them. ``python scripts/gpu_report.py gpu_check.json`` renders the
JSON as markdown tables.

What it measures (issue 5's targets, Llama-3.1-8B shape in bf16):

* device copy bandwidth (``y.copy_(x)``, read + write bytes per second);
* verify kernel bandwidth at batch 32, context 32K, q = 1 and γ+1 = 5 (target ≥ 70 % of copy);
* T_V(γ)/T_T (target ≤ 1.15 at γ = 4) and T_D(budget)/T_T (target ≤ 0.10 at budget 512) with the
  engine's own forwards, at batch 16–64 and context 8K–32K;
* the same attention through the stock paths (SDPA as HF calls it) and HF's DynamicCache decode
  step, for comparison;
* every model ratio twice: eager, and with the steps captured as ``compile=`` runs them (inductor
  with CUDA graphs; issue 15's targets T_D(512)/T_T ≤ 0.15 and T_V(4)/T_T ≤ 1.2 with graphs), and
  T_D with the quantized draft weights (``draft_weights=``: torchao's when installed);
* end to end (``--e2e``, default batch 32 × 32K, 128 new tokens): MagicDec's decode time against
  stock ``generate(cache_implementation="static")``, which transformers compiles on CUDA, same
  inputs, same run, and whether the greedy tokens are identical (target ≥ 1.5×);
* the ``views`` stage (issue 26): the verify kernel's attention mass per page (``draft="attended"``)
  against the twin and its cost beside the plain verify kernel; ``snapkv`` against ``attended`` at
  8 × 4K → 128 and a long generation (16 × 256 → 1,024) against the static cache
  (:func:`views_and_long_generation`).

``--stages`` runs a subset (``kernel``, ``views``, ``ratios``, ``e2e``; the correctness checks
always run first).

Model-level timings use ``--layers`` decoder layers (default 8) of the real shape: a full 32-layer
KV cache at batch 32 × 32K (128 GiB) does not fit next to the weights on one 141 GB GPU, and the
ratios are per layer except for the embedding and LM head, which a shallower model over-weights
(so T_D/T_T is, if anything, pessimistic).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # triton_bridges: --smoke runs the kernels interpreted

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402
from triton_bridges import bridge_triton_interpreter  # noqa: E402

from hf_magicdec import kernels  # noqa: E402
from hf_magicdec.kernels import Segments, reference  # noqa: E402

bridge_triton_interpreter()  # under TRITON_INTERPRET=1 on torch 2.11 / Triton 3.6; before any kernel is imported

CONFIGS = {name: ROOT / "tests" / "configs" / f"{name}.json" for name in ("llama-3.1-8b", "qwen2.5-7b")}
TARGETS = {"verify_bandwidth_fraction": 0.70, "tv4_over_tt": 1.15, "td512_over_tt": 0.10,
           # With the steps captured (compile=, CUDA graphs): issue 15's targets.
           "graphs_tv4_over_tt": 1.2, "graphs_td512_over_tt": 0.15,
           # MagicDec's decode vs stock generate(cache_implementation="static"), compiled by transformers.
           "end_to_end_speedup": 1.5}


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device, nbytes: int, repeats: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), repeats, device)
    return 2 * nbytes / seconds / 1e9


def check_correctness(device, smoke: bool) -> list[dict]:
    """Triton vs the fp32 torch twin, in bf16 and fp16, verify and draft shapes, plus SnapKV."""
    shapes = [(2, 4, 2, 1, 64, 301), (3, 8, 2, 5, 128, 517)] if smoke else [
        (4, 4, 8, 1, 128, 4099), (4, 4, 8, 5, 128, 4099), (16, 7, 4, 5, 128, 8191), (1, 8, 8, 5, 64, 32771)]
    tolerance = {torch.bfloat16: 2e-2, torch.float16: 2e-3}
    results = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for batch, group, kv_heads, q_len, head_dim, kv_len in shapes:
            query = torch.randn(batch, kv_heads * group, q_len, head_dim, generator=gen).to(device, dtype)
            key = torch.randn(batch, kv_heads, kv_len, head_dim, generator=gen).to(device, dtype)
            value = torch.randn(batch, kv_heads, kv_len, head_dim, generator=gen).to(device, dtype)
            ends = torch.randint(q_len + 1, kv_len + 1, (batch,), generator=gen)
            ends[0] = kv_len
            for kind, seg in (("verify", Segments.causal(torch.randint(0, 4, (batch,), generator=gen), ends)),
                              ("draft", Segments.prefix_and_block(torch.clamp(ends // 3, min=1), kv_len - 8,
                                                                  kv_len - 8 + q_len))):
                seg = seg.to(device)
                got = kernels._triton().segment_attention(query, key, value, seg, head_dim**-0.5)
                want = reference.segment_attention(query.float(), key.float(), value.float(), seg, head_dim**-0.5)
                err = (got.float() - want).abs().max().item()
                results.append(dict(kernel="segment_attention", kind=kind, dtype=str(dtype), batch=batch, group=group,
                                    kv_heads=kv_heads, q=q_len, head_dim=head_dim, kv_len=kv_len, max_abs_err=err,
                                    ok=err <= tolerance[dtype]))
        results += _mass_correctness(device, dtype, smoke, gen)
        window = 32
        q = torch.randn(2, 8 * 2, window, 128, generator=gen).to(device, dtype)
        k = torch.randn(2, 2, 2053 if not smoke else 131, 128, generator=gen).to(device, dtype)
        pad = torch.tensor([0, 17], device=device)
        got = kernels._triton().snapkv_mass(q, k, pad, 128**-0.5)
        want = reference.snapkv_mass(q.float(), k.float(), pad, 128**-0.5)
        err = ((got - want).abs().max() / want.abs().max()).item()
        results.append(dict(kernel="snapkv_mass", dtype=str(dtype), kv_len=k.shape[2], max_rel_err=err, ok=err <= 1e-3))
    return results


def _mass_correctness(device, dtype, smoke: bool, gen) -> list[dict]:
    """The verify kernel's attention mass per page (``page_size=``, what ``draft="attended"``
    chooses from) against the fp32 twin's: output and mass, causal verify segments, left padding."""
    shapes = [(2, 4, 2, 4, 64, 301)] if smoke else [(8, 4, 8, 4, 128, 4099), (4, 7, 4, 5, 128, 32771)]
    rows = []
    for batch, group, kv_heads, q_len, head_dim, kv_len in shapes:
        query = torch.randn(batch, kv_heads * group, q_len, head_dim, generator=gen).to(device, dtype)
        key = torch.randn(batch, kv_heads, kv_len, head_dim, generator=gen).to(device, dtype)
        value = torch.randn(batch, kv_heads, kv_len, head_dim, generator=gen).to(device, dtype)
        ends = torch.randint(kv_len // 2, kv_len + 1, (batch,), generator=gen)
        ends[0] = kv_len
        seg = Segments.causal(torch.randint(0, 40, (batch,), generator=gen), ends).to(device)
        for page in (16, 64):
            out, mass = kernels._triton().segment_attention(query, key, value, seg, head_dim**-0.5, page_size=page)
            want_out, want_mass = reference.segment_attention(query.float(), key.float(), value.float(), seg,
                                                              head_dim**-0.5, page_size=page)
            out_err = (out.float() - want_out).abs().max().item()
            mass_err = ((mass - want_mass).abs().max() / want_mass.abs().max()).item()
            # Mass per (row, KV head) sums to g * q (every query row's probabilities sum to 1).
            total_err = (mass.sum(-1) - group * q_len).abs().max().item() / (group * q_len)
            rows.append(dict(kernel="segment_attention_mass", dtype=str(dtype), batch=batch, group=group,
                             kv_heads=kv_heads, q=q_len, kv_len=kv_len, page_size=page, max_abs_err=out_err,
                             mass_max_rel_err=mass_err, mass_total_rel_err=total_err,
                             ok=out_err <= (2e-2 if dtype == torch.bfloat16 else 2e-3) and mass_err <= 1e-3
                             and total_err <= 1e-3))
    return rows


def kernel_timings(device, batch, context, kv_heads, group, head_dim, dtype, copy_gbs, repeats) -> list[dict]:
    """Verify attention (q = 1 and 5) over the full cache: our kernel, its torch twin, stock SDPA."""
    key = torch.randn(batch, kv_heads, context + 8, head_dim, device=device, dtype=dtype)
    value = torch.randn_like(key)
    rows = []
    for q_len in (1, 5):
        query = torch.randn(batch, kv_heads * group, q_len, head_dim, device=device, dtype=dtype)
        seg = Segments.causal(torch.zeros(batch, dtype=torch.long, device=device),
                              torch.full((batch,), context, device=device))
        k, v = key[:, :, :context], value[:, :, :context]
        nbytes = 2 * k.numel() * k.element_size()
        mask = seg.mask(q_len, context)
        paths = {
            "triton": lambda: kernels._triton().segment_attention(query, k, v, seg, head_dim**-0.5),
            "torch_twin": lambda: reference.segment_attention(query, k, v, seg, head_dim**-0.5),
            # What HF's sdpa attention does: one query needs no mask (flash / efficient kernels);
            # several queries pass a bool mask, and GQA goes through enable_gqa.
            "stock_sdpa": (lambda: F.scaled_dot_product_attention(query, k, v, enable_gqa=True)) if q_len == 1 else
                          (lambda: F.scaled_dot_product_attention(query, k, v, attn_mask=mask, enable_gqa=True)),
        }
        if q_len > 1:  # issue 26: the verify pass emitting the mass per 16-key page (draft="attended")
            paths["triton_mass16"] = lambda: kernels._triton().segment_attention(query, k, v, seg, head_dim**-0.5,
                                                                                 page_size=16)
        for name, fn in paths.items():
            try:
                seconds = timed(fn, repeats, device)
            except Exception as exc:  # noqa: BLE001 - a stock path may refuse a shape; record why
                rows.append(dict(path=name, q=q_len, error=repr(exc)[:200]))
                continue
            gbs = nbytes / seconds / 1e9
            rows.append(dict(path=name, q=q_len, batch=batch, context=context, ms=seconds * 1e3, gb_per_s=gbs,
                             fraction_of_copy=gbs / copy_gbs if copy_gbs else None))
    del key, value
    return rows


def build_model(name: str, layers: int, dtype, device, smoke: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    data = json.loads(CONFIGS[name].read_text())
    data["num_hidden_layers"] = layers
    if smoke:  # keep the real head layout ratios, shrink everything else
        data.update(hidden_size=256, intermediate_size=512, vocab_size=1024, head_dim=64, bos_token_id=None,
                    eos_token_id=None,
                    num_attention_heads=data["num_attention_heads"] // data["num_key_value_heads"] * 2,
                    num_key_value_heads=2)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def stock_decode_step(model, batch, context, device, repeats) -> float:
    """One 1-token forward of stock HF decoding (DynamicCache, sdpa) at ``context`` cached tokens."""
    from transformers import DynamicCache

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    cache = DynamicCache(config=cfg)
    for layer in range(cfg.num_hidden_layers):
        kv = torch.randn(batch, cfg.num_key_value_heads, context, head_dim, device=device, dtype=dtype)
        cache.update(kv, kv.clone(), layer)
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), device=device)
    position = torch.full((batch, 1), context, device=device)

    def step():
        model(input_ids=ids, position_ids=position, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # back to `context` tokens: every timed step appends one

    with torch.no_grad():
        return timed(step, repeats, device)


class Budget:
    """Soft time budget: a measurement starts only while :meth:`allows` (``None``: no budget)."""

    def __init__(self, seconds: float | None):
        self.seconds, self.start = seconds, time.time()

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - (time.time() - self.start)

    def allows(self, need: float = 0.0) -> bool:
        return self.left() > need


def model_ratios(name, layers, units, device, dtype, repeats, smoke, *, gammas=(1, 2, 4, 6),
                 budgets=(256, 512, 1024), graph_gammas=None, graph_budgets=None, stock_shape=None,
                 budget: Budget | None = None, on_row=None, skipped=None) -> list[dict]:
    """T_T, T_V(γ)/T_T and T_D(budget)/T_T for each ``(batch, context, graphs)`` of ``units``, then
    (``stock_shape``) HF's stock decode step. ``on_row(row)`` sees each row as it is measured; units
    the ``budget`` no longer allows are appended to ``skipped``."""
    from transformers import CompileConfig

    from hf_magicdec.engine.draft_weights import feasible_formats

    from hf_magicdec.calibration import measure_steps

    budget = budget or Budget(None)
    skipped = [] if skipped is None else skipped
    on_row = on_row or (lambda row: None)
    rows = []

    def add(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        on_row(row)

    if not budget.allows():
        skipped += [dict(model=name, batch=b, context=c, graphs=g) for b, c, g in units]
        if stock_shape:
            skipped.append(dict(model=name, path="stock_dynamic_cache_decode"))
        return rows
    model = build_model(name, layers, dtype, device, smoke)
    # Draft steps also timed on the quantized draft (draft_weights=): int8 on CPU, torchao's on CUDA.
    quantized = (feasible_formats(model, device) or ("full",))[0]
    # Graphs off (eager, every operator launched from the host) and on (compile=, as generate runs
    # it: inductor + CUDA graphs on a GPU; aot_eager in the CPU smoke run, which only checks the path).
    captured = CompileConfig() if device.type == "cuda" else CompileConfig(backend="aot_eager")
    for batch, context, graphs in units:
        if not budget.allows():
            skipped.append(dict(model=name, batch=batch, context=context, graphs=graphs))
            continue
        try:
            st = measure_steps(model, batch, context,
                               gammas=(graph_gammas or gammas) if graphs else gammas,
                               budgets=(graph_budgets or budgets) if graphs else budgets,
                               repeats=repeats, compile_config=captured if graphs else None,
                               draft_weights=quantized)
        except Exception as exc:  # noqa: BLE001 - one lent run: record why, measure the rest
            add(dict(model=name, batch=batch, context=context, graphs=graphs, error=_error(exc)))
            _free(device)
            continue
        add(dict(model=name, layers=layers, batch=batch, context=context, graphs=graphs,
                 backend=kernels.check_backend(device), t_target_ms=st.t_target * 1e3,
                 tv_over_tt={g: t / st.t_target for g, t in st.t_verify.items()},
                 td_over_tt={k: t / st.t_target for k, t in st.t_draft.items()},
                 draft_weights=st.draft_weights,
                 td_quantized_over_tt={k: t / st.t_target for k, t in st.t_draft_quantized.items()}))
        _free(device)
    # Stock decoding at the headline shape, for comparison with T_T above.
    if stock_shape and not budget.allows():
        skipped.append(dict(model=name, path="stock_dynamic_cache_decode"))
    elif stock_shape:
        batch, context = stock_shape
        try:
            add(dict(model=name, path="stock_dynamic_cache_decode", batch=batch, context=context,
                     t_target_ms=stock_decode_step(model, batch, context, device, repeats) * 1e3))
        except Exception as exc:  # noqa: BLE001
            add(dict(model=name, path="stock_dynamic_cache_decode", batch=batch, context=context,
                     error=_error(exc)))
    del model
    _free(device)
    return rows


def _error(exc: BaseException) -> str:
    """What a failed measurement records (the traceback goes to the log)."""
    traceback.print_exception(exc)
    return repr(exc)[:300]


def _free(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def end_to_end(name, layers, batch, context, new_tokens, device, dtype, smoke, prefill_chunk=None) -> dict:
    """Decode time of MagicDec (``compile=`` as ``"auto"`` runs it on CUDA) against stock
    ``generate(cache_implementation="static")`` (which transformers compiles itself on CUDA), same
    random prompts, same run, after one warm-up call each that pays the compilation. Decode is
    timed directly, from the first generated token to the end of ``generate``, by a streamer that
    both methods feed (one host copy of the new tokens per step, for both). Both prefill in chunks of
    ``prefill_chunk`` tokens (``generation_config.prefill_chunk_size``): in one piece, stock's
    prefill at 32 × 32K would need ~90 GB of MLP activations and a 34 GB mask beside its cache."""
    import hf_magicdec  # noqa: F401  (the speculative= routing)

    model = build_model(name, layers, dtype, device, smoke)
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g).to(device)
    common = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                  prefill_chunk_size=prefill_chunk)
    methods = {
        "stock_static": dict(cache_implementation="static"),
        "magicdec": dict(speculative="magicdec", draft="snapkv", draft_budget=512, gamma=3,
                         compile=device.type == "cuda", draft_weights="full"),
    }

    row = dict(model=name, layers=layers, batch=batch, context=context, new_tokens=new_tokens,
               prefill_chunk=prefill_chunk)
    outputs = {}
    for method, kwargs in methods.items():
        out, row[f"{method}_decode_s"] = timed_decode(model, new_tokens, **common, **kwargs)
        outputs[method] = out.sequences
        stats = getattr(out, "speculation", None)
        if stats is not None:  # random weights: the acceptance says why a speedup is or is not there
            row.update(magicdec_steps=stats.steps, magicdec_acceptance=stats.acceptance_rate)
    row["speedup_vs_compiled_static"] = row["stock_static_decode_s"] / max(row["magicdec_decode_s"], 1e-9)
    row["identical"] = bool(torch.equal(outputs["stock_static"], outputs["magicdec"]))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def timed_decode(model, new_tokens: int, **kwargs):
    """``model.generate(**kwargs)`` decoding exactly ``new_tokens``: one warm-up call, then the timed
    one; returns its output (``return_dict_in_generate``) and its decode seconds (:class:`DecodeClock`).
    The warm-up has the timed call's own lengths: the static caches (stock's and ours) are sized by
    prompt + max_new_tokens, and a shorter warm-up would leave the compilation to the timed run."""
    lengths = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    model.generate(**kwargs, **lengths)
    clock = DecodeClock()
    out = model.generate(**kwargs, **lengths, streamer=clock, return_dict_in_generate=True)
    return out, clock.stop - clock.first


class DecodeClock(BaseStreamer):
    """A streamer that times decode: from the first generated token(s) to the end of ``generate``
    (the first ``put`` is the prompt). Both stock ``generate`` and MagicDec feed it."""

    def __init__(self):
        self.puts, self.first, self.stop = 0, None, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self):
        self.stop = time.perf_counter()


def views_and_long_generation(name, layers, device, dtype, smoke, budget: Budget, which, only, on_row) -> None:
    """Issue 26 on the GPU, random weights of a real shape (so acceptance says nothing about real
    text; the step costs and the token identity do):

    * long prompt (8 x 4K -> 128, budget 256, γ 3, eager, ``HF_MAGICDEC_PROFILE=1``): ``snapkv``
      against ``attended``, whose choices (the per-layer gathers after a verification) are the
      "other" seconds beyond draft and verify; tokens against plain decoding on our cache (γ 0);
    * long generation (16 x 256 -> 1024, EOS ignored): ``attended`` γ 3 eager, stock
      ``generate(cache_implementation="static")`` (transformers compiles it on CUDA) and MagicDec
      γ = 0 with ``compile=True`` (the cost of starting on our own cache), same prompts; decode
      seconds from a streamer, after one warm-up call each (compilation, allocator). The default
      plan is not run: with random weights its γ schedule answers an acceptance text never has."""
    import hf_magicdec  # noqa: F401  (the speculative= routing)

    model = build_model(name, layers, dtype, device, smoke)
    gen = torch.Generator(device="cpu").manual_seed(1)
    shapes = {"long_prompt": (2, 128, 8) if smoke else (8, 4096, 128),
              "long_generation": (2, 64, 24) if smoke else (16, 256, 1024)}
    views = dict(draft_budget=64 if smoke else 256, gamma=3, compile=False, draft_weights="full")
    methods = {
        "long_prompt": {"gamma0": dict(speculative="magicdec", draft="snapkv", **{**views, "gamma": 0}),
                        "snapkv": dict(speculative="magicdec", draft="snapkv", **views),
                        "attended": dict(speculative="magicdec", draft="attended", **views)},
        "long_generation": {"attended": dict(speculative="magicdec", draft="attended", **views),
                            "stock_static": dict(cache_implementation="static"),
                            "gamma0_compiled": dict(speculative="magicdec", draft="attended",
                                                    **{**views, "gamma": 0, "compile": device.type == "cuda"})},
    }
    # Seconds of the budget a method needs left to start: the compiled ones pay a compilation.
    need = {"stock_static": 120, "gamma0_compiled": 120}
    os.environ["HF_MAGICDEC_PROFILE"] = "1"  # host timers synchronise: draft / verify / other split
    try:
        for shape, (batch, prompt, new) in ((k, v) for k, v in shapes.items() if k in which):
            ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=gen).to(device)
            common = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                          eos_token_id=None)
            reference_tokens = None
            for method, kwargs in methods[shape].items():
                if only and method not in only:
                    continue
                row = dict(stage="views", shape=shape, method=method, model=name, layers=layers, batch=batch,
                           prompt=prompt, new_tokens=new)
                if not budget.allows(need.get(method, 60)):
                    row["skipped"] = f"time budget ({budget.left():.0f} s left)"
                    on_row(row)
                    continue
                try:
                    with torch.inference_mode():
                        out, row["decode_s"] = timed_decode(model, new, **common, **kwargs)
                    stats = getattr(out, "speculation", None)
                    if stats is not None:
                        other = (stats.decode_seconds or 0) - (stats.draft_seconds or 0) - (stats.verify_seconds or 0)
                        row.update(steps=stats.steps, acceptance=stats.acceptance_rate, draft=stats.draft,
                                   gamma_mean=(statistics.mean(stats.gamma_trace) if stats.gamma_trace else None),
                                   draft_s=stats.draft_seconds, verify_s=stats.verify_seconds, other_s=other)
                    if reference_tokens is None:
                        reference_tokens = out.sequences
                    row["identical_to_first"] = bool(torch.equal(out.sequences, reference_tokens))
                except Exception as exc:  # noqa: BLE001 - one lent run: record why, measure the rest
                    row["error"] = _error(exc)
                on_row(row)
                _free(device)
    finally:
        os.environ.pop("HF_MAGICDEC_PROFILE", None)
        del model
        _free(device)


def verdict(report: dict) -> dict:
    """The headline figures against :data:`TARGETS`, from whatever ``report`` holds so far."""
    def headline(graphs: bool):
        return next((r for r in report.get("model", []) if r.get("model") == "llama-3.1-8b" and r.get("batch") == 32
                     and r.get("context") == 32768 and r.get("graphs") is graphs and "tv_over_tt" in r), None)

    eager, captured = headline(False), headline(True)
    verify = next((r for r in report.get("kernel", []) if r.get("path") == "triton" and r.get("q") == 5), None)
    e2e = report.get("end_to_end") or {}
    correctness = report.get("correctness")
    return dict(
        correctness=bool(correctness) and all(r["ok"] for r in correctness),
        verify_bandwidth_fraction=verify and verify.get("fraction_of_copy"),
        tv4_over_tt=eager and eager["tv_over_tt"].get(4),
        td512_over_tt=eager and eager["td_over_tt"].get(512),
        graphs_tv4_over_tt=captured and captured["tv_over_tt"].get(4),
        graphs_td512_over_tt=captured and captured["td_over_tt"].get(512),
        graphs_td512_quantized_over_tt=captured and captured["td_quantized_over_tt"].get(512),
        quantized_draft_weights=captured and captured["draft_weights"],
        end_to_end_speedup=e2e.get("speedup_vs_compiled_static"),
        end_to_end_identical=e2e.get("identical"),
    )


def save(report: dict, path: Path, t0: float, complete: bool = False, status: str = "running") -> None:
    """Write ``report`` (with its verdict so far) to ``path`` atomically: a reader, or a run stopped
    midway, only ever sees a whole JSON file."""
    report.update(complete=complete, status=status, seconds=time.time() - t0, verdict=verdict(report))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, path)


#: Stages after the kernel correctness checks, in the order they run.
STAGES = ("kernel", "views", "ratios", "e2e")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_check.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device (CPU: TRITON_INTERPRET=1)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--gammas", type=int, nargs="+", default=[1, 2, 4, 6], help="γ of the timed verifications")
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024], help="draft budgets timed")
    parser.add_argument("--graph-gammas", type=int, nargs="+", default=None,
                        help="γ timed with the steps captured (default: --gammas); each is one more compilation")
    parser.add_argument("--graph-budgets", type=int, nargs="+", default=None,
                        help="draft budgets timed with the steps captured (default: --budgets)")
    parser.add_argument("--e2e", type=int, nargs=3, default=[32, 32768, 128], metavar=("BATCH", "CONTEXT", "NEW"),
                        help="end-to-end decode vs compiled stock static cache (llama-3.1-8b shape)")
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES),
                        help="what to run (default: all; correctness and the copy bandwidth always run)")
    parser.add_argument("--views-shapes", nargs="+", default=["long_prompt", "long_generation"],
                        choices=["long_prompt", "long_generation"], help="the views stage's workloads to run")
    parser.add_argument("--views-methods", nargs="+", default=None,
                        help="only these of the views stage's methods (default: all; e.g. stock_static "
                             "gamma0_compiled)")
    parser.add_argument("--prefill-chunk", type=int, default=1024,
                        help="prompt tokens per prefill forward in the end-to-end comparison, both methods")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no measurement after this many seconds (the JSON keeps what was measured); "
                             "the end-to-end comparison starts only with 90 s of it left")
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        parser.error("no GPU: run with --smoke (and TRITON_INTERPRET=1) to check the script on CPU")
    if args.smoke:
        args.layers, args.batches, args.contexts, args.repeats, args.e2e = 1, [2], [256], 2, [2, 256, 8]
        args.prefill_chunk = 96  # several chunks, an uneven last one
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    import transformers
    import triton

    out = Path(args.out)
    budget = Budget(args.budget_s)
    report = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
        smoke=args.smoke, targets=TARGETS, started=time.strftime("%Y-%m-%d %H:%M:%S"),
        options={k: v for k, v in vars(args).items() if k != "out"}, skipped=[],
    )
    t0 = time.time()

    def on_term(signum, frame):  # `timeout` sends SIGTERM: keep what was measured, say so
        save(report, out, t0, status=f"stopped by signal {signum}")
        print(f"stopped by signal {signum}; wrote {out}", flush=True)
        os._exit(124)

    signal.signal(signal.SIGTERM, on_term)
    save(report, out, t0)
    report["copy_gb_per_s"] = copy_bandwidth(device, (1 << 20) if args.smoke else (4 << 30), args.repeats)
    print(f"copy bandwidth {report['copy_gb_per_s']:.0f} GB/s", flush=True)
    report["correctness"] = check_correctness(device, args.smoke)
    print(f"correctness: {sum(r['ok'] for r in report['correctness'])}/{len(report['correctness'])} ok", flush=True)
    save(report, out, t0)
    shape = (2, 256, 2, 4, 64) if args.smoke else (32, 32768, 8, 4, 128)  # batch, context, Hkv, g, D
    report["kernel"] = (kernel_timings(device, *shape, dtype, report["copy_gb_per_s"], args.repeats)
                        if "kernel" in args.stages else [])
    for row in report["kernel"]:
        print(json.dumps(row), flush=True)
    report["model"] = []
    report["views"] = []
    save(report, out, t0)
    if "views" in args.stages:
        views_and_long_generation(args.models[0], args.layers, device, dtype, args.smoke, budget,
                                  args.views_shapes, args.views_methods,
                                  lambda row: (print(json.dumps(row, default=str), flush=True),
                                               report["views"].append(row), save(report, out, t0)))

    # Headline shape first (batch 32, or the first batch, at the longest context; eager, then
    # captured), HF's stock step there, the end-to-end comparison, then the rest of the grid.
    head = (32 if 32 in args.batches else args.batches[0], max(args.contexts))
    grid = [(b, c) for b in args.batches for c in args.contexts]
    common = dict(gammas=tuple(args.gammas), budgets=tuple(args.budgets),
                  graph_gammas=args.graph_gammas and tuple(args.graph_gammas),
                  graph_budgets=args.graph_budgets and tuple(args.graph_budgets),
                  budget=budget, skipped=report["skipped"],
                  on_row=lambda row: (report["model"].append(row), save(report, out, t0)))
    stock = (args.batches[0], args.contexts[-1]) if args.smoke else (32, max(args.contexts))
    first, *others = args.models
    if "ratios" not in args.stages:
        others = []
    else:
        model_ratios(first, args.layers, [(*head, False), (*head, True)], device, dtype, args.repeats, args.smoke,
                     stock_shape=stock, **common)
    if "e2e" not in args.stages:
        report["end_to_end"] = dict(skipped="not in --stages")
    elif not budget.allows(90):
        report["end_to_end"] = dict(skipped=f"time budget ({budget.left():.0f} s left of {args.budget_s:.0f})")
    else:
        try:
            report["end_to_end"] = end_to_end("llama-3.1-8b", args.layers, *args.e2e, device, dtype, args.smoke,
                                              args.prefill_chunk)
        except Exception as exc:  # noqa: BLE001 - out of memory, a compile failure: record it
            report["end_to_end"] = dict(error=_error(exc))
        _free(device)
    print(json.dumps(report["end_to_end"]), flush=True)
    save(report, out, t0)
    rest = [(b, c, g) for b, c in grid if (b, c) != head for g in (False, True)]
    if rest and "ratios" in args.stages:
        model_ratios(first, args.layers, rest, device, dtype, args.repeats, args.smoke, **common)
    for name in others:
        model_ratios(name, args.layers, [(b, c, g) for b, c in grid for g in (False, True)], device, dtype,
                     args.repeats, args.smoke, stock_shape=stock, **common)

    errors = [r for r in report["model"] + report["views"] if "error" in r]
    errors += [report["end_to_end"]] if "error" in report["end_to_end"] else []
    status = "done" + (f", {len(report['skipped'])} measurement(s) skipped for time" if report["skipped"] else "") + (
        f", {len(errors)} failed" if errors else "")
    save(report, out, t0, complete=True, status=status)
    print(json.dumps(report["verdict"]), f"{status}; wrote {args.out} in {report['seconds']:.0f} s", sep="\n")
    return 0 if report["verdict"]["correctness"] and not errors else 1


if __name__ == "__main__":
    sys.exit(main())

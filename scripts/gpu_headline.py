#!/usr/bin/env python
"""The GPU headline: is ``speculative="magicdec"`` faster on this GPU than what a transformers user
would run, at a shape where reading the KV cache dominates? Writes one JSON file.

    python scripts/gpu_headline.py --assets .gpu_a .gpu_b --out headline.json   # on the GPU
    python scripts/gpu_headline.py --smoke --out smoke.json                      # on CPU: checks the script

``scripts/gpu_headline.sh`` prepares the assets here and runs this on a lent GPU in two calls made
back to back (docs/gpu_runs.md gives the exact calls). The assets are SmolLM2-135M-Instruct's GGUF
(98 MB, real weights) cut in two parts, one per call, checked against its SHA-256 once joined, and
the prompts tokenized here from real text (``prompts.pt``). If a part is missing or the digest does
not match, the model is built with random weights of the same config and every row says so
(acceptance then says nothing about real text; step costs and token identity still do).

Stages, in order; the JSON is rewritten after each (``"complete": false`` until the end), and no
stage starts once ``--budget-s`` seconds have passed:

1. ``batch_<B>`` for B in ``--batches`` (the first is the headline, 64 × 7,936 → 128 in bf16: 11.9 GB
   of KV against 0.27 GB of weights): rows ``stock_static`` (``generate(cache_implementation=
   "static")``, which transformers compiles on CUDA), ``magicdec_default`` (the default plan),
   ``snapkv_256_g3`` (``compile=True``) and ``gamma0`` (``gamma=0, compile=True``: our cache and
   kernel without speculation). Each row: one warm-up call of the timed shape (compilation), then
   decode = T(new) − T(1), no EOS, no ``min_new_tokens``, no streamer. A recompile or graph break
   during a timed call marks the row invalid; ``cudagraphs_skipped`` counts the warm-up's CUDA-graph
   skips (inductor decides them when it compiles).
2. ``identity``: fp32, 8 × 7,936 → 64 (after the first batch): stock greedy ``generate`` against the
   default plan, row by row.
3. ``step_ratios``: captured T_D(256)/T_T and T_V(3)/T_T (``measure_steps`` with the compile
   configuration) at the capacity ``generate`` allocates for the headline call.
4. ``bookkeeping``: aten operations outside the decoder forwards per speculation step, eager (the
   median over one call's steps).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # hf_magicdec_bench.models
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
               rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512)
#: The issue's GPU targets at the headline shape (checked in "verdict").
TARGETS = {"captured_td256_over_tt": 0.3, "speedup_vs_compiled_static": 2.0, "speculation_vs_gamma0": 1.5}
PARTS = ("smollm2.gguf.part1", "smollm2.gguf.part2")


# ---------------------------------------------------------------------------- assets
def split_gguf(gguf: Path, first: Path, second: Path, first_bytes: int) -> None:
    """Cut ``gguf`` into ``first`` (its first ``first_bytes``) and ``second`` (the rest)."""
    data = gguf.read_bytes()
    first.parent.mkdir(parents=True, exist_ok=True)
    second.parent.mkdir(parents=True, exist_ok=True)
    first.write_bytes(data[:first_bytes])
    second.write_bytes(data[first_bytes:])


def join_gguf(folders: list[Path], dest: Path) -> tuple[bool, str]:
    """Join the two parts found in ``folders`` into ``dest``; ``(ok, why not)``."""
    found = [next((f / p for f in folders if (f / p).is_file()), None) for p in PARTS]
    if None in found:
        return False, "missing " + ", ".join(p for p, f in zip(PARTS, found) if f is None)
    digest = hashlib.sha256()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with dest.open("wb") as out:
        for part in found:
            data = part.read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != GGUF_SHA256:
        return False, f"SHA-256 {digest.hexdigest()} is not SmolLM2's {GGUF_SHA256}"
    return True, ""


def build_model(assets: list[Path], device, smoke: bool):
    """``(model in bf16 (fp32 in smoke), weights description)``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    dtype = torch.float32 if smoke else torch.bfloat16
    if not smoke:
        gguf = Path("/tmp/gpu_headline") / GGUF
        ok, why = join_gguf(assets, gguf)
        if ok:
            # transformers dequantizes GGUF weights into plain Linear layers but keeps the model marked
            # quantized (no .float(), .to(dtype)); the same weights in a plain model are what a user of
            # the safetensors checkpoint runs, and the identity stage can cast it to fp32.
            loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=GGUF, dtype=torch.float32)
            config = loaded.config
            del config.quantization_config
            model = LlamaForCausalLM(config)
            model.load_state_dict(loaded.state_dict())
            model.generation_config = loaded.generation_config
            return _ready(model.to(dtype), device), "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized), SHA-256 checked"
    else:
        why = "smoke run"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**(TINY if smoke else SMOLLM2))).to(dtype)
    what = "random tiny Llama (smoke)" if smoke else f"RANDOM weights of SmolLM2-135M's config ({why})"
    return _ready(model, device), what


def _ready(model, device):
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None  # timed calls decode exactly the asked tokens
    model.generation_config.pad_token_id = 0
    return model


def load_prompts(assets: list[Path], batch: int, context: int, vocab: int) -> tuple[torch.Tensor, str]:
    """``[batch, context]`` prompts: ``prompts.pt`` (tokenized here from real text) when it holds
    enough, else random tokens (said so)."""
    for folder in assets:
        path = folder / "prompts.pt"
        if path.is_file():
            ids = torch.load(path)
            if ids.shape[0] >= batch and ids.shape[1] >= context:
                return ids[:batch, :context].long(), f"real text ({path.name})"
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (batch, context), generator=g), "RANDOM tokens"


def write_prompts(out: Path, batch: int, context: int) -> None:
    """Here, not on the GPU: ``[batch, context]`` real-text prompts for SmolLM2 as int32."""
    from hf_magicdec_bench.data import prompt_batch
    from hf_magicdec_bench.models import load

    _, tokenizer = load("smollm2-135m", progress=False)
    ids = prompt_batch(tokenizer, batch, context)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ids.to(torch.int32), out)


# ---------------------------------------------------------------------------- measuring
def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _graph_counters() -> dict:
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
            "cudagraph_skips": counters["inductor"]["cudagraph_skips"]}


def timed_generate(model, ids, new_tokens: int, kwargs: dict):
    """``(output, seconds, graph counter changes)`` of one greedy ``generate`` decoding exactly
    ``new_tokens`` (no EOS)."""
    device = ids.device
    _sync(device)
    before = _graph_counters()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         do_sample=False, return_dict_in_generate=True, **kwargs)
    _sync(device)
    seconds = time.perf_counter() - t0
    after = _graph_counters()
    return out, seconds, {k: after[k] - before[k] for k in after if after[k] != before[k]}


def methods(smoke: bool, device) -> dict:
    """The rows: how each is called."""
    from transformers import CompileConfig

    compiled = CompileConfig(backend="aot_eager") if smoke else True  # True: CompileConfig() on CUDA
    return {
        "stock_static": dict(cache_implementation="static"),
        "magicdec_default": dict(speculative="magicdec"),
        "snapkv_256_g3": dict(speculative="magicdec", draft="snapkv", draft_budget=64 if smoke else 256, gamma=3,
                              compile=compiled),
        "gamma0": dict(speculative="magicdec", gamma=0, compile=compiled),
    }


def batch_rows(model, ids, new_tokens: int, smoke: bool, on_row) -> None:
    """Every method at one batch: decode = T(new) − T(1), after a warm-up call of the timed shape."""
    reference = None
    for name, kwargs in methods(smoke, ids.device).items():
        row = {"method": name, "kwargs": {k: repr(v) for k, v in kwargs.items()}}
        try:
            _, _, changed_warmup = timed_generate(model, ids, new_tokens, kwargs)  # warm-up: compiles, allocates
            out, t_new, changed_new = timed_generate(model, ids, new_tokens, kwargs)
            timed_generate(model, ids, 1, kwargs)
            _, t_one, changed_one = timed_generate(model, ids, 1, kwargs)
            row.update(t_new_s=t_new, t_one_s=t_one, decode_s=t_new - t_one,
                       valid=not changed_new, graph_changes=changed_new or None,
                       graph_changes_t1=changed_one or None, warmup_graph_changes=changed_warmup or None,
                       # Inductor counts a CUDA-graph skip when it compiles, so in the warm-up.
                       cudagraphs_skipped=changed_warmup.get("cudagraph_skips", 0))
            stats = getattr(out, "speculation", None)
            if stats is not None:
                row.update(steps=stats.steps, acceptance=stats.acceptance_rate, gamma=stats.gamma,
                           draft=stats.draft, draft_budget=stats.draft_budget, draft_weights=stats.draft_weights,
                           gamma_trace=list(stats.gamma_trace)[:64])
            if reference is None:
                reference = out.sequences
            row["identical_to_stock_static"] = bool(torch.equal(reference, out.sequences))
        except Exception as exc:  # a failed row is a result: keep the others
            row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        on_row(row)


def identity(model, ids, new_tokens: int) -> dict:
    """fp32 greedy: stock ``generate`` against the default plan, row by row."""
    dtype = next(model.parameters()).dtype
    fp32 = model.float()
    try:
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
        stock = fp32.generate(**kwargs)
        ours = fp32.generate(**kwargs, speculative="magicdec")
        rows = [bool(torch.equal(a, b)) for a, b in zip(stock, ours)]
        return {"shape": list(ids.shape), "new_tokens": new_tokens, "rows_identical": rows, "identical": all(rows)}
    finally:
        model.to(dtype)


def step_ratios(model, batch: int, context: int, new_tokens: int, smoke: bool) -> dict:
    from transformers import CompileConfig

    from hf_magicdec.calibration import measure_steps

    gamma, budget = 3, 64 if smoke else 256
    capacity = -(-(context + new_tokens + gamma + 1) // 256) * 256  # what a captured generate allocates
    config = CompileConfig(backend="aot_eager") if smoke else CompileConfig()
    times = measure_steps(model, batch, context, gammas=(gamma,), budgets=(budget,), draft="snapkv", repeats=5,
                          compile_config=config, capacity=capacity)
    return {"batch": batch, "context": context, "capacity": capacity, "t_target_s": times.t_target,
            "t_verify_s": times.t_verify[gamma], "t_draft_s": times.t_draft[budget],
            f"td{budget}_over_tt": times.t_draft[budget] / times.t_target,
            f"tv{gamma}_over_tt": times.t_verify[gamma] / times.t_target}


class _OutsideOps(TorchDispatchMode):
    """Counts aten operations dispatched while no forward of ``decoder`` runs, per speculation step:
    from the start of one verify forward (``verify_width`` tokens) to the start of the next, so a step
    is its commit and the next step's drafts, and prefill, building the views and the hand-back at the
    end fall outside every step."""

    def __init__(self, decoder, verify_width: int):
        super().__init__()
        self.depth, self.width, self.steps, self.current = 0, verify_width, [], None
        self._hooks = [decoder.register_forward_pre_hook(self._enter, with_kwargs=True),
                       decoder.register_forward_hook(lambda *a: self._leave())]

    def _enter(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        width = (ids if ids is not None else kwargs["inputs_embeds"]).shape[1]
        if width == self.width:
            if self.current is not None:
                self.steps.append(self.current)
            self.current = 0
        self.depth += 1

    def _leave(self) -> None:
        self.depth -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.current is not None and not self.depth:
            self.current += 1
        return func(*args, **(kwargs or {}))

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def bookkeeping(model, ids, new_tokens: int, smoke: bool) -> dict:
    """Eager aten ops outside the decoder per speculation step (snapkv, γ = 3): the median over the
    steps of one call (a step where rows leave the batch pays once more per row)."""
    kwargs = dict(speculative="magicdec", draft="snapkv", draft_budget=64 if smoke else 256, gamma=3, compile=False)
    timed_generate(model, ids, new_tokens, kwargs)  # what a first call builds once
    counter = _OutsideOps(model.model, kwargs["gamma"] + 1)
    try:
        with counter:
            out, _, _ = timed_generate(model, ids, new_tokens, kwargs)
    finally:
        counter.close()
    steps = sorted(counter.steps)
    return {"shape": list(ids.shape), "new_tokens": new_tokens, "speculation_steps": out.speculation.steps,
            "outside_ops_per_step": steps[len(steps) // 2] if steps else None,
            "outside_ops_per_step_max": steps[-1] if steps else None}


def verdict(report: dict) -> dict:
    head = report["stages"].get(f"batch_{report['batches'][0]}", [])
    rows = {r["method"]: r for r in head if "decode_s" in r}
    out = {}
    if {"stock_static", "snapkv_256_g3"} <= set(rows):
        out["speedup_snapkv_vs_compiled_static"] = rows["stock_static"]["decode_s"] / rows["snapkv_256_g3"]["decode_s"]
    if {"stock_static", "magicdec_default"} <= set(rows):
        out["speedup_default_vs_compiled_static"] = (rows["stock_static"]["decode_s"]
                                                     / rows["magicdec_default"]["decode_s"])
    if {"gamma0", "snapkv_256_g3"} <= set(rows):
        out["speculation_vs_gamma0"] = rows["gamma0"]["decode_s"] / rows["snapkv_256_g3"]["decode_s"]
    out["all_rows_valid"] = all(r.get("valid", False) for r in head) if head else None
    out["targets"] = TARGETS
    return out


# ---------------------------------------------------------------------------- driver
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--assets", type=Path, nargs="*", default=[], help="folders holding the GGUF parts, prompts")
    parser.add_argument("--smoke", action="store_true", help="tiny random model, small shapes (CPU)")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default 64 32 8 (smoke: 3 2)")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens, default 7936 (smoke: 160)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 128 (smoke: 12)")
    parser.add_argument("--budget-s", type=float, default=520.0, help="no stage starts after this many seconds")
    parser.add_argument("--prepare", type=Path, default=None, metavar="DIR",
                        help="here, not on the GPU: write DIR/prompts.pt (64 x 7936 real-text tokens) and exit")
    args = parser.parse_args(argv)
    smoke = args.smoke
    batches = args.batches or ([3, 2] if smoke else [64, 32, 8])
    context = args.context or (160 if smoke else 7936)
    new_tokens = args.new_tokens or (12 if smoke else 128)
    if args.prepare is not None:
        write_prompts(args.prepare / "prompts.pt", max(batches), context)
        return 0

    import transformers

    import hf_magicdec  # noqa: F401  (the speculative= routing)

    t0 = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    report = {"complete": False, "batches": batches, "context": context, "new_tokens": new_tokens, "smoke": smoke,
              "env": {"python": platform.python_version(), "torch": torch.__version__,
                      "transformers": transformers.__version__,
                      "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"},
              "stages": {}, "skipped": []}

    def save(status: str = "running") -> None:
        report.update(status=status, elapsed_s=time.perf_counter() - t0, verdict=verdict(report))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))

    def allowed(stage: str) -> bool:
        if time.perf_counter() - t0 < args.budget_s:
            print(f"gpu_headline: {stage} at {time.perf_counter() - t0:.0f} s", flush=True)
            return True
        report["skipped"].append(stage)
        return False

    model, weights = build_model(args.assets, device, smoke)
    prompts, text = load_prompts(args.assets, max(batches), context, model.config.vocab_size)
    report.update(weights=weights, prompts=text)
    save()

    def run_batch(batch: int) -> None:
        rows = report["stages"].setdefault(f"batch_{batch}", [])

        def on_row(row):
            rows.append(row)
            print("gpu_headline:", json.dumps(row, default=str)[:400], flush=True)
            save()
        batch_rows(model, prompts[:batch].to(device), new_tokens, smoke, on_row)

    stages = [(f"batch_{batches[0]}", lambda: run_batch(batches[0])),
              ("identity", lambda: identity(model, prompts[:min(8, max(batches))].to(device), new_tokens // 2))]
    stages += [(f"batch_{b}", lambda b=b: run_batch(b)) for b in batches[1:]]
    stages += [("step_ratios", lambda: step_ratios(model, batches[0], context, new_tokens, smoke)),
               ("bookkeeping", lambda: bookkeeping(model, prompts[:min(8, max(batches))].to(device), 48, smoke))]
    for name, stage in stages:
        if not allowed(name):
            continue
        try:
            result = stage()
            if result is not None:
                report["stages"][name] = result
        except Exception as exc:
            report["stages"][name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    report["complete"] = not report["skipped"]
    save("done")
    print(json.dumps(report["verdict"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

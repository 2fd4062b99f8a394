"""How close is 16-bit greedy output to stock ``generate``, next to stock's own variation?

    python scripts/dtype_agreement.py --out dtype_out                        # SmolLM2-135M, bf16 + fp16, fp32 control
    python scripts/dtype_agreement.py --dtypes bf16 --batch 8 --new-tokens 96 --out dtype_out
    python scripts/dtype_agreement.py --smoke --out /tmp/smoke                # tiny random model, seconds

In fp32 MagicDec's greedy output is token-identical to stock ``generate``. In 16-bit it is not
always: a verify forward evaluates γ+1 positions with differently shaped matmuls than stock's
one-token steps, so a near-tie between two tokens can round the other way. Stock ``generate`` does
the same to itself when only the batch shape changes. This script measures both on the same
real-text prompts (ragged, left-padded), greedy, EOS ignored, for every dtype asked for and fp32 as
the control, and compares these greedy decodings pairwise:

  (a) stock batch 1 (each row alone, unpadded) vs stock batch N (the rows together, left-padded)
  (b) stock fp32 vs stock in the dtype (batch N, and batch 1)
  (c) stock batch N vs MagicDec batch N, for every view (default streamingllm/64 and snapkv/128 at
      γ=3, and the default plan ``speculative="magicdec"``)
  (d) stock batch 1 vs MagicDec batch N
  (e) stock fp32 (batch N) vs MagicDec in the dtype: is MagicDec further from fp32 than stock is?

Per row it records the first new-token position where the two decodings differ (0 = the first new
token; once they differ, the rows continue from different text, so token-by-token agreement after
that is meaningless). Per pair: rows identical over the whole generation, the first divergence
(min / median over the rows that diverged), the mean agreed prefix (fraction of the new tokens
before the first divergence), divergences per 1,000 tokens (diverged rows / positions at risk: the
rate of a geometric first-divergence, comparable between pairs), the position-wise fraction of new
tokens that differ (for completeness), and, where the reference decoding is stock's, the gap
between the two tokens' logits in stock's own logits at the divergence, in units of the dtype's
spacing (ulp) at stock's top logit: 0 = an exact tie in that dtype.

Prints a markdown table and, with ``--out DIR``, writes ``DIR/dtype_agreement.jsonl`` (one meta
record, then one record per pair with the per-row details) and ``DIR/table.md``.
``--smoke`` runs a tiny random Llama on random prompts (the test suite's check of this script).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import hf_magicdec  # noqa: E402  (installs the speculative= routing)
from hf_magicdec_bench import data  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: mantissa bits (explicit) of each dtype: ulp(x) = 2 ** (floor(log2 |x|) - bits)
MANTISSA = {"fp32": 23, "bf16": 7, "fp16": 10}
DEFAULT_PLAN = "default"

COLUMNS = ["dtype", "pair", "rows identical", "first divergence min / median", "mean agreed prefix",
           "divergences / 1k tokens", "new tokens differing", "logit gap at divergence (ulp)"]


# ----------------------------------------------------------------------------- metrics
def first_divergence(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """Index of the first new token where ``a`` and ``b`` differ, ``None`` if they are equal."""
    diff = (a != b).nonzero()
    return None if diff.numel() == 0 else int(diff[0, 0])


def ulp(value: float, dtype: str) -> float:
    """Spacing of ``dtype`` numbers at ``value``."""
    value = abs(value)
    if value == 0:
        return 2.0 ** -126
    return 2.0 ** (math.floor(math.log2(value)) - MANTISSA[dtype])


def compare(ref: list[torch.Tensor], other: list[torch.Tensor], ref_logits: list[torch.Tensor] | None,
            ulp_dtype: str) -> list[dict]:
    """Per-row comparison of two greedy decodings (lists of 1-D new-token tensors of equal length).

    At a divergence, ``gap`` is ``ref``'s logit of its own token minus its logit of ``other``'s token
    (``ref_logits``: per row ``[T, V]``), and ``gap_ulp`` the same in ulps of ``ulp_dtype`` (the
    pair's lower precision) at ``ref``'s top logit."""
    rows = []
    for i, (a, b) in enumerate(zip(ref, other)):
        n = min(len(a), len(b))
        a, b = a[:n], b[:n]
        first = first_divergence(a, b)
        row = {"row": i, "new_tokens": n, "first_divergence": first,
               "differing": int((a != b).sum()), "gap": None, "gap_ulp": None}
        if first is not None and ref_logits is not None:
            logits = ref_logits[i][first].float()
            gap = float(logits[a[first]] - logits[b[first]])
            row["gap"] = round(gap, 6)
            row["gap_ulp"] = round(gap / ulp(float(logits.max()), ulp_dtype), 3)
        rows.append(row)
    return rows


def summarize(rows: list[dict]) -> dict:
    """The per-pair statistics of the table from the per-row records of :func:`compare`."""
    n_tokens = sum(r["new_tokens"] for r in rows)
    firsts = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
    agreed = [r["new_tokens"] if r["first_divergence"] is None else r["first_divergence"] for r in rows]
    at_risk = sum(r["new_tokens"] if r["first_divergence"] is None else r["first_divergence"] + 1 for r in rows)
    gaps = [r["gap_ulp"] for r in rows if r["gap_ulp"] is not None]
    return {
        "rows": len(rows),
        "rows_identical": len(rows) - len(firsts),
        "first_divergence_min": min(firsts) if firsts else None,
        "first_divergence_median": statistics.median(firsts) if firsts else None,
        "mean_agreed_prefix": round(statistics.fmean(a / r["new_tokens"] for a, r in zip(agreed, rows)), 4)
        if rows else None,
        "divergences_per_1k": round(1000 * len(firsts) / at_risk, 2) if at_risk else None,
        "differing_fraction": round(sum(r["differing"] for r in rows) / n_tokens, 4) if n_tokens else None,
        "gap_ulp_median": round(statistics.median(gaps), 3) if gaps else None,
        "gap_ulp_max": round(max(gaps), 3) if gaps else None,
    }


def table_row(rec: dict) -> list[str]:
    s = rec["summary"]
    first = "—" if s["first_divergence_min"] is None else f"{s['first_divergence_min']} / {s['first_divergence_median']:g}"
    gap = "—" if s["gap_ulp_median"] is None else f"median {s['gap_ulp_median']:g}, max {s['gap_ulp_max']:g}"
    return [rec["dtype"], rec["pair"], f"{s['rows_identical']}/{s['rows']}", first, f"{s['mean_agreed_prefix']:.2f}",
            f"{s['divergences_per_1k']:g}", f"{s['differing_fraction']:.1%}", gap]


def markdown(records: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(table_row(r)) + " |" for r in records]
    return "\n".join(lines)


def verdicts(records: list[dict]) -> list[str]:
    """One line per 16-bit dtype and MagicDec configuration: its disagreement with stock batch N
    next to stock's own batch-1 vs batch-N disagreement."""
    out = []
    by = {(r["dtype"], r["kind"], r.get("method")): r["summary"] for r in records}
    for r in records:
        if r["kind"] != "c":
            continue
        own = by.get((r["dtype"], "a", None))
        s = r["summary"]
        if own is None:
            continue
        within = (s["divergences_per_1k"] <= own["divergences_per_1k"]
                  and s["rows_identical"] >= own["rows_identical"])
        out.append(f"{r['dtype']} {r['method']}: MagicDec vs stock batch N {s['rows_identical']}/{s['rows']} rows "
                   f"identical, {s['divergences_per_1k']:g} divergences/1k tokens; stock batch 1 vs batch N "
                   f"{own['rows_identical']}/{own['rows']}, {own['divergences_per_1k']:g}/1k -> "
                   f"{'within' if within else 'NOT within'} stock's own batch-shape variation")
    return out


# ----------------------------------------------------------------------------- models and prompts
def tiny_model():
    """A random 2-layer Llama (vocabulary 128) with sharpened logits, as the test suite builds them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=160, num_attention_heads=6,
                         num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=1024,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    model.generation_config.do_sample = False
    return model


def prompt_lengths(batch: int, min_len: int, max_len: int) -> list[int]:
    """Evenly spread lengths, longest first."""
    if batch == 1:
        return [max_len]
    return [max_len - round(i * (max_len - min_len) / (batch - 1)) for i in range(batch)]


ragged = data.left_padded  # left-pad 1-D prompts into ``input_ids`` and ``attention_mask``


def parse_view(spec: str, gamma: int) -> tuple[str, dict]:
    """``streamingllm/64`` -> (label, generate keywords); ``default`` -> the default plan."""
    if spec == DEFAULT_PLAN:
        return 'default plan (speculative="magicdec")', {"speculative": "magicdec"}
    draft, _, budget = spec.partition("/")
    if not budget.isdigit():
        raise argparse.ArgumentTypeError(f"a view is VIEW/BUDGET (e.g. snapkv/128) or {DEFAULT_PLAN!r}, got {spec!r}")
    return f"{draft}/{budget} γ={gamma}", {"speculative": "magicdec", "draft": draft, "draft_budget": int(budget),
                                           "gamma": gamma}


def plan_label(stats) -> str:
    """What a MagicDec call ran, from its ``out.speculation``."""
    if stats is None:
        return "?"
    if stats.draft.startswith("none"):
        return "plain decoding (planner declined)"
    gamma = f"γ≈{stats.mean_gamma:.1f} adaptive" if stats.adaptive_gamma else f"γ={stats.gamma}"
    return f"{stats.draft}/{stats.draft_budget} {gamma} {stats.draft_weights}"


# ----------------------------------------------------------------------------- decoding
class Runner:
    def __init__(self, prompts: list[torch.Tensor], pad_id: int, new_tokens: int, log):
        self.prompts, self.pad_id, self.new_tokens, self.log = prompts, pad_id, new_tokens, log
        self.ids, self.mask = ragged(prompts, pad_id)
        self.common = dict(max_new_tokens=new_tokens, min_new_tokens=None, do_sample=False, eos_token_id=None,
                           pad_token_id=pad_id)
        self.seconds: dict[str, float] = {}

    def _timed(self, name, fn):
        t = time.perf_counter()
        out = fn()
        self.seconds[name] = round(time.perf_counter() - t, 2)
        self.log(f"  {name}: {self.seconds[name]:.1f} s")
        return out

    def stock_batch(self, model, name):
        """Stock batch N: new tokens and stock's logits (fp32 copies) per row."""
        def run():
            with torch.inference_mode():
                return model.generate(input_ids=self.ids, attention_mask=self.mask, return_dict_in_generate=True,
                                      output_logits=True, **self.common)
        out = self._timed(name, run)
        width = self.ids.shape[1]
        logits = torch.stack(out.logits, dim=1).float()  # [N, T, V]
        return [out.sequences[i, width:] for i in range(len(self.prompts))], list(logits)

    def stock_alone(self, model, name):
        """Stock batch 1: every row alone, unpadded."""
        def run():
            tokens, logits = [], []
            with torch.inference_mode():
                for p in self.prompts:
                    ids = p[None]
                    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                         return_dict_in_generate=True, output_logits=True, **self.common)
                    tokens.append(out.sequences[0, ids.shape[1]:])
                    logits.append(torch.cat(out.logits, dim=0).float())
            return tokens, logits
        return self._timed(name, run)

    def magicdec(self, model, name, kwargs):
        def run():
            with torch.inference_mode(), warnings.catch_warnings():
                warnings.simplefilter("ignore", hf_magicdec.MagicDecWarning)
                return model.generate(input_ids=self.ids, attention_mask=self.mask, return_dict_in_generate=True,
                                      **self.common, **kwargs)
        out = self._timed(name, run)
        width = self.ids.shape[1]
        stats = getattr(out, "speculation", None)
        info = {"plan_ran": plan_label(stats),
                "acceptance_rate": None if stats is None or stats.steps == 0 else round(stats.acceptance_rate, 4)}
        return [out.sequences[i, width:] for i in range(len(self.prompts))], info


def measure(model_for, dtypes: list[str], views: list[str], gamma: int, runner: Runner, log) -> list[dict]:
    """Every decoding of every dtype, then the pairwise comparisons. ``model_for(dtype)`` builds a model."""
    records = []
    parsed = [parse_view(v, gamma) for v in views]
    fp32 = None
    for dtype in ["fp32"] + [d for d in dtypes if d != "fp32"]:
        log(f"{dtype}:")
        model = model_for(dtype)
        bn, bn_logits = runner.stock_batch(model, f"{dtype} stock batch N")
        b1, b1_logits = runner.stock_alone(model, f"{dtype} stock batch 1")
        md = {label: runner.magicdec(model, f"{dtype} magicdec {label}", kwargs) for label, kwargs in parsed}
        del model

        def add(kind, pair, ref, ref_logits, other, **extra):
            rows = compare(ref, other, ref_logits, dtype)
            records.append({"record": "pair", "dtype": dtype, "kind": kind, "pair": pair, **extra,
                            "summary": summarize(rows), "rows": rows})

        add("a", "(a) stock batch 1 vs stock batch N", bn, bn_logits, b1)
        if dtype != "fp32":
            add("b", "(b) stock fp32 vs stock, batch N", fp32["bn"], fp32["bn_logits"], bn)
            add("b", "(b) stock fp32 vs stock, batch 1", fp32["b1"], fp32["b1_logits"], b1)
        for label, (tokens, info) in md.items():
            add("c", f"(c) stock batch N vs MagicDec {label} [{info['plan_ran']}]", bn, bn_logits, tokens,
                method=label, **info)
        for label, (tokens, info) in md.items():
            add("d", f"(d) stock batch 1 vs MagicDec {label}", b1, b1_logits, tokens, method=label)
        if dtype != "fp32":
            for label, (tokens, info) in md.items():
                add("e", f"(e) stock fp32 batch N vs MagicDec {label}", fp32["bn"], fp32["bn_logits"],
                    tokens, method=label)
        if dtype == "fp32":
            fp32 = {"bn": bn, "bn_logits": bn_logits, "b1": b1, "b1_logits": b1_logits}
        del bn_logits, b1_logits
    return records


def dtype_supported(dtype: str) -> str | None:
    """``None`` if a small matmul runs in ``dtype`` on this CPU, else the reason."""
    try:
        x = torch.ones(4, 4, dtype=DTYPES[dtype])
        (x @ x).sum().item()
        return None
    except Exception as exc:  # noqa: BLE001 - any failure means "skip with a note"
        return f"{type(exc).__name__}: {exc}"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ----------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="hf_magicdec_bench.models.load name, directory or Hub id")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=sorted(DTYPES),
                    help="dtypes to measure; fp32 always runs as the control (default: bf16 fp16)")
    ap.add_argument("--batch", type=int, default=8, help="prompts (rows), default 8")
    ap.add_argument("--min-len", type=int, default=256, help="shortest prompt (tokens), default 256")
    ap.add_argument("--max-len", type=int, default=512, help="longest prompt (tokens), default 512")
    ap.add_argument("--new-tokens", type=int, default=96, help="new tokens per row (EOS ignored), default 96")
    ap.add_argument("--views", nargs="+", default=["streamingllm/64", "snapkv/128", DEFAULT_PLAN],
                    help=f"MagicDec configurations: VIEW/BUDGET, or {DEFAULT_PLAN!r} for speculative=\"magicdec\" "
                         "alone (default: streamingllm/64 snapkv/128 default)")
    ap.add_argument("--gamma", type=int, default=3, help="γ of the VIEW/BUDGET configurations, default 3")
    ap.add_argument("--source", default="auto", help="text source of hf_magicdec_bench.data (default auto)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; 1 with --smoke). On a machine other jobs load, 1 "
                         "avoids OpenMP threads spinning against each other")
    ap.add_argument("--out", type=Path, default=None, help="write DIR/dtype_agreement.jsonl and DIR/table.md")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny random Llama, random prompts, small sizes (seconds; the test suite's run)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke and args.threads is None:
        args.threads = 1  # a tiny model gains nothing from threads, and spinning threads stall a busy machine
    if args.threads:
        torch.set_num_threads(args.threads)
    log = (lambda *_: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    for v in args.views:
        parse_view(v, args.gamma)  # refuse a bad spec before loading anything
    start = time.perf_counter()
    skipped = {}
    dtypes = []
    for d in args.dtypes:
        reason = dtype_supported(d)
        if reason:
            skipped[d] = reason
        else:
            dtypes.append(d)

    if args.smoke:
        if args.views == build_parser().get_default("views"):
            args.views = ["streamingllm/32", "snapkv/48", DEFAULT_PLAN]
        if args.batch == build_parser().get_default("batch"):
            args.batch = 3
        args.min_len = min(args.min_len, 56)
        args.max_len = min(args.max_len, 80)
        args.new_tokens = min(args.new_tokens, 16)
        base = tiny_model()
        model_name = "tiny random Llama (2 layers, vocabulary 128)"
        gen = torch.Generator().manual_seed(0)
        full = torch.randint(3, 128, (args.batch, args.max_len), generator=gen)
        full[:, 0] = 1
        pad_id = 0

        def model_for(dtype):
            return copy.deepcopy(base).to(DTYPES[dtype])
    else:
        from hf_magicdec_bench import models

        model_name = args.model
        _, tokenizer = models.load(args.model, progress=False)
        full = data.prompt_batch(tokenizer, args.batch, args.max_len, source=args.source)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

        def model_for(dtype):
            return models.load(args.model, dtype=DTYPES[dtype], progress=False)[0]

    lengths = prompt_lengths(args.batch, args.min_len, args.max_len)
    prompts = [full[i, :n] for i, n in enumerate(lengths)]
    runner = Runner(prompts, pad_id, args.new_tokens, log)
    records = measure(model_for, dtypes, args.views, args.gamma, runner, log)
    elapsed = time.perf_counter() - start

    meta = {"record": "meta", "model": model_name, "smoke": args.smoke, "dtypes": ["fp32"] + dtypes,
            "skipped_dtypes": skipped, "batch": args.batch, "prompt_lengths": lengths,
            "new_tokens": args.new_tokens, "views": args.views, "gamma": args.gamma, "greedy": True,
            "eos": "ignored", "padding": "left", "source": None if args.smoke else args.source,
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "hf_magicdec": getattr(hf_magicdec, "__version__", None), "cpu": cpu_name(),
            "threads": torch.get_num_threads(), "seconds": round(elapsed, 1), "run_seconds": runner.seconds,
            "command": "python scripts/dtype_agreement.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    table = markdown(records)
    lines = verdicts(records)
    print(f"model {model_name}; {args.batch} prompts of {min(lengths)}..{max(lengths)} tokens (left-padded), "
          f"{args.new_tokens} new tokens, greedy, EOS ignored; {elapsed:.0f} s")
    print()
    print(table)
    print()
    for line in lines:
        print(line)
    for d, reason in skipped.items():
        print(f"skipped {d}: {reason}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "dtype_agreement.jsonl", "w", encoding="utf-8") as fh:
            for rec in [meta] + records:
                fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
        (args.out / "table.md").write_text(table + "\n\n" + "\n".join(lines) + "\n", encoding="utf-8")
        print(f"wrote {args.out / 'dtype_agreement.jsonl'} and {args.out / 'table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

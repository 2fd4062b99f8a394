"""``hf-magicdec bench`` / ``python -m hf_magicdec_bench.bench``: decode speedup, acceptance and tokens
per step of ``speculative="magicdec"`` against stock ``model.generate``, on a real model and real
long text, side by side in one process on the same prompts.

Example (the issue's CPU target; about 10 minutes on 2 cores)::

    hf-magicdec bench --batch 8 --context 4096 --new-tokens 128 --draft streamingllm snapkv --budget 256 --gamma 3

On a machine that may be busy, ``--rounds 3`` (one prefill per point, every method decoded once per
round in a rotated order, median and spread per method, a warning when the spread is large)::

    hf-magicdec bench --batch 8 --context 2048 --new-tokens 32 --rounds 3 --static-baseline --default-plan

Writes ``<out>/results.jsonl`` (one row per run, with environment metadata) and PNG plots, and
prints a table. Exit status 1 if any speculative output differed from stock ``generate``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from pathlib import Path

import torch

from ..ruler import RULER_TASKS, task_names
from .harness import environment
from .report import breakdown_table, plots, rounds_notes, table, write_jsonl
from .reuse import run_reuse_and_report
from .ruler_mode import ruler_table, run_ruler
from .runner import BenchSpec, resolve_device, run

log = logging.getLogger("hf_magicdec")


def _int_or_auto(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or 'auto', got {text!r}") from None


def build_parser(prog: str = "hf-magicdec bench") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m",
                    help="offline name (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b), local dir or Hub id")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--batch", type=int, nargs="+", default=[8], help="batch size(s)")
    ap.add_argument("--context", type=int, nargs="+", default=[2048], help="prompt length(s) in tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--draft", nargs="+", default=["streamingllm", "snapkv"],
                    help="draft view(s); 'none' with --default-plan: the default plan alone")
    ap.add_argument("--budget", type=_int_or_auto, nargs="+", default=[256], help="draft budget(s), or auto")
    ap.add_argument("--gamma", type=_int_or_auto, nargs="+", default=[3],
                    help="draft tokens per step, or auto (planner's choice, adapted per step)")
    ap.add_argument("--draft-weights", nargs="+", default=["full"], choices=["full", "int8", "fp16", "int4", "auto"],
                    help="the self-draft's weights: full, int8 / fp16 / int4 (compressed copies of the linear "
                         "layers), auto")
    ap.add_argument("--text", default="auto",
                    help="auto | shakespeare | pg19 | files:<glob>; chat[:<source>]: the model's chat template asking to "
                         "continue a passage (answers stop at EOS with --stop-at-eos; see hf_magicdec_bench.data)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per method (median reported)")
    ap.add_argument("--rounds", type=int, default=None, metavar="N",
                    help="the rounds timing protocol (docs/benchmarks.md): one prefill per point shared by every "
                         "round, then N rounds that decode every method once each, the order rotated per round; "
                         "median decode, spread and a warning when the machine looked busy (default: off, "
                         "methods run one after another)")
    ap.add_argument("--default-plan", action="store_true",
                    help='also run speculative="magicdec" with nothing else set (the planner chooses view, '
                         "budget, gamma and draft weights, or plain decoding); the table shows what it chose")
    ap.add_argument("--temperature", type=float, default=0.0, metavar="T",
                    help="sample at temperature T (> 0; with --rounds; the model's other sampling defaults kept): "
                         "each round's calls from one seed, tokens not compared; 0 (default): greedy")
    ap.add_argument("--no-warmup", action="store_true", help="skip the short discarded warm-up run per method")
    ap.add_argument("--no-own-ar", action="store_true", help="skip our own autoregressive path (gamma=0)")
    ap.add_argument("--static-baseline", action="store_true",
                    help="also time stock generate with cache_implementation='static' (a second stock baseline)")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="let rows stop at EOS (default: every row decodes exactly --new-tokens, as the reference)")
    ap.add_argument("--assistant", default=None,
                    help="also run HF assisted generation at batch 1 with this draft model (same tokenizer)")
    ap.add_argument("--prompt-lookup", type=int, default=None, metavar="N",
                    help="also run HF prompt lookup decoding at batch 1 (prompt_lookup_num_tokens=N)")
    ap.add_argument("--draft-model", default=None,
                    help="also run MagicDec with this separate small draft model (same tokenizer), any batch size")
    ap.add_argument("--draft-model-view", nargs="+", default=["full"],
                    help="view(s) compressing the draft model's cache: full streamingllm snapkv (budgets: --budget)")
    ap.add_argument("--share-prefill", action="store_true",
                    help="prefill once per point for every MagicDec run (decode times unchanged; their prefill "
                         "times are then not measured): long contexts on slow devices (always on with --rounds)")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="prefill chunk size for every method (default: stock prefills at once, MagicDec in 1024s)")
    ap.add_argument("--ruler", nargs="+", default=None, metavar="TASK",
                    help="RULER mode: these tasks instead of book text, by RULER's names (niah_single_1/2/3 "
                         "niah_multikey_1/2/3 niah_multivalue niah_multiquery vt cwe fwe qa_1 qa_2; 'all': those 13) "
                         "or ours (niah_single niah_multikey ... qa); --context gives the lengths")
    ap.add_argument("--ruler-samples", type=int, default=8, help="samples (batch rows) per RULER task and length")
    ap.add_argument("--reuse-prefix", type=int, default=None, metavar="N",
                    help="prefill the documents once and answer N questions from copies of their cache, stock vs "
                         "MagicDec (first batch, context and MagicDec config): prefill saved and decode speedup "
                         "per question (docs/cache_reuse.md)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--out", default="bench_out", help="folder for results.jsonl and plots")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap


def main(argv: list[str] | None = None, prog: str = "hf-magicdec bench") -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    try:  # validate every size and config before loading anything
        spec = BenchSpec(
            model=args.model, dtype=args.dtype, device=args.device, batches=tuple(args.batch),
            contexts=tuple(args.context), new_tokens=args.new_tokens, drafts=tuple(args.draft),
            budgets=tuple(args.budget), gammas=tuple(args.gamma), draft_weights=tuple(args.draft_weights),
            text=args.text, repeats=args.repeats,
            warmup=not args.no_warmup, own_ar=not args.no_own_ar, static_baseline=args.static_baseline,
            stop_at_eos=args.stop_at_eos,
            assistant=args.assistant, prompt_lookup=args.prompt_lookup, prefill_chunk=args.prefill_chunk,
            draft_model=args.draft_model,
            draft_model_views=tuple(args.draft_model_view), share_prefill=args.share_prefill,
            default_plan=args.default_plan, rounds=args.rounds, temperature=args.temperature,
        )
    except ValueError as exc:
        ap.error(str(exc))
    if args.rounds is not None and (args.ruler or args.reuse_prefix is not None):
        ap.error("--rounds times the book-text comparison; it does not apply to --ruler or --reuse-prefix")
    tasks = None
    if args.ruler:
        tasks = list(RULER_TASKS) if args.ruler == ["all"] else args.ruler
        bad = [t for t in tasks if t not in task_names()]
        if bad:
            ap.error(f"unknown RULER task(s) {bad}; choose from {list(task_names())} or 'all'")
        if args.ruler_samples < 1:
            ap.error(f"--ruler-samples must be >= 1, got {args.ruler_samples}")
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.reuse_prefix is not None:
        if args.reuse_prefix < 1:
            ap.error(f"--reuse-prefix must be >= 1, got {args.reuse_prefix}")
        return run_reuse_and_report(spec, args.reuse_prefix, Path(args.out), progress=not args.quiet)
    if tasks:
        return run_ruler_and_report(spec, tasks, args.ruler_samples, Path(args.out), progress=not args.quiet)
    return run_and_report(spec, Path(args.out), progress=not args.quiet)


def run_ruler_and_report(spec, tasks, samples, out: Path, progress: bool = True) -> int:
    out.mkdir(parents=True, exist_ok=True)
    rows, env = run_ruler(spec, tasks, samples, progress=progress)
    (out / "ruler.jsonl").unlink(missing_ok=True)
    write_jsonl(out / "ruler.jsonl", rows)
    print(f"\nRULER-style tasks, {spec.model} {spec.dtype} on {env['device']}, greedy, {samples} samples per task")
    print(ruler_table(rows))
    print(f"\nrows: {out / 'ruler.jsonl'}")
    bad = [r for r in rows if r["identical"] is False]
    if bad:
        print(f"\n{len(bad)} run(s) differed from stock generate", file=sys.stderr)
        return 1
    return 0


def run_and_report(spec, out: Path, progress: bool = True, title_prefix: str = "") -> int:
    """Run ``spec``, stream JSONL rows to ``out/results.jsonl``, print the tables, write the plots."""
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "results.jsonl"
    jsonl.unlink(missing_ok=True)
    env = environment(resolve_device(spec.device))  # collected once, written with every row
    meta = {"model": spec.model, "dtype": spec.dtype, "spec": dataclasses.asdict(spec)}

    def on_result(r):
        write_jsonl(jsonl, [{**meta, **r.to_dict(), "env": env}])

    results, env, _ = run(spec, progress=progress, on_result=on_result, env=env)
    decoding = f"sampled at T={spec.temperature:g}" if spec.sampled else "greedy"
    title = (f"{title_prefix}{spec.model} {spec.dtype} on {env['device']}, {spec.new_tokens} new tokens, {decoding}"
             f"{'' if spec.stop_at_eos else ', EOS ignored'}"
             f"{f', {spec.rounds} rounds' if spec.rounds is not None else ''}")
    print()
    print(title)
    print(table(results))
    notes = rounds_notes(results) if spec.rounds is not None else ""
    if notes:
        print(notes)
    extra = breakdown_table(results)
    if extra:
        print()
        print(extra)
    written = plots(results, out, title)
    print(f"\nrows: {jsonl}" + "".join(f"\nplot: {p}" for p in written))
    bad = [r for r in results if r.identical is False]
    if bad:
        print(f"\n{len(bad)} run(s) differed from stock generate: " + ", ".join(r.label for r in bad), file=sys.stderr)
        return 1
    return 0

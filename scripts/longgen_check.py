"""End-to-end check of long generations on a real model: MagicDec against stock ``generate`` with
its static cache (``cache_implementation="static"``, the baseline a user would pick), token for token.

    python scripts/longgen_check.py                     # every case (15-26 minutes on 2 CPU cores)
    python scripts/longgen_check.py processors-default --stock   # also time stock generate (dynamic cache)
    python scripts/longgen_check.py ragged-chat-eos-default batch1-default --scale 0.1
    python scripts/longgen_check.py --list
    python scripts/longgen_check.py long-8k-default    # opt-in: 8 x 128 -> 8,064 (the model's 8K positions)

SmolLM2-135M-Instruct in fp32 on real text (``hf_magicdec_bench``'s offline assets), greedy (or
sampling with ``top_k=1``, which is deterministic): short prompts and hundreds to thousands of new
tokens, ragged batches (left padding), chat prompts whose answers stop at EOS, every draft view,
the default plan (the schedule: γ = 0 while speculation does not pay, then γ by context), logits
processors; cases marked ``opt_in`` (``--list``) run only when named. ``--scale`` multiplies every
case's new tokens (a quick run). Prints one line per case (identical, shapes, seconds of both
calls, acceptance and steps) and, for a mismatch, the first differing column of each row; exits 1
if any case differs. ``--json PATH`` writes the lines' data. ``--stock`` also runs plain
``generate`` (its dynamic cache), checks it gives the static cache's tokens too and prints its
seconds: which stock cache is faster depends on the machine and the shapes. The test suite holds the same property on tiny models and short runs (``tests/test_fuzz.py``,
``tests/test_greedy_equality.py``); this script is the long, real-model run it does not contain.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

import torch

import hf_magicdec  # noqa: F401  (registers speculative="magicdec")
from hf_magicdec_bench import data, models

#: name -> prompt lengths (one row each), chat prompts or running text, EOS honoured, new tokens,
#: MagicDec's options and the generation options both calls share.
CASES = {
    "ragged-chat-eos-default": dict(lengths=[70, 200, 333], chat=True, eos=True, new=700, magicdec={}),
    "attended-auto-int8": dict(lengths=[128] * 5, chat=False, eos=False, new=1500,
                               magicdec=dict(draft="attended", gamma="auto", draft_weights="int8")),
    "attended-every1-pages32": dict(lengths=[1000, 700], chat=False, eos=False, new=600,
                                    magicdec=dict(draft="attended", draft_budget=128, every=1, page_size=32, gamma=4)),
    "snapkv-ragged-chat-eos": dict(lengths=[90, 150, 210, 270, 330, 390, 450, 510], chat=True, eos=True, new=400,
                                   magicdec=dict(draft="snapkv", gamma="auto")),
    "batch1-default": dict(lengths=[30], chat=False, eos=False, new=2000, magicdec={}),
    "dynamic-chat-eos": dict(lengths=[256] * 4, chat=True, eos=True, new=900,
                             magicdec=dict(draft="dynamic", gamma="auto", draft_budget=128)),
    "streamingllm-fp16-ragged": dict(lengths=[40, 500, 2000], chat=False, eos=False, new=300,
                                     magicdec=dict(draft="streamingllm", gamma=6, draft_weights="fp16")),
    "processors-default": dict(lengths=[100, 180], chat=False, eos=False, new=800, magicdec={},
                               common=dict(repetition_penalty=1.2, no_repeat_ngram_size=4)),
    "topk1-sampling-chat-eos": dict(lengths=[150] * 3, chat=True, eos=True, new=600,
                                    magicdec=dict(draft="attended", gamma="auto"),
                                    common=dict(do_sample=True, top_k=1, temperature=0.7)),
    # Opt-in (run only when named): the longest generations, 68 minutes on 2 CPU cores.
    "long-8k-default": dict(lengths=[128] * 8, chat=False, eos=False, new=8064, magicdec={}, opt_in=True),
}


def default_cases() -> list[str]:
    """The cases a run without names runs: every case not marked ``opt_in``."""
    return [name for name, case in CASES.items() if not case.get("opt_in")]


def ragged_batch(tokenizer, lengths: list[int], chat: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Left-padded ``[B, max(lengths)]`` prompts (row ``i`` a different passage of ``lengths[i]``
    tokens), their attention mask and the pad token."""
    make = data.chat_prompt_batch if chat else data.prompt_batch
    rows = [make(tokenizer, 1, n, skip_tokens=8000 + 977 * i)[0] for i, n in enumerate(lengths)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return (*data.left_padded(rows, pad), pad)


def run_case(model, tokenizer, name: str, case: dict, scale: float = 1.0, stock: bool = False) -> dict:
    """Both calls (with ``stock``, plain ``generate`` too) on one case; the result line's data."""
    ids, mask, pad = ragged_batch(tokenizer, case["lengths"], case["chat"])
    new = max(1, round(case["new"] * scale))
    common = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, pad_token_id=pad,
                  eos_token_id=tokenizer.eos_token_id if case["eos"] else None)
    common.update({"do_sample": False, **case.get("common", {})})
    with torch.inference_mode():
        start = time.perf_counter()
        ref = model.generate(**common, cache_implementation="static")
        static_s = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(**common, speculative="magicdec", return_dict_in_generate=True, **case["magicdec"])
        magicdec_s = time.perf_counter() - start
        if stock:
            start = time.perf_counter()
            plain = model.generate(**common)
            stock_s = time.perf_counter() - start
    seq = out.sequences
    same = ref.shape == seq.shape and torch.equal(ref, seq)
    first_diff = []
    if not same:
        width = min(ref.shape[1], seq.shape[1])
        for r in range(ref.shape[0]):
            cols = (ref[r, :width] != seq[r, :width]).nonzero()
            first_diff.append(int(cols[0]) if len(cols) else (None if ref.shape == seq.shape else width))
    spec = out.speculation
    return dict(case=name, identical=same, shape=list(ref.shape), magicdec_shape=list(seq.shape),
                new_tokens=new, static_s=round(static_s, 2), magicdec_s=round(magicdec_s, 2),
                acceptance=round(spec.acceptance_rate, 3), steps=spec.steps, first_diff=first_diff,
                schedule=[list(run) for run in spec.schedule()],
                **({"stock_s": round(stock_s, 2), "stock_identical": plain.shape == ref.shape and torch.equal(plain, ref)}
                   if stock else {}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help="case names (default: all; --list shows them)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every case's new tokens")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument("--stock", action="store_true", help="also time stock generate (its dynamic cache)")
    args = parser.parse_args(argv)
    if args.list:
        for name, case in CASES.items():
            print(name, json.dumps(case))
        return 0
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {list(CASES)}")
    if not args.scale > 0:
        parser.error(f"--scale must be > 0, got {args.scale}")
    warnings.simplefilter("ignore")
    model, tokenizer = models.load("smollm2-135m", progress=False)
    results = []
    for name in args.cases or default_cases():
        result = run_case(model, tokenizer, name, CASES[name], args.scale, args.stock)
        results.append(result)
        print(f"{name}: identical {result['identical']}  {result['shape']} vs {result['magicdec_shape']}  "
              f"static cache {result['static_s']:.1f} s  magicdec {result['magicdec_s']:.1f} s  "
              f"acceptance {result['acceptance']:.3f}  steps {result['steps']}"
              + (f"  stock generate {result['stock_s']:.1f} s (identical {result['stock_identical']})"
                 if "stock_s" in result else "")
              + (f"  first differing column per row {result['first_diff']}" if result["first_diff"] else ""),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    failed = [r["case"] for r in results if not r["identical"]]
    print(f"{len(results) - len(failed)} of {len(results)} cases identical" + (f"; differ: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

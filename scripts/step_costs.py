"""Measure per-forward step costs of the engine on a real model and real text.

    python scripts/step_costs.py --batch 8 --context 2048 --gamma 4 --budget 256

Times, on the same really prefilled MagicDecCache (rolled back after every forward, untimed, so
the context never changes): a 1-token step on the full cache (T_T), a (gamma+1)-token
verification (T_V) and a draft step on the draft view (T_D), with the cost model's own
``measure_steps``; next to stock HF's own 1-token and (gamma+1)-token steps (DynamicCache +
sdpa, crop included). Medians over --repeats after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch
from transformers import DynamicCache

from hf_magicdec.calibration import measure_steps
from hf_magicdec_bench import data, models


def median_time(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--draft", default="streamingllm")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = models.load(args.model)
    ids = data.prompt_batch(tokenizer, args.batch, args.context)
    q = args.gamma + 1
    result = {"model": args.model, "batch": args.batch, "context": args.context, "gamma": args.gamma,
              "draft": args.draft, "budget": args.budget, "threads": torch.get_num_threads()}
    # --- ours: the engine's own forwards on one real prefilled cache (the cost model's calibration code).
    steps = measure_steps(model, args.batch, args.context, gammas=(args.gamma,), budgets=(args.budget,),
                          draft=args.draft, repeats=args.repeats, input_ids=ids)
    result.update(prefill_s=steps.prefill_seconds, T_T_s=steps.t_target, T_V_s=steps.t_verify[args.gamma],
                  T_D_s=steps.t_draft[args.budget])
    with torch.no_grad():
        # --- stock HF for reference: DynamicCache + sdpa, 1-token and (gamma+1)-token steps.
        tokens = ids[:, -q:].clone()
        out = model(input_ids=ids, use_cache=True, past_key_values=DynamicCache(config=model.config), logits_to_keep=1)
        stock_cache = out.past_key_values

        def stock_step(n):
            model(input_ids=tokens[:, :n], past_key_values=stock_cache, use_cache=True, logits_to_keep=1)
            stock_cache.crop(-n)

        result["stock_T_T_s"] = median_time(lambda: stock_step(1), args.repeats)
        result["stock_T_V_s"] = median_time(lambda: stock_step(q), args.repeats)
    result["T_V/T_T"] = result["T_V_s"] / result["T_T_s"]
    result["T_D/T_T"] = result["T_D_s"] / result["T_T_s"]
    result["stock T_V/T_T"] = result["stock_T_V_s"] / result["stock_T_T_s"]
    result["ours T_T / stock T_T"] = result["T_T_s"] / result["stock_T_T_s"]
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}, indent=2))


if __name__ == "__main__":
    main()

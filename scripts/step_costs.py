"""Measure per-forward step costs of the engine on a real model and real text.

    python scripts/step_costs.py --batch 8 --context 2048 --gamma 4 --budget 256

Times, on the same prefilled MagicDecCache (rolled back after every forward, so the context
never changes): a 1-token step on the full cache (T_T), a (gamma+1)-token verification (T_V),
and a draft step on the draft view (T_D), next to stock HF's own 1-token and (gamma+1)-token
steps (DynamicCache + sdpa). Medians over --repeats after one warm-up.
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

from hf_magicdec import MagicDecConfig, data, models
from hf_magicdec.generation import _Engine, _magicdec_attention


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
    config = MagicDecConfig(draft=args.draft, draft_budget=args.budget, gamma=args.gamma)
    result = {"model": args.model, "batch": args.batch, "context": args.context, "gamma": args.gamma,
              "draft": args.draft, "budget": args.budget, "threads": torch.get_num_threads()}
    with torch.no_grad():
        # --- ours: prefill once through the engine's own path, then time single forwards.
        with _magicdec_attention(model):
            engine = _Engine(model, config, model.generation_config, [], [], None, chunk=1024)
            pad = torch.zeros(args.batch, dtype=torch.long)
            positions = torch.arange(args.context)[None].expand(args.batch, -1)
            t0 = time.perf_counter()
            engine._prefill(ids, positions, pad, capacity=args.context + 64 + q)
            engine.cache.build_draft_views(engine.view, config, args.context, 64)
            result["prefill_s"] = time.perf_counter() - t0
            cache = engine.cache
            tokens = ids[:, -q:].clone()

            def verify(n):
                engine._verify(tokens[:, 0], tokens[:, 1:n])
                cache.commit(torch.zeros(args.batch, dtype=torch.long))  # roll back: context never changes

            def draft_step():
                cache.begin_draft(0)
                valid = cache.draft_valid()
                mask = torch.cat([valid, torch.ones(args.batch, 1, dtype=torch.bool)], 1)[:, None, None, :]
                engine._forward(tokens[:, :1], cache.lengths[:, None], mask, logits_to_keep=1)

            result["T_T_s"] = median_time(lambda: verify(1), args.repeats)
            result["T_V_s"] = median_time(lambda: verify(q), args.repeats)
            result["T_D_s"] = median_time(draft_step, args.repeats)
        # --- stock HF for reference: DynamicCache + sdpa, 1-token and (gamma+1)-token steps.
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

"""Acceptance rate and tokens per verification step on a real model and real long text.

    python scripts/acceptance.py --batch 4 --context 2048 --new-tokens 128 --gamma 4 --budget 256

Runs stock greedy ``generate`` once, then ``speculative="magicdec"`` per draft view on the same
prompts, checks token identity and prints the speculation statistics (one JSON line per view).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import torch

import hf_magicdec  # noqa: F401
from hf_magicdec import MagicDecConfig, data, models


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--drafts", nargs="+", default=["streamingllm", "snapkv"])
    ap.add_argument("--text", default="auto")
    args = ap.parse_args()
    model, tokenizer = models.load(args.model)
    ids = data.prompt_batch(tokenizer, args.batch, args.context, source=args.text)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False)
    reference = model.generate(**kwargs)
    for draft in args.drafts:
        config = MagicDecConfig(draft=draft, draft_budget=args.budget, gamma=args.gamma)
        out = model.generate(**kwargs, speculative=config, return_dict_in_generate=True)
        row = {"model": args.model, "batch": args.batch, "context": args.context, "new_tokens": args.new_tokens,
               "identical": bool(torch.equal(out.sequences, reference)), **out.speculation.summary()}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

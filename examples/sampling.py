"""Sampling with MagicDec: lossless rejection sampling, with HF's logits processors and warpers.

    python examples/sampling.py                                            # batch 4 x 1024, 64 new tokens
    python examples/sampling.py --batch 2 --context 256 --new-tokens 16 --budget 64   # a few seconds

With ``do_sample=True`` each draft token is accepted with probability
min(1, target_prob / draft_prob) and a rejected one is replaced by a draw from the residual
max(target_probs - draft_probs, 0), so every emitted token follows the target model's distribution
(after temperature, top-k/top-p, repetition penalty ...) exactly as stock sampling does. The draws
themselves differ from stock ``generate`` (the random numbers are consumed differently), except with
``gamma=0``, which samples draw for draw like stock under the same seed. The script shows:

1. stock sampling and ``gamma=0`` under the same seed: identical tokens;
2. MagicDec sampling (``--gamma``): different tokens, same distribution; its acceptance;
3. the same seed twice: MagicDec sampling is reproducible.

The distribution itself is checked statistically in ``tests/test_sampling.py``.
"""

from __future__ import annotations

import argparse
import sys

import torch

import hf_magicdec  # noqa: F401  (the import enables generate(speculative=...))
from hf_magicdec_bench import data, models


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="offline name, Hub id or local directory")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--draft", default="streamingllm")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--repetition-penalty", type=float, default=1.1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    model, tokenizer = models.load(args.model, progress=False)
    ids = data.prompt_batch(tokenizer, args.batch, args.context)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                  do_sample=True, temperature=args.temperature, top_p=args.top_p,
                  repetition_penalty=args.repetition_penalty)
    magicdec = dict(speculative="magicdec", draft=args.draft, draft_budget=args.budget)

    def sample(seed: int, **kwargs):
        torch.manual_seed(seed)
        return model.generate(**inputs, **kwargs)

    stock = sample(args.seed)
    own_ar = sample(args.seed, **magicdec, gamma=0)
    same_draws = torch.equal(stock, own_ar)
    print(f"1. stock sampling vs gamma=0 (plain decoding on MagicDec's cache), seed {args.seed}: "
          f"{'identical draws' if same_draws else 'DIFFERENT'}")

    out = sample(args.seed, **magicdec, gamma=args.gamma, return_dict_in_generate=True)
    s = out.speculation
    differ = int((out.sequences != stock).any(1).sum())
    print(f"2. MagicDec sampling, {s.draft}/{s.draft_budget}, gamma {s.gamma}: acceptance {s.acceptance_rate:.3f}, "
          f"tokens/step {s.tokens_per_step:.2f}, histogram {s.histogram()}; "
          f"{differ} of {args.batch} rows differ from stock's draws (expected: same distribution, other draws)")
    for row in range(min(2, args.batch)):
        text = tokenizer.decode(out.sequences[row, ids.shape[1]:], skip_special_tokens=True)
        print(f"   row {row}: {text[:120]!r}")

    again = sample(args.seed, **magicdec, gamma=args.gamma)
    reproducible = torch.equal(again, out.sequences)
    print(f"3. the same seed again: {'identical' if reproducible else 'DIFFERENT'}")
    return 0 if same_draws and reproducible else 1


if __name__ == "__main__":
    sys.exit(main())

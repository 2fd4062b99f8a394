"""A long-context batch on real text, with per-row speculation statistics.

    python examples/long_context_batch.py                         # batch 8 x 4096 tokens, 128 new tokens
    python examples/long_context_batch.py --batch 2 --context 384 --new-tokens 16 --budget 96   # seconds

Rows get prompts of different lengths (``--ragged``, on by default: row i keeps the first
``context * (1 - i / (2 * batch))`` tokens and is left-padded), so the batch is ragged from the start;
during decoding every row also keeps its own number of accepted tokens per step. The script prints,
per row, the prompt length, the verification steps it took, its acceptance rate and tokens per
step, then the whole batch's accepted-length histogram and the time split, and checks the output
against stock ``generate`` (``--no-check`` skips that).

``--gamma auto`` / ``--budget auto`` / ``--draft auto`` leave the choice to the planner (see
docs/configuration.md); with all three ``auto`` it may decide to decode plainly.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import hf_magicdec  # noqa: F401  (the import enables generate(speculative=...))
from hf_magicdec_bench import data, models


def int_or_auto(text: str):
    return text if text == "auto" else int(text)


def ragged_batch(ids: torch.Tensor, pad_id: int, ragged: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad row i to keep its first ``P * (1 - i / 2B)`` tokens: ``(input_ids, attention_mask)``, both [B, P]."""
    batch, prompt = ids.shape
    ids, mask = ids.clone(), torch.ones_like(ids)
    if ragged:
        for row in range(batch):
            keep = prompt - prompt * row // (2 * batch)
            ids[row] = torch.cat([ids.new_full((prompt - keep,), pad_id), ids[row, :keep]])
            mask[row, : prompt - keep] = 0
    return ids, mask


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="offline name, Hub id or local directory")
    ap.add_argument("--text", default="auto", help="auto | shakespeare | pg19 | paulgraham | files:<glob>")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096, help="longest prompt, tokens")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--draft", default="snapkv", help="streamingllm | snapkv | full | auto")
    ap.add_argument("--budget", type=int_or_auto, default=256)
    ap.add_argument("--gamma", type=int_or_auto, default=3)
    ap.add_argument("--no-ragged", dest="ragged", action="store_false", help="every row gets --context tokens")
    ap.add_argument("--stop-at-eos", action="store_true", help="let rows finish at EOS (default: ignore EOS)")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the stock generate comparison")
    args = ap.parse_args(argv)

    model, tokenizer = models.load(args.model, progress=False)
    ids = data.prompt_batch(tokenizer, args.batch, args.context, source=args.text)
    ids, mask = ragged_batch(ids, tokenizer.pad_token_id, args.ragged)
    inputs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False)
    if not args.stop_at_eos:
        inputs["eos_token_id"] = None  # every row decodes exactly --new-tokens, as the benchmarks do

    t0 = time.perf_counter()
    out = model.generate(**inputs, speculative="magicdec", draft=args.draft, draft_budget=args.budget,
                         gamma=args.gamma, return_dict_in_generate=True)
    wall = time.perf_counter() - t0
    s = out.speculation
    prompt_lens = mask.sum(1).tolist()
    new_lens = [args.new_tokens] * args.batch
    if args.stop_at_eos:  # a finished row ends with its EOS token, then padding
        eos = model.generation_config.eos_token_id
        for row, tokens in enumerate(out.sequences[:, ids.shape[1]:].tolist()):
            ends = [i + 1 for i, t in enumerate(tokens) if t in (eos if isinstance(eos, list) else [eos])]
            new_lens[row] = ends[0] if ends else len(tokens)

    print(f"{args.model}: batch {args.batch}, prompts of {min(prompt_lens)}..{max(prompt_lens)} tokens, "
          f"{args.new_tokens} new tokens")
    if not s.steps:
        print(f"the planner chose plain decoding: {s.plan['reason'] if s.plan else s.draft}")
    else:
        print(f"draft view {s.draft}, budget {s.draft_budget}, gamma {s.gamma}"
              + (f" (adaptive, mean {s.mean_gamma:.2f})" if s.adaptive_gamma else ""))
        print(f"{'row':>4} {'prompt':>7} {'new':>5} {'steps':>6} {'acceptance':>11} {'tokens/step':>12}")
        for row in range(args.batch):
            steps = len(s.accepted_lengths[row])
            per_step = (sum(s.accepted_lengths[row]) + steps) / steps if steps else 0.0
            print(f"{row:>4} {prompt_lens[row]:>7} {new_lens[row]:>5} {steps:>6} "
                  f"{s.row_acceptance_rate(row):>11.3f} {per_step:>12.2f}")
        print(f"batch: acceptance {s.acceptance_rate:.3f}, tokens/step {s.tokens_per_step:.2f}, "
              f"{s.steps} verification forwards, accepted-length histogram {s.histogram()}")
        print(f"time: prefill + views {s.prefill_seconds:.2f} s, decode {s.decode_seconds:.2f} s "
              f"(draft {s.draft_seconds:.2f} s, verify {s.verify_seconds:.2f} s), call {wall:.2f} s")
    print("row 0 continues:", repr(tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)[:200]))

    if args.check:
        reference = model.generate(**inputs)
        identical = torch.equal(reference, out.sequences)
        print(f"identical to stock generate: {'yes' if identical else 'NO'}")
        return 0 if identical else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Ask the planner first, then generate with its choice.

    python examples/plan_then_generate.py                                   # batch 8 x 4096, 128 new tokens
    python examples/plan_then_generate.py --batch 2 --context 320 --new-tokens 16 --force   # seconds
    python examples/plan_then_generate.py --calibrate                       # measure this device first (~30 s)

``hf_magicdec.plan(model, batch_size=..., prompt_len=..., new_tokens=...)`` runs the cost model
(docs/cost_model.md) for a workload without touching the weights: it picks the draft view, the
draft budget and gamma, or says that plain decoding is faster. It uses the device model
``generate`` would use (this model's cached calibration on this device, else the preset matching
the device). ``speculative="magicdec"`` with nothing else set makes the same decision inside every
``generate`` call; the script shows both. ``--hardware h100`` plans for another device (nothing
runs there). ``--force`` runs the planner's best candidate even when it predicts no speedup.
"""

from __future__ import annotations

import argparse
import sys

import torch

import hf_magicdec
from hf_magicdec import MagicDecConfig
from hf_magicdec_bench import data, models


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="offline name, Hub id or local directory")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--hardware", default=None,
                    help="also plan for a preset: a100 | h100 | h200 | l40s | cpu (default: only this device)")
    ap.add_argument("--calibrate", action="store_true", help="calibrate the cost model on this device first")
    ap.add_argument("--force", action="store_true", help="speculate with the best candidate even if not predicted to pay")
    args = ap.parse_args(argv)

    model, tokenizer = models.load(args.model, progress=False)
    if args.calibrate:  # cached per model, device and dtype; later plans and generate calls use it
        from hf_magicdec.calibration import calibrate

        cal = calibrate(model, base="cpu" if model.device.type == "cpu" else "h100")
        print(f"calibrated in {cal.wall_seconds:.0f} s: {cal.bandwidth / 1e9:.1f} GB/s, {cal.flops / 1e9:.0f} GFLOP/s, "
              f"overhead {cal.overhead * 1e3:.2f} ms per forward, RMS error {cal.rel_rms_error:.1%}")
    if args.hardware:
        print(f"--- plan on {args.hardware} (not this device) ---")
        print(hf_magicdec.plan(model.config, batch_size=args.batch, prompt_len=args.context,
                               new_tokens=args.new_tokens, hardware=args.hardware).summary())

    plan = hf_magicdec.plan(model, batch_size=args.batch, prompt_len=args.context, new_tokens=args.new_tokens)
    print("--- plan on this device ---")
    print(plan.summary())

    ids = data.prompt_batch(tokenizer, args.batch, args.context)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                  do_sample=False, eos_token_id=None)  # EOS ignored: every row decodes --new-tokens
    reference = model.generate(**inputs)

    if plan.draft is not None and (plan.speculate or args.force):
        config = MagicDecConfig.from_any(plan)  # a MagicDecConfig: draft, draft_budget, gamma fixed
        out = model.generate(**inputs, speculative=config, return_dict_in_generate=True)
        s = out.speculation
        print(f"--- generate(speculative={config.draft_name}/{config.draft_budget}, gamma={config.gamma}) ---")
        print(f"acceptance {s.acceptance_rate:.3f} (the plan assumed {plan.acceptance:.3f}), "
              f"tokens/step {s.tokens_per_step:.2f} (predicted {plan.tokens_per_step:.2f}), "
              f"decode {s.decode_seconds:.2f} s")
        sequences = out.sequences
    else:
        print("--- plain generate (the planner predicts no speedup; --force to speculate anyway) ---")
        sequences = reference

    # The same decision, made inside generate: every field "auto".
    auto = model.generate(**inputs, speculative="magicdec", return_dict_in_generate=True)
    s = auto.speculation
    chosen = "plain decoding" if not s.steps else f"{s.draft}/{s.draft_budget}, gamma {s.gamma} (adaptive)"
    # (Its acceptance estimate now includes what the call above measured for that view and budget.)
    print(f"--- generate(speculative='magicdec'): {chosen}; plan: {s.plan['reason'] if s.plan else '-'} ---")

    identical = torch.equal(reference, sequences) and torch.equal(reference, auto.sequences)
    print(f"identical to stock generate: {'yes' if identical else 'NO'}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())

"""``hf-magicdec acceptance``: acceptance rate and tokens per step over draft views x budgets x
contexts on a real model and real long text, with one prefill shared by all configurations of a
context (:func:`hf_magicdec.shared_prefill`), so long contexts stay affordable.

    hf-magicdec acceptance --contexts 2048 4096 8192 --budgets 128 256 512 1024 --batch 4 --new-tokens 64

Every run is checked token for token against stock greedy ``generate`` on the same prompts (stock
prefills in chunks of ``--prefill-chunk`` tokens too, so 16K-32K prompts fit in memory). Timings are
not reported: this command measures acceptance, ``hf-magicdec bench`` measures speed. Writes
``<out>/acceptance.jsonl``, ``<out>/acceptance.md`` (a table per gamma) and
``<out>/acceptance_vs_budget.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
from hf_magicdec import MagicDecConfig, shared_prefill
from tqdm.auto import tqdm

from .. import data
from .harness import environment
from .report import acceptance_plot
from .runner import draft_name, load_model, resolve_device

log = logging.getLogger("hf_magicdec")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hf-magicdec acceptance", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--budgets", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--drafts", nargs="+", default=["streamingllm", "snapkv"])
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=1024)
    ap.add_argument("--text", default="auto")
    ap.add_argument("--out", default="bench_out/acceptance")
    return ap


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ap = build_parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    for name in ("batch", "new_tokens", "prefill_chunk"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(c < 2 for c in args.contexts):
        ap.error(f"--contexts must be >= 2, got {args.contexts}")
    try:
        grid = [MagicDecConfig.from_any(draft=d, draft_budget=b, gamma=args.gamma)
                for d in args.drafts for b in args.budgets]
    except ValueError as exc:
        ap.error(str(exc))
    rows = sweep(args, grid)
    out = Path(args.out)
    write(rows, out, args)
    return 0 if all(r["identical"] for r in rows) else 1


def sweep(args, grid) -> list[dict]:
    device = resolve_device(args.device)
    model, tokenizer = load_model(args.model, args.dtype, device)
    env = environment(device)
    # Views that record prefill queries (SnapKV) first: their prefill then serves every view, while
    # a StreamingLLM-first order would make SnapKV prefill again.
    grid = sorted(grid, key=lambda cfg: -cfg.view.observation_window())
    runs = [(c, cfg) for c in args.contexts for cfg in grid if draft_name(cfg) == "full" or cfg.draft_budget < c]
    bar = tqdm(total=len(runs) + len(args.contexts), desc="acceptance", unit="run")
    rows = []
    common = dict(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None,
                  pad_token_id=tokenizer.pad_token_id, prefill_chunk_size=args.prefill_chunk)
    with torch.inference_mode():
        for context in args.contexts:
            ids = data.prompt_batch(tokenizer, args.batch, context, source=args.text).to(device)
            mask = torch.ones_like(ids)
            bar.set_postfix_str(f"S={context} stock generate")
            reference = model.generate(input_ids=ids, attention_mask=mask, **common)
            bar.update(1)
            with shared_prefill():
                for ctx, cfg in runs:
                    if ctx != context:
                        continue
                    bar.set_postfix_str(f"S={context} {draft_name(cfg)}/{cfg.draft_budget}")
                    out = model.generate(input_ids=ids, attention_mask=mask, speculative=cfg,
                                         return_dict_in_generate=True, **common)
                    s = out.speculation
                    rows.append({
                        "model": args.model, "dtype": args.dtype, "batch": args.batch, "context": context,
                        "new_tokens": args.new_tokens, "draft": draft_name(cfg), "budget": cfg.draft_budget,
                        "gamma": cfg.gamma, "acceptance_rate": s.acceptance_rate,
                        "tokens_per_step": s.tokens_per_step, "accepted_histogram": s.histogram(),
                        "identical": bool(torch.equal(out.sequences, reference)), "text": args.text, "env": env,
                    })
                    if not rows[-1]["identical"]:
                        log.error("%s/%d at %d: output differs from generate", draft_name(cfg), cfg.draft_budget,
                                  context)
                    bar.update(1)
    bar.close()
    return rows


def markdown(rows: list[dict]) -> str:
    """One table: rows = context, columns = draft view x budget, cells = acceptance (tokens/step)."""
    cols = sorted({(r["draft"], r["budget"]) for r in rows})
    cells = {(r["context"], r["draft"], r["budget"]): r for r in rows}
    head = "| context | " + " | ".join(f"{d} {b}" for d, b in cols) + " |"
    lines = [head, "|---:|" + "---:|" * len(cols)]
    for ctx in sorted({r["context"] for r in rows}):
        vals = []
        for d, b in cols:
            r = cells.get((ctx, d, b))
            vals.append("-" if r is None else f"{r['acceptance_rate']:.3f} ({r['tokens_per_step']:.2f})"
                        + ("" if r["identical"] else " **NOT IDENTICAL**"))
        lines.append(f"| {ctx} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def write(rows: list[dict], out: Path, args) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "acceptance.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    env = rows[0]["env"] if rows else {}
    title = (f"{args.model} {args.dtype}, batch {args.batch}, {args.new_tokens} new tokens, γ={args.gamma}, "
             f"{args.text} text, {env.get('device', '?')}")
    table = markdown(rows)
    (out / "acceptance.md").write_text(f"{title}\n\nacceptance rate (tokens per step)\n\n{table}\n")
    print(f"\n{title}\nacceptance rate (tokens per step)\n\n{table}\n")
    series = defaultdict(list)
    for r in rows:
        series[(r["draft"], r["context"], "")].append((r["budget"], r["acceptance_rate"]))
    if not acceptance_plot(series, out / "acceptance_vs_budget.png", title):
        return
    print(f"rows: {out / 'acceptance.jsonl'}\nplot: {out / 'acceptance_vs_budget.png'}")


if __name__ == "__main__":
    sys.exit(main())

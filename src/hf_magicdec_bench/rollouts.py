"""Timing of GRPO-shaped rollout generation: stock ``generate``, stock with a static cache, MagicDec.

    python -m hf_magicdec_bench.rollouts                       # 16 prompts x 4 generations, 1024 tokens, T = 1.0
    python -m hf_magicdec_bench.rollouts --prompts 2 --generations 2 --new-tokens 16 --prompt-words 60   # seconds
    python -m hf_magicdec_bench.rollouts --magicdec streamingllm:256:3 snapkv:256:auto --out rollouts_out

What RL fine-tuning (TRL's ``GRPOTrainer`` with ``use_vllm=False``) spends its time on: ``N`` chat
prompts, ``G`` sampled completions each (``num_return_sequences=G``, i.e. a batch of ``N x G`` rows),
long completions at temperature 1.0, every row stopping at its EOS. Every method generates from the
same left-padded prompts in the same process, seeded identically, with the same
``GenerationConfig`` (the form TRL passes) but for its own entries:

* ``stock``: transformers' ``generate`` (dynamic cache);
* ``static``: ``cache_implementation="static"``;
* ``magicdec``: ``speculative="magicdec"`` with every setting left to the planner (which may decide
  that plain decoding is faster: the row then says so, ``fell back``);
* ``--magicdec VIEW:BUDGET:GAMMA`` (each part may be ``auto``): explicit MagicDec configurations.

Reported per method (median over ``--repeats``, the methods' order rotated between repeats; a short
warm-up per method is discarded): wall time of the call, time to the first token (prefill) and after
it (decode), completion tokens generated (up to and including each row's EOS), rows that ended at
EOS, decode tokens/s, speedup over stock (whole call and decode), and for MagicDec the acceptance
rate, tokens per verification step and what the planner chose. With ``--greedy`` the sequences are
compared with stock's (identical in fp32). ``--out DIR`` writes ``rollouts.jsonl`` (one row per
method and repeat, with the environment) and ``rollouts.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

import hf_magicdec  # the import enables generate(speculative=...)

from . import data, models

__all__ = ["Row", "build_parser", "chat_batch", "main", "run", "summarize", "table"]


class _Timestamps(BaseStreamer):
    """Receives the prompt, then tokens; keeps the times of the first new token and of the end."""

    def __init__(self) -> None:
        self.start = self.first = self.stop = None

    def put(self, value) -> None:
        now = time.perf_counter()
        if self.start is None:
            self.start = now
        elif self.first is None:
            self.first = now

    def end(self) -> None:
        self.stop = time.perf_counter()


@dataclasses.dataclass
class Row:
    """One method's measurement (one repeat)."""

    method: str
    repeat: int
    rows: int
    prompt_tokens_mean: float
    prompt_tokens_max: int
    max_new_tokens: int
    temperature: float | None
    seconds: float
    prefill_seconds: float
    decode_seconds: float
    tokens: int
    eos_rows: int
    longest: int
    decode_tokens_per_second: float
    acceptance: float | None = None
    tokens_per_step: float | None = None
    draft: str | None = None
    draft_budget: int | None = None
    gamma: int | None = None
    draft_weights: str | None = None
    fell_back: bool | None = None
    plan_reason: str | None = None
    identical_to_stock: bool | None = None
    speedup: float | None = None
    decode_speedup: float | None = None


def build_parser(prog: str = "python -m hf_magicdec_bench.rollouts") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="offline name, Hub id or local directory")
    ap.add_argument("--prompts", type=int, default=16, help="distinct prompts (N)")
    ap.add_argument("--generations", type=int, default=4, help="completions per prompt (G, num_return_sequences)")
    ap.add_argument("--new-tokens", type=int, default=1024, help="max_new_tokens (GRPO's max_completion_length)")
    ap.add_argument("--prompt-words", type=int, default=120,
                    help="mean words of text per prompt (lengths vary from half to 1.5x; plus the chat template)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--greedy", action="store_true", help="do_sample=False, and check identity with stock")
    ap.add_argument("--methods", nargs="+", default=["stock", "static", "magicdec"],
                    choices=["stock", "static", "magicdec"], help="baselines and MagicDec defaults to run")
    ap.add_argument("--magicdec", nargs="*", default=[], metavar="VIEW:BUDGET:GAMMA",
                    help="explicit MagicDec configurations, e.g. streamingllm:256:3 (any part may be 'auto')")
    ap.add_argument("--sink-tokens", type=int, default=None, help="sink_tokens of streamingllm / dynamic configs")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-warmup", action="store_true", help="skip the short discarded run per method")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    ap.add_argument("--out", type=Path, default=None, help="directory for rollouts.jsonl and rollouts.md")
    return ap


def chat_batch(tokenizer, prompts: int, words: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``prompts`` chat prompts about passages of real text (offline: Shakespeare), ``words // 2`` to
    ``3 * words // 2`` words each, through the tokenizer's chat template, left-padded."""
    texts = data.long_texts()
    g = torch.Generator().manual_seed(seed)
    conversations = []
    for i in range(prompts):
        title, text = texts[i % len(texts)]
        tokens = text.split()
        n = int(torch.randint(max(words // 2, 1), max(3 * words // 2, 2), (1,), generator=g))
        start = int(torch.randint(0, max(len(tokens) - n, 1), (1,), generator=g))
        passage = " ".join(tokens[start:start + n])
        conversations.append([{"role": "user", "content": f"Here is a passage from {title}:\n\n{passage}\n\n"
                                                          "Explain step by step what happens in it, then give a "
                                                          "one-sentence summary."}])
    tokenizer.padding_side = "left"
    if getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, padding=True,
                                            return_tensors="pt", return_dict=True)
    else:
        enc = tokenizer([c[0]["content"] for c in conversations], padding=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def _eos_ids(model, tokenizer) -> list[int]:
    """Every EOS the model declares, and the tokenizer's (as TRL does)."""
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos = [tokenizer.eos_token_id, *eos]
    return eos


def _parse_config(text: str, sink_tokens: int | None) -> dict[str, Any]:
    parts = text.split(":")
    if len(parts) != 3:
        raise SystemExit(f"--magicdec {text!r}: expected VIEW:BUDGET:GAMMA, e.g. streamingllm:256:3")
    view, budget, gamma = parts

    def value(v: str):
        return v if v == "auto" else int(v)

    spec = {"method": "magicdec", "draft": view, "draft_budget": value(budget), "gamma": value(gamma)}
    if sink_tokens is not None and view in ("streamingllm", "dynamic"):
        spec["sink_tokens"] = sink_tokens
    hf_magicdec.MagicDecConfig.from_any(spec)  # fails here, naming the bad value
    return spec


def _methods(args) -> list[tuple[str, dict[str, Any]]]:
    """``(label, generation-config entries)`` per method."""
    out = []
    for name in args.methods:
        out.append((name, {"stock": {}, "static": {"cache_implementation": "static"},
                           "magicdec": {"speculative": "magicdec"}}[name]))
    for text in args.magicdec:
        out.append((f"magicdec {text}", {"speculative": _parse_config(text, args.sink_tokens)}))
    return out


def _completions(sequences: torch.Tensor, prompt: int, eos: list[int]) -> tuple[int, int, int]:
    """``(tokens, rows ended at EOS, longest)``: completion tokens up to and including each row's EOS."""
    new = sequences[:, prompt:]
    if new.shape[1] == 0:
        return 0, 0, 0
    is_eos = torch.isin(new, torch.tensor(eos, device=new.device)) if eos else torch.zeros_like(new, dtype=torch.bool)
    ended = is_eos.any(1)
    lengths = torch.where(ended, is_eos.int().argmax(1) + 1, torch.full_like(ended, new.shape[1], dtype=torch.long))
    return int(lengths.sum()), int(ended.sum()), int(lengths.max())


def _one(model, inputs, config: GenerationConfig, seed: int) -> tuple[Any, _Timestamps, float]:
    clock = _Timestamps()
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    out = model.generate(**inputs, generation_config=config, streamer=clock)
    seconds = time.perf_counter() - t0
    return out, clock, seconds


def _device(name: str) -> torch.device:
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def run(args) -> list[Row]:
    """Run every method ``args.repeats`` times on the same inputs; returns one :class:`Row` each."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = _device(args.device)
    model, tokenizer = models.load(args.model, progress=False)
    model = model.to(device=device, dtype=getattr(torch, args.dtype)).eval()
    inputs = {k: v.to(device) for k, v in chat_batch(tokenizer, args.prompts, args.prompt_words, args.seed).items()}
    prompt = inputs["input_ids"].shape[1]
    real = inputs["attention_mask"].sum(1).float()
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    sampling = {} if args.greedy else {"temperature": args.temperature, "top_p": 1.0, "top_k": 0}
    base = {"max_new_tokens": args.new_tokens, "do_sample": not args.greedy, "num_return_sequences": args.generations,
            "eos_token_id": eos, "pad_token_id": pad, "return_dict_in_generate": True, **sampling}
    methods = _methods(args)
    if not args.no_warmup:
        small = {k: v[:2] for k, v in inputs.items()}
        for _, extra in methods:
            model.generate(**small, generation_config=GenerationConfig(**{**base, **extra, "max_new_tokens": 8,
                                                                          "num_return_sequences": 1}))
    rows: list[Row] = []
    sequences: dict[tuple[str, int], torch.Tensor] = {}  # greedy: compared with stock's
    for repeat in range(args.repeats):
        order = methods[repeat % len(methods):] + methods[:repeat % len(methods)]
        for label, extra in order:
            out, clock, seconds = _one(model, inputs, GenerationConfig(**base, **extra), args.seed + repeat)
            tokens, eos_rows, longest = _completions(out.sequences, prompt, eos)
            first = clock.first if clock.first is not None else clock.stop
            prefill = (first - clock.start) if first is not None and clock.start is not None else float("nan")
            decode = (clock.stop - first) if clock.stop is not None and first is not None else float("nan")
            n_rows = out.sequences.shape[0]
            row = Row(method=label, repeat=repeat, rows=n_rows, prompt_tokens_mean=float(real.mean()),
                      prompt_tokens_max=int(real.max()), max_new_tokens=args.new_tokens,
                      temperature=None if args.greedy else args.temperature, seconds=seconds,
                      prefill_seconds=prefill, decode_seconds=decode, tokens=tokens, eos_rows=eos_rows,
                      longest=longest,
                      decode_tokens_per_second=(tokens - n_rows) / decode if decode and decode > 0 else float("nan"))
            s = getattr(out, "speculation", None)
            if s is not None:
                fell_back = not s.draft or s.draft.startswith("none")
                row.fell_back = fell_back
                row.plan_reason = (s.plan or {}).get("reason")
                if not fell_back:
                    row.acceptance, row.tokens_per_step = s.acceptance_rate, s.tokens_per_step
                    row.draft, row.draft_budget, row.gamma = s.draft, s.draft_budget, s.gamma
                    row.draft_weights = s.draft_weights
            if args.greedy:
                sequences[label, repeat] = out.sequences.cpu()
            rows.append(row)
    stock_rows = {r.repeat: r for r in rows if r.method == "stock"}
    for r in rows:
        ref = stock_rows.get(r.repeat)
        if ref is not None:
            r.speedup = ref.seconds / r.seconds if r.seconds else None
            r.decode_speedup = ref.decode_seconds / r.decode_seconds if r.decode_seconds else None
        if args.greedy and ("stock", r.repeat) in sequences and r.method != "stock":
            r.identical_to_stock = torch.equal(sequences[r.method, r.repeat], sequences["stock", r.repeat])
    return rows


def summarize(rows: list[Row]) -> list[dict[str, Any]]:
    """Median over repeats per method, in the order the methods were given."""
    out: list[dict[str, Any]] = []
    for method in dict.fromkeys(r.method for r in rows):
        mine = [r for r in rows if r.method == method]
        merged = dataclasses.asdict(mine[0])
        for key, value in merged.items():
            values = [getattr(r, key) for r in mine]
            if isinstance(value, float) and all(isinstance(v, float) for v in values):
                merged[key] = statistics.median(values)
        merged["repeats"] = len(mine)
        out.append(merged)
    return out


def _fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format(value, spec)


def table(summary: list[dict[str, Any]]) -> str:
    head = ("| method | rows | total s | prefill s | decode s | tokens | EOS rows | decode tok/s | vs stock | "
            "decode vs stock | acceptance | tokens/step | chosen | identical |")
    lines = [head, "|" + "---|" * 14]
    for r in summary:
        if r["fell_back"]:
            chosen = f"plain decoding ({r['plan_reason']})" if r["plan_reason"] else "plain decoding"
        elif r["draft"]:
            chosen = f"{r['draft']}/{r['draft_budget']} γ={r['gamma']} {r['draft_weights']}"
        else:
            chosen = "–"
        identical = {None: "–", True: "yes", False: "NO"}[r["identical_to_stock"]]
        lines.append(
            f"| {r['method']} | {r['rows']} | {_fmt(r['seconds'], '.2f')} | {_fmt(r['prefill_seconds'], '.2f')} | "
            f"{_fmt(r['decode_seconds'], '.2f')} | {r['tokens']} | {r['eos_rows']} | "
            f"{_fmt(r['decode_tokens_per_second'], '.1f')} | {_fmt(r['speedup'], '.2f')}× | "
            f"{_fmt(r['decode_speedup'], '.2f')}× | {_fmt(r['acceptance'], '.3f')} | "
            f"{_fmt(r['tokens_per_step'], '.2f')} | {chosen} | {identical} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "python -m hf_magicdec_bench.rollouts") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.prompts < 1 or args.generations < 1 or args.new_tokens < 1 or args.repeats < 1:
        raise SystemExit("--prompts, --generations, --new-tokens and --repeats must be >= 1")
    rows = run(args)
    summary = summarize(rows)
    mode = "greedy" if args.greedy else f"temperature {args.temperature}"
    title = (f"{args.model}: {args.prompts} prompts x {args.generations} generations, up to {args.new_tokens} "
             f"new tokens, {mode}, EOS honoured, {args.dtype}")
    text = f"{title}\n\n{table(summary)}"
    print(text)
    if args.out is not None:
        from .bench.harness import environment

        args.out.mkdir(parents=True, exist_ok=True)
        env = environment(_device(args.device))
        with (args.out / "rollouts.jsonl").open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({**dataclasses.asdict(row), "model": args.model, "prompts": args.prompts,
                                    "generations": args.generations, "seed": args.seed, "dtype": args.dtype,
                                    "env": env}) + "\n")
        (args.out / "rollouts.md").write_text(text + "\n", encoding="utf-8")
        print(f"wrote {args.out / 'rollouts.jsonl'} and {args.out / 'rollouts.md'}")
    return 0 if not any(r.identical_to_stock is False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""``hf-magicdec bench --reuse-prefix N``: prefill a document once, answer N questions from copies of its cache.

The long-context pattern of ``docs/cache_reuse.md``: one batch of documents (``--batch`` x
``--context`` tokens of real text) is prefilled once into a ``DynamicCache``; every question (a short
suffix) then continues from ``copy.deepcopy`` of it, with stock ``generate`` and with MagicDec (the
first ``--draft`` / ``--budget`` / ``--gamma`` / ``--draft-weights``). Reported per question:

* ``prefill_saved_s``: time to first token of stock ``generate`` on the whole sequence without a
  cache (measured once, on the first question) minus MagicDec's from the cache;
* ``decode_speedup``: stock decode seconds / MagicDec decode seconds, both from the cache;
* whether MagicDec's tokens are identical to stock's from the same cache.

Uses the library's public API only (``speculative="magicdec"`` through ``generate``).
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from .. import data
from .harness import environment, measure
from .runner import BenchSpec, load_model, resolve_device

__all__ = ["QUESTIONS", "ReuseRow", "run_reuse", "run_reuse_and_report"]

QUESTIONS = ("\nQuestion: Who speaks first in this passage?\nAnswer:",
             "\nQuestion: Where does this scene take place?\nAnswer:",
             "\nQuestion: Summarise the passage in one sentence.\nAnswer:",
             "\nQuestion: Which names appear in the passage?\nAnswer:")


@dataclass
class ReuseRow:
    """One question of the reuse benchmark (the JSONL schema of ``reuse.jsonl``)."""

    question: int
    batch: int
    context: int
    suffix_tokens: int
    new_tokens: int
    document_prefill_s: float  # the one plain forward over the documents
    uncached_prefill_s: float  # stock time to first token without a cache (first question)
    stock_prefill_s: float
    stock_decode_s: float
    magicdec_prefill_s: float
    magicdec_decode_s: float
    prefill_saved_s: float
    decode_speedup: float
    acceptance_rate: float
    identical: bool
    label: str


def run_reuse(spec: BenchSpec, questions: int, progress: bool = True) -> tuple[list[ReuseRow], dict]:
    """Run the reuse benchmark at ``spec``'s first batch size and context; returns ``(rows, env)``."""
    device = resolve_device(spec.device)
    model, tokenizer = load_model(spec.model, spec.dtype, device)
    batch, context = spec.batches[0], spec.contexts[0]
    config = spec.configs(context)[0]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    extra = {} if spec.stop_at_eos else {"eos_token_id": None}
    documents = data.prompt_batch(tokenizer, batch, context, source=spec.text).to(device)

    def generate(ids, clock, **kwargs):
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=spec.new_tokens,
                              do_sample=False, streamer=clock, pad_token_id=pad_id, **extra, **kwargs)

    if spec.warmup:  # one-time costs (kernels, a quantized draft copy) stay out of the timings
        warm = documents[:, :32]
        generate(warm, None)
        generate(warm, None, speculative=config)
    cache, document_s = _prefill(model, documents)
    rows, uncached = [], None
    for i in range(questions):
        suffix = tokenizer(QUESTIONS[i % len(QUESTIONS)], return_tensors="pt", add_special_tokens=False).input_ids
        ids = torch.cat([documents, suffix.to(device).expand(batch, -1)], dim=1)
        if uncached is None:
            uncached = measure(lambda clock: generate(ids, clock), 1, device).prefill_s
        stock = measure(lambda clock: generate(ids, clock, past_key_values=copy.deepcopy(cache)), spec.repeats, device)
        ours = measure(lambda clock: generate(ids, clock, past_key_values=copy.deepcopy(cache), speculative=config,
                                              return_dict_in_generate=True), spec.repeats, device)
        rows.append(ReuseRow(
            question=i + 1, batch=batch, context=context, suffix_tokens=suffix.shape[1], new_tokens=spec.new_tokens,
            document_prefill_s=document_s, uncached_prefill_s=uncached, stock_prefill_s=stock.prefill_s,
            stock_decode_s=stock.decode_s, magicdec_prefill_s=ours.prefill_s, magicdec_decode_s=ours.decode_s,
            prefill_saved_s=uncached - ours.prefill_s, decode_speedup=stock.decode_s / max(ours.decode_s, 1e-9),
            acceptance_rate=ours.speculation.acceptance_rate if ours.speculation is not None else 0.0,
            identical=torch.equal(stock.sequences, ours.sequences),
            label=f"{config.draft_name}/{config.draft_budget} g{config.gamma} {config.draft_weights}",
        ))
    return rows, environment(device)


def _prefill(model, documents: torch.Tensor) -> tuple[DynamicCache, float]:
    """The documents' cache, filled by one plain forward, and its wall-clock seconds."""
    if documents.device.type == "cuda":
        torch.cuda.synchronize(documents.device)
    t0 = time.perf_counter()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=documents, past_key_values=cache, use_cache=True)
    if documents.device.type == "cuda":
        torch.cuda.synchronize(documents.device)
    return cache, time.perf_counter() - t0


def reuse_table(rows: list[ReuseRow]) -> str:
    head = (f"{'question':>8} {'suffix':>6} {'prefill saved s':>15} {'stock decode s':>14} "
            f"{'magicdec decode s':>17} {'decode speedup':>14} {'acceptance':>10} {'identical':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.question:>8} {r.suffix_tokens:>6} {r.prefill_saved_s:>15.2f} {r.stock_decode_s:>14.2f} "
                     f"{r.magicdec_decode_s:>17.2f} {r.decode_speedup:>13.2f}x {r.acceptance_rate:>10.3f} "
                     f"{'yes' if r.identical else 'NO':>9}")
    return "\n".join(lines)


def run_reuse_and_report(spec: BenchSpec, questions: int, out: Path, progress: bool = True) -> int:
    """Run :func:`run_reuse`, write ``out/reuse.jsonl``, print the table; 1 if any answer differed."""
    out.mkdir(parents=True, exist_ok=True)
    rows, env = run_reuse(spec, questions, progress=progress)
    path = out / "reuse.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({"model": spec.model, "dtype": spec.dtype, **asdict(r), "env": env}) + "\n")
    first = rows[0] if rows else None
    print(f"\nprefix reuse, {spec.model} {spec.dtype} on {env['device']}: batch {spec.batches[0]} x "
          f"{spec.contexts[0]}-token documents prefilled once"
          + (f" in {first.document_prefill_s:.2f} s (stock without a cache: {first.uncached_prefill_s:.2f} s to "
             f"first token), magicdec {first.label}" if first else ""))
    print(reuse_table(rows))
    print(f"\nrows: {path}")
    if any(not r.identical for r in rows):
        print("\nsome answers differed from stock generate from the same cache", flush=True)
        return 1
    return 0

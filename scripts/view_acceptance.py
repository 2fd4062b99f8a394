"""Acceptance and decode time of draft views on one workload (SmolLM2-135M, real text, greedy).

    python scripts/view_acceptance.py 8 256 512 128 3 streamingllm snapkv attended    # long generation
    python scripts/view_acceptance.py 8 4096 128 256 3 snapkv attended:page_size=8 snapkv --draft-weights int8

Arguments: batch, prompt tokens, new tokens, draft budget, γ (an int or ``auto``), then the views,
each a name with optional ``:option=value`` view options (``attended:every=1:page_size=8``);
``--draft-weights full|int8|fp16`` (default full). The prompts are prefilled once
(``hf_magicdec.shared_prefill``) and every view decodes from a copy of that cache, EOS ignored,
checked token for token against plain decoding on MagicDec's cache (``gamma=0``, itself identical
to stock ``generate`` in fp32: the test suite's claim); prints acceptance, decode / draft / verify /
other seconds, steps and row-steps (each row's steps, summed: a step costs less once rows have
finished and left the batch) and whether the tokens were identical. One run per view, no rounds:
list a view twice (first and last) to see this machine's drift; ``hf-magicdec bench --rounds``
times properly.

``--prompt-sets N`` (default 1) repeats the comparison on N disjoint batches of prompts (set ``k``:
the text's chunks ``k*batch .. (k+1)*batch - 1``, the views in reverse order on odd sets) and ends
with each view's steps, acceptance and decode seconds summed over the sets; ``--first-set K``
(default 0) starts at set ``K``, so that a second run decodes other prompts than the first. Which view takes fewer
steps on one batch can turn on rounding: the step count is the slowest row's, and a change of
1e-7 in the verify attention's sums moved ``attended`` from 42 to 46 steps at 8 x 4K -> 128.
"""

import sys
import warnings

import torch

import hf_magicdec
from hf_magicdec_bench import data, models

warnings.simplefilter("ignore")


def _view(spec: str) -> tuple[str, dict]:
    """``name[:option=value...]`` -> (name, options); values are ints, floats or strings."""
    name, *options = spec.split(":")
    parsed = {}
    for option in options:
        key, _, value = option.partition("=")
        for kind in (int, float):
            try:
                parsed[key] = kind(value)
                break
            except ValueError:
                continue
        else:
            parsed[key] = value
    return name, parsed


def _option(argv: list[str], name: str, default: str) -> tuple[str, list[str]]:
    """The value after ``name`` in ``argv`` (or ``default``) and ``argv`` without the pair."""
    if name not in argv:
        return default, argv
    i = argv.index(name)
    return argv[i + 1], argv[:i] + argv[i + 2:]


def main(argv: list[str]) -> None:
    weights, argv = _option(argv, "--draft-weights", "full")
    sets, argv = _option(argv, "--prompt-sets", "1")
    first, argv = _option(argv, "--first-set", "0")
    sets, first = int(sets), int(first)
    if len(argv) < 6 or sets < 1 or first < 0:
        sys.exit(__doc__)
    batch, prompt, new, budget = (int(x) for x in argv[:4])
    gamma = argv[4] if argv[4] == "auto" else int(argv[4])
    specs = argv[5:]
    model, tok = models.load("smollm2-135m", progress=False)
    prompts = data.prompt_batch(tok, batch * (first + sets), prompt)
    totals: dict[str, list[float]] = {}  # spec -> [runs, steps, row-steps, summed acceptance, decode s]
    for k in range(first, first + sets):
        ids = prompts[k * batch:(k + 1) * batch]
        label = f"{batch}x{prompt}->{new}" + (f" set {k}" if sets > 1 or first else "")
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                  eos_token_id=None, pad_token_id=0)
        with torch.inference_mode(), hf_magicdec.shared_prefill():
            ref = model.generate(**kw, speculative="magicdec", draft="streamingllm", draft_budget=budget, gamma=0,
                                 return_dict_in_generate=True)
            print(f"{label} plain (gamma=0): decode {ref.speculation.decode_seconds:.2f} s", flush=True)
            for spec in (specs if k % 2 == 0 else specs[::-1]):
                draft, options = _view(spec)
                out = model.generate(**kw, speculative="magicdec", draft=draft, draft_budget=budget, gamma=gamma,
                                     draft_weights=weights, return_dict_in_generate=True, **options)
                s = out.speculation
                other = s.decode_seconds - s.draft_seconds - s.verify_seconds
                row_steps = sum(len(row) for row in s.accepted_lengths)  # a step costs less as rows finish
                print(f"{label} {spec}/{budget} gamma {gamma} {weights}: acceptance "
                      f"{s.acceptance_rate:.3f}, decode {s.decode_seconds:.2f} s (draft {s.draft_seconds:.2f}, verify "
                      f"{s.verify_seconds:.2f}, other {other:.2f}; {s.steps} steps, {row_steps} row-steps), identical "
                      f"{torch.equal(out.sequences, ref.sequences)}", flush=True)
                for i, value in enumerate((1, s.steps, row_steps, s.acceptance_rate, s.decode_seconds)):
                    totals.setdefault(spec, [0, 0, 0, 0.0, 0.0])[i] += value
    if sets > 1:
        for spec, (runs, steps, row_steps, acceptance, seconds) in totals.items():
            print(f"{spec} over {runs} runs ({sets} sets): {steps} steps, {row_steps} row-steps, mean acceptance "
                  f"{acceptance / runs:.3f}, decode {seconds:.2f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

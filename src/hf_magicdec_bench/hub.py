"""``hf-magicdec export-hub DIR``: MagicDec as a transformers-native ``custom_generate`` repository.

transformers runs decoding methods that live outside its core from a repository holding
``custom_generate/generate.py`` (and ``custom_generate/requirements.txt``)::

    model.generate(**inputs, custom_generate="your-name/magicdec", trust_remote_code=True)   # or a local DIR

:func:`export` writes that layout: ``generate.py`` imports ``hf_magicdec`` and hands the call to
``hf_magicdec.generate`` (through the library's own ``speculative=`` routing, so every keyword behaves
as on the import path), ``requirements.txt`` names the package, and ``README.md`` is a model card
with the ``custom_generate`` tag. With a model (``--model``), the folder also holds its weights,
tokenizer and a ``generation_config.json`` carrying the defaults; ``from_pretrained(DIR,
trust_remote_code=True)`` then replaces that model's ``generate`` with MagicDec's.

The exported ``generate.py`` runs MagicDec with the defaults it was exported with unless the call
(``speculative=``, a ``generation_config`` with a ``speculative`` entry) or the model's generation
config says otherwise. Nothing needs ``import hf_magicdec`` first: loading ``generate.py`` imports
it, which installs the library's ``speculative=`` routing for the process as the import always
does (transformers' own import check of ``generate.py`` imports it too); from then on
``speculative=`` works on every model of the process, and a plain call (no ``custom_generate=``)
decodes as stock ``generate`` does unless the model's generation config asks for MagicDec.
"""

from __future__ import annotations

import argparse
import json
import pprint
import sys
from pathlib import Path
from typing import Any

from hf_magicdec import MagicDecConfig, __version__

#: Where users get the package (it is not on PyPI yet).
INSTALL = "pip install git+https://github.com/hf-magicdec/hf-magicdec"

#: ``custom_generate/requirements.txt``: transformers checks each line against the installed
#: distributions (``name<op>version``, one comparison per line) before it runs ``generate.py``.
REQUIREMENTS = f"hf-magicdec>={__version__}\n"

GENERATE_PY = '''\
"""MagicDec (lossless self-speculative decoding) as a transformers ``custom_generate`` method.

Written by ``hf-magicdec export-hub`` (hf-magicdec {version}); needs the ``hf-magicdec`` package
({install}). Use::

    model.generate(**inputs, custom_generate="<this repository or folder>", trust_remote_code=True,
                   max_new_tokens=256)

Every keyword of ``model.generate(..., speculative="magicdec")`` works here (``draft=``,
``draft_budget=``, ``gamma=``, ``streamer=``, ``return_dict_in_generate=True`` ...). The call runs
MagicDec with ``SPECULATIVE`` below unless a generation config (the call's, else the model's)
carries a ``speculative`` entry. To decode plainly, leave ``custom_generate=`` out; a model loaded
from this repository with ``trust_remote_code=True`` (whose ``generate`` is this function) takes
``speculative=None`` for that.
"""

import hf_magicdec  # also installs its speculative= routing in this process, as `import hf_magicdec` does

#: The defaults this repository was exported with (``hf_magicdec.MagicDecConfig`` fields; "auto":
#: hf-magicdec's planner chooses per call).
SPECULATIVE = {speculative}

# GenerationMixin.generate's named parameters, all None by default: transformers hands them to a
# custom_generate repository even when the caller did not set them.
_GENERATE_PARAMETERS = (
    "inputs", "generation_config", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
    "synced_gpus", "assistant_model", "streamer", "negative_prompt_ids", "negative_prompt_attention_mask",
)


def _stored(model, generation_config):
    for config in (generation_config, getattr(model, "generation_config", None)):
        spec = getattr(config, "speculative", None) if config is not None else None
        if spec is not None:
            return spec
    return None


def generate(*args, model=None, **kwargs):
    """``model.generate(custom_generate=...)`` and ``from_pretrained(..., trust_remote_code=True)``
    call this with ``model=``; the call goes to ``hf_magicdec.generate`` through hf-magicdec's
    ``speculative=`` routing (switched on for this call if ``HF_MAGICDEC_NO_PATCH=1`` kept it off)."""
    if model is None:
        if not args:
            raise TypeError("generate() needs the model")
        model, args = args[0], args[1:]
    for name in _GENERATE_PARAMETERS:
        if name in kwargs and kwargs[name] is None:
            del kwargs[name]
    if "speculative" in kwargs:
        speculative = kwargs.pop("speculative")
    else:
        speculative = _stored(model, kwargs.get("generation_config"))
        if speculative is None:
            speculative = dict(SPECULATIVE)
    routed = hf_magicdec.is_enabled()
    if not routed:  # route this call only
        hf_magicdec.enable()
    try:
        # The class's generate, not model.generate: from_pretrained(trust_remote_code=True) sets the
        # instance attribute to this very function.
        return type(model).generate(model, *args, speculative=speculative, **kwargs)
    finally:
        if not routed:
            hf_magicdec.disable()
'''

CARD = """\
---
library_name: transformers
{base_model_line}tags:
- custom_generate
- speculative-decoding
- magicdec
- hf-magicdec
---

# {title}

Lossless self-speculative decoding ([MagicDec](https://arxiv.org/abs/2408.11049), via
[hf-magicdec](https://github.com/hf-magicdec/hf-magicdec)) as a transformers
[`custom_generate`](https://huggingface.co/docs/transformers/generation_strategies) method.
At long context and large batch the model drafts tokens while attending to a small compressed view
of its own KV cache, then verifies them in one pass over the full cache: greedy outputs are
token-identical to plain `generate` and sampled outputs follow the same distribution. With the
defaults, hf-magicdec's planner decides per call whether speculation pays (it decodes plainly for
short prompts and small batches).

## Usage

`{install}`, then, with any supported decoder-only model (Llama, Mistral, Qwen2, ...):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{model_id}")
tokenizer = AutoTokenizer.from_pretrained("{model_id}", padding_side="left")
inputs = tokenizer(["<a long document> ..."], return_tensors="pt", padding=True)
out = model.generate(**inputs, custom_generate="{repo_id}", trust_remote_code=True,
                     max_new_tokens=256, return_dict_in_generate=True)
print(tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print(out.speculation.summary())  # draft view, budget, gamma, acceptance rate, tokens per step
```
{model_usage}
No `import hf_magicdec` is needed: `custom_generate/generate.py` imports it and hands the call to
`hf_magicdec.generate`. Every keyword of `speculative="magicdec"` works here: `draft=`,
`draft_budget=`, `gamma=` override the defaults for one call, `speculative=None` decodes plainly,
`streamer=` streams. transformers checks `custom_generate/requirements.txt` (`{requirement}`)
before it runs the code.

## Defaults

`custom_generate/generate.py`, `SPECULATIVE` (a call's `speculative=`, or a `speculative` entry in
the generation config, takes precedence):

```json
{speculative}
```

Fields left `"auto"` are chosen per call by hf-magicdec's planner from the batch size, the prompt
length and the device.

## Files

- `custom_generate/generate.py`: the `generate(model, ...)` function transformers loads;
- `custom_generate/requirements.txt`: `{requirement}`;
{model_files}"""

MODEL_USAGE = """
This repository also holds the model itself, with the defaults in its `generation_config.json`:
loading it with `trust_remote_code=True` makes a plain `generate` run MagicDec.

```python
model = AutoModelForCausalLM.from_pretrained("{repo_id}", trust_remote_code=True)
out = model.generate(**inputs, max_new_tokens=256)   # MagicDec, no custom_generate= needed
```
"""

MODEL_FILES = ("- the model (`config.json`, weights, tokenizer) and `generation_config.json` with a "
               "`speculative` entry (read by `generate.py` and by `import hf_magicdec`).\n")


def generate_py(speculative: dict) -> str:
    """The text of ``custom_generate/generate.py`` with these defaults."""
    defaults = pprint.pformat(speculative, sort_dicts=False, width=100)
    return GENERATE_PY.format(version=__version__, install=INSTALL, speculative=defaults)


def model_card(repo_id: str, speculative: dict, *, base_model: str | None = None, title: str | None = None,
               with_model: bool = False, model_id: str | None = None, install: str = INSTALL) -> str:
    """``README.md`` of an exported repository (tag ``custom_generate``)."""
    model_id = repo_id if with_model else (model_id or base_model or "HuggingFaceTB/SmolLM2-135M-Instruct")
    return CARD.format(
        base_model_line=f"base_model: {base_model}\n" if base_model else "",
        title=title or repo_id, install=install, model_id=model_id, repo_id=repo_id,
        model_usage=MODEL_USAGE.format(repo_id=repo_id) if with_model else "",
        requirement=REQUIREMENTS.strip(), speculative=json.dumps(speculative, indent=2),
        model_files=MODEL_FILES if with_model else "",
    )


def speculative_defaults(speculative: Any = "magicdec", **options: Any) -> dict:
    """``MagicDecConfig.from_any(speculative, **options).to_dict()``: validated, JSON-able."""
    return MagicDecConfig.from_any(speculative, **options).to_dict()


def write_custom_generate(out: str | Path, speculative: dict) -> Path:
    """Write ``out/custom_generate/{generate.py, requirements.txt}``; returns the folder."""
    folder = Path(out) / "custom_generate"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generate.py").write_text(generate_py(speculative), encoding="utf-8")
    (folder / "requirements.txt").write_text(REQUIREMENTS, encoding="utf-8")
    return folder


def export(out: str | Path, *, model=None, tokenizer=None, repo_id: str | None = None,
           base_model: str | None = None, speculative: Any = "magicdec", card: bool = True,
           **options: Any) -> Path:
    """Write a ``custom_generate`` repository to ``out``: the code, its requirements, a model card.

    Parameters
    ----------
    out : the folder (created; files in it are overwritten).
    model, tokenizer : optional; saved into ``out`` too, ``model`` with the defaults in its
        ``generation_config.json`` (``hf_magicdec.set_default_speculation``).
    repo_id : the Hub id named in the card (default ``your-name/<folder name>``).
    base_model : the Hub id of the model the card names (its ``base_model`` field).
    speculative, **options : the defaults (``MagicDecConfig`` fields and view options; fields not
        given stay ``"auto"``).
    card : write ``README.md``.
    """
    import hf_magicdec

    out = Path(out)
    spec = speculative_defaults(speculative, **options)
    out.mkdir(parents=True, exist_ok=True)
    if model is not None:
        hf_magicdec.set_default_speculation(model, spec)
        model.save_pretrained(out)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
    write_custom_generate(out, spec)
    if card:
        repo_id = repo_id or f"your-name/{out.resolve().name}"
        text = model_card(repo_id, spec, base_model=base_model, with_model=model is not None)
        (out / "README.md").write_text(text, encoding="utf-8")
    return out


# ---------------------------------------------------------------------------------------- CLI
def build_parser(prog: str = "hf-magicdec export-hub") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", metavar="DIR", help="folder to write (created; existing files are overwritten)")
    ap.add_argument("--model", default=None,
                    help="also save this model (offline name, local dir or Hub id) with the defaults in its "
                         "generation_config.json; default: the custom_generate code and card only")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="with --model: the dtype to save it in")
    ap.add_argument("--draft", default=None, help="default draft view: streamingllm | snapkv | ... (default: auto)")
    ap.add_argument("--budget", type=int, default=None, help="default draft budget (default: auto)")
    ap.add_argument("--gamma", type=int, default=None, help="default draft tokens per step (default: auto)")
    ap.add_argument("--repo-id", default=None, help="Hub id named in the model card (default: your-name/<DIR name>)")
    ap.add_argument("--base-model", default=None, help="base_model field of the card (default: the model's Hub id)")
    ap.add_argument("--push-to-hub", metavar="REPO_ID", default=None,
                    help="upload the folder to this Hub repository (needs a huggingface_hub login and network)")
    ap.add_argument("--private", action="store_true", help="with --push-to-hub: create a private repository")
    ap.add_argument("--quiet", action="store_true", help="print nothing but errors")
    return ap


def main(argv: list[str] | None = None, prog: str = "hf-magicdec export-hub") -> int:
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    options = {k: v for k, v in (("draft", args.draft), ("draft_budget", args.budget), ("gamma", args.gamma))
               if v is not None}
    try:
        speculative_defaults(**options)  # validate before loading anything
    except (ValueError, TypeError) as exc:
        ap.error(str(exc))
    model = tokenizer = None
    base_model = args.base_model
    if args.model:
        import torch

        from . import models

        model, tokenizer = models.load(args.model, dtype=getattr(torch, args.dtype), progress=not args.quiet)
        known = models.KNOWN_MODELS.get(args.model.strip().lower())
        base_model = base_model or (known.hub_id if known else args.model)
    repo_id = args.repo_id or args.push_to_hub
    out = export(args.out, model=model, tokenizer=tokenizer, repo_id=repo_id, base_model=base_model, **options)
    if not args.quiet:
        files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
        print(f"wrote {out}: " + ", ".join(files))
        print(f"use: model.generate(**inputs, custom_generate={str(out)!r}, trust_remote_code=True)")
    if args.push_to_hub:
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(args.push_to_hub, private=args.private, exist_ok=True)
        api.upload_folder(repo_id=args.push_to_hub, folder_path=str(out))
        if not args.quiet:
            print(f"uploaded to https://huggingface.co/{args.push_to_hub}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The bench's progress bar shows the prefill (stock ``generate`` and MagicDec's chunked prefill
alike), then the decode, and leaves no hook behind (decode is timed without them)."""

from __future__ import annotations

import io

import torch
from tqdm import tqdm
from torch.nn.modules import module as torch_module

from hf_magicdec import MagicDecConfig
from hf_magicdec_bench.bench.harness import measure

from conftest import make_model, ragged_prompts

NEW = 6


class Recording(tqdm):
    """A tqdm bar that remembers (description, n, total) after every update."""

    def __init__(self, *args, **kwargs):
        self.seen = []
        super().__init__(*args, file=io.StringIO(), **kwargs)

    def update(self, n=1):
        out = super().update(n)
        self.seen.append((self.desc, self.n, self.total))
        return out


def _run(model, ids, mask, **kwargs):
    bars = []

    def factory():
        bars.append(Recording(total=NEW, desc="  method", unit="tok", leave=False))
        return bars[-1]

    def run(clock):
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, streamer=clock,
                              eos_token_id=None, **kwargs)

    m = measure(run, 1, torch.device("cpu"), factory)
    return m, bars[0]


def _no_hooks_left(model):
    assert not torch_module._global_forward_pre_hooks
    assert all(not m._forward_hooks for m in model.modules())


def test_stock_and_magicdec_prefill_move_the_bar():
    model = make_model("llama-gqa3", layers=2)
    ids, mask = ragged_prompts(batch=2, length=40, seed=1)
    prompt = ids.numel()  # all rows' prompt tokens
    results = {}
    for name, kwargs in (("stock", {}),
                         ("magicdec", dict(speculative=MagicDecConfig.from_any(draft="streamingllm", draft_budget=16,
                                                                      sink_tokens=2, gamma=2, prefill_chunk_size=8),
                                           return_dict_in_generate=True))):
        m, bar = _run(model, ids, mask, **kwargs)
        prefill = [n for desc, n, total in bar.seen if desc.endswith("prefill") and total == prompt]
        assert prefill and prefill[-1] == prompt, (name, bar.seen)  # the whole prompt went through
        assert prefill == sorted(prefill) and len(set(prefill)) >= 2, (name, prefill)  # layer by layer, monotone
        decode = [(desc, n, total) for desc, n, total in bar.seen if not desc.endswith("prefill")]
        assert decode and all(d == "  method" and t == NEW for d, _, t in decode)  # restored for the decode
        assert bar.n == NEW and bar.unit == "tok"
        _no_hooks_left(model)
        results[name] = m.sequences
    assert torch.equal(results["stock"], results["magicdec"])


def test_a_failing_generate_leaves_no_hooks():
    model = make_model("llama-gqa3", layers=2)
    ids, mask = ragged_prompts(batch=1, length=12, seed=2)

    def run(clock):
        clock.put(ids)  # the prompt: hooks installed
        raise RuntimeError("boom")

    try:
        measure(run, 1, torch.device("cpu"), lambda: Recording(total=NEW, desc="x", leave=False))
    except RuntimeError:
        pass
    _no_hooks_left(model)


def test_no_bar_no_hooks():
    """Without a progress bar (--quiet) nothing is hooked at all."""
    model = make_model("llama-gqa3", layers=2)
    ids, mask = ragged_prompts(batch=1, length=12, seed=3)
    seen = []
    handle = torch_module.register_module_forward_pre_hook(lambda mod, args: seen.append(len(mod._forward_hooks)))
    try:
        measure(lambda clock: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                                             streamer=clock), 1, torch.device("cpu"))
    finally:
        handle.remove()
    assert seen and not any(seen)

"""One device→host read per speculation step on the default path (greedy, EOS, no processors or
criteria of the user's): what a GPU pays a pipeline stall for. Counted by wrapping the Tensor
methods that read device memory on the host (``item``, ``tolist``, ``__bool__``, ``__int__``,
``nonzero``); on a GPU ``torch.cuda.set_sync_debug_mode`` would flag the same places."""

from __future__ import annotations

import contextlib

import torch

from conftest import EOS, make_model, ragged_prompts

_READS = ("item", "tolist", "__bool__", "__int__", "nonzero")


@contextlib.contextmanager
def counting_host_reads():
    counts = {"n": 0}
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def wrap(original):
        def counted(self, *args, **kwargs):
            counts["n"] += 1
            return original(self, *args, **kwargs)
        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _reads_and_steps(model, max_new_tokens: int, **options):
    ids, mask = ragged_prompts(batch=4, length=24, seed=1)
    with counting_host_reads() as counts:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=EOS, speculative="magicdec", return_dict_in_generate=True, **options)
    return counts["n"], out.speculation.steps, out


def test_one_host_read_per_step():
    model = make_model("llama-gqa3")
    options = dict(draft="streamingllm", draft_budget=12, sink_tokens=2, gamma=3)
    short_reads, short_steps, _ = _reads_and_steps(model, 20, **options)
    long_reads, long_steps, out = _reads_and_steps(model, 60, **options)
    assert long_steps > short_steps + 5
    # Per step: exactly one read (rows alive and longest rows, packed); the rest is per generation.
    assert long_reads - short_reads == long_steps - short_steps, (short_reads, short_steps, long_reads, long_steps)
    assert long_reads <= long_steps + 16, (long_reads, long_steps)
    # Statistics are complete although they were read once, at the end.
    assert sum(len(a) for a in out.speculation.accepted_lengths) > long_steps  # several rows per step
    assert all(len(a) == len(g) for a, g in zip(out.speculation.accepted_lengths, out.speculation.row_gammas))

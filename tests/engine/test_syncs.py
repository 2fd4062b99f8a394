"""One device→host read per speculation step on the default path (greedy or sampling with
temperature / top-k / top-p, with or without an EOS token, fixed or adaptive γ, no processors or
criteria of the user's): what a GPU pays a pipeline stall for. Counted by wrapping the Tensor
methods that read device memory on the host (``item``, ``tolist``, ``__bool__``, ``__int__``,
``nonzero``); on a GPU ``torch.cuda.set_sync_debug_mode`` would flag the same places.

Options that add reads (docs/kernels.md, "Host reads"): logits processors that depend on the tokens
(repetition penalty, n-gram bans …: one call per distinct row length; ``min_length`` and
``min_new_tokens`` are applied on the device), stopping criteria of the user's and
``stop_strings``, ``refresh_every`` / ``refresh_below``, ``output_scores`` / ``output_logits`` and
a streamer (per emitted token)."""

from __future__ import annotations

import contextlib

import pytest
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
    options = {"do_sample": False, "eos_token_id": EOS, **options}
    torch.manual_seed(0)
    with counting_host_reads() as counts:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             speculative="magicdec", return_dict_in_generate=True, **options)
    return counts["n"], out.speculation.steps, out


CASES = {
    "fixed γ, EOS": dict(gamma=3),
    "fixed γ, no EOS": dict(gamma=3, eos_token_id=None),  # stock's no-EOS stopping rule, on the device
    "adaptive γ, EOS": dict(gamma="auto", adaptive_gamma=True),  # the accepted count rides in the step's read
    "adaptive γ, no EOS": dict(gamma="auto", adaptive_gamma=True, eos_token_id=None),
    "sampling": dict(gamma=3, do_sample=True, temperature=0.8, top_k=20, top_p=0.9),  # row-local warpers
    "int8 draft weights": dict(gamma=3, draft_weights="int8"),
    # Length-dependent processors transformers ships, each position checked against its own length.
    "min_new_tokens and min_length": dict(gamma=3, min_new_tokens=12, min_length=30),
    # The verification-guided view re-chooses its static part after every verification, masked.
    "attended, adaptive γ": dict(draft="attended", draft_budget=24, page_size=4, recent_window=6,
                                 gamma="auto", adaptive_gamma=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_host_read_per_step(monkeypatch, case):
    import hf_magicdec.api

    model = make_model("llama-gqa3")
    options = {"draft": "streamingllm", "draft_budget": 12, "sink_tokens": 2, "draft_weights": "full", **CASES[case]}
    # Without the cache hand-back (once per generation, counted below), so that the difference
    # between a short and a long run is the per-step reads alone; a first call builds what later
    # calls reuse (a quantized draft), once per model.
    monkeypatch.setattr(hf_magicdec.api, "outlives_call", lambda cache, gen: False)
    _reads_and_steps(model, 4, **options)
    short_reads, short_steps, _ = _reads_and_steps(model, 20, **options)
    long_reads, long_steps, out = _reads_and_steps(model, 60, **options)
    assert long_steps > short_steps + 5
    # Per step: exactly one read (rows alive and longest rows, packed); the rest is per generation.
    assert long_reads - short_reads == long_steps - short_steps, (short_reads, short_steps, long_reads, long_steps)
    assert long_reads <= long_steps + 16, (long_reads, long_steps)
    # Statistics are complete although they were read once, at the end.
    assert sum(len(a) for a in out.speculation.accepted_lengths) > long_steps  # several rows per step
    assert all(len(a) == len(g) for a, g in zip(out.speculation.accepted_lengths, out.speculation.row_gammas))


def test_returning_the_cache_costs_reads_per_generation_not_per_step(monkeypatch):
    """Handing the cache back (return_dict_in_generate) reads the device a bounded number of
    times: when rows leave the batch and once at the end (the tail forward of rows that ended
    early included), whatever the number of steps."""
    import hf_magicdec.api

    model = make_model("llama-gqa3")
    options = dict(draft="streamingllm", draft_budget=12, sink_tokens=2, gamma=3)
    with_cache, steps, out = _reads_and_steps(model, 60, **options)
    assert out.past_key_values is not None
    monkeypatch.setattr(hf_magicdec.api, "outlives_call", lambda cache, gen: False)
    without, same_steps, _ = _reads_and_steps(model, 60, **options)
    assert same_steps == steps
    assert 0 <= with_cache - without <= 4 + 4 * 2, (with_cache, without)  # 4 rows

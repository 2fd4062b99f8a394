"""Rows that finish before the others: dropped from the working batch (the cache compacted) only
when the copy costs less than carrying them for the steps left, kept as dead rows otherwise.
Either way the output is stock ``generate``'s."""

from __future__ import annotations

import pytest
import torch

from hf_magicdec.engine import loop
from hf_magicdec.engine.cache import MagicDecCache

from conftest import make_model, ragged_prompts


@pytest.mark.parametrize("alive, dead, room, gamma, pays", [
    (7, 1, 8, 3, False),     # two steps left at most: carrying one row is cheaper than copying seven
    (7, 1, 60, 3, True),     # 15 steps left: copying seven rows once is cheaper
    (7, 1, 56, 3, False),    # exactly 14 steps: a tie keeps them
    (1, 7, 4, 3, True),      # one row left: its copy is cheap, carrying seven is not
    (4, 4, 0, 0, False),     # nothing left to emit
    (4, 4, 3, 0, True),      # plain steps: 3 steps of 4 dead rows > 2 x 4
])
def test_compaction_pays_when_the_copy_is_cheaper_than_the_steps_left(alive, dead, room, gamma, pays):
    assert loop.compaction_pays(alive, dead, room, gamma) is pays


def test_handing_the_cache_back_makes_dropping_dearer():
    """Exporting the dropped rows' KV (the cache is returned) is one more copy, of the dead rows."""
    assert loop.compaction_pays(4, 4, 12, 3)  # 3 steps x 4 rows > 8
    assert not loop.compaction_pays(4, 4, 12, 3, export=True)  # 12 <= 8 + 8
    assert loop.compaction_pays(4, 4, 20, 3, export=True)  # 5 steps x 4 rows > 16


def _spy_compactions(monkeypatch):
    sizes = []
    original = MagicDecCache.select_rows

    def spy(self, rows, *args, **kwargs):
        sizes.append(int(rows.shape[0]))
        return original(self, rows, *args, **kwargs)

    monkeypatch.setattr(MagicDecCache, "select_rows", spy)
    return sizes


@pytest.mark.parametrize("rule", ["default", "always", "never"])
def test_rows_finishing_apart_give_stock_tokens_whether_dropped_or_carried(monkeypatch, rule):
    """Ragged prompts, a compressed view and γ 4: rows accept at different rates and reach
    ``max_new_tokens`` steps apart. Compacting at every finish, never, or by the rule: the same
    tokens and the same handed-back cache as stock ``generate``; the default carries some of the rows that finish near the cap."""
    model = make_model("llama-gqa3")
    ids, mask = ragged_prompts(batch=6, length=32, seed=3)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=None,
              pad_token_id=0)
    reference = model.generate(**kw, return_dict_in_generate=True)
    decisions, rule_of = [], loop.compaction_pays

    def decide(*args):
        decisions.append(rule_of(*args) if rule == "default" else rule == "always")
        return decisions[-1]

    monkeypatch.setattr(loop, "compaction_pays", decide)
    sizes = _spy_compactions(monkeypatch)
    out = model.generate(**kw, speculative="magicdec", draft="streamingllm", draft_budget=12, sink_tokens=2,
                         gamma=4, return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference.sequences)
    for stock, ours in zip(reference.past_key_values.layers, out.past_key_values.layers):  # handed back alike
        torch.testing.assert_close(ours.keys, stock.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours.values, stock.values, atol=1e-4, rtol=1e-4)
    finished_apart = len({len(a) for a in out.speculation.accepted_lengths}) > 1  # rows took different step counts
    assert finished_apart, "test setup: every row finished on the same step"
    assert len(sizes) == sum(decisions)  # the cache is compacted exactly when the rule says so
    if rule == "always":
        assert sizes and all(s < ids.shape[0] for s in sizes)
    elif rule == "never":
        assert decisions and sizes == []
    else:  # near the cap some drops cost more than the few steps left to carry the rows
        assert False in decisions


def test_a_row_stopped_by_eos_far_from_the_cap_is_dropped(monkeypatch):
    """A row that ends at EOS with most of ``max_new_tokens`` left is dropped (the copy pays);
    tokens still stock's."""
    model = make_model("llama-gqa3")
    ids, mask = ragged_prompts(batch=4, length=24, seed=5)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=120, do_sample=False, pad_token_id=0)
    plain = model.generate(**kw, eos_token_id=None)[:, ids.shape[1]:]
    eos = int(plain[0, 3])  # row 0 emits it 4 tokens in; some other row must not emit it early
    assert any(eos not in row[:60].tolist() for row in plain[1:]), "test setup: EOS early in every row"
    reference = model.generate(**kw, eos_token_id=eos)
    sizes = _spy_compactions(monkeypatch)
    out = model.generate(**kw, eos_token_id=eos, speculative="magicdec", draft="streamingllm", draft_budget=12,
                         sink_tokens=2, gamma=2)
    assert torch.equal(out, reference)
    assert sizes and sizes[0] < ids.shape[0]

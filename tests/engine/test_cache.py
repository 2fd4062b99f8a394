"""Unit tests of MagicDecCache: ragged writes, commit / rollback, draft views, row removal."""

from __future__ import annotations

import pytest
import torch

from hf_magicdec import MagicDecConfig
from hf_magicdec.engine.cache import MagicDecCache
from hf_magicdec.views import snapkv_scores

B, HKV, D = 3, 2, 4


def _slot_keys(batch, heads, start, length, row_offset=1000):
    """Keys whose first feature encodes (row, slot): easy to read back."""
    slot = torch.arange(start, start + length, dtype=torch.float32)
    k = torch.zeros(batch, heads, length, D)
    k[..., 0] = slot + row_offset * torch.arange(batch, dtype=torch.float32)[:, None, None]
    return k


def _prefilled(prompt=20, pad=(0, 5, 12), layers=2, capacity=64):
    cache = MagicDecCache(layers, B, capacity, torch.tensor(pad))
    cache.begin_prefill(0, prompt)
    for layer in range(layers):
        k = _slot_keys(B, HKV, 0, prompt)
        cache.update(k, k.clone(), layer)
    cache.end_prefill(prompt)
    return cache


def _slots(t):
    """Decode (row, slot) encoded keys back into slots: [B, H, S]."""
    return (t[..., 0] - 1000 * torch.arange(t.shape[0])[:, None, None]).long()


def test_update_outside_engine_refuses():
    cache = MagicDecCache(1, 1, 8, torch.zeros(1, dtype=torch.long))
    with pytest.raises(RuntimeError, match="outside a MagicDec step"):
        cache.update(torch.zeros(1, 1, 1, D), torch.zeros(1, 1, 1, D), 0)


def test_verify_writes_ragged_rows_and_rollback_is_o1():
    cache = _prefilled()
    cache.begin_verify(5)  # rows at different offsets: commit 0, 2 and 5 verified tokens first
    for layer in range(2):
        cache.update(torch.zeros(B, HKV, 5, D), torch.zeros(B, HKV, 5, D), layer)
    cache.commit(torch.tensor([0, 2, 5]))
    assert cache.lengths.tolist() == [20, 22, 25] and cache.max_length() == 25
    cache.begin_verify(3)
    k = torch.full((B, HKV, 3, D), 7.0)
    keys, _ = cache.update(k, k, 0)
    assert keys.shape[2] == 28  # max length + q
    for b, start in enumerate([20, 22, 25]):
        assert (cache.layers[0].keys[b, :, start : start + 3] == 7.0).all()
    cache.commit(torch.tensor([1, 0, 3]))
    assert cache.lengths.tolist() == [21, 22, 28] and cache.max_length() == 28
    # Rolled-back slots are simply overwritten by the next verify.
    cache.begin_verify(1)
    cache.update(torch.full((B, HKV, 1, D), 9.0), torch.zeros(B, HKV, 1, D), 0)
    assert (cache.layers[0].keys[1, :, 22] == 9.0).all()


def test_streamingllm_view_holds_sinks_and_recent_window():
    cache = _prefilled(prompt=20, pad=(0, 5, 12))
    config = MagicDecConfig.from_any(draft="streamingllm", draft_budget=10, sink_tokens=3, gamma=2)
    cache.build_draft_views(config.view, config.draft_budget, config.gamma, 20, max_new_tokens=8)
    valid = cache.geometry.valid()
    for b, pad in enumerate([0, 5, 12]):
        slots = _slots(cache.layers[1].draft_keys)[b, 0, :10].tolist()
        # sinks = first 3 real tokens, window = last 7 (row 2 has only 8 real tokens: all kept).
        n = 20 - pad
        if n >= 10:
            expected = list(range(pad, pad + 3)) + list(range(13, 20))
            assert sorted(slots) == expected and valid[b].all()
        else:
            assert sorted(s for s, v in zip(slots, valid[b].tolist()) if v) == list(range(pad, 20))


def test_rolling_window_evicts_and_budget_stays_fixed():
    cache = _prefilled(prompt=20, pad=(0, 0, 0), capacity=80)
    config = MagicDecConfig.from_any(draft="streamingllm", draft_budget=8, sink_tokens=2, gamma=3)
    cache.build_draft_views(config.view, config.draft_budget, config.gamma, 20, max_new_tokens=40)
    for step in range(10):
        cache.begin_verify(4)
        start = cache.lengths.clone()
        for layer in range(2):
            k = torch.stack([_slot_keys(1, HKV, int(s), 4)[0] + 1000 * b for b, s in enumerate(start.tolist())])
            cache.update(k, k, layer)
        cache.commit(torch.tensor([4, 1, 2]))
    view = _slots(cache.layers[0].draft_keys)[:, 0, :8]
    assert cache.geometry.valid().sum(1).tolist() == [8, 8, 8]
    for b in range(B):
        length = int(cache.lengths[b])
        assert sorted(view[b].tolist()) == [0, 1] + list(range(length - 6, length))


def _snapkv_reference(queries, keys, valid, scaling, kernel):
    """Loop-by-loop SnapKV: per query head, window query, softmax over allowed keys."""
    batch, heads, window, _ = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    out = torch.zeros(batch, kv_heads, slots, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            acc = torch.zeros(slots, dtype=torch.float64)
            for i in range(window):
                q_slot = slots - window + i
                if not valid[b, q_slot]:
                    continue
                allowed = valid[b] & (torch.arange(slots) <= q_slot)
                logits = (keys[b, h // group].double() @ queries[b, h, i].double()) * scaling
                logits[~allowed] = float("-inf")
                acc += torch.softmax(logits, 0)
            pooled = torch.nn.functional.avg_pool1d(acc[None, None], kernel, 1, kernel // 2)[0, 0]
            out[b, h // group] += pooled
    return out


@pytest.mark.parametrize("group", [1, 3, 4, 7])
def test_snapkv_scores_match_loop_reference_for_any_gqa_ratio(group):
    torch.manual_seed(group)
    batch, kv_heads, slots, window = 2, 2, 30, 6
    queries = torch.randn(batch, kv_heads * group, window, D)
    keys = torch.randn(batch, kv_heads, slots, D)
    valid = torch.ones(batch, slots, dtype=torch.bool)
    valid[1, :27] = False  # row 1: only 3 real tokens, shorter than the window
    got = snapkv_scores(queries, keys, valid, D**-0.5, 5)
    want = _snapkv_reference(queries, keys, valid, D**-0.5, 5)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_snapkv_view_selects_top_scored_tokens_without_duplicates():
    cache = _prefilled(prompt=20, pad=(0, 5, 12))
    torch.manual_seed(0)
    for layer in cache.layers:
        layer.observe(torch.randn(B, HKV * 3, 4, D), 0.5, window=4)
    config = MagicDecConfig.from_any(draft="snapkv", draft_budget=10, window=4, gamma=2)
    cache.build_draft_views(config.view, config.draft_budget, config.gamma, 20, max_new_tokens=8)
    valid = cache.geometry.valid()
    for b, pad in enumerate([0, 5, 12]):
        for h in range(HKV):
            slots = [s for s, v in zip(_slots(cache.layers[0].draft_keys)[b, h, :10].tolist(), valid[b].tolist()) if v]
            assert len(slots) == len(set(slots)), "a token appears twice in the view"
            assert all(s >= pad for s in slots), "a padding slot was selected"
            n = 20 - pad
            assert len(slots) == min(10, n)
            if n > 10:  # 6 selected among the earlier tokens + the 4-token window
                assert set(range(16, 20)) <= set(slots)


def test_dropped_rows_keep_state_aligned():
    cache = _prefilled()
    config = MagicDecConfig.from_any(draft="streamingllm", draft_budget=10, sink_tokens=3, gamma=2)
    cache.build_draft_views(config.view, config.draft_budget, config.gamma, 20, max_new_tokens=8)
    before, view = cache.layers[0].keys[2].clone(), cache.layers[0].draft_keys[2].clone()
    valid = cache.geometry.valid()[2].clone()
    order = cache.drop_rows((False, True, False))  # row 2 takes row 1's place
    assert order.tolist()[:2] == [0, 2] and cache.num_rows == 2 and cache.pad.tolist() == [0, 12]
    assert torch.equal(cache.layers[0].keys[1], before) and torch.equal(cache.layers[0].draft_keys[1], view)
    assert cache.geometry.valid().shape == (2, 10) and torch.equal(cache.geometry.valid()[1], valid)


@pytest.mark.parametrize("finished, order", [
    ((False, True, False, False), [0, 3, 2, 1]),  # row 3 fills the hole at 1, row 1 goes to the end
    ((True, True, False, False, True), [2, 3, 0, 1, 4]),
    ((False, False, True), [0, 1, 2]),  # only the last finished: nothing moves
    ((True, True), [0, 1]),
])
def test_row_moves_fill_holes_from_the_end(finished, order):
    from hf_magicdec.engine.cache.buffers import row_moves

    got, holes, sources = row_moves(finished)
    kept = finished.count(False)
    assert got == order and len(holes) == len(sources)
    assert not any(finished[r] for r in got[:kept]) and all(finished[r] for r in got[kept:])
    assert all(h < kept <= s for h, s in zip(holes, sources))


@pytest.mark.parametrize("keep_finished", [False, True])
def test_finished_rows_leave_in_place(keep_finished):
    # What the loop does when rows finish: the kept rows end up in the front of the same buffers,
    # in the returned order, equal to a plain row selection in the full KV's filled slots and in
    # the draft views; handed back, the finished rows' KV is returned as it was.
    cache = _prefilled(layers=3)
    config = MagicDecConfig.from_any(draft="streamingllm", draft_budget=10, sink_tokens=3, gamma=2)
    cache.build_draft_views(config.view, config.draft_budget, config.gamma, 20, max_new_tokens=8)
    before = [(layer.keys.clone(), layer.draft_keys.clone()) for layer in cache.layers]
    storage = [(layer.keys.data_ptr(), layer.values.data_ptr(), layer.draft_keys.data_ptr()) for layer in cache.layers]
    order = cache.drop_rows((True, False, False), max_length=20, keep_finished=keep_finished)
    assert order.tolist() == [2, 1, 0]
    assert cache.num_rows == 2 and cache.pad.tolist() == [12, 5] and cache.row_ids.tolist() == [2, 1]
    for i, layer in enumerate(cache.layers):
        full, draft = before[i]
        assert (layer.keys.data_ptr(), layer.values.data_ptr(), layer.draft_keys.data_ptr()) == storage[i]
        assert torch.equal(layer.keys[:, :, :20], full[[2, 1], :, :20]) and torch.equal(layer.draft_keys, draft[[2, 1]])
        assert torch.isfinite(layer.keys).all()
    if keep_finished:
        kv, filled = cache.committed_kv(3, 20)
        assert filled.tolist() == [20, 20, 20]
        for i, (keys, _) in enumerate(kv):
            assert torch.equal(keys, before[i][0][:, :, :20])


def test_stacked_layers_share_one_buffer_and_commit_once():
    # Every layer of one device and head shape is a view of one stacked buffer, so what happens
    # between forwards is one copy for all of them, at any depth.
    cache = _prefilled(layers=5)
    config = MagicDecConfig.from_any(draft="streamingllm", draft_budget=10, sink_tokens=3, gamma=2)
    cache.build_draft_views(config.view, config.draft_budget, config.gamma, 20, max_new_tokens=8)
    (stack,) = cache.stacks
    assert stack.layers == list(range(5)) and stack.keys.shape[0] == 5
    for j, layer in enumerate(cache.layers):
        assert layer.keys.data_ptr() == stack.keys[j].data_ptr()
        assert layer.draft_keys.data_ptr() == stack.draft_keys[j].data_ptr()


@pytest.mark.parametrize("swap", [False, True])
def test_stack_move_rows_moves_only_filled_slots(swap):
    from hf_magicdec.engine.cache.store import LayerStack

    keys, values = torch.randn(2, 5, 2, 7, 3), torch.randn(2, 5, 2, 7, 3)
    before = keys.clone()
    stack = LayerStack([0, 1], keys, values)
    stack.move_rows([0, 2], [3, 4], kept=3, filled=5, swap=swap)
    assert stack.rows == 3
    assert torch.equal(keys[:, [0, 2], :, :5], before[:, [3, 4], :, :5])
    assert torch.equal(keys[:, 1], before[:, 1])
    if swap:
        assert torch.equal(keys[:, [3, 4], :, :5], before[:, [0, 2], :, :5])
    assert torch.equal(keys[:, :, :, 5:], before[:, :, :, 5:])

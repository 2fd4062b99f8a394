"""The query-aware ``dynamic`` draft view (Quest-style pages) and the refresh of static views."""

from __future__ import annotations

import pytest
import torch

from hf_magicdec import MagicDecConfig
from hf_magicdec.engine.cache import MagicDecCache
from hf_magicdec.engine.refresh import Refresher, recent_attention_mass
from hf_magicdec.views import get_view
from hf_magicdec.views.dynamic import page_scores, page_summaries

from conftest import ARCHS, assert_view_samples_like_stock, ragged_prompts, slot_encoded_cache, static_slots

HKV, GROUP, D = 2, 3, 8


def _cache(keys: torch.Tensor, pad: list[int], capacity: int = 96) -> MagicDecCache:
    return slot_encoded_cache(keys, pad, capacity)


def _true_top_page_slots(query, keys, first, span, page_size, slots):
    """Brute force: exact Quest bound of every page, pages taken best first until ``slots`` are filled."""
    group = query.shape[0] // keys.shape[0]  # query [H, 1, D], keys [Hkv, S, D]
    out = []
    for h in range(keys.shape[0]):
        pages = []
        for start in range(first, first + span, page_size):
            stop = min(start + page_size, first + span)
            lo, hi = keys[h, start:stop].amin(0), keys[h, start:stop].amax(0)
            bound = sum(
                torch.maximum(q * lo, q * hi).sum() for q in query[h * group : (h + 1) * group, 0].double()
            )
            pages.append((float(bound), list(range(start, stop))))
        pages.sort(key=lambda p: -p[0])
        taken = [s for _, toks in pages for s in toks][:slots]
        out.append(sorted(taken))
    return out


def test_page_scores_are_the_quest_bound_summed_over_the_group():
    torch.manual_seed(0)
    keys = torch.randn(2, HKV, 37, D)
    first, span = torch.tensor([0, 5]), torch.tensor([37, 30])
    kmin, kmax, start, tokens = page_summaries(keys, first, span, 8)
    assert start.tolist() == [[0, 8, 16, 24, 32], [5, 13, 21, 29, 37]]
    assert tokens.tolist() == [[8, 8, 8, 8, 5], [8, 8, 8, 6, 0]]  # partial pages, an empty one
    query = torch.randn(2, HKV * GROUP, 1, D)
    got = page_scores(query, kmin, kmax)
    for b in range(2):
        for h in range(HKV):
            for p in range(5):
                n = int(tokens[b, p])
                if n == 0:
                    continue
                page = keys[b, h, int(start[b, p]) : int(start[b, p]) + n].double()
                want = sum(torch.maximum(q * page.amin(0), q * page.amax(0)).sum()
                           for q in query[b, h * GROUP : (h + 1) * GROUP, 0].double())
                torch.testing.assert_close(got[b, h, p].double(), want, rtol=1e-5, atol=1e-5)


def test_selected_pages_are_the_true_top_pages_and_never_padding_or_window():
    torch.manual_seed(1)
    batch, prompt, pad = 3, 60, [0, 7, 50]  # row 2: 10 real tokens, fits the budget
    keys = torch.randn(batch, HKV, prompt, D)
    query = torch.randn(batch, HKV * GROUP, 1, D)
    # Padding and the prompt tail (the initial window) look irresistible to the query: a view that
    # selected among them would pick them first.
    lure = 50 * query.reshape(batch, HKV, GROUP, D).sum(2)  # [B, Hkv, D]
    for b, p in enumerate(pad):
        keys[b, :, :p] = lure[b, :, None]
    keys[:, :, -10:] = lure[:, :, None]
    config = MagicDecConfig.from_any(draft="dynamic", draft_budget=30, sink_tokens=3, page_size=5, recent_window=10, gamma=2)
    cache = _cache(keys, pad)
    cache.build_draft_views(config.view, config.draft_budget, config.gamma, prompt, max_new_tokens=8)
    ks, w = cache.static_slots, cache.window_slots
    assert (ks, w) == (3 + 3 * 5, 12)  # 3 sinks + 3 pages; the window takes the rest of the budget
    before = static_slots(cache).clone()
    cache.begin_draft(0)
    cache.forward.before_attention(0, query, D**-0.5)
    static = static_slots(cache)
    for b, p in enumerate(pad):
        n = prompt - p
        if n <= ks + w:  # fits: the whole prompt stays, nothing is re-selected
            assert torch.equal(static[b], before[b])
            continue
        region = n - w  # candidates: neither padding nor the initial window
        for h in range(HKV):
            got = static[b, h].tolist()
            assert got[:3] == [p, p + 1, p + 2]  # sinks
            want = _true_top_page_slots(query[b], keys[b], p + 3, region - 3, 5, ks - 3)[h]
            assert sorted(got[3:]) == want
            assert min(got) >= p and max(got) < p + region and len(set(got)) == ks


def test_refill_follows_the_query_from_step_to_step():
    """A different query selects different pages, and the view is rewritten at every draft step."""
    torch.manual_seed(2)
    prompt = 64
    keys = torch.randn(1, HKV, prompt, D) * 0.1
    keys[0, :, 20:24, 0] = 5.0  # a "needle" page for queries along +e0
    keys[0, :, 40:44, 1] = 5.0  # and one for +e1
    config = MagicDecConfig.from_any(draft="dynamic", draft_budget=16, sink_tokens=0, page_size=4, recent_window=12, gamma=2)
    cache = _cache(keys, [0])
    cache.build_draft_views(config.view, config.draft_budget, config.gamma, prompt, max_new_tokens=4)
    for axis, needle in ((0, range(20, 24)), (1, range(40, 44)), (0, range(20, 24))):
        query = torch.zeros(1, HKV * GROUP, 1, D)
        query[..., axis] = 1.0
        cache.begin_draft(0)
        cache.forward.before_attention(0, query, 1.0)
        assert static_slots(cache)[0].tolist() == [list(needle)] * HKV


def test_dynamic_view_retrieves_what_attention_needs():
    """Retrieval-like: one needle page holds most of the attention mass; the dynamic view keeps it
    and its attention output is far closer to the full cache's than StreamingLLM's at equal budget."""
    torch.manual_seed(3)
    prompt = 256
    keys, vals = torch.randn(1, 1, prompt, D), torch.randn(1, 1, prompt, D)
    query = torch.randn(1, 1, 1, D)
    keys[0, 0, 100:108] = 2.0 * query[0, 0, 0]  # the needle: most of the attention mass
    full = torch.softmax(query[0, 0] @ keys[0, 0].T, -1) @ vals[0, 0]

    def view_output(draft, **extra):
        config = MagicDecConfig.from_any(draft=draft, draft_budget=32, gamma=2, **extra)
        cache = MagicDecCache(1, 1, prompt + 8, torch.tensor([0]))
        cache.begin_prefill(0, prompt)
        cache.update(keys, vals, 0)
        cache.end_prefill(prompt)
        cache.build_draft_views(config.view, config.draft_budget, config.gamma, prompt, max_new_tokens=4)
        cache.begin_draft(0)
        cache.forward.before_attention(0, query, 1.0)
        layer, n = cache.layers[0], cache.static_slots + cache.window_slots
        return torch.softmax(query[0, 0] @ layer.draft_keys[0, 0, :n].T, -1) @ layer.draft_values[0, 0, :n]

    dynamic = view_output("dynamic", sink_tokens=4, page_size=8, recent_window=12)
    streaming = view_output("streamingllm", sink_tokens=4)
    assert (dynamic - full).norm() < 0.5 * (streaming - full).norm()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_budget_covering_the_prompt_accepts_everything(tiny_models, arch):
    model = tiny_models(arch)
    ids, mask = ragged_prompts(batch=3, length=40, seed=4)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None)
    reference = model.generate(**kwargs)
    out = model.generate(**kwargs, speculative="magicdec", draft="dynamic", draft_budget=128, gamma=3, sink_tokens=2,
                         page_size=4, return_dict_in_generate=True)
    assert torch.equal(reference, out.sequences)
    assert out.speculation.acceptance_rate == 1.0


def test_dynamic_config_validation():
    with pytest.raises(ValueError, match="at least one page"):
        MagicDecConfig.from_any(draft="dynamic", draft_budget=32, sink_tokens=16, page_size=16, gamma=3)
    with pytest.raises(ValueError, match="page_size"):
        MagicDecConfig.from_any(draft="dynamic", page_size=0)
    with pytest.raises(ValueError, match="re-selects its view"):
        MagicDecConfig.from_any(draft="dynamic", draft_budget=256, gamma=3, refresh_every=8)
    view = MagicDecConfig.from_any(draft="dynamic", draft_budget=256, gamma=3).view  # defaults: 16 sinks, pages of 16
    assert (view.static_slots(256, 4096), view.window_slots(256, 3, 4096, 128)) == (16 + 11 * 16, 64)
    assert view == get_view("dynamic") and view.fits(256, 3) and not view.fits(32, 3)


def test_dynamic_sampling_is_lossless():
    """Sampling through the dynamic view reproduces stock sampling's distribution (two-sample chi-square)."""
    assert_view_samples_like_stock(3, draft="dynamic", draft_budget=10, sink_tokens=1, page_size=2,
                                   recent_window=3, gamma=2)


# ---------------------------------------------------------------------------------- refresh
def test_recent_attention_mass_matches_loop():
    torch.manual_seed(5)
    queries, keys = torch.randn(2, HKV * GROUP, 4, D), torch.randn(2, HKV, 11, D)
    key_valid = torch.ones(2, 11, dtype=torch.bool)
    key_valid[1, :3] = False
    query_valid = torch.tensor([[True] * 4, [True, True, False, False]])
    got = recent_attention_mass(queries, keys, key_valid, query_valid, 0.5)
    want = torch.zeros(2, HKV, 11, dtype=torch.float64)
    for b in range(2):
        for h in range(HKV * GROUP):
            for i in range(4):
                if query_valid[b, i]:
                    logits = keys[b, h // GROUP].double() @ queries[b, h, i].double() * 0.5
                    want[b, h // GROUP] += torch.softmax(logits.masked_fill(~key_valid[b], float("-inf")), 0)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_refresh_reselects_what_recent_queries_attend_to():
    """After commits whose queries look at slots 30..33 (prompt tokens SnapKV did not keep, and
    not in the window), a refresh puts exactly those into the static part."""
    torch.manual_seed(6)
    prompt, batch = 48, 2
    keys = torch.randn(batch, HKV, prompt, D) * 0.1
    keys[:, :, 30:34, 2] = 4.0  # what the generation will come to need
    keys[:, :, 10:18, 3] = 4.0  # what the prompt's observation window attends to
    cache = _cache(keys, [0, 6])
    # Observation queries that look elsewhere (along e3): SnapKV keeps slots 10..17.
    observed = torch.zeros(batch, HKV * GROUP, 4, D)
    observed[..., 3] = 1.0
    cache.layers[0].observe(observed, 1.0, window=4)
    config = MagicDecConfig.from_any(draft="snapkv", draft_budget=16, window=4, recent_window=8, pool_kernel=1,
                                     gamma=2, refresh_every=3)
    cache.build_draft_views(config.view, config.draft_budget, config.gamma, prompt, max_new_tokens=16)
    refresher = Refresher.create(config.view, config, cache)
    cache.attach(refresher)  # what the self-drafter does
    assert refresher is not None and cache.static_slots == 8
    assert static_slots(cache).sort(-1).values.tolist() == [[list(range(10, 18))] * HKV] * batch
    for step in range(2):
        cache.begin_verify(3)
        k = torch.randn(batch, HKV, 3, D) * 0.1
        v = torch.zeros(batch, HKV, 3, D)
        v[..., 0] = (cache.lengths[:, None] + torch.arange(3)).float()[:, None, :]
        cache.update(k, v, 0)
        query = torch.zeros(batch, HKV * GROUP, 3, D)
        query[..., 2] = 4.0  # the recent queries attend to slots 30..33
        cache.forward.before_attention(0, query, 1.0)
        keep = torch.tensor([2, 1])
        cache.commit(keep)
        fired = refresher.after_commit(cache, keep, keep - 1, 2)
        assert fired == (1 if step == 1 else 0)  # row 0 reaches 3 committed tokens at step 2
    static = static_slots(cache)
    assert set(range(30, 34)) <= set(static[0, 0].tolist()) and set(range(30, 34)) <= set(static[0, 1].tolist())
    assert not set(range(30, 34)) & set(static[1, 0].tolist())  # row 1 (2 tokens so far) is not due yet
    for b, pad in enumerate([0, 6]):
        ring_start = int(cache.lengths[b] - cache.geometry.window_filled()[b])
        for h in range(HKV):
            got = static[b, h].tolist()
            assert len(set(got)) == 8 and min(got) >= pad and max(got) < ring_start  # no padding, no duplicates


def test_refresh_config_validation():
    for bad in (dict(refresh_every=0), dict(refresh_every=2.5), dict(refresh_below=0), dict(refresh_below=1.5),
                dict(refresh_below=True)):
        with pytest.raises(ValueError, match="refresh_"):
            MagicDecConfig.from_any(draft="snapkv", **bad)
    MagicDecConfig.from_any(draft="snapkv", draft_budget=256, gamma=3, refresh_every=64, refresh_below=0.6)


# ---------------------------------------------------------------------------------- cost model
def test_cost_model_charges_dynamic_selection():
    """Per draft step, dynamic reads 2/P of the context's keys (page min / max) and gathers the
    budget's K and V (read + write); static views pay nothing extra. H100 is memory-bound here."""
    from hf_magicdec.planner import ModelSpec, SearchSpace, Workload, estimate, get_hardware
    from hf_magicdec.planner.search import search_plan as plan
    from hf_magicdec.planner.selection import selection_seconds

    spec = ModelSpec(name="toy", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                     vocab=128256)
    hw = get_hardware("h100")
    batch, context, budget = 16, 32768, 512
    snapkv, dynamic = get_view("snapkv"), get_view("dynamic")
    assert selection_seconds(spec, hw, batch, context, budget, snapkv) == 0.0
    assert selection_seconds(spec, hw, batch, context, budget, "dynamic") == 0.0  # a name prices a static view
    assert selection_seconds(spec, hw, batch, 400, budget, dynamic) == 0.0  # the view holds the context
    summaries = 2 * batch * 8 * (context // 16) * 128 * 2
    gather = 4 * batch * 8 * budget * 128 * 2
    want = 32 * (summaries + gather) / hw.bandwidth
    assert selection_seconds(spec, hw, batch, context, budget, dynamic) == pytest.approx(want, rel=1e-6)
    # The view's own page size: pages of 32 halve the summaries read.
    half = 32 * (summaries / 2 + gather) / hw.bandwidth
    assert selection_seconds(spec, hw, batch, context, budget, get_view("dynamic", page_size=32)) == pytest.approx(half)
    snap = estimate(spec, hw, batch=batch, context=context, draft=snapkv, budget=budget, gamma=3, acceptance=0.8)
    dyn = estimate(spec, hw, batch=batch, context=context, draft=dynamic, budget=budget, gamma=3, acceptance=0.8)
    assert dyn.draft == "dynamic" and dyn.t_draft == pytest.approx(snap.t_draft + want) and dyn.speedup < snap.speedup
    # The planner asks the views: with equal α it prefers the cheaper static view.
    p = plan(spec, Workload(batch, context, 128), "h100", SearchSpace(drafts=(snapkv, dynamic)), acceptance=0.8)
    assert p.draft == "snapkv" and any(e.draft == "dynamic" for e in p.runner_ups)
    only = plan(spec, Workload(batch, context, 128), "h100", SearchSpace(drafts=(get_view("dynamic", page_size=32),)))
    assert only.draft == "dynamic" and MagicDecConfig.from_any(only) == MagicDecConfig.from_any(
        draft="dynamic", draft_budget=only.draft_budget, gamma=only.gamma, page_size=32, draft_weights="full")

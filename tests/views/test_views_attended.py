"""The verification-guided ``attended`` draft view: the draft's KV chosen by the verify pass's attention mass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_magicdec import MagicDecConfig
from hf_magicdec.engine.cache import MagicDecCache
from hf_magicdec.planner import ModelSpec, estimate, get_hardware
from hf_magicdec.planner.selection import choice_seconds
from hf_magicdec.views import get_view
from hf_magicdec.views.attended import AttendedPageSelection

from conftest import assert_view_samples_like_stock, ragged_prompts, slot_encoded_cache, static_slots

HKV, D = 2, 8


def _cache(batch: int, prompt: int, pad: list[int], capacity: int = 128) -> MagicDecCache:
    return slot_encoded_cache(torch.randn(batch, HKV, prompt, D), pad, capacity)


def _state(cache: MagicDecCache) -> AttendedPageSelection:
    (state,) = [s for s in cache.row_states if isinstance(s, AttendedPageSelection)]
    return state


def _true_choice(mass: torch.Tensor, lo: int, hi: int, page: int, slots: int) -> list[int]:
    """Brute force: pages (absolute slots [p·P, (p+1)·P) cut to [lo, hi)) best mass first, their
    tokens taken until ``slots`` are filled."""
    order = sorted(range(mass.numel()), key=lambda p: -float(mass[p]))
    taken = []
    for p in order:
        taken += [s for s in range(p * page, (p + 1) * page) if lo <= s < hi]
    return sorted(taken[:slots])


def test_choice_is_the_pages_with_most_verify_mass_never_sinks_padding_or_window():
    torch.manual_seed(0)
    batch, prompt, pad = 3, 72, [0, 9, 52]  # row 2: 20 real tokens, fits the view (24 + 8 slots)
    cache = _cache(batch, prompt, pad)
    config = MagicDecConfig.from_any(draft="attended", draft_budget=32, sink_tokens=2, page_size=4, recent_window=8,
                                     window=4, gamma=2, every=1)
    cache.build_draft_views(config.view, config.draft_budget, config.gamma, prompt, max_new_tokens=8)
    ks, w = cache.static_slots, cache.window_slots
    assert (ks, w) == (24, 8)
    before = static_slots(cache).clone()
    state = _state(cache)
    assert state.verify_page_size(1) == 0  # plain steps emit no mass
    assert state.verify_page_size(3) == 4  # (every=1) a verification does, and the choice follows it

    mass = torch.rand(batch, HKV, prompt // 4)
    mass[:, :, -2:] = 100.0  # the window's pages look irresistible: they must not be chosen
    mass[1, :, :2] = 100.0  # row 1's padding pages too
    state.on_verify_mass(cache, 0, mass)
    state.on_commit(cache)
    assert state.rounds == 1 and state.mass == {}
    static = static_slots(cache)
    for b, p in enumerate(pad):
        n = prompt - p
        if n < ks + w:  # fits: every token stays, nothing is chosen
            assert torch.equal(static[b], before[b])
            continue
        lo, hi = p + 2, p + n - w
        for h in range(HKV):
            got = static[b, h].tolist()
            assert got[:2] == [p, p + 1]  # sinks
            assert sorted(got[2:]) == _true_choice(mass[b, h], lo, hi, 4, ks - 2)
            assert len(set(got)) == ks and min(got) >= p and max(got) < hi


def test_choice_waits_for_every_and_plain_steps_choose_nothing():
    torch.manual_seed(1)
    cache = _cache(1, 64, [0])
    view = get_view("attended", sink_tokens=0, page_size=4, recent_window=8, every=3, window=4)
    cache.build_draft_views(view, 24, 2, 64, max_new_tokens=8)
    state = _state(cache)
    assert state.verify_page_size(1) == 0
    state.on_commit(cache)  # a plain step: no mass, not a verification
    assert state.verifications == 0 and state.rounds == 0
    needle = torch.zeros(1, HKV, 16)
    needle[..., 5] = 1.0  # slots 20-23
    for _ in range(2):  # verifications that no choice follows emit no mass (it would be thrown away)
        assert state.verify_page_size(3) == 0
        state.on_commit(cache)
    assert state.rounds == 0 and state.verifications == 2
    assert state.verify_page_size(3) == 4  # the third: its mass chooses
    state.on_verify_mass(cache, 0, needle)
    state.on_commit(cache)
    assert state.rounds == 1 and state.verifications == 0
    assert all(s in static_slots(cache)[0, h].tolist() for h in range(HKV) for s in range(20, 24))


def test_the_first_verification_chooses_while_the_window_holds_every_generated_token():
    """The verifier's queries re-rank the prompt's pages from the first verification on, before
    the rolling window has rolled over (the choice is never held back for it)."""
    cache = _cache(1, 64, [0])
    view = get_view("attended", sink_tokens=0, page_size=4, recent_window=8, every=1, window=4)
    cache.build_draft_views(view, 24, 2, 64, max_new_tokens=40)
    state = _state(cache)
    assert state.verify_page_size(3) == 4  # 3 tokens to verify, none committed yet: it emits
    needle = torch.zeros(1, HKV, 16)
    needle[..., 3] = 1.0  # slots 12-15
    state.on_verify_mass(cache, 0, needle)
    state.on_commit(cache)
    assert state.rounds == 1 and state.verifications == 0
    assert all(s in static_slots(cache)[0, h].tolist() for h in range(HKV) for s in range(12, 16))


def _count_choices(monkeypatch) -> list[int]:
    calls = []
    choose = AttendedPageSelection._choose

    def counted(self, cache, ready):
        calls.append(int(ready.sum()))
        return choose(self, cache, ready)

    monkeypatch.setattr(AttendedPageSelection, "_choose", counted)
    return calls


@pytest.mark.parametrize("arch", ["llama-gqa3", "qwen2-gqa7"])
def test_long_generation_from_short_prompts_is_lossless_and_chooses(tiny_models, arch, monkeypatch):
    """Short ragged prompts, a generation that outgrows the view: identical to stock, and the
    verifier's choice ran for rows once they outgrew it."""
    model = tiny_models(arch)
    ids, mask = ragged_prompts(3, 20, seed=3, min_len=9)
    calls = _count_choices(monkeypatch)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=60, do_sample=False, eos_token_id=None)
    stock = model.generate(**kwargs)
    out = model.generate(**kwargs, speculative="magicdec", draft="attended", draft_budget=24, sink_tokens=1,
                         page_size=4, recent_window=8, window=4, gamma=3, return_dict_in_generate=True)
    assert torch.equal(out.sequences, stock)
    assert calls and max(calls) == 3  # every row outgrew its 24-slot view and was chosen for
    assert out.speculation.draft == "attended"


def test_verify_mass_sums_to_one_per_query_and_head(tiny_models, monkeypatch):
    """The mass the verify attention hands the view is its softmax mass: per row and KV head it sums
    to (γ + 1) queries × the query heads of the group."""
    model = tiny_models("llama-gqa3")  # 6 query heads over 2 KV heads
    seen = []
    record = AttendedPageSelection.on_verify_mass

    def spy(self, cache, layer_idx, mass):
        seen.append(mass.clone())
        return record(self, cache, layer_idx, mass)

    monkeypatch.setattr(AttendedPageSelection, "on_verify_mass", spy)
    ids, mask = ragged_prompts(2, 40, seed=4, min_len=31)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                   speculative="magicdec", draft="attended", draft_budget=24, sink_tokens=1, page_size=4,
                   recent_window=8, window=4, gamma=2)
    assert seen
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    for mass in seen:
        rows = mass.shape[0]  # 2, or 1 once a row is done and compacted away
        assert rows in (1, 2) and mass.shape[1] == kv_heads and (mass >= 0).all()
        torch.testing.assert_close(mass.sum(-1), torch.full((rows, kv_heads), 3.0 * heads / kv_heads))


def test_attended_sampling_keeps_the_distribution():
    """Sampling through the attended view reproduces stock sampling's distribution (two-sample chi-square)."""
    assert_view_samples_like_stock(4, draft="attended", draft_budget=12, sink_tokens=1, page_size=2,
                                   recent_window=3, window=4, gamma=2)


def test_attended_config_validation():
    with pytest.raises(ValueError, match="page_size=0"):
        MagicDecConfig.from_any(draft="attended", page_size=0)
    with pytest.raises(ValueError, match="every=0"):
        MagicDecConfig.from_any(draft="attended", every=0)
    with pytest.raises(ValueError, match="room for the sinks and one page"):
        MagicDecConfig.from_any(draft="attended", draft_budget=32, sink_tokens=16, page_size=16, gamma=3)
    with pytest.raises(ValueError, match="refresh"):  # it re-chooses itself
        MagicDecConfig.from_any(draft="attended", draft_budget=256, gamma=3, refresh_every=8)
    view = MagicDecConfig.from_any(draft="attended", draft_budget=256, gamma=3).view
    assert view.reselects and not view.query_aware
    assert view.static_slots(256, 4096) == 192 and view.window_slots(256, 3, 4096, 128) == 64


def test_cost_model_charges_the_choice_once_per_every():
    config = json.loads((Path(__file__).parents[1] / "configs" / "llama-3.1-8b.json").read_text())
    spec, hw = ModelSpec.from_config(config, name="llama-3.1-8b"), get_hardware("h100")
    view, sparse = get_view("attended"), get_view("attended", every=8)
    per_verify = choice_seconds(spec, hw, 32, 32768, 512, view)
    assert per_verify > choice_seconds(spec, hw, 32, 32768, 512, sparse) > 0
    assert choice_seconds(spec, hw, 32, 32768, 512, get_view("snapkv")) == 0.0
    assert choice_seconds(spec, hw, 32, 32768, 512, get_view("dynamic")) == 0.0  # costed per draft step instead
    assert choice_seconds(spec, hw, 32, 256, 512, view) == 0.0  # the view holds the context: nothing to choose
    a = estimate(spec, hw, batch=32, context=32768, draft=view, budget=512, gamma=3)
    b = estimate(spec, hw, batch=32, context=32768, draft=get_view("snapkv"), budget=512, gamma=3)
    assert a.t_verify == pytest.approx(b.t_verify + per_verify)


def test_cost_model_charges_the_twins_explicit_softmax_where_the_mass_is_not_fused():
    """On a CPU the PyTorch twin emits the mass: the emitting verification reads its fp32
    probabilities once more (4·B·H·q·S bytes per layer), priced per verification like the rest;
    the fused kernel's few bytes per page stay the whole cost on a GPU preset."""
    config = json.loads((Path(__file__).parents[1] / "configs" / "llama-3.1-8b.json").read_text())
    spec, view = ModelSpec.from_config(config, name="llama-3.1-8b"), get_view("attended")
    cpu = get_hardware("cpu")
    assert not cpu.fused_mass and get_hardware("h100").fused_mass
    fused = cpu.replace(fused_mass=True)
    extra = choice_seconds(spec, cpu, 8, 4096, 256, view, 4) - choice_seconds(spec, fused, 8, 4096, 256, view, 4)
    per_layer = 4 * 8 * spec.heads * 4 * 4096 / cpu.bandwidth  # overlap False: bytes / bandwidth
    assert extra == pytest.approx(spec.layers * per_layer / view.every, rel=0.02)
    assert choice_seconds(spec, cpu, 8, 4096, 256, view, 8) > choice_seconds(spec, cpu, 8, 4096, 256, view, 4)
    h100 = get_hardware("h100")
    assert choice_seconds(spec, h100, 8, 4096, 256, view, 8) == choice_seconds(spec, h100, 8, 4096, 256, view, 4)
    a = estimate(spec, cpu, batch=8, context=4096, draft=view, budget=256, gamma=3)
    b = estimate(spec, cpu, batch=8, context=4096, draft=get_view("snapkv"), budget=256, gamma=3)
    assert a.t_verify == pytest.approx(b.t_verify + choice_seconds(spec, cpu, 8, 4096, 256, view, 4))

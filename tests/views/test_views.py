"""A draft view owns its options: validation on the view, the registry, the config's routing of
view options, and ``generate`` taking them (or a view instance) on every path."""

from __future__ import annotations

import dataclasses
import inspect
import json
from dataclasses import dataclass

import pytest
import torch

import hf_magicdec
from conftest import RecentOnly, ragged_prompts
from hf_magicdec import MagicDecConfig
from hf_magicdec import views as views_module
from hf_magicdec.views import AttendedPages, DynamicPages, FullKV, SnapKV, StreamingLLM, get_view, register_view


# ---------------------------------------------------------------------------------- the views
@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: StreamingLLM(sink_tokens=-1), r"sink_tokens must be >= 0, got sink_tokens=-1"),
        (lambda: StreamingLLM(sink_tokens=2.0), r"sink_tokens must be an int, got 2.0 \(float\)"),
        (lambda: SnapKV(window=0), r"window must be >= 1, got window=0"),
        (lambda: SnapKV(pool_kernel=4), r"pool_kernel must be a positive odd int, got pool_kernel=4"),
        (lambda: SnapKV(recent_window=0), r"recent_window must be a positive int or None, got recent_window=0"),
        (lambda: DynamicPages(page_size=0), r"page_size must be a positive int, got page_size=0"),
        (lambda: DynamicPages(recent_window=True), r"recent_window .* got recent_window=True"),
        (lambda: get_view("snapkv", window="8"), r"window must be an int, got '8' \(str\)"),
        (lambda: get_view("snapkv", sink_tokens=2), r"'snapkv' draft view has no option\(s\) \['sink_tokens'\]"),
        (lambda: MagicDecConfig.from_any(draft="snapkv", pool_kernel=4), "pool_kernel"),
        (lambda: MagicDecConfig.from_any(pool_kernel=4), "pool_kernel"),  # "auto": checked by the views that have it
        (lambda: MagicDecConfig.from_any(draft="dynamic", page_size=0), "page_size"),
        # "auto" chooses among streamingllm, snapkv and attended: another view's option is refused, naming the view
        (lambda: MagicDecConfig.from_any(static_tokens=3),
         r"belong to the 'recent-only' draft view.*pass draft='recent-only'"),
    ],
)
def test_view_options_are_validated_with_clear_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_views_are_frozen_dataclasses():
    view = SnapKV(window=16)
    assert not hasattr(views_module, "SnapKVView")  # the former names are gone (docs/changelog.md)
    assert view == get_view("snapkv", window=16) and hash(view) == hash(SnapKV(window=16))
    assert view.options() == {"window": 16, "recent_window": None, "pool_kernel": 5}
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.window = 8
    assert SnapKV.name == "snapkv" and DynamicPages.query_aware and not SnapKV.query_aware
    assert StreamingLLM.option_names() == ("sink_tokens",) and FullKV.option_names() == ()
    assert DynamicPages() == DynamicPages(sink_tokens=16, page_size=16, recent_window=None)  # defaults.py


def test_geometry_takes_budget_and_gamma():
    snap = SnapKV(window=16, recent_window=40)
    assert (snap.static_slots(128, 1000), snap.window_slots(128, 3, 1000, 64)) == (88, 40)
    assert snap.observation_window() == 16 and StreamingLLM().observation_window() == 0
    assert StreamingLLM(sink_tokens=4).window_slots(16, 3, 0, 0) == 12
    assert FullKV().window_slots(16, 3, 100, 20) == 124
    with pytest.raises(ValueError, match="sink_tokens"):
        StreamingLLM(sink_tokens=16).check(16, 3)
    with pytest.raises(ValueError, match=r"gamma \+ 1"):
        StreamingLLM(sink_tokens=4).check(8, 4)
    assert StreamingLLM(sink_tokens=4).fits(8, 3) and not StreamingLLM(sink_tokens=4).fits(8, 4)
    assert not SnapKV().fits(32, 1) and SnapKV(window=8).fits(32, 1)


# ---------------------------------------------------------------------------------- the config
def test_config_holds_a_view_and_from_any_parses_names_and_flat_options():
    a = MagicDecConfig.from_any(draft="snapkv", window=16, draft_budget=64, gamma=3)
    b = MagicDecConfig(draft=SnapKV(window=16), draft_budget=64, gamma=3)
    assert a == b and hash(a) == hash(b) and a.draft == SnapKV(window=16) and a.view == SnapKV(window=16)
    assert a.draft_name == "snapkv" and a.candidates == ()
    assert MagicDecConfig.from_any({"draft": "snapkv", "window": 16, "draft_budget": 64, "gamma": 3}) == a
    assert MagicDecConfig.from_any("magicdec", draft="snapkv", window=16, draft_budget=64, gamma=3) == a
    assert MagicDecConfig.from_any(a, window=None) is a  # None overrides are ignored
    assert json.loads(json.dumps(a.to_dict()))["window"] == 16 and MagicDecConfig.from_any(a.to_dict()) == a
    assert MagicDecConfig.from_any(a, window=8).view == SnapKV(window=8)
    assert MagicDecConfig.from_any(a, draft="snapkv") == a
    assert MagicDecConfig().view is None and MagicDecConfig().draft_name == "auto"
    # "auto": each option goes to the candidates that have it; choosing a view keeps the ones it has.
    auto = MagicDecConfig.from_any(sink_tokens=2, window=8)
    assert auto.candidates == (StreamingLLM(sink_tokens=2), SnapKV(window=8), AttendedPages(sink_tokens=2, window=8))
    assert MagicDecConfig().candidates == (StreamingLLM(), SnapKV(), AttendedPages())
    assert MagicDecConfig.from_any(auto, draft="snapkv").view == SnapKV(window=8)
    assert MagicDecConfig.from_any(auto, draft=SnapKV(pool_kernel=3)).view == SnapKV(pool_kernel=3)
    assert MagicDecConfig.from_any(auto.to_dict()) == auto
    assert MagicDecConfig.from_any(draft=SnapKV(), window=32) == MagicDecConfig.from_any(draft="snapkv", window=32)
    only = MagicDecConfig.from_any(candidates=["dynamic"], page_size=8)
    assert only.candidates == (DynamicPages(page_size=8),) and MagicDecConfig.from_any(only.to_dict()) == only
    # The constructor takes the one representation: names go through from_any.
    with pytest.raises(ValueError, match=r"takes a view instance .* got the name 'snapkv'.*from_any"):
        MagicDecConfig(draft="snapkv")
    with pytest.raises(TypeError):
        MagicDecConfig(draft=SnapKV(), window=16)  # flat options are from_any's


def test_config_refuses_options_of_no_view_or_of_another_view():
    with pytest.raises(ValueError, match=r"Unknown MagicDec option\(s\) \['windw'\] "
                                         r"\(did you mean 'window'\?\); known: "):
        MagicDecConfig.from_any(draft="snapkv", windw=16)
    with pytest.raises(ValueError, match=r"'streamingllm' draft view has no option\(s\) \['window'\]; "
                                         r"its options: \['sink_tokens'\]"):
        MagicDecConfig.from_any(draft="streamingllm", window=16)
    with pytest.raises(ValueError, match="both"):
        MagicDecConfig.from_any(draft=SnapKV(window=16), window=8)

    @dataclass(frozen=True)
    class Unregistered(StreamingLLM):
        name = "unregistered"

    with pytest.raises(ValueError, match="not registered"):
        MagicDecConfig(draft=Unregistered())

    @dataclass(frozen=True)
    class Impostor(StreamingLLM):  # a subclass answering to a registered name
        pass

    with pytest.raises(ValueError, match="not the registered 'streamingllm' view"):
        MagicDecConfig(draft=Impostor())


def test_registering_a_view_later_reaches_config_and_generate(monkeypatch):
    monkeypatch.setattr(views_module, "_VIEWS", dict(views_module._VIEWS))

    @dataclass(frozen=True)
    class Late(StreamingLLM):
        name = "late"
        late_knob: int = 1

    try:
        register_view(Late)
        assert "late_knob" in MagicDecConfig.option_names()
        assert MagicDecConfig.from_any(draft="late", late_knob=2).view == Late(late_knob=2)
        register_view(Late(late_knob=5))  # an instance: its fields become the defaults
        assert get_view("late") == Late(late_knob=5) and get_view("late", sink_tokens=2) == Late(2, 5)
        assert MagicDecConfig(draft=Late(late_knob=5)).to_dict()["draft"] == "late"
        assert "late_knob" not in MagicDecConfig(draft=Late(late_knob=5)).to_dict()  # the default now
    finally:
        monkeypatch.undo()
    assert "late_knob" not in MagicDecConfig.option_names()
    # generate's signature is fixed: options reach it through the routing, not named parameters.
    assert "late_knob" not in inspect.signature(hf_magicdec.generate).parameters


# ---------------------------------------------------------------------------------- generate
def test_view_instance_generates_exactly_as_name_and_options(tiny_models):
    model = tiny_models("llama-gqa3")
    ids, mask = ragged_prompts(batch=3, length=40, seed=4)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, eos_token_id=None,
                  speculative="magicdec", draft_budget=16, gamma=3, return_dict_in_generate=True)
    by_name = model.generate(**kwargs, draft="snapkv", window=6)
    by_view = model.generate(**kwargs, draft=SnapKV(window=6))
    assert torch.equal(by_name.sequences, by_view.sequences)
    assert by_name.speculation.accepted_lengths == by_view.speculation.accepted_lengths
    # The option is what made it valid: snapkv's default window (32) does not fit a budget of 16.
    with pytest.raises(ValueError, match="window"):
        model.generate(**kwargs, draft="snapkv")


def test_option_for_the_wrong_view_is_refused_before_any_forward(tiny_models, monkeypatch):
    model = tiny_models("llama-gqa3")
    ids, mask = ragged_prompts(batch=2, length=20, seed=1)
    calls = []
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError, match=r"'streamingllm' draft view has no option\(s\) \['window'\]"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, speculative="magicdec",
                       draft="streamingllm", window=8)
    with pytest.raises(ValueError, match=r"'recent-only' draft view has no option\(s\) \['page_size'\]"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, speculative="magicdec",
                       draft=RecentOnly(), page_size=8)
    assert not calls


def test_user_view_options_on_every_path(tiny_models):
    """The user's view (tests/conftest.py) and its own option, through routing, HF's
    custom_generate, the dict form and an instance: all give stock generate's tokens."""
    model = tiny_models("qwen2-gqa7")
    ids, mask = ragged_prompts(batch=3, length=36, seed=9)
    plain = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    reference = model.generate(**plain)
    settings = dict(draft="recent-only", static_tokens=3, draft_budget=12, gamma=2)
    outputs = {
        "routed": model.generate(**plain, speculative="magicdec", **settings),
        "custom_generate": model.generate(**plain, custom_generate=hf_magicdec.generate, **settings),
        "dict": model.generate(**plain, speculative=settings),
        "instance": model.generate(**plain, speculative="magicdec", draft=RecentOnly(static_tokens=3),
                                   draft_budget=12, gamma=2),
    }
    for path, out in outputs.items():
        assert torch.equal(reference, out), path
    out = model.generate(**plain, speculative="magicdec", return_dict_in_generate=True, **settings)
    assert out.speculation.draft == "recent-only" and 0 < out.speculation.acceptance_rate < 1

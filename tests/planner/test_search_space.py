"""``search_plan(model, Workload, hardware, SearchSpace)``: the objects are checked, and the search
takes only them (not their fields as keywords)."""

from __future__ import annotations

import dataclasses

import pytest

from hf_magicdec.planner import ModelSpec, SearchSpace, Workload, search_plan
from hf_magicdec.views import get_view

SPEC = ModelSpec(name="toy", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
                 vocab=128256)
VIEWS = (get_view("streamingllm"), get_view("snapkv"))


@pytest.mark.parametrize("schedule", [False, True])
def test_objects_plan(schedule):
    p = search_plan(SPEC, Workload(8, 8192, 256), "h100", SearchSpace(drafts=VIEWS, schedule=schedule))
    assert p.draft is not None and p.batch_size == 8 and p.prompt_len == 8192 and p.new_tokens == 256


def test_the_space_is_checked_and_held_as_tuples():
    space = SearchSpace(drafts=list(VIEWS), budgets=[256, 512], gammas=range(1, 4))
    assert space.drafts == VIEWS and space.budgets == (256, 512) and space.gammas == (1, 2, 3)
    assert dataclasses.replace(space, budgets=[128]).budgets == (128,)
    with pytest.raises(ValueError, match="drafts: pass the draft views"):
        SearchSpace()
    with pytest.raises(ValueError, match="budgets must not be empty"):
        SearchSpace(drafts=VIEWS, budgets=())
    with pytest.raises(TypeError, match="draft view objects"):
        SearchSpace(drafts=("snapkv",))
    with pytest.raises(ValueError, match="new_tokens"):
        Workload(1, 128, -1)


def test_a_call_takes_the_objects_not_their_fields():
    with pytest.raises(TypeError, match="unexpected keyword"):
        search_plan(SPEC, Workload(1, 4096, 16), space=SearchSpace(drafts=VIEWS), batch_size=2)
    with pytest.raises(TypeError, match="unexpected keyword"):
        search_plan(SPEC, Workload(1, 4096, 16), space=SearchSpace(drafts=VIEWS), gammas=(1,))
    with pytest.raises(ValueError, match="drafts: pass the draft views"):
        search_plan(SPEC, Workload(1, 4096, 16))

"""``scripts/longgen_check.py`` (the long real-model comparison with the static cache) stays runnable:
a few of its cases at a twentieth of their new tokens, and a mismatch is reported as one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hf_magicdec_bench import models

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import longgen_check  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return models.load("smollm2-135m", progress=False)


@pytest.mark.parametrize("name", ["ragged-chat-eos-default", "processors-default", "topk1-sampling-chat-eos"])
def test_short_cases_are_identical(smollm2, name):
    model, tokenizer = smollm2
    case = longgen_check.CASES[name]
    # A budget below the short prompts and a fixed γ: the planner would decline this little work.
    case = dict(case, magicdec=dict(case["magicdec"], draft_budget=64, gamma=3))
    stock = name == "processors-default"  # --stock: plain generate (dynamic cache) checked and timed too
    result = longgen_check.run_case(model, tokenizer, name, case, scale=0.05, stock=stock)
    assert result["identical"], result
    assert ("stock_s" in result) is stock and result.get("stock_identical", True), result
    assert result["shape"][0] == len(case["lengths"])
    assert result["steps"] < result["new_tokens"]  # it drafted, and some drafts were accepted


def test_ragged_batch_left_pads_each_row_to_its_length(smollm2):
    _, tokenizer = smollm2
    ids, mask, pad = longgen_check.ragged_batch(tokenizer, [20, 35], chat=False)
    assert ids.shape == (2, 35) and mask.sum(1).tolist() == [20, 35]
    assert (ids[0, :15] == pad).all() and not torch.equal(ids[0, 15:], ids[1, 15:])


def test_a_changed_token_is_reported(smollm2, monkeypatch):
    model, tokenizer = smollm2
    generate = model.generate

    def altered(*args, **kwargs):
        out = generate(*args, **kwargs)
        if "speculative" in kwargs:
            out.sequences[1, -2] += 1  # one token of row 1
        return out

    monkeypatch.setattr(model, "generate", altered)
    case = dict(lengths=[40, 40], chat=False, eos=False, new=6, magicdec={})
    result = longgen_check.run_case(model, tokenizer, "altered", case)
    assert not result["identical"]
    assert result["first_diff"] == [None, 40 + 6 - 2]


def test_cli_lists_and_rejects_unknown_cases(capsys):
    assert longgen_check.main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert "batch1-default" in listed and "long-8k-default" in listed
    with pytest.raises(SystemExit):
        longgen_check.main(["no-such-case"])


def test_opt_in_cases_run_only_when_named():
    defaults = longgen_check.default_cases()
    assert "long-8k-default" not in defaults and "batch1-default" in defaults

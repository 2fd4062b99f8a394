"""``scripts/view_acceptance.py`` (views compared from one shared prefill) stays runnable, and
``--prompt-sets`` decodes disjoint prompt batches and sums each view's runs over them; ``--first-set``
starts further into the text."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import view_acceptance  # noqa: E402

pytestmark = pytest.mark.slow


def test_prompt_sets_compare_every_view_on_each_set_and_total_them(capsys):
    view_acceptance.main(["2", "128", "12", "64", "2", "attended:every=1", "snapkv", "snapkv",
                          "--draft-weights", "int8", "--prompt-sets", "2"])
    lines = capsys.readouterr().out.splitlines()
    runs = [line for line in lines if " gamma 2 int8: " in line]
    assert len(runs) == 6 and all(line.endswith("identical True") for line in runs)
    assert [line.split()[2] for line in lines if "plain (gamma=0)" in line] == ["0", "1"]
    # Odd sets run the views in reverse order (drift spreads over all of them).
    order = [line.split()[3] for line in runs]
    assert order == ["attended:every=1/64", "snapkv/64", "snapkv/64", "snapkv/64", "snapkv/64", "attended:every=1/64"]
    steps, row_steps = {}, {}
    for line in runs:
        spec = line.split()[3].rsplit("/", 1)[0]
        step, row_step = (int(n) for n in re.search(r"; (\d+) steps, (\d+) row-steps\)", line).groups())
        # Each of the 2 rows takes part in a step until it has its 12 tokens: at most 3 per step (γ 2).
        assert step <= row_step <= 2 * step and row_step >= 2 * 4
        steps[spec] = steps.get(spec, 0) + step
        row_steps[spec] = row_steps.get(spec, 0) + row_step
    totals = {line.split()[0]: line for line in lines if " runs (2 sets): " in line}
    assert totals.keys() == {"snapkv", "attended:every=1"}
    assert "over 4 runs" in totals["snapkv"] and "over 2 runs" in totals["attended:every=1"]
    for spec, line in totals.items():
        assert f": {steps[spec]} steps, {row_steps[spec]} row-steps," in line


def _runs(capsys) -> dict[str, tuple[str, str]]:
    """The runs just printed, label (batch x prompt -> new, set) -> acceptance and steps."""
    found = {}
    for line in capsys.readouterr().out.splitlines():
        match = re.match(r"(.*?) snapkv/64 gamma 2 full: acceptance ([\d.]+), .*; (\d+) steps, \d+ row-steps\)", line)
        if match:
            found[match.group(1)] = match.group(2, 3)
    return found


def test_first_set_decodes_the_prompts_of_that_set(capsys):
    view_acceptance.main(["2", "128", "12", "64", "2", "snapkv", "--prompt-sets", "2"])
    both = _runs(capsys)
    view_acceptance.main(["2", "128", "12", "64", "2", "snapkv", "--first-set", "1"])
    second = _runs(capsys)
    assert list(both) == ["2x128->12 set 0", "2x128->12 set 1"] and list(second) == ["2x128->12 set 1"]
    assert second["2x128->12 set 1"] == both["2x128->12 set 1"]


def test_bad_arguments_print_the_usage():
    with pytest.raises(SystemExit, match="Acceptance and decode time"):
        view_acceptance.main(["8", "256", "--prompt-sets", "0"])
    with pytest.raises(SystemExit, match="Acceptance and decode time"):
        view_acceptance.main(["2", "128", "12", "64", "2", "snapkv", "--first-set", "-1"])

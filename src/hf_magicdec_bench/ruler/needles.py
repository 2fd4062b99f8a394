"""RULER's retrieval and multi-hop tracing tasks: needle in a haystack (``niah_*``) and
variable tracking (``vt``).

Each ``_<task>(...)`` returns a plan ``(build, smallest size, largest size or None, tokens
per size unit)`` for :func:`hf_magicdec_bench.ruler.tasks.generate_samples` to size.
"""

from __future__ import annotations

import random
import string
from typing import Any, Callable

from .text import (
    _DEPTHS,
    _NEEDLE,
    _NOISE,
    _TEMPLATES,
    WordLists,
    _distinct,
    _haystack_words,
    _Plan,
    _random_value,
    _sentences,
)


def _niah(opts: dict[str, Any], haystack: str, word_lists: Callable[[], WordLists]) -> _Plan:
    num_k = max(opts["num_needle_k"], opts["num_needle_q"])
    num_v, num_q = opts["num_needle_v"], opts["num_needle_q"]
    type_k, type_v = opts["type_needle_k"], opts["type_needle_v"]
    if min(num_k, num_v, num_q) < 1 or num_k * num_v > len(_DEPTHS):
        raise ValueError(f"invalid needle counts {num_k=}, {num_v=}, {num_q=}")
    for kind in (type_k, type_v):
        if kind not in ("numbers", "words", "uuids"):
            raise ValueError(f"unknown needle type {kind=!r}; expected 'numbers', 'words' or 'uuids'")
    nouns, adjs, _ = word_lists()
    cfg = _TEMPLATES["niah"]
    template = cfg["template"] + cfg["answer_prefix"]
    type_name = type_v
    if num_q * num_v == 1:  # singular wording, exactly as RULER rewrites it
        template = (template.replace("Some", "A").replace("are all", "is").replace("are", "is")
                    .replace("answers", "answer"))
        type_name = type_v[:-1]
    words = None if haystack in ("noise", "needle") else _haystack_words(haystack)

    def build(rng: random.Random, size: int) -> tuple[str, list[str]]:
        keys = _distinct(rng, num_k, lambda r: _random_value(r, type_k, adjs, nouns))
        values = [_distinct(rng, num_v, lambda r: _random_value(r, type_v, adjs, nouns)) for _ in keys]
        needles = [_NEEDLE.format(type_needle_v=type_v, key=k, value=v)
                   for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        if haystack == "needle":  # RULER's "needle" haystack: every filler line is a distractor needle
            sentences = []
            while len(sentences) < size:
                key = _random_value(rng, type_k, adjs, nouns)
                if key not in keys:  # a distractor never answers the question
                    value = _random_value(rng, type_v, adjs, nouns)
                    sentences.append(_NEEDLE.format(type_needle_v=type_v, key=key, value=value))
            for index, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles):
                sentences.insert(index, needle)
            context = "\n".join(sentences)
        elif words is None:
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

    if haystack == "needle":  # distractor lines of ~18 tokens (uuids: ~40)
        return build, num_k * num_v, None, 40.0 if "uuids" in (type_k, type_v) else 18.0
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

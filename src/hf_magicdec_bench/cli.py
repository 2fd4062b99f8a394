"""``hf-magicdec``: the command-line entry point.

    hf-magicdec bench ...   decode speedup, acceptance and tokens per step vs stock ``generate``
    hf-magicdec acceptance ...  acceptance rate over draft views x budgets x contexts
    hf-magicdec plan  ...   the cost model's choice of draft view, budget and gamma

Each subcommand lives in its own module (``hf_magicdec_bench.bench``, ``hf_magicdec_bench.plan``)
and is imported only when used.
"""

from __future__ import annotations

import importlib
import sys

#: subcommand -> (module with ``main(argv) -> int``, one-line help)
COMMANDS = {
    "bench": ("hf_magicdec_bench.bench", "benchmark speculative decoding against stock generate"),
    "acceptance": ("hf_magicdec_bench.bench.acceptance", "acceptance over draft views x budgets x contexts (shared prefill)"),
    "plan": ("hf_magicdec_bench.plan", "print the planner's choice and a predicted-speedup grid"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: hf-magicdec {%s} [options]\n" % ",".join(COMMANDS))
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<8}{text}")
        print("\nRun 'hf-magicdec <command> --help' for a command's options.")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"hf-magicdec: unknown command {name!r}; choose one of {sorted(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())

"""``hf-magicdec``: the command-line entry point.

    hf-magicdec bench ...        decode speedup, acceptance and tokens per step vs stock ``generate``
    hf-magicdec demo ...         the benchmark's default comparison (``make demo``)
    hf-magicdec acceptance ...   acceptance rate over draft views x budgets x contexts
    hf-magicdec plan ...         the cost model's choice of draft view, budget and gamma
    hf-magicdec rollouts ...     GRPO-shaped generation (prompts x generations, sampling, EOS) timed
    hf-magicdec export-hub DIR   a transformers ``custom_generate`` repository that runs MagicDec

``hf-magicdec --version`` prints the version; ``--quiet`` (before or after the command, on every
command) turns off progress bars and informational messages. Each subcommand lives in its own module
and is imported only when used.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

PROG = "hf-magicdec"

#: subcommand -> (module with ``main(argv) -> int``, one-line help, whether it takes ``--quiet`` itself)
COMMANDS = {
    "bench": ("hf_magicdec_bench.bench", "benchmark speculative decoding against stock generate", True),
    "demo": ("hf_magicdec_bench.demo", "the benchmark's default comparison, a few minutes on 2 CPU cores", True),
    "acceptance": ("hf_magicdec_bench.bench.acceptance",
                   "acceptance over draft views x budgets x contexts (shared prefill)", False),
    "plan": ("hf_magicdec_bench.plan", "print the planner's choice and a predicted-speedup grid", True),
    "rollouts": ("hf_magicdec_bench.rollouts",
                 "time RL-rollout-shaped generation (prompts x generations, sampling, EOS honoured)", False),
    "export-hub": ("hf_magicdec_bench.hub",
                   "write a custom_generate repository: model.generate(custom_generate=DIR, trust_remote_code=True)",
                   True),
}

QUIET_FLAGS = ("--quiet", "-q")


def version() -> str:
    """The installed distribution's version (without importing torch), else the package's."""
    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        return dist_version("hf-magicdec")
    except PackageNotFoundError:
        from hf_magicdec import __version__

        return __version__


def usage() -> str:
    lines = [f"usage: {PROG} [--version] [--quiet] {{{','.join(COMMANDS)}}} [options]", "",
             "Lossless self-speculative decoding (MagicDec) for Hugging Face transformers: benchmarks, planning and",
             "publishing.", "", "commands:"]
    width = max(map(len, COMMANDS)) + 2
    lines += [f"  {name:<{width}}{text}" for name, (_, text, _) in COMMANDS.items()]
    lines += ["", "options:",
              f"  {'-h, --help':<{width + 4}}show this message and exit",
              f"  {'--version':<{width + 4}}print the version and exit",
              f"  {'-q, --quiet':<{width + 4}}no progress bars or informational messages (any command)",
              "", f"Run '{PROG} <command> --help' for a command's options."]
    return "\n".join(lines)


def quiet() -> None:
    """Silence progress bars (tqdm, Hub downloads, transformers) and informational logging."""
    os.environ["TQDM_DISABLE"] = "1"  # tqdm >= 4.66 reads TQDM_* defaults from the environment
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    logging.getLogger("hf_magicdec").setLevel(logging.ERROR)
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    is_quiet = False
    while argv and argv[0].startswith("-"):  # options before the command
        flag = argv.pop(0)
        if flag in ("-h", "--help"):
            print(usage())
            return 0
        if flag in ("-V", "--version"):
            print(f"{PROG} {version()}")
            return 0
        if flag in QUIET_FLAGS:
            is_quiet = True
            continue
        print(f"{PROG}: unknown option {flag!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if not argv:
        print(usage(), file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"{PROG}: unknown command {name!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module_name, _, takes_quiet = COMMANDS[name]
    is_quiet = is_quiet or any(a in QUIET_FLAGS for a in rest)
    rest = [a for a in rest if a not in QUIET_FLAGS]
    if is_quiet:
        quiet()
        if takes_quiet:
            rest.append("--quiet")
    module = importlib.import_module(module_name)
    kwargs = {"prog": f"{PROG} {name}"} if name in ("demo", "export-hub", "rollouts") else {}
    return int(module.main(rest, **kwargs) or 0)


if __name__ == "__main__":
    raise SystemExit(main())

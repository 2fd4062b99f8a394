#!/usr/bin/env python
"""Render ``scripts/gpu_check.py``'s JSON as markdown tables (runs anywhere: json and the standard
library only; a partial JSON, from a run stopped by its time limit, renders what it holds).

    python scripts/gpu_report.py gpu_check.json                    # markdown to stdout
    python scripts/gpu_report.py gpu_check.json --out gpu_check.md

Tables: the run (device, versions, status), the verdict against the targets, kernel correctness,
verify-attention bandwidth, the step-time ratios per model shape, HF's stock decode step, the
end-to-end comparison, the draft views and long generation (issue 26), and what was skipped or failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: verdict key -> (label, target key in the JSON's "targets", "<=" or ">=")
VERDICT_ROWS = (
    ("correctness", "Triton kernels match the fp32 twin (bf16, fp16)", None, None),
    ("verify_bandwidth_fraction", "verify kernel bandwidth / copy bandwidth (q = 5)", "verify_bandwidth_fraction",
     ">="),
    ("tv4_over_tt", "T_V(4) / T_T, eager", "tv4_over_tt", "<="),
    ("td512_over_tt", "T_D(512) / T_T, eager", "td512_over_tt", "<="),
    ("graphs_tv4_over_tt", "T_V(4) / T_T, captured (compile=)", "graphs_tv4_over_tt", "<="),
    ("graphs_td512_over_tt", "T_D(512) / T_T, captured", "graphs_td512_over_tt", "<="),
    ("graphs_td512_quantized_over_tt", "T_D(512) / T_T, captured, quantized draft weights", None, None),
    ("end_to_end_speedup", "decode speedup vs compiled stock static cache", "end_to_end_speedup", ">="),
    ("end_to_end_identical", "end-to-end greedy tokens identical", None, None),
)


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value).replace("|", "\\|")


def _table(header: list[str], rows: list[list], align: str | None = None) -> list[str]:
    align = align or "l" + "r" * (len(header) - 1)
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(_fmt(c) if not isinstance(c, str) else c.replace("|", "\\|") for c in row) + " |"
              for row in rows]
    return lines + [""]


def _keys(rows: list[dict], field: str) -> list[str]:
    """Union of the (string or int) keys of ``row[field]`` over ``rows``, in numeric order."""
    keys = {str(k) for r in rows for k in (r.get(field) or {})}
    return sorted(keys, key=lambda k: (float(k) if k.replace(".", "", 1).isdigit() else float("inf"), k))


def _get(mapping: dict | None, key: str):
    if not mapping:
        return None
    return mapping.get(key, mapping.get(int(key)) if key.isdigit() else None)


def _err(value: float | None) -> str:
    """An error in scientific notation (three decimals would print most of them as 0.000)."""
    return "–" if value is None else f"{value:.1e}"


def render(report: dict) -> str:
    out = ["# GPU check", ""]
    status = report.get("status", "complete" if report.get("complete", True) else "incomplete")
    complete = report.get("complete", "verdict" in report)
    out += _table(["", ""], [
        ["device", _fmt(report.get("device"))],
        ["torch / triton / transformers", " / ".join(_fmt(report.get(k)) for k in ("torch", "triton", "transformers"))],
        ["started", _fmt(report.get("started"))],
        ["seconds", _fmt(report.get("seconds"), 0)],
        ["status", f"{status}" + ("" if complete else " (partial: stopped before the end)")],
        ["smoke (tiny shapes, not figures)", _fmt(bool(report.get("smoke")))],
        ["copy bandwidth GB/s", _fmt(report.get("copy_gb_per_s"), 0)],
    ], "ll")

    verdict, targets = report.get("verdict") or {}, report.get("targets") or {}
    rows = []
    for key, label, target_key, op in VERDICT_ROWS:
        value = verdict.get(key)
        target = targets.get(target_key) if target_key else None
        meets = None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and target is not None:
            meets = value <= target if op == "<=" else value >= target
        rows.append([label, _fmt(value), f"{op} {target}" if target is not None else "–", _fmt(meets)])
    out += ["## Verdict", ""] + _table(["figure", "measured", "target", "meets"], rows, "lrrl")

    correctness = report.get("correctness") or []
    if correctness:
        rows = [[r.get("kernel"), r.get("kind", f"verify, mass per {r['page_size']}" if "page_size" in r else "–"),
                 r.get("dtype", "").replace("torch.", ""),
                 "×".join(str(r[k]) for k in ("batch", "group", "kv_heads", "q", "head_dim") if k in r) or "–",
                 r.get("kv_len"), _err(r.get("max_abs_err", r.get("max_rel_err"))), _err(r.get("mass_max_rel_err")),
                 r.get("ok")] for r in correctness]
        out += ["## Kernel correctness (vs the fp32 twin)", "",
                "Max err: output, absolute (SnapKV's mass: relative to its largest); mass err: the per-page "
                "attention mass the verify kernel emits (`page_size=`), relative to its largest.", ""]
        out += _table(["kernel", "kind", "dtype", "B×g×Hkv×q×D", "keys", "max err", "mass err", "ok"], rows,
                      "llllrrrl")

    kernel = report.get("kernel") or []
    if kernel:
        rows = [[r.get("path"), r.get("q"), r.get("batch"), r.get("context"), r.get("ms"), r.get("gb_per_s"),
                 r.get("fraction_of_copy"), r.get("error", "")] for r in kernel]
        out += ["## Verify attention over the full cache", ""]
        out += _table(["path", "q", "batch", "context", "ms", "GB/s", "of copy", "error"], rows, "lrrrrrrl")

    model = [r for r in report.get("model") or [] if "path" not in r]
    if model:
        gammas, budgets = _keys(model, "tv_over_tt"), _keys(model, "td_over_tt")
        quant = _keys(model, "td_quantized_over_tt")
        header = (["model", "batch", "context", "steps", "T_T ms"] + [f"T_V({g})/T_T" for g in gammas]
                  + [f"T_D({b})/T_T" for b in budgets] + [f"T_D({b}) quantized" for b in quant] + ["error"])
        rows = []
        for r in model:
            steps = "captured" if r.get("graphs") else "eager"
            rows.append([r.get("model"), r.get("batch"), r.get("context"), steps, r.get("t_target_ms")]
                        + [_get(r.get("tv_over_tt"), g) for g in gammas]
                        + [_get(r.get("td_over_tt"), b) for b in budgets]
                        + [_get(r.get("td_quantized_over_tt"), b) for b in quant] + [r.get("error", "")])
        weights = sorted({r.get("draft_weights") for r in model if r.get("draft_weights")})
        out += ["## Step times (engine forwards)", ""]
        if weights:
            out += [f"Quantized draft weights: {', '.join(weights)}.", ""]
        out += _table(header, rows, "lrrl" + "r" * (len(header) - 5) + "l")

    stock = [r for r in report.get("model") or [] if r.get("path")]
    if stock:
        out += ["## Stock decode step (DynamicCache, sdpa)", ""]
        out += _table(["model", "batch", "context", "ms", "error"],
                      [[r.get("model"), r.get("batch"), r.get("context"), r.get("t_target_ms"), r.get("error", "")]
                       for r in stock], "lrrrl")

    e2e = report.get("end_to_end")
    if e2e:
        out += ["## End to end (decode, MagicDec vs compiled stock static cache)", ""]
        if "skipped" in e2e or "error" in e2e:
            what = "Skipped" if "skipped" in e2e else "Failed"
            out += [f"{what}: {_fmt(e2e.get('skipped') or e2e.get('error'))}", ""]
        else:
            out += _table(["model", "layers", "batch", "context", "new tokens", "stock static s", "magicdec s",
                           "steps", "acceptance", "speedup", "identical"],
                          [[e2e.get("model"), e2e.get("layers"), e2e.get("batch"), e2e.get("context"),
                            e2e.get("new_tokens"), e2e.get("stock_static_decode_s"), e2e.get("magicdec_decode_s"),
                            e2e.get("magicdec_steps"), e2e.get("magicdec_acceptance"),
                            e2e.get("speedup_vs_compiled_static"), e2e.get("identical")]], "lrrrrrrrrrl")

    views = report.get("views") or []
    if views:
        out += ["## Draft views and long generation (issue 26; random weights: acceptance is not text's)", ""]
        out += _table(["shape", "method", "batch", "prompt", "new", "decode s", "steps", "acceptance", "γ mean",
                       "draft s", "verify s", "other s", "same tokens as first", "note"],
                      [[r.get("shape"), r.get("method"), r.get("batch"), r.get("prompt"), r.get("new_tokens"),
                        r.get("decode_s"), r.get("steps"), r.get("acceptance"), r.get("gamma_mean"),
                        r.get("draft_s"), r.get("verify_s"), r.get("other_s"), r.get("identical_to_first"),
                        _fmt(r.get("error") or r.get("skipped") or "")] for r in views],
                      "llrrrrrrrrrrll")

    skipped = report.get("skipped") or []
    if skipped:
        out += ["## Skipped (time budget)", ""]
        out += [f"- {', '.join(f'{k}={v}' for k, v in s.items())}" for s in skipped] + [""]
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", type=Path, help="gpu_check.py's output")
    parser.add_argument("--out", type=Path, help="write the markdown here (default: stdout)")
    args = parser.parse_args(argv)
    text = render(json.loads(args.json.read_text()))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

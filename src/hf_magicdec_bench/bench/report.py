"""Benchmark output: the terminal tables, JSONL rows and PNG plots."""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

from .runner import Result

log = logging.getLogger("hf_magicdec")


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def _label_width(results) -> int:
    return max([32, *(len(r.label) + 2 for r in results)])


def table(results: list[Result]) -> str:
    """The main table: one line per method and (batch, context) point."""
    w = _label_width(results)
    head = (f"{'B':>3} {'ctx':>6}  {'method':<{w}}{'prefill s':>10}{'decode s':>10}{'tok/s':>9}{'ms/tok':>8}"
            f"{'vs stock':>9}{'vs AR':>7}{'accept':>8}{'tok/step':>9}{'peak MB':>9}{'GB/s':>7}  identical")
    lines = [head, "-" * len(head)]
    for r in results:
        d = r.to_dict()
        ident = "(baseline)" if r.identical is None else ("yes" if r.identical else "NO")
        lines.append(
            f"{r.batch:>3} {r.context:>6}  {r.label:<{w}}{r.m.prefill_s:>10.2f}{r.m.decode_s:>10.2f}"
            f"{r.decode_tok_per_s:>9.1f}{r.ms_per_token:>8.1f}{_fmt(r.speedup_vs_stock, '.2f', 'x'):>9}"
            f"{_fmt(r.speedup_vs_ar, '.2f', 'x'):>7}{_fmt(d.get('acceptance_rate'), '.3f'):>8}"
            f"{_fmt(d.get('tokens_per_step'), '.2f'):>9}{_fmt(d['peak_memory_mb'], '.0f'):>9}"
            f"{_fmt(r.gb_per_s, '.1f'):>7}  {ident}"
        )
    return "\n".join(lines)


def breakdown_table(results: list[Result]) -> str:
    """Where a MagicDec step's time goes, next to the cost model's prediction when there is one."""
    rows = [r for r in results if r.breakdown()]
    if not rows:
        return ""
    w = _label_width(rows)
    head = (f"{'B':>3} {'ctx':>6}  {'method':<{w}}{'steps':>6}{'draft ms':>10}{'verify ms':>10}{'other ms':>10}"
            f"{'mean acc':>9}  {'histogram (accepted 0..γ)':<28}{'predicted':>10}{'vs AR':>8}")
    lines = ["per verification step:", head, "-" * len(head)]
    for r in rows:
        b, d = r.breakdown(), r.to_dict()
        lines.append(
            f"{r.batch:>3} {r.context:>6}  {r.label:<{w}}{b['steps']:>6}{b['draft_ms_per_step']:>10.1f}"
            f"{b['verify_ms_per_step']:>10.1f}{b['other_ms_per_step']:>10.1f}{_fmt(d.get('mean_accepted'), '.2f'):>9}  "
            f"{str(d.get('accepted_histogram', '-')):<28}{_fmt(r.predicted_speedup, '.2f', 'x'):>10}"
            f"{_fmt(r.speedup_vs_ar, '.2f', 'x'):>8}"
        )
    lines.append("predicted: the cost model's speedup over own AR with the run's measured acceptance "
                 "(calibrated when `hf-magicdec plan --calibrate` ran on this device)")
    return "\n".join(lines)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "a") as fh:
        for row in rows:
            fh.write(json.dumps(row, default=str) + "\n")


def _pyplot():
    try:
        import matplotlib  # optional dependency

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional dependency
    except ImportError:
        log.warning("matplotlib is not installed: no plots (pip install 'hf-magicdec[bench]')")
        return None
    return plt


def plots(results: list[Result], out: Path, title: str) -> list[Path]:
    """Write the plots the grid supports; returns their paths.

    - ``throughput.png``: decode tokens/s per method at each (batch, context) point;
    - ``speedup_vs_batch.png`` / ``speedup_vs_context.png`` when the grid varies that axis;
    - ``acceptance_vs_budget.png`` per draft view when several budgets ran.
    """
    plt = _pyplot()
    if plt is None or not results:
        return []
    written = []
    shown = ("stock", "stock-static", "own-ar", "magicdec")
    points = sorted({(r.batch, r.context) for r in results if r.method in shown})
    # 1. throughput bars per point
    fig, axes = plt.subplots(len(points), 1, figsize=(8, 0.5 + 0.42 * max(len(results) // max(len(points), 1), 2)
                                                        * len(points)), squeeze=False)
    for ax, (b, c) in zip(axes[:, 0], points):
        rows = [r for r in results if (r.batch, r.context) == (b, c) and r.method in shown]
        values = [r.decode_tok_per_s for r in rows]
        colors = ["#888" if r.method.startswith("stock") else "#58a" if r.method == "own-ar" else "#2a7" for r in rows]
        bars = ax.barh([r.label for r in rows], values, color=colors)
        for bar, r in zip(bars, rows):
            note = f"  {r.decode_tok_per_s:.1f} tok/s"
            if r.method != "stock" and r.speedup_vs_stock is not None:
                note += f"  {r.speedup_vs_stock:.2f}x" + ("" if r.identical else "  NOT IDENTICAL")
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, note, va="center", fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, max(values) * 1.5)
        ax.set_title(f"batch {b}, context {c}", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[-1, 0].set_xlabel("decode throughput (generated tokens / s)")
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    written.append(out / "throughput.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    spec_rows = [r for r in results if r.method in ("stock-static", "own-ar", "magicdec")]
    for axis, other, name in (("batch", "context", "speedup_vs_batch"), ("context", "batch", "speedup_vs_context")):
        if len({getattr(r, axis) for r in spec_rows}) < 2:
            continue
        series = defaultdict(list)
        for r in spec_rows:
            series[(r.label, getattr(r, other))].append((getattr(r, axis), r.speedup_vs_stock))
        fig, ax = plt.subplots(figsize=(6.4, 4))
        for (label, fixed), pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{label}, {other} {fixed}")
        ax.axhline(1.0, color="#888", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ticks = sorted({getattr(r, axis) for r in spec_rows})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel(axis)
        ax.set_ylabel("decode speedup vs stock generate")
        ax.set_title(title, fontsize=8)
        ax.legend(fontsize=6)
        fig.tight_layout()
        written.append(out / f"{name}.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

    mag = [r for r in results if r.method == "magicdec" and r.m.speculation is not None and r.m.speculation.steps]
    if len({r.m.speculation.draft_budget for r in mag}) >= 2:
        series = defaultdict(list)
        for r in mag:  # resolved values: "auto" rows land where the planner put them
            s = r.m.speculation
            series[(s.draft, r.context, str(r.config.gamma))].append((s.draft_budget, s.acceptance_rate))
        written.append(out / "acceptance_vs_budget.png")
        acceptance_plot({(d, c, f"γ={g}"): pts for (d, c, g), pts in series.items()}, written[-1], title)
    return written


def acceptance_plot(series: dict, path: Path, title: str) -> bool:
    """Acceptance vs budget, one line per ``(draft, context, note)`` key of ``series``, whose values
    are ``(budget, acceptance)`` points. Returns False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for (draft, ctx, note), pts in sorted(series.items()):
        pts = sorted(dict(pts).items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ls="-" if draft == "snapkv" else "--",
                label=f"{draft}, context {ctx}" + (f", {note}" if note else ""))
    ax.set_xscale("log", base=2)
    budgets = sorted({p[0] for pts in series.values() for p in pts})
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("draft budget (tokens per layer, row and KV head)")
    ax.set_ylabel("acceptance rate α")
    ax.set_title(title, fontsize=7)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True

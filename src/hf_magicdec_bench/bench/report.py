"""Benchmark output: the terminal tables, JSONL rows and PNG plots."""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from pathlib import Path

from .runner import Result

log = logging.getLogger("hf_magicdec")


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def _label_width(results) -> int:
    return max([32, *(len(r.label) + 2 for r in results)])


def table(results: list[Result]) -> str:
    """The main table: one line per method and (batch, context) point.

    ``plan``: what each MagicDec row ran (draft view/budget, γ or mean γ when adaptive, draft
    weights; ``plain (declined)`` when the planner chose plain decoding). With the rounds protocol
    the prefill column is each round's time to the first token (the shared prefill's copy, the
    draft view's construction) and ``spread`` the decode's (max - min) / median over the rounds;
    ``vs static`` appears when the static-cache baseline ran.
    """
    w = _label_width(results)
    rounds = any("decode_spread" in r.extra for r in results)
    static = any(r.speedup_vs_static is not None for r in results)
    plans = [r.to_dict().get("plan_label") or "-" for r in results]
    pw = max([6, *(len(p) + 2 for p in plans)])
    head = (f"{'B':>3} {'ctx':>6}  {'method':<{w}}{'plan':<{pw}}{'1st tok s' if rounds else 'prefill s':>10}"
            f"{'decode s':>10}{format('spread', '>8') if rounds else ''}{'tok/s':>9}{'ms/tok':>8}{'vs stock':>9}"
            f"{format('vs static', '>10') if static else ''}{'vs AR':>7}{'accept':>8}{'tok/step':>9}{'peak MB':>9}"
            f"{'GB/s':>7}  identical")
    lines = [head, "-" * len(head)]
    for r, plan in zip(results, plans):
        d = r.to_dict()
        ident = ("sampled" if r.extra.get("sampled") else "(baseline)") if r.identical is None else (
            "yes" if r.identical else "NO")
        spread = f"{_fmt(100 * r.extra['decode_spread'] if 'decode_spread' in r.extra else None, '.0f', '%'):>8}"
        lines.append(
            f"{r.batch:>3} {r.context:>6}  {r.label:<{w}}{plan:<{pw}}{r.m.prefill_s:>10.2f}{r.m.decode_s:>10.2f}"
            f"{spread if rounds else ''}"
            f"{r.decode_tok_per_s:>9.1f}{r.ms_per_token:>8.1f}{_fmt(r.speedup_vs_stock, '.2f', 'x'):>9}"
            f"{format(_fmt(r.speedup_vs_static, '.2f', 'x'), '>10') if static else ''}"
            f"{_fmt(r.speedup_vs_ar, '.2f', 'x'):>7}{_fmt(d.get('acceptance_rate'), '.3f'):>8}"
            f"{_fmt(d.get('tokens_per_step'), '.2f'):>9}{_fmt(d['peak_memory_mb'], '.0f'):>9}"
            f"{_fmt(r.gb_per_s, '.1f'):>7}  {ident}"
        )
    return "\n".join(lines)


def rounds_notes(results: list[Result], threshold: float | None = None) -> str:
    """What the rounds protocol's table needs said under it: the prefills (once per point), how the
    rounds ran, plans that changed between rounds, and the busy-machine WARNING when it applies."""
    from .rounds import BUSY_SPREAD, busy_warning

    rows = [r for r in results if "decode_spread" in r.extra]
    if not rows:
        return ""
    lines = []
    for b, c in sorted({(r.batch, r.context) for r in rows}):
        point = [r for r in rows if (r.batch, r.context) == (b, c)]
        stock = next((r for r in point if r.method == "stock"), None)
        shared = next((r.extra.get("shared_prefill_s") for r in point if r.extra.get("shared_prefill_s")), None)
        parts = []
        if stock is not None and "reference_prefill_s" in stock.extra:
            role = ("the prompt cache of the rounds" if stock.extra.get("sampled") else
                    f"also the token reference; decode {stock.extra['reference_decode_s']:.2f} s, not counted")
            parts.append(f"stock generate {stock.extra['reference_prefill_s']:.2f} s (from scratch, {role})")
        if shared is not None:
            parts.append(f"MagicDec {shared:.2f} s (chunked, shared by own AR and every MagicDec row)")
        lines.append(f"prefill, once for B={b} S={c}: " + "; ".join(parts))
    n = max(r.extra["rounds"] for r in rows)
    lines.append(f"{n} round(s), order rotated each round; decode s = median over the rounds, spread = (max - min) / "
                 "median; speedups from the medians. Stock and static cache continue from copies of the reference's "
                 "prompt cache, own AR and MagicDec from the shared prefill ('1st tok s': each round's copy, last "
                 "prompt token and draft-view construction).")
    for r in rows:
        plans = r.extra.get("round_plans") or []
        if len(set(plans)) > 1:
            lines.append(f"note: {r.label} ran different plans in different rounds: {', '.join(plans)}")
        passed = r.extra.get("round_cache_passed") or []
        if any(passed):
            lines.append(f"note: {r.label}: after the planner declined, the next round continued from a copy of "
                         "stock's prompt cache (as stock does)")
            if any(p and plan != "plain (declined)" for p, plan in zip(passed, plans)):
                lines.append(f"note: {r.label} speculated in a round that continued from stock's cache: that "
                             "round's decode includes handing the cache back")
    if n < 2:
        lines.append("one round: no spread to judge the machine by (--rounds 3 or more for that)")
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    warning = busy_warning(rows, BUSY_SPREAD if threshold is None else threshold, load)
    if warning:
        lines.append(warning)
    return "\n".join(lines)


def planned_decode_speedup(result: Result) -> float | None:
    """The decode speedup generate's plan of this call predicted (None: no plan, or it did not speculate)."""
    s = result.m.speculation
    plan = getattr(s, "plan", None) or {}
    return plan.get("predicted_decode_speedup") if plan.get("speculate") else None


def breakdown_table(results: list[Result]) -> str:
    """Where a MagicDec step's time goes, next to the cost model's prediction when there is one."""
    rows = [r for r in results if r.breakdown()]
    if not rows:
        return ""
    w = _label_width(rows)
    head = (f"{'B':>3} {'ctx':>6}  {'method':<{w}}{'steps':>6}{'draft ms':>10}{'verify ms':>10}{'other ms':>10}"
            f"{'mean acc':>9}  {'histogram (accepted 0..γ)':<28}{'planned':>9}{'predicted':>10}{'vs AR':>8}")
    lines = ["per verification step:", head, "-" * len(head)]
    for r in rows:
        b, d = r.breakdown(), r.to_dict()
        lines.append(
            f"{r.batch:>3} {r.context:>6}  {r.label:<{w}}{b['steps']:>6}{b['draft_ms_per_step']:>10.1f}"
            f"{b['verify_ms_per_step']:>10.1f}{b['other_ms_per_step']:>10.1f}{_fmt(d.get('mean_accepted'), '.2f'):>9}  "
            f"{str(d.get('accepted_histogram', '-')):<28}{_fmt(planned_decode_speedup(r), '.2f', 'x'):>9}"
            f"{_fmt(r.predicted_speedup, '.2f', 'x'):>10}"
            f"{_fmt(r.speedup_vs_ar, '.2f', 'x'):>8}"
        )
    lines.append("planned: the speedup over own AR that generate's plan of the call predicted, at the prior "
                 "acceptance, for the decode steps alone (Plan.predicted_decode_speedup: without a one-time build "
                 "of quantized draft weights, which the decode time does not hold)")
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

    - ``throughput.png``: decode tokens/s per method at each (batch, context) point (with the
      rounds protocol: the median as the bar, each round as a dot, the range as an error bar);
    - ``speedup_vs_batch.png`` / ``speedup_vs_context.png`` when the grid varies that axis;
    - ``speedup_vs_position.png`` (one per point) for long generations (``new_tokens`` >=
      :data:`LONG_GENERATION`) with the rounds protocol: speedup over the static-cache baseline in
      windows of the generation (:func:`position_speedups`), and the MagicDec rows' mean γ and
      acceptance in windows (``position_schedule``);
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
        names = [r.label + (f": {r.to_dict()['plan_label']}" if r.config is not None and r.config.planner_may_decline
                            else "") for r in rows]  # the default plan: what the planner chose
        bars = ax.barh(names, values, color=colors)
        for y, r in enumerate(rows):  # rounds protocol: every round's throughput, and its range
            per_round = [r.decode_tokens / d for d in r.m.decode_all if d > 0]
            if len(per_round) > 1 and "decode_spread" in r.extra:
                ax.errorbar([r.decode_tok_per_s], [y], xerr=[[r.decode_tok_per_s - min(per_round)],
                                                            [max(per_round) - r.decode_tok_per_s]],
                            fmt="none", ecolor="#333", elinewidth=0.8, capsize=2)
                ax.plot(per_round, [y] * len(per_round), "o", color="#333", ms=2.5)
        for bar, r in zip(bars, rows):
            note = f"  {r.decode_tok_per_s:.1f} tok/s"
            if "decode_spread" in r.extra and len(r.m.decode_all) > 1:
                note += f"  (spread {100 * r.extra['decode_spread']:.0f}%)"
            if r.method != "stock" and r.speedup_vs_stock is not None:
                note += f"  {r.speedup_vs_stock:.2f}x" + ("  NOT IDENTICAL" if r.identical is False else "")
            right = max([bar.get_width(), *(r.decode_tokens / d for d in r.m.decode_all if d > 0)])
            ax.text(right, bar.get_y() + bar.get_height() / 2, note, va="center", fontsize=7)
        ax.invert_yaxis()
        top = max([*values, *(r.decode_tokens / d for r in rows for d in r.m.decode_all if d > 0)])
        ax.set_xlim(0, top * 1.6)
        ax.set_title(f"batch {b}, context {c}", fontsize=8)
        ax.tick_params(labelsize=7)
    rounds = any("decode_spread" in r.extra for r in results)
    axes[-1, 0].set_xlabel("decode throughput (generated tokens / s)"
                           + ("; bar: median over the rounds, dots: each round" if rounds else ""), fontsize=8)
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

    for (b, c) in points:
        rows = [r for r in results if (r.batch, r.context) == (b, c) and len(r.extra.get("position_trace") or ()) > 1]
        if rows and rows[0].new_tokens >= LONG_GENERATION:
            path = out / (f"speedup_vs_position_b{b}_s{c}.png" if len(points) > 1 else "speedup_vs_position.png")
            if position_plot(rows, path, f"{title}\nbatch {b}, prompt {c}"):
                written.append(path)

    mag = [r for r in results if r.method == "magicdec" and r.m.speculation is not None and r.m.speculation.steps]
    if len({r.m.speculation.draft_budget for r in mag}) >= 2:
        series = defaultdict(list)
        for r in mag:  # resolved values: "auto" rows land where the planner put them
            s = r.m.speculation
            series[(s.draft, r.context, str(r.config.gamma))].append((s.draft_budget, s.acceptance_rate))
        written.append(out / "acceptance_vs_budget.png")
        acceptance_plot({(d, c, f"γ={g}"): pts for (d, c, g), pts in series.items()}, written[-1], title)
    return written


#: New tokens from which a point gets the speedup-vs-position plot.
LONG_GENERATION = 256
#: Windows of the generation the position plot measures the speedup in.
POSITION_WINDOWS = 16


def _time_at(trace: list, position: float) -> float:
    """Seconds since the first new token at which ``trace`` reached ``position`` (interpolated)."""
    prev = (0, 0.0)
    for pos, sec in trace:
        if pos >= position:
            span = pos - prev[0]
            return prev[1] + (sec - prev[1]) * ((position - prev[0]) / span if span else 1.0)
        prev = (pos, sec)
    return trace[-1][1]


def position_speedups(rows: list[Result], windows: int = POSITION_WINDOWS) -> tuple[str, dict[str, list]]:
    """Per method, ``[(window mid-position, speedup in that window)]`` against the static-cache
    baseline (stock's own cache when it did not run): the reference's time to go through the
    window over the method's, from the rounds' median-run position traces."""
    ref = next((r for r in rows if r.method == "stock-static"), None) or next(r for r in rows if r.method == "stock")
    end = min(r.extra["position_trace"][-1][0] for r in rows)
    edges = [end * i / windows for i in range(windows + 1)]
    rt = [_time_at(ref.extra["position_trace"], e) for e in edges]
    out = {}
    for r in rows:
        if r is ref:
            continue
        mt = [_time_at(r.extra["position_trace"], e) for e in edges]
        out[r.label] = [((edges[i] + edges[i + 1]) / 2, (rt[i + 1] - rt[i]) / (mt[i + 1] - mt[i]))
                        for i in range(windows) if mt[i + 1] > mt[i]]
    return ref.label, out


def position_plot(rows: list[Result], path: Path, title: str) -> bool:
    """``speedup_vs_position.png``: each method's speedup over the static-cache baseline in windows
    of the generation, by position (long generations: where speculation starts to pay), and under
    it the mean γ and the acceptance of the MagicDec rows in the same windows (where the schedule
    speculated, and how well). Returns False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    ref_label, series = position_speedups(rows)
    ref = next(r for r in rows if r.label == ref_label)
    scheduled = [r for r in rows if r.extra.get("position_schedule")]
    if scheduled:
        fig, (ax, ax_gamma, ax_acc) = plt.subplots(3, 1, figsize=(7, 7.6), sharex=True,
                                                   gridspec_kw={"height_ratios": [2.2, 1, 1]})
    else:
        fig, ax = plt.subplots(figsize=(7, 4.2))
    colors = {}
    for label, pts in series.items():
        r = next(x for x in rows if x.label == label)
        name = label + (f": {r.to_dict()['plan_label']}" if r.config is not None and r.config.planner_may_decline
                        else "")
        line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=name,
                        ls="--" if r.method in ("stock", "own-ar") else "-")
        colors[label] = line.get_color()
    ax.axhline(1.0, color="#888", lw=0.8, ls="--")
    ax.set_ylabel(f"speedup vs {'static cache' if ref.method == 'stock-static' else 'stock'}\n"
                  f"(windows of {rows[0].new_tokens // POSITION_WINDOWS} tokens)")
    if scheduled:
        for r in scheduled:
            pts = r.extra["position_schedule"]
            ax_gamma.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", color=colors.get(r.label))
            acc = [p for p in pts if p[2] is not None]
            ax_acc.plot([p[0] for p in acc], [p[2] for p in acc], marker=".", color=colors.get(r.label))
        ax_gamma.set_ylabel("mean γ\n(0: plain steps)")
        ax_acc.set_ylabel("acceptance α")
        ax.tick_params(labelbottom=False)
        ax_acc.set_xlabel("new tokens generated (mean per row)")
    else:
        ax.set_xlabel("new tokens generated (mean per row)")
    _finish(plt, fig, ax, path, title, 8)
    return True


def _finish(plt, fig, ax, path: Path, title: str, title_size: int) -> None:
    """Title, legend, layout; write ``path`` and close the figure."""
    ax.set_title(title, fontsize=title_size)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    _finish(plt, fig, ax, path, title, 7)
    return True

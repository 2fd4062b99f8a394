"""Plot the row curves of CPU calibrations: the linear layers' time by rows, against a roofline's.

    python scripts/row_curve.py ~/.cache/hf_magicdec/models/calibration/*.json --out row_curve.png

Each file is a calibration (``hf-magicdec plan --model M --calibrate``, format 4) with a row curve:
the measured time of one pass over the model's linear layers at 1 … 128 rows (batch × query tokens),
relative to one row, beside the roofline the same calibration's forwards fit without the curve
(``bytes / bandwidth + FLOPs / FLOP/s``, the additive CPU form), also relative to one row.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hf_magicdec.calibration import Calibration
from hf_magicdec.calibration.fit import fit
from hf_magicdec.planner.roofline import group_work


def roofline_curve(cal: Calibration) -> list[tuple[int, float]]:
    """The linear layers' time by rows relative to one row, as the roofline fitted without a curve says."""
    spec = cal.spec.with_dtype(cal.dtype)
    plain = fit(spec, [m for m in cal.measurements if m.weights == "full"], base="cpu", form="sum")

    def seconds(rows: int) -> float:
        work = group_work(spec, 1, batch=rows, query_tokens=1, kv_tokens=1, logit_tokens=1)
        return sum(n * (b / plain.bandwidth + f / plain.flops)
                   for name, (f, b, n) in work.items() if name in ("linear", "lm_head"))

    return [(rows, seconds(rows) / seconds(1)) for rows, _ in cal.linear_rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("calibrations", nargs="+", type=Path, help="calibration JSON files with a row curve")
    ap.add_argument("--out", type=Path, default=Path("row_curve.png"))
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    calibrations = [(path, Calibration.load(path)) for path in args.calibrations]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for path, cal in calibrations:
        if not cal.linear_rows:
            print(f"{path}: no row curve (a GPU, or a calibration before format 4)", file=sys.stderr)
            continue
        name = Path(cal.model).name
        rows, measured = zip(*cal.linear_rows)
        line, = ax.plot(rows, measured, marker="o", label=f"{name}: measured")
        ax.plot(rows, [f for _, f in roofline_curve(cal)], linestyle="--", color=line.get_color(),
                label=f"{name}: roofline fitted without the curve")
    ax.set_xscale("log", base=2)
    first = calibrations[0][1]
    ticks = [rows for rows, _ in first.linear_rows]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("rows (batch × query tokens)")
    ax.set_ylabel("linear layers' time / one row's")
    ax.set_title(f"CPU row curves ({first.device})", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

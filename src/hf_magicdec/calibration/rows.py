"""The CPU row curve: how the time of the model's linear layers grows with the rows they multiply.

A CPU GEMM library streams the weights once for a few rows and switches to a packed kernel beyond
(from 4 rows on the 2-core Xeon of docs/benchmarks.md), so a 5-token verify costs about twice a
plain step there, where a roofline of bytes and FLOPs says 1.1×. The curve is measured on the model's own
weights and priced by :attr:`~hf_magicdec.planner.hardware.HardwareSpec.linear_rows`.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

import torch

from ..checks import check_int

__all__ = ["DEFAULT_ROWS", "measure_linear_rows"]

#: Rows timed: batch × query tokens of the steps a CPU plans (past the last, the curve grows in proportion).
DEFAULT_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def _linears(model: Any) -> list[torch.nn.Linear]:
    """The model's dense linear layers, LM head included (a tied head once)."""
    seen, out = set(), []
    for module in model.modules():
        if type(module) is torch.nn.Linear and id(module.weight) not in seen:
            seen.add(id(module.weight))
            out.append(module)
    return out


def measure_linear_rows(model: Any, rows: Iterable[int] = DEFAULT_ROWS,
                        repeats: int = 3) -> tuple[tuple[int, float], ...]:
    """``((rows, factor), ...)``: one pass over all of ``model``'s dense linear layers with ``rows`` input
    rows, timed (the fastest of ``repeats``, rows interleaved), relative to one row and made
    non-decreasing (more rows never cost less). Empty off the CPU or for a model without
    ``torch.nn.Linear`` layers (a GPU is priced by its roofline)."""
    rows = sorted({check_int("rows", r) for r in rows} | {1})
    check_int("repeats", repeats)
    linears = _linears(model)
    if not linears or linears[0].weight.device.type != "cpu":
        return ()
    weight = linears[0].weight
    inputs = {r: {n: torch.randn(r, n, dtype=weight.dtype) for n in {m.in_features for m in linears}} for r in rows}
    best = dict.fromkeys(rows, float("inf"))
    with torch.inference_mode():
        for rnd in range(repeats + 1):  # round 0 warms the kernels up
            for r in rows:
                t = time.perf_counter()
                for m in linears:
                    torch.nn.functional.linear(inputs[r][m.in_features], m.weight)
                if rnd:
                    best[r] = min(best[r], time.perf_counter() - t)
    curve, floor = [], 1.0
    for r in rows:
        floor = max(floor, best[r] / best[1])
        curve.append((r, floor))
    return tuple(curve)

"""The torch-free fit of the roofline's effective rates to measured step times.

Datasheet peaks overshoot (MagicDec §3), so :func:`fit` fits ``overhead`` (seconds per forward),
``1/bandwidth`` and ``1/flops`` to timed forwards by non-negative least squares on relative error,
over the roofline's op groups, in two forms: ``max(FLOPs / flops, bytes / bandwidth)`` per group
(alternating side assignment and fit) and ``FLOPs / flops + bytes / bandwidth`` (small CPU matmuls).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from typing import Iterable, Sequence

from ..planner.hardware import HardwareSpec, get_hardware
from ..planner.modelspec import ModelSpec
from ..planner.roofline import curve_factor, group_work
from .store import Fit, Measurement

__all__ = ["fit", "fit_quantized", "nnls"]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Solve the square system ``a x = b`` by Gaussian elimination; None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


def nnls(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> list[float]:
    """``argmin ||A x − t||² s.t. x ≥ 0`` for a few unknowns, exactly: every subset of free unknowns is
    solved (normal equations, columns scaled to unit norm) and the best non-negative solution kept."""
    n = len(rows[0])
    scale = [math.sqrt(sum(r[j] ** 2 for r in rows)) or 1.0 for j in range(n)]
    a = [[r[j] / scale[j] for j in range(n)] for r in rows]
    best, best_err = [0.0] * n, sum(t * t for t in targets)
    for size in range(1, n + 1):
        for free in itertools.combinations(range(n), size):
            ata = [[sum(r[i] * r[j] for r in a) for j in free] for i in free]
            atb = [sum(r[i] * t for r, t in zip(a, targets)) for i in free]
            sol = _solve(ata, atb)
            if sol is None or any(v < 0 for v in sol):
                continue
            x = [0.0] * n
            for i, v in zip(free, sol):
                x[i] = v
            err = sum((sum(r[j] * x[j] for j in range(n)) - t) ** 2 for r, t in zip(a, targets))
            if err < best_err:
                best, best_err = x, err
    return [v / s for v, s in zip(best, scale)]


def _rms(errors: Iterable[float]) -> float:
    errors = list(errors)
    return math.sqrt(sum(e * e for e in errors) / len(errors)) if errors else 0.0


def _fit_max(work, measurements, bw, fl, oh, max_iterations):
    """Roofline form: alternate compute/memory assignment of every group and an NNLS fit."""

    def error(bw_, fl_, oh_):
        return _rms((oh_ + sum(n * max(f / fl_, b / bw_) for f, b, n in w.values()) - m.seconds) / m.seconds
                    for w, m in zip(work, measurements))

    best = (bw, fl, oh, error(bw, fl, oh))
    seen = set()
    for _ in range(max_iterations):
        # Assign every group of every forward to the side of the current roofline it sits on.
        assignment = tuple(tuple(f / fl > b / bw for f, b, _ in w.values()) for w in work)
        if assignment in seen:
            break
        seen.add(assignment)
        oh, bw, fl = _fit_rates(work, measurements, assignment, bw, fl)
        err = error(bw, fl, oh)
        if err < best[3]:
            best = (bw, fl, oh, err)
    return best


def _fit_rates(work, measurements, assignment, bw: float, fl: float) -> tuple[float, float, float]:
    """``(overhead, bandwidth, flops)`` by NNLS on relative error, each group counted on the side
    ``assignment`` puts it (True: compute, False: memory, None: both); an unconstrained rate keeps its value."""
    rows = []
    for w, m, sides in zip(work, measurements, assignment):
        nbytes = sum(n * b for (f, b, n), compute in zip(w.values(), sides) if compute is not True)
        nflops = sum(n * f for (f, b, n), compute in zip(w.values(), sides) if compute is not False)
        rows.append([1.0 / m.seconds, nbytes / m.seconds, nflops / m.seconds])  # relative error
    x_oh, x_bw, x_fl = nnls(rows, [1.0] * len(rows))
    return x_oh, 1.0 / x_bw if x_bw > 0 else bw, 1.0 / x_fl if x_fl > 0 else fl


def _fit_sum(work, measurements, bw, fl):
    """Additive form: time = overhead + bytes / bandwidth + FLOPs / flops, linear in the unknowns."""
    x_oh, bw, fl = _fit_rates(work, measurements, [[None] * len(w) for w in work], bw, fl)
    err = _rms((x_oh + sum(n * (f / fl + b / bw) for f, b, n in w.values()) - m.seconds) / m.seconds
               for w, m in zip(work, measurements))
    return bw, fl, x_oh, err


def _fit_forms(model, work, measurements, base, form, max_iterations) -> Fit:
    bw, fl, oh = base.bandwidth, base.peak(model.dtype), base.overhead
    fits = []
    if form in ("auto", "max"):
        b, f, o, e = _fit_max(work, measurements, bw, fl, oh, max_iterations)
        fits.append(Fit(b, f, o, True, e))
    if form in ("auto", "sum"):
        b, f, o, e = _fit_sum(work, measurements, bw, fl)
        fits.append(Fit(b, f, o, False, e))
    return min(fits, key=lambda x: x.rel_rms_error)


def fit(model: ModelSpec, measurements: Sequence[Measurement], base: HardwareSpec | str = "cpu",
        form: str = "auto", trim: bool = True, max_iterations: int = 20) -> Fit:
    """The :class:`~.store.Fit` of effective bandwidth, FLOP/s and overhead to at least three
    ``measurements`` of ``model``.

    ``base`` (a preset or spec) gives the first compute/memory assignment and the rates the data
    cannot identify; its ``linear_rows`` (a CPU's row curve), if any, prices the full-precision linear
    layers and LM head as weight reads times the curve, as the planner will. ``form``: ``"max"``
    (roofline, at most ``max_iterations`` assignment/fit rounds), ``"sum"`` (no overlap) or ``"auto"``
    (the smaller error). ``trim``: refit, twice at most, without
    forwards whose error exceeds ``max(30 %, 4 × the median)`` (at most a quarter of them).
    """
    if len(measurements) < 3:
        raise ValueError(f"fit needs at least 3 measurements, got {len(measurements)}.")
    if form not in ("auto", "max", "sum"):
        raise ValueError(f"Unknown {form=!r}; choose 'auto', 'max' or 'sum'.")
    base = get_hardware(base)
    work = [_work(model, m, base.linear_rows) for m in measurements]
    result = _fit_forms(model, work, list(measurements), base, form, max_iterations)
    for _ in range(2 if trim else 0):
        hw = result.hardware(base, model.dtype)
        errors = [abs(m.predict(model, hw) - m.seconds) / m.seconds for m in measurements]
        limit = max(0.3, 4 * statistics.median(errors))
        bad = {i for i, e in enumerate(errors) if e > limit}
        if not bad or len(measurements) - len(bad) < max(3, math.ceil(0.75 * len(measurements))):
            break
        keep = [i for i in range(len(measurements)) if i not in bad]
        refit = _fit_forms(model, [work[i] for i in keep], [measurements[i] for i in keep], base, form, max_iterations)
        result = dataclasses.replace(refit, outliers=tuple(sorted(bad)))
    return result


def _work(model: ModelSpec, m: Measurement, curve) -> dict[str, tuple[float, float, int]]:
    """``group_work`` of ``m``, the groups a row ``curve`` prices as weight reads times its factor."""
    work = group_work(model, 1, batch=m.batch, query_tokens=m.query_tokens, kv_tokens=m.kv_tokens,
                      logit_tokens=m.logit_tokens)
    for name, (f, b, n) in work.items():
        factor = curve_factor(curve, name, m.batch, m.query_tokens, m.logit_tokens)
        if factor is not None:
            work[name] = (0.0, b * factor, n)
    return work


def fit_quantized(model: ModelSpec, measurements: Sequence[Measurement],
                  hardware: HardwareSpec) -> dict[str, tuple[float, float]]:
    """``{format: (FLOP/s, host seconds per layer)}`` of quantized linear layers among ``measurements``,
    ``hardware``'s other rates fixed (empty if none): the rate on a log grid (0.1 GFLOP/s to 1 PFLOP/s,
    refined), each with the non-negative per-layer time (dynamic quantization's per-call work) that
    minimises the relative RMS error, in closed form."""
    out: dict[str, tuple[float, float]] = {}
    for fmt in sorted({m.weights for m in measurements} - {"full"}):
        timed = [m for m in measurements if m.weights == fmt]

        def fitted(rate: float) -> tuple[float, float]:
            """``(relative RMS error, seconds per layer)`` at ``rate``."""
            hw = hardware.replace(format_flops={**hardware.format_flops, fmt: rate},
                                  format_overhead={**hardware.format_overhead, fmt: 0.0})
            misses = [(m.predict(model, hw) - m.seconds) / m.seconds for m in timed]
            scales = [model.layers / m.seconds for m in timed]
            # min over o >= 0 of sum((miss + o * scale)^2)
            per_layer = max(0.0, -sum(a * b for a, b in zip(misses, scales)) / sum(b * b for b in scales))
            return _rms(a + per_layer * b for a, b in zip(misses, scales)), per_layer

        grid = [10 ** (8 + i / 8) for i in range(57)]  # 1e8 … 1e15
        best = min(grid, key=lambda rate: fitted(rate)[0])
        rate = min((best * 10 ** (i / 64) for i in range(-8, 9)), key=lambda r: fitted(r)[0])
        out[fmt] = (rate, fitted(rate)[1])
    return out

"""Calibrate the planner on the real model: time its steps at a few operating points, fit the roofline
to them and cache the result as JSON."""

from __future__ import annotations

import datetime
import os
import platform
import time
import warnings
from typing import Any, Iterable

import torch
import transformers

from ..checks import check_int
from ..engine.draft_weights import feasible_formats, quantized_draft, source_bytes
from ..planner.hardware import HardwareSpec, get_hardware
from ..planner.modelspec import ModelSpec
from .fit import fit, fit_quantized
from .rows import measure_linear_rows
from .steps import measure_steps
from .store import Calibration, Measurement, calibration_path, device_key

__all__ = ["calibrate", "DEFAULT_POINTS"]

#: ``(batch, context)`` points of a default calibration: short on a CPU, and together they separate the
#: overhead (batch 1), weight and KV bandwidth (1-token steps, 8 × 2048) and the FLOP rate (8-row verifications).
DEFAULT_POINTS: tuple[tuple[int, int], ...] = ((1, 256), (1, 2048), (4, 1024), (8, 256), (8, 2048))
DEFAULT_GAMMAS = (1, 4)
DEFAULT_BUDGETS = (64, 256)


def _cpu_busy(interval: float = 0.25) -> float:
    """Fraction of all CPUs busy over ``interval`` seconds (``/proc/stat``; else the load average per CPU)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="utf-8") as fh:
            values = [int(v) for v in fh.readline().split()[1:]]
        return values[3] + (values[4] if len(values) > 4 else 0), sum(values)  # idle + iowait, total

    try:
        idle0, total0 = sample()
        time.sleep(interval)
        idle1, total1 = sample()
        return 1.0 - (idle1 - idle0) / max(1, total1 - total0)
    except (OSError, ValueError, IndexError):
        try:
            return min(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
        except (AttributeError, OSError):
            return 0.0


def _versions() -> dict[str, str]:
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "threads": str(torch.get_num_threads())}


def calibrate(model: Any, *, name: str | None = None, points: Iterable[tuple[int, int]] = DEFAULT_POINTS,
              gammas: Iterable[int] = DEFAULT_GAMMAS, budgets: Iterable[int] = DEFAULT_BUDGETS, repeats: int = 5,
              passes: int = 2, statistic: str = "min", base: HardwareSpec | str = "cpu", form: str = "auto",
              cache: bool = True, force: bool = False, cache_dir: str | os.PathLike | None = None,
              progress: Any = None, draft_weights: Iterable[str] | None = None) -> Calibration:
    """Time ``model``'s steps on its device and in its dtype, fit the roofline, return the :class:`Calibration`.

    Each of the ``points`` (batch, context) costs a cache fill and ``(1 + len(gammas) + len(budgets)) ·
    (1 + repeats)`` forwards (budgets >= the context are skipped there), the whole list measured
    ``passes`` times, each forward keeping its best pass; ``statistic``: ``"min"`` or ``"median"`` of
    the repeats. ``base``: the preset the fit starts from; ``form``: see :func:`.fit.fit`.
    ``draft_weights``: quantized draft formats timed too (default: those the device and model run), their
    rates, per-layer host time and build time fitted (``Calibration.quantized_*``). On a CPU the row curve
    of the linear layers is measured first and the fit prices them by it (``Calibration.linear_rows``).
    ``name`` names the cache file (default ``_name_or_path``); ``cache`` reads and writes it under
    ``cache_dir``, ``force`` measures again. ``progress`` gets one line for the row curve and one per point.
    """
    param = next(model.parameters())
    spec = ModelSpec.from_config(model.config, dtype=param.dtype)
    name = name or getattr(model.config, "_name_or_path", None) or spec.name
    device = device_key(param.device)
    path = calibration_path(name, spec, device, spec.dtype, cache_dir)
    cached = _cached(path) if cache and not force else None
    if cached is not None:
        return cached
    gammas, budgets, points = tuple(gammas), tuple(budgets), tuple(points)
    check_int("passes", passes)
    if not points:
        raise ValueError("points must not be empty.")
    busy_before = _cpu_busy()
    if param.device.type == "cpu" and busy_before > 0.5:
        warnings.warn(f"calibrating while the machine is busy ({busy_before:.0%} of the CPUs in use by other "
                      "processes): timings will include their work", RuntimeWarning, stacklevel=2)
    t0 = time.perf_counter()
    # The first forwards of a process pay for allocator growth and thread-pool start-up.
    measure_steps(model, 1, 128, gammas=(1,), budgets=(64,), repeats=1)
    linear_rows = measure_linear_rows(model)
    if progress is not None and linear_rows:
        progress("  linear layers' time by rows (batch x query tokens), x one row's: "
                 + ", ".join(f"{rows}: {factor:.2f}" for rows, factor in linear_rows))
    base = get_hardware(base).replace(linear_rows=linear_rows)
    formats = tuple(draft_weights) if draft_weights is not None else feasible_formats(model, param.device)
    best: dict[tuple, Measurement] = {}
    for _ in range(passes):
        for batch, context in points:
            _measure_point(model, batch, context, gammas, budgets, repeats, statistic, formats, best, progress)
    weight_bytes = source_bytes(model)
    built = {fmt: quantized_draft(model, fmt).build_seconds / weight_bytes for fmt in formats}
    result = _fitted(name, spec, device, list(best.values()), base, form, t0, busy_before, built)
    if cache:
        result.save(path)
    return result


def _cached(path) -> Calibration | None:
    """The calibration at ``path``, or None where there is none or it is stale (then measured again)."""
    if not path.is_file():
        return None
    try:
        return Calibration.load(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _fitted(name: str, spec: ModelSpec, device: str, measurements: list[Measurement], base: HardwareSpec, form: str,
            t0: float, busy_before: float, quantized_build: dict[str, float]) -> Calibration:
    """The full-precision forwards fitted, then the quantized drafts' rates with the others fixed
    (``quantized_build``: their build times, seconds per weight byte)."""
    full = [m for m in measurements if m.weights == "full"]
    fitted = fit(spec, full, base, form=form)
    quantized = fit_quantized(spec, measurements, fitted.hardware(base, spec.dtype))
    return Calibration(
        model=name, spec=spec, device=device, dtype=spec.dtype, bandwidth=fitted.bandwidth, flops=fitted.flops,
        overhead=fitted.overhead, overlap=fitted.overlap, measurements=tuple(measurements),
        rel_rms_error=fitted.rel_rms_error, outliers=tuple(measurements.index(full[i]) for i in fitted.outliers),
        wall_seconds=time.perf_counter() - t0, quantized_flops={f: rate for f, (rate, _) in quantized.items()},
        quantized_overhead={f: per_layer for f, (_, per_layer) in quantized.items()}, quantized_build=quantized_build,
        linear_rows=base.linear_rows,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        versions={**_versions(), "cpu_busy_before": f"{busy_before:.2f}"},
    )


def _measure_point(model, batch: int, context: int, gammas, budgets, repeats: int, statistic: str, formats,
                   best: dict, progress) -> None:
    """Time one operating point (each quantized draft too); keep each forward's fastest pass in ``best``."""
    usable = tuple(k for k in budgets if k < context) or (min(budgets),)
    timed = [measure_steps(model, batch, context, gammas=gammas, budgets=usable, repeats=repeats,
                           statistic=statistic, draft_weights=formats[0] if formats else "full")]
    timed += [measure_steps(model, batch, context, gammas=(1,), budgets=usable, repeats=repeats,
                            statistic=statistic, draft_weights=fmt) for fmt in formats[1:]]
    for m in (m for t in timed for m in t.measurements()):
        key = (m.kind, m.batch, m.query_tokens, m.kv_tokens, m.logit_tokens, m.weights)
        if key not in best or m.seconds < best[key].seconds:
            best[key] = m
    if progress is not None:
        steps = timed[0]
        progress(f"  B={batch:<3} S={context:<6} T_T={steps.t_target * 1e3:8.2f} ms  "
                 + "  ".join(f"T_V(g={g})={t * 1e3:.2f} ms" for g, t in steps.t_verify.items()) + "  "
                 + "  ".join(f"T_D(K={k})={t * 1e3:.2f} ms" for k, t in steps.t_draft.items())
                 + "".join(f"  T_D(K={k}, {t.draft_weights})={v * 1e3:.2f} ms"
                           for t in timed for k, v in t.t_draft_quantized.items()))

"""Calibration, the planner's half: fit the roofline's effective rates to measured step times,
and keep the result per model, device and dtype. Torch-free, like the rest of the cost model.

Pure rooflines use datasheet peaks and overshoot (MagicDec §3). The engine times a few operating
points ``(B, S, q)`` with its own forwards through its public step-timing API
(:mod:`hf_magicdec.step_timing`: ``measure_steps``, ``calibrate``), and this module fits three
non-negative numbers to them by least squares on relative error:

* ``overhead``  seconds per forward (dispatch, kernel launches, Python),
* ``1/bandwidth``  seconds per byte of weights and KV,
* ``1/flops``  seconds per FLOP,

keeping the roofline's op groups (linear, attention, LM head; see
:mod:`~hf_magicdec.costmodel.roofline`). Two forms are fitted and the better one kept: the
roofline ``max(FLOPs / flops, bytes / bandwidth)`` per group (each group charged the side of the
fitted roofline it sits on; assignment and fit alternate until the assignment is stable), and
``FLOPs / flops + bytes / bandwidth`` (no overlap of compute and memory traffic, which describes
small matmuls on CPUs better). Predictions at unmeasured points come from the same model with the
fitted numbers (:meth:`Calibration.hardware`).

Results are cached as JSON per model, device and dtype under ``cache_root() / "calibration"``.

Only :func:`device_key` imports torch (inside the function), to name the device.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import platform
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ._checks import check_number
from .hardware import HardwareSpec, get_hardware
from .modelspec import ModelSpec
from .roofline import forward_cost, group_work

__all__ = [
    "Calibration",
    "Measurement",
    "StepTimes",
    "DEFAULT_POINTS",
    "cache_root",
    "calibration_path",
    "cpu_name",
    "device_key",
    "Fit",
    "fit",
    "load_calibration",
]

_FORMAT = 1

#: ``(batch, context)`` points of a default calibration. Small contexts and batches keep a run
#: short on a CPU; together they separate the per-forward overhead (batch 1, short context), the
#: weight-read bandwidth (1-token steps), the KV-read bandwidth (batch 8 × 2048) and the FLOP
#: rate (5-token verification of 8 rows).
DEFAULT_POINTS: tuple[tuple[int, int], ...] = ((1, 256), (1, 2048), (4, 1024), (8, 256), (8, 2048))
DEFAULT_GAMMAS = (1, 4)
DEFAULT_BUDGETS = (64, 256)


# ---------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Measurement:
    """One timed forward.

    Attributes
    ----------
    kind : str
        ``"target"`` (T_T), ``"verify"`` (T_V) or ``"draft"`` (T_D, draft step 0).
    batch, query_tokens, kv_tokens, logit_tokens : int
        The forward's shape, as in :func:`~hf_magicdec.costmodel.roofline.forward_cost`.
    seconds : float
        Wall time (median or minimum over repeats), seconds.
    """

    kind: str
    batch: int
    query_tokens: int
    kv_tokens: int
    logit_tokens: int
    seconds: float

    def predict(self, model: ModelSpec, hardware: HardwareSpec) -> float:
        """Roofline prediction of this forward on ``hardware``, seconds."""
        return forward_cost(model, hardware, batch=self.batch, query_tokens=self.query_tokens,
                            kv_tokens=self.kv_tokens, logit_tokens=self.logit_tokens).seconds


@dataclass(frozen=True)
class StepTimes:
    """Step times measured on one prefilled cache.

    Attributes
    ----------
    batch, context : int
        Rows and cached tokens per row.
    draft : str
        Draft view used for the draft steps.
    t_target : float
        T_T: one 1-token step on the full cache, seconds.
    t_verify : Mapping[int, float]
        T_V per γ: one (γ+1)-token verification, seconds.
    t_draft : Mapping[int, float]
        T_D per budget: draft step 0 (view of ``budget`` tokens + its own), seconds.
    prefill_seconds : float
        Time to fill the cache and build the draft views, seconds (synthetic or real).
    """

    batch: int
    context: int
    draft: str
    t_target: float
    t_verify: Mapping[int, float] = field(hash=False)
    t_draft: Mapping[int, float] = field(hash=False)
    prefill_seconds: float = 0.0

    def measurements(self) -> list[Measurement]:
        """The times as :class:`Measurement` rows (the shapes the roofline needs)."""
        s, b = self.context, self.batch
        rows = [Measurement("target", b, 1, s + 1, 1, self.t_target)]
        rows += [Measurement("verify", b, g + 1, s + g + 1, g + 1, t) for g, t in sorted(self.t_verify.items())]
        # The draft attends to its whole view buffer (budget slots, masked where empty) + itself.
        rows += [Measurement("draft", b, 1, k + 1, 1, t) for k, t in sorted(self.t_draft.items())]
        return rows


@dataclass(frozen=True)
class Calibration:
    """Fitted effective rates of one model on one device in one dtype.

    Attributes
    ----------
    model : str
        Model name.
    spec : ModelSpec
        Its shapes (the fit is only meaningful for these).
    device : str
        Device key (see :func:`device_key`).
    dtype : str
        Canonical dtype.
    bandwidth : float
        Effective memory bandwidth, bytes/s.
    flops : float
        Effective FLOP/s.
    overhead : float
        Fixed cost per forward, seconds.
    overlap : bool
        Which form fitted better: roofline ``max`` (True) or ``compute + memory`` (False).
    measurements : tuple[Measurement, ...]
        What the fit saw.
    rel_rms_error : float
        Root-mean-square relative error of the fitted roofline on ``measurements`` (outliers
        excluded).
    outliers : tuple[int, ...]
        Indices of measurements the fit left out (see :func:`fit`).
    wall_seconds : float
        Duration of the calibration run, seconds.
    created : str
        ISO timestamp.
    versions : Mapping[str, str]
        torch / transformers / Python versions and threads at measuring time.
    """

    model: str
    spec: ModelSpec
    device: str
    dtype: str
    bandwidth: float
    flops: float
    overhead: float
    overlap: bool
    measurements: tuple[Measurement, ...]
    rel_rms_error: float
    outliers: tuple[int, ...] = ()
    wall_seconds: float = 0.0
    created: str = ""
    versions: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        check_number("bandwidth", self.bandwidth)
        check_number("flops", self.flops)
        check_number("overhead", self.overhead, allow_zero=True)

    def hardware(self, base: HardwareSpec | str = "cpu") -> HardwareSpec:
        """``base`` with the fitted bandwidth, FLOP/s (for :attr:`dtype`), overhead and form.

        The tensor-parallel degree and interconnect of ``base`` are kept (calibration runs on
        one device).
        """
        fitted = Fit(self.bandwidth, self.flops, self.overhead, self.overlap, self.rel_rms_error)
        return fitted.hardware(base, self.dtype, name=f"{self.device} (calibrated)")

    def predictions(self) -> list[tuple[Measurement, float]]:
        """``(measurement, predicted seconds)`` for every measured forward."""
        hw = self.hardware()
        spec = self.spec.with_dtype(self.dtype)
        return [(m, m.predict(spec, hw)) for m in self.measurements]

    def table(self) -> str:
        """Predicted vs measured, one line per forward."""
        lines = [f"{'kind':<7}{'B':>4}{'q':>4}{'keys':>7}  {'measured ms':>12}{'predicted ms':>13}{'error':>8}"]
        for i, (m, p) in enumerate(self.predictions()):
            mark = "  (outlier, not fitted)" if i in self.outliers else ""
            lines.append(f"{m.kind:<7}{m.batch:>4}{m.query_tokens:>4}{m.kv_tokens:>7}  {m.seconds * 1e3:>12.2f}"
                         f"{p * 1e3:>13.2f}{(p - m.seconds) / m.seconds:>+8.1%}{mark}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["format"] = _FORMAT
        out["versions"] = dict(self.versions)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Calibration":
        """Inverse of :meth:`to_dict`.

        Raises
        ------
        ValueError
            If the data was written by another format version.
        """
        if data.get("format") != _FORMAT:
            raise ValueError(f"Calibration format {data.get('format')!r} is not {_FORMAT}; recalibrate.")
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in fields}
        kwargs["spec"] = ModelSpec(**data["spec"])
        kwargs["measurements"] = tuple(Measurement(**m) for m in data["measurements"])
        kwargs["outliers"] = tuple(data.get("outliers", ()))
        return cls(**kwargs)

    def save(self, path: str | os.PathLike) -> Path:
        """Write JSON atomically; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=2))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Calibration":
        return cls.from_dict(json.loads(Path(path).read_text()))


# ---------------------------------------------------------------------------------------- fit


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
    """Non-negative least squares ``min ||A x − t||² s.t. x ≥ 0`` for a few unknowns.

    Exact: tries every subset of free unknowns (the others pinned at 0), solves its normal
    equations and keeps the best non-negative solution. Fine for the 3–4 unknowns of the fit.
    Columns are scaled to unit norm first so that seconds-per-byte and seconds-per-forward
    (20 orders of magnitude apart) stay well conditioned.
    """
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
        rows = []
        for w, m, sides in zip(work, measurements, assignment):
            nbytes = sum(n * b for (f, b, n), compute in zip(w.values(), sides) if not compute)
            nflops = sum(n * f for (f, b, n), compute in zip(w.values(), sides) if compute)
            rows.append([1.0 / m.seconds, nbytes / m.seconds, nflops / m.seconds])  # relative error
        x_oh, x_bw, x_fl = nnls(rows, [1.0] * len(rows))
        # A zero coefficient means the data does not constrain that rate: keep the previous one.
        bw = 1.0 / x_bw if x_bw > 0 else bw
        fl = 1.0 / x_fl if x_fl > 0 else fl
        oh = x_oh
        err = error(bw, fl, oh)
        if err < best[3]:
            best = (bw, fl, oh, err)
    return best


def _fit_sum(work, measurements, bw, fl):
    """Additive form: time = overhead + bytes / bandwidth + FLOPs / flops, linear in the unknowns."""
    rows = []
    for w, m in zip(work, measurements):
        nbytes = sum(n * b for f, b, n in w.values())
        nflops = sum(n * f for f, b, n in w.values())
        rows.append([1.0 / m.seconds, nbytes / m.seconds, nflops / m.seconds])
    x_oh, x_bw, x_fl = nnls(rows, [1.0] * len(rows))
    bw = 1.0 / x_bw if x_bw > 0 else bw
    fl = 1.0 / x_fl if x_fl > 0 else fl
    err = _rms((x_oh + sum(n * (f / fl + b / bw) for f, b, n in w.values()) - m.seconds) / m.seconds
               for w, m in zip(work, measurements))
    return bw, fl, x_oh, err


@dataclass(frozen=True)
class Fit:
    """Result of :func:`fit`.

    Attributes
    ----------
    bandwidth : float
        Effective bandwidth, bytes/s.
    flops : float
        Effective FLOP/s.
    overhead : float
        Seconds per forward.
    overlap : bool
        True: roofline ``max(compute, memory)`` per group; False: ``compute + memory``.
    rel_rms_error : float
        Root-mean-square relative error on the measurements that were kept.
    outliers : tuple[int, ...]
        Indices of measurements left out as outliers (e.g. timed while another process held
        the CPU).
    """

    bandwidth: float
    flops: float
    overhead: float
    overlap: bool
    rel_rms_error: float
    outliers: tuple[int, ...] = ()

    def hardware(self, base: HardwareSpec | str, dtype: str, name: str | None = None) -> HardwareSpec:
        """``base`` with the fitted numbers (FLOP/s for ``dtype``)."""
        base = get_hardware(base)
        flops = dict(base.peak_flops)
        flops[dtype] = self.flops
        return base.replace(name=name or base.name, peak_flops=flops, bandwidth=self.bandwidth,
                            overhead=self.overhead, overlap=self.overlap)


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
    """Fit effective bandwidth, FLOP/s and per-forward overhead to measured forwards.

    Minimises the relative squared error with non-negative least squares over
    ``(overhead, 1/bandwidth, 1/flops)``.

    Parameters
    ----------
    model : ModelSpec
        Shapes and dtype of the measured model.
    measurements : sequence of Measurement
        At least three forwards of different shapes.
    base : HardwareSpec or str
        Starting point (its rates decide the first compute/memory assignment of the roofline
        form) and fallback for a rate the data cannot identify (e.g. no group was ever
        compute-bound).
    form : str
        ``"max"``: the roofline, each group on the side of the fitted roofline it falls on
        (alternating assignment and fit until the assignment is stable). ``"sum"``: compute and
        memory do not overlap (small matmuls on CPUs). ``"auto"``: both, keep the smaller error.
    trim : bool
        Refit without measurements whose relative error exceeds ``max(30 %, 4 × the median
        error)`` (at most a quarter of them, twice at most): a forward timed while another
        process held the machine should not bend the fit.
    max_iterations : int
        Bound on assignment/fit alternations of the ``"max"`` form.

    Returns
    -------
    Fit

    Raises
    ------
    ValueError
        With fewer than three measurements or an unknown ``form``.
    """
    if len(measurements) < 3:
        raise ValueError(f"fit needs at least 3 measurements, got {len(measurements)}.")
    if form not in ("auto", "max", "sum"):
        raise ValueError(f"Unknown {form=!r}; choose 'auto', 'max' or 'sum'.")
    base = get_hardware(base)
    work = [group_work(model, 1, batch=m.batch, query_tokens=m.query_tokens, kv_tokens=m.kv_tokens,
                       logit_tokens=m.logit_tokens) for m in measurements]
    keep = list(range(len(measurements)))
    result = _fit_forms(model, [work[i] for i in keep], [measurements[i] for i in keep], base, form, max_iterations)
    for _ in range(2 if trim else 0):
        hw = result.hardware(base, model.dtype)
        errors = [abs(m.predict(model, hw) - m.seconds) / m.seconds for m in measurements]
        limit = max(0.3, 4 * statistics.median(errors))
        bad = {i for i, e in enumerate(errors) if e > limit}
        if not bad or len(measurements) - len(bad) < max(3, math.ceil(0.75 * len(measurements))):
            break
        keep = [i for i in range(len(measurements)) if i not in bad]
        refit = _fit_forms(model, [work[i] for i in keep], [measurements[i] for i in keep], base, form,
                           max_iterations)
        result = dataclasses.replace(refit, outliers=tuple(sorted(bad)))
    return result


# ---------------------------------------------------------------------------------------- measuring


# ---------------------------------------------------------------------------------------- cache keys


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-").lower() or "unknown"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform`` elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_key(device: Any = "cpu") -> str:
    """Identify the device a calibration belongs to.

    Parameters
    ----------
    device : str or torch.device
        ``"cpu"`` or a CUDA device.

    Returns
    -------
    str
        ``"cpu-<model name>-<threads>t"`` (torch's intra-op threads, which change CPU timings as
        much as the chip does) or ``"cuda-<device name>"``.
    """
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return _slug(f"cuda-{torch.cuda.get_device_name(device)}")
    return _slug(f"{device.type}-{cpu_name()}-{torch.get_num_threads()}t")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The directory hf_magicdec keeps files in (calibrations; the tooling's converted checkpoints).

    ``cache_dir`` if given, else ``$HF_MAGICDEC_CACHE``, else ``$XDG_CACHE_HOME/hf_magicdec/models``
    (``~/.cache/hf_magicdec/models``).
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("HF_MAGICDEC_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "hf_magicdec" / "models"


def calibration_path(model_name: str, spec: ModelSpec, device: str, dtype: str,
                     cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the calibration of ``model_name`` (shapes ``spec``) on ``device`` in ``dtype`` lives.

    ``<cache_root(cache_dir)>/calibration/<model>-<shape hash>__<device>__<dtype>.json``.
    """
    model = _slug(Path(model_name).name or model_name)  # a Hub id or a path: its last part
    dtype = spec.with_dtype(dtype).dtype
    return cache_root(cache_dir) / "calibration" / f"{model}-{spec.key()}__{_slug(device)}__{dtype}.json"


def load_calibration(model_name: str, spec: ModelSpec, device: Any = "cpu", dtype: Any = None,
                     cache_dir: str | os.PathLike | None = None) -> Calibration | None:
    """The cached calibration for this model, device and dtype, or None (no weights are loaded)."""
    dtype = spec.with_dtype(dtype).dtype if dtype is not None else spec.dtype
    path = calibration_path(model_name, spec, device_key(device), dtype, cache_dir)
    if not path.is_file():
        return None
    try:
        return Calibration.load(path)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable or stale format: calibrate again

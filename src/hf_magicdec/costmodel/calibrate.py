"""Calibration: time real draft / target / verify forwards on the actual model and device, and
fit the roofline's effective rates to them.

Pure rooflines use datasheet peaks and overshoot (MagicDec §3). Here we measure a few
operating points ``(B, S, q)`` with the engine's own forwards, then fit three non-negative
numbers by least squares on relative error:

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

Results are cached as JSON per model, device and dtype under
``hf_magicdec.models.default_cache_root() / "calibration"``.

Only this module of the cost model imports torch, and only inside functions.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import math
import os
import platform
import re
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ._checks import check_int, check_number
from .hardware import HardwareSpec, get_hardware
from .modelspec import ModelSpec
from .roofline import forward_cost, group_work

__all__ = [
    "Calibration",
    "Measurement",
    "StepTimes",
    "DEFAULT_POINTS",
    "calibrate",
    "calibration_path",
    "device_key",
    "Fit",
    "fit",
    "load_calibration",
    "measure_steps",
    "probe_acceptance",
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


_STATISTICS = {"median": statistics.median, "min": min}


def _time_rounds(jobs: dict, repeats: int, sync, statistic: str) -> dict:
    """Time every job ``repeats`` times, round-robin, after one warm-up each.

    ``jobs`` maps a key to ``(before, fn, after)``: only ``fn`` is timed; ``before`` and ``after``
    (or None) run untimed (e.g. selecting a draft view, rolling back). Round-robin spreads any
    burst of interference from other processes over all jobs instead of spoiling every repeat of
    one of them.
    """
    times = {key: [] for key in jobs}
    for rnd in range(repeats + 1):
        for key, (before, fn, after) in jobs.items():
            if before is not None:
                before()
            sync()
            t = time.perf_counter()
            fn()
            sync()
            if rnd:  # round 0 is the warm-up
                times[key].append(time.perf_counter() - t)
            if after is not None:
                after()
    return {key: _STATISTICS[statistic](values) for key, values in times.items()}


def _synthetic_cache(engine, model, batch: int, context: int, capacity: int, observation_window: int):
    """A MagicDecCache filled with random KV, as if ``context`` tokens had been prefilled.

    Step timings do not depend on KV values, and a real prefill of 8 × 2048 tokens costs tens of
    seconds on a CPU, far more than the steps we want to time.
    """
    import torch

    from ..cache import MagicDecCache

    param = next(model.parameters())
    spec = ModelSpec.from_config(model.config)
    pad = torch.zeros(batch, dtype=torch.long, device=param.device)
    cache = MagicDecCache(model.config.num_hidden_layers, batch, capacity, pad)
    cache.observation_window = observation_window
    for layer in cache.layers:
        seed = torch.zeros(batch, spec.kv_heads, 1, spec.head_dim, dtype=param.dtype, device=param.device)
        layer.lazy_initialization(seed, seed)
        layer.keys.normal_()
        layer.values.normal_()
        if observation_window:
            layer.observed_queries = torch.randn(batch, spec.heads, min(observation_window, context), spec.head_dim,
                                                 dtype=param.dtype, device=param.device)
            layer.scaling = spec.head_dim ** -0.5
    cache.end_prefill(context)
    engine.cache = cache


def measure_steps(
    model: Any,
    batch: int,
    context: int,
    gammas: Iterable[int] = (4,),
    budgets: Iterable[int] = (256,),
    draft: str = "streamingllm",
    repeats: int = 5,
    input_ids: Any = None,
    statistic: str = "median",
) -> StepTimes:
    """Time T_T, T_V(γ) and T_D(budget) with the engine's own forwards on one prefilled cache.

    The cache is rolled back after every verification (``cache.commit(zeros)``, untimed), so the
    context never changes. Each time is the median (or minimum) of ``repeats`` runs after one warm-up; the
    forwards are timed round-robin.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        The model, on its device and in its dtype.
    batch : int
        Rows B.
    context : int
        Cached tokens per row S.
    gammas : iterable of int
        Verification sizes to time (γ + 1 tokens each).
    budgets : iterable of int
        Draft budgets to time (draft step 0 on a view of that many tokens).
    draft : str
        Draft view (only the selection differs between views, not the step's cost).
    repeats : int
        Timed runs per forward.
    input_ids : torch.LongTensor, optional
        ``[batch, context]`` real prompts: prefilled through the engine (slow, realistic). By
        default the cache is filled with random KV instead (fast; timings are the same).
    statistic : str
        ``"median"`` or ``"min"`` over the repeats. ``"min"`` resists other processes sharing
        the machine (interference only ever adds time).

    Returns
    -------
    StepTimes

    Raises
    ------
    ValueError
        For non-positive sizes or ``input_ids`` of the wrong shape.
    """
    import torch

    from ..config import MagicDecConfig
    from ..generation import _Engine, _magicdec_attention
    from ..views import get_view

    gammas, budgets = tuple(gammas), tuple(budgets)
    for name, value in (("batch", batch), ("context", context), ("repeats", repeats)):
        check_int(name, value)
    if not gammas or not budgets:
        raise ValueError(f"gammas and budgets must not be empty, got {gammas=} and {budgets=}.")
    if statistic not in _STATISTICS:
        raise ValueError(f"Unknown {statistic=!r}; choose one of {sorted(_STATISTICS)}.")
    if input_ids is not None and tuple(input_ids.shape) != (batch, context):
        raise ValueError(f"input_ids must have shape {(batch, context)}, got {tuple(input_ids.shape)}.")
    device = next(model.parameters()).device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    q_max = max(gammas) + 1
    # gamma=1 keeps every budget valid; the view's scratch size does not change step 0's cost.
    configs = {k: MagicDecConfig(draft=draft, draft_budget=k, gamma=1) for k in budgets}
    first = configs[budgets[0]]
    view = get_view(draft)
    capacity = context + q_max + 1
    rng = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (batch, q_max), generator=rng).to(device)
    zeros = torch.zeros(batch, dtype=torch.long, device=device)
    with torch.no_grad(), _magicdec_attention(model):
        engine = _Engine(model, first, model.generation_config, [], [], None, chunk=1024)
        t0 = time.perf_counter()
        if input_ids is not None:
            positions = torch.arange(context, device=device)[None].expand(batch, -1)
            engine._prefill(input_ids.to(device), positions, zeros, capacity=capacity)
        else:
            _synthetic_cache(engine, model, batch, context, capacity, view.observation_window(first))
        cache = engine.cache
        cache.build_draft_views(view, first, context, 64)
        sync()
        prefill_seconds = time.perf_counter() - t0

        def verify(n: int) -> None:
            engine._verify(tokens[:, 0], tokens[:, 1:n])

        def rollback() -> None:
            # Keep none of the verified tokens: the context never changes. Untimed: this is the
            # loop's bookkeeping, not the forward the roofline models.
            cache.commit(zeros)

        def draft_step() -> None:
            cache.begin_draft(0)
            mask = cache.forward_mask(1, cache.static_slots + cache.window_slots + 1)
            engine._forward(tokens[:, :1], cache.lengths[:, None], mask, logits_to_keep=1)

        built = [first]

        def use_view(k: int):
            def before() -> None:
                if built[0] is not configs[k]:  # about the cost of one forward; untimed
                    cache.build_draft_views(view, configs[k], context, 64)
                    built[0] = configs[k]
            return before

        jobs = {("target", 1): (None, lambda: verify(1), rollback)}
        jobs.update({("verify", g): (None, lambda g=g: verify(g + 1), rollback) for g in gammas})
        jobs.update({("draft", k): (use_view(k), draft_step, None) for k in budgets})
        times = _time_rounds(jobs, repeats, sync, statistic)
    return StepTimes(batch, context, draft, times[("target", 1)], {g: times[("verify", g)] for g in gammas},
                     {k: times[("draft", k)] for k in budgets}, prefill_seconds)


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


def calibration_path(model_name: str, spec: ModelSpec, device: str, dtype: str,
                     cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the calibration of ``model_name`` (shapes ``spec``) on ``device`` in ``dtype`` lives.

    ``<default_cache_root(cache_dir)>/calibration/<model>-<shape hash>__<device>__<dtype>.json``.
    """
    from ..models import default_cache_root

    model = _slug(Path(model_name).name or model_name)  # a Hub id or a path: its last part
    dtype = spec.with_dtype(dtype).dtype
    return default_cache_root(cache_dir) / "calibration" / f"{model}-{spec.key()}__{_slug(device)}__{dtype}.json"


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


def _cpu_busy(interval: float = 0.25) -> float:
    """Fraction of all CPUs busy over ``interval`` seconds while we wait (other processes' load).

    Read from ``/proc/stat``; elsewhere the 1-minute load average per CPU stands in (it lags).
    """

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
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "threads": str(torch.get_num_threads())}


def calibrate(
    model: Any,
    *,
    name: str | None = None,
    points: Iterable[tuple[int, int]] = DEFAULT_POINTS,
    gammas: Iterable[int] = DEFAULT_GAMMAS,
    budgets: Iterable[int] = DEFAULT_BUDGETS,
    repeats: int = 5,
    passes: int = 2,
    statistic: str = "min",
    base: HardwareSpec | str = "cpu",
    form: str = "auto",
    cache: bool = True,
    force: bool = False,
    cache_dir: str | os.PathLike | None = None,
    progress: Any = None,
) -> Calibration:
    """Measure the model's step times on its device and fit the roofline to them.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        On its device, in the dtype to calibrate.
    name : str, optional
        Name for the cache file (default ``model.config._name_or_path``).
    points : iterable of (batch, context)
        Operating points; each costs one cache fill and ``(1 + len(gammas) + len(budgets)) ·
        (1 + repeats)`` forwards.
    gammas, budgets :
        Verification sizes and draft budgets timed at every point (budgets ≥ context are
        skipped there).
    repeats : int
        Timed runs per forward.
    passes : int
        Times the whole list of points is measured; each forward keeps its best pass. A burst of
        other work then has to hit the same forward in every pass to bend the fit.
    statistic : str
        ``"min"`` (default: robust to other processes) or ``"median"`` over the repeats.
    base : HardwareSpec or str
        Preset to start the fit from (``"cpu"`` for CPUs, e.g. ``"h100"`` on an H100).
    form : str
        ``"auto"``, ``"max"`` (roofline) or ``"sum"`` (no compute/memory overlap), see :func:`fit`.
    cache : bool
        Read and write the JSON cache.
    force : bool
        Measure again even if a cached calibration exists.
    cache_dir : path-like, optional
        Root of the cache (see :func:`hf_magicdec.models.default_cache_root`).
    progress : callable, optional
        Called with one line of text per measured point.

    Returns
    -------
    Calibration

    Examples
    --------
    >>> model, _ = hf_magicdec.models.load("smollm2-135m")  # doctest: +SKIP
    >>> cal = calibrate(model, name="smollm2-135m")          # doctest: +SKIP
    >>> plan(model.config, ..., hardware="cpu", calibration=cal)  # doctest: +SKIP
    """
    param = next(model.parameters())
    spec = ModelSpec.from_config(model.config, dtype=param.dtype)
    name = name or getattr(model.config, "_name_or_path", None) or spec.name
    device = device_key(param.device)
    path = calibration_path(name, spec, device, spec.dtype, cache_dir)
    if cache and not force and path.is_file():
        try:
            return Calibration.load(path)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # stale: measure again
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
    best: dict[tuple, Measurement] = {}
    for _ in range(passes):
        for batch, context in points:
            usable = tuple(k for k in budgets if k < context) or (min(budgets),)
            steps = measure_steps(model, batch, context, gammas=gammas, budgets=usable, repeats=repeats,
                                  statistic=statistic)
            for m in steps.measurements():
                key = (m.kind, m.batch, m.query_tokens, m.kv_tokens, m.logit_tokens)
                if key not in best or m.seconds < best[key].seconds:
                    best[key] = m
            if progress is not None:
                progress(f"  B={batch:<3} S={context:<6} T_T={steps.t_target * 1e3:8.2f} ms  "
                         + "  ".join(f"T_V(g={g})={t * 1e3:.2f} ms" for g, t in steps.t_verify.items()) + "  "
                         + "  ".join(f"T_D(K={k})={t * 1e3:.2f} ms" for k, t in steps.t_draft.items()))
    measurements = list(best.values())
    fitted = fit(spec, measurements, base, form=form)
    result = Calibration(
        model=name, spec=spec, device=device, dtype=spec.dtype, bandwidth=fitted.bandwidth, flops=fitted.flops,
        overhead=fitted.overhead, overlap=fitted.overlap, measurements=tuple(measurements),
        rel_rms_error=fitted.rel_rms_error, outliers=fitted.outliers, wall_seconds=time.perf_counter() - t0,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        versions={**_versions(), "cpu_busy_before": f"{busy_before:.2f}"},
    )
    if cache:
        result.save(path)
    return result


# ---------------------------------------------------------------------------------------- acceptance


def probe_acceptance(
    model: Any,
    tokenizer: Any = None,
    *,
    draft: str = "streamingllm",
    budget: int = 256,
    gamma: int = 4,
    batch: int = 1,
    context: int = 1024,
    new_tokens: int = 64,
    input_ids: Any = None,
) -> float:
    """Measure α with one short speculative generation.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    tokenizer : optional
        Used to cut real long-text prompts (:func:`hf_magicdec.data.prompt_batch`); without it
        (and without ``input_ids``) random token ids are used, whose α says little about text.
    draft, budget, gamma :
        The candidate to probe (``budget < context``).
    batch, context, new_tokens :
        Prompt batch and length, tokens generated per row.
    input_ids : torch.LongTensor, optional
        ``[batch, context]`` prompts to use as is.

    Returns
    -------
    float
        ``output.speculation.acceptance_rate``.

    Raises
    ------
    ValueError
        If ``budget >= context`` (the view would hold the whole prompt).
    """
    import torch

    from .. import data
    from ..config import MagicDecConfig

    if budget >= context:
        raise ValueError(f"budget must be < context to probe a compressed view, got {budget=} and {context=}.")
    device = next(model.parameters()).device
    if input_ids is None:
        if tokenizer is not None:
            input_ids = data.prompt_batch(tokenizer, batch, context)
        else:
            g = torch.Generator().manual_seed(0)
            input_ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g)
    input_ids = input_ids.to(device)
    config = MagicDecConfig(draft=draft, draft_budget=budget, gamma=gamma)
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, speculative=config, return_dict_in_generate=True)
    return float(out.speculation.acceptance_rate)

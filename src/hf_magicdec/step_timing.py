"""Public step-timing API of the engine: time its own target, verify and draft forwards, and
calibrate the planner from those times.

The planner (:mod:`hf_magicdec.planner`) is torch-free and never imports the engine; it fits the
numbers this module measures (:func:`hf_magicdec.planner.calibrate.fit`) and reads cached
calibrations. This module sits beside the engine and drives it:

* :func:`measure_steps`: T_T, T_V(γ), T_D(budget) on one prefilled (or synthetic) cache;
* :func:`calibrate`: measure a few operating points and fit the roofline (cached as JSON);
* :func:`probe_acceptance`: one short generation's acceptance rate.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import time
import warnings
from typing import Any, Iterable

import torch
import transformers

from .engine.cache import MagicDecCache
from .config import AUTO, MagicDecConfig
from .planner._checks import check_int
from .planner.calibrate import (
    DEFAULT_BUDGETS,
    DEFAULT_GAMMAS,
    DEFAULT_POINTS,
    Calibration,
    Measurement,
    StepTimes,
    calibration_path,
    device_key,
    fit,
    fit_quantized,
)
from .planner.hardware import HardwareSpec
from .planner.modelspec import ModelSpec
from .engine import attention
from .engine.draft_weights import check_draft_weights, draft_twin, feasible_formats
from .engine.drafters import new_cache, twin_call
from .engine.steps import ModelCall, draft_step, prefill, verify_step
from .views import DraftView

__all__ = ["calibrate", "measure_steps", "probe_acceptance"]


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


def _synthetic_cache(model, batch: int, context: int, capacity: int, observation_window: int) -> MagicDecCache:
    """A MagicDecCache filled with random KV, as if ``context`` tokens had been prefilled.

    Step timings do not depend on KV values, and a real prefill of 8 × 2048 tokens costs tens of
    seconds on a CPU, far more than the steps we want to time.
    """
    param = next(model.parameters())
    spec = ModelSpec.from_config(model.config)
    # A timing cache carries no generation length (no sliding-window check).
    cache = new_cache(model, torch.zeros(batch, dtype=torch.long, device=param.device), capacity, observation_window,
                      None)
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
    return cache


def measure_steps(
    model: Any,
    batch: int,
    context: int,
    gammas: Iterable[int] = (4,),
    budgets: Iterable[int] = (256,),
    draft: str | DraftView = "streamingllm",
    repeats: int = 5,
    input_ids: Any = None,
    statistic: str = "median",
    compile_config: Any = None,
    draft_weights: str = "full",
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
    draft : str or DraftView
        Draft view, a name or an instance with its options (only the selection differs between
        views, not the step's cost).
    repeats : int
        Timed runs per forward.
    input_ids : torch.LongTensor, optional
        ``[batch, context]`` real prompts: prefilled through the engine (slow, realistic). By
        default the cache is filled with random KV instead (fast; timings are the same).
    statistic : str
        ``"median"`` or ``"min"`` over the repeats. ``"min"`` resists other processes sharing
        the machine (interference only ever adds time).

    compile_config : transformers.CompileConfig or None
        Time the draft and verify forwards compiled under it, as ``compile=`` runs them in
        ``generate`` (fixed-shape buffers; on CUDA the buffers' addresses are marked static, so
        ``mode="reduce-overhead"`` captures CUDA graphs). None: eager. The first (warm-up) round
        includes the compilation.
    draft_weights : str
        ``"int8"`` / ``"fp16"`` / ``"int4"``: also time the draft steps on the model's quantized twin
        (:mod:`hf_magicdec.engine.draft_weights`; ``StepTimes.t_draft_quantized``), as
        ``draft_weights=`` runs them. ``"full"``: the full-precision draft only.

    Returns
    -------
    StepTimes

    Raises
    ------
    ValueError
        For non-positive sizes or ``input_ids`` of the wrong shape.
    """
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
    quantized = draft_weights not in ("full", AUTO)
    if quantized:
        check_draft_weights(model, draft_weights, device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    q_max = max(gammas) + 1
    # gamma=1 keeps every budget valid; the view's scratch size does not change step 0's cost.
    configs = {k: MagicDecConfig(draft=draft, draft_budget=k, gamma=1) for k in budgets}
    first = configs[budgets[0]]
    view = first.view
    capacity = context + q_max + 1
    rng = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (batch, q_max), generator=rng).to(device)
    zeros = torch.zeros(batch, dtype=torch.long, device=device)
    with torch.no_grad(), attention.switched(model):
        call = ModelCall.of(model, compile_config)
        twin = twin_call(draft_twin(model, draft_weights), compile_config) if quantized else None
        t0 = time.perf_counter()
        if input_ids is not None:
            positions = torch.arange(context, device=device)[None].expand(batch, -1)
            # A timing cache carries no generation length (no sliding-window check).
            cache = new_cache(model, zeros, capacity, view.observation_window(), None)
            prefill(call, cache, input_ids.to(device), positions, chunk=1024)
        else:
            cache = _synthetic_cache(model, batch, context, capacity, view.observation_window())
        cache.fixed_shapes = call.compiled is not None
        cache.build_draft_views(view, first, context, 64)
        if call.compiled is not None and device.type == "cuda":
            cache.mark_static_addresses()  # CUDA graphs may then write the cache in place
        sync()
        prefill_seconds = time.perf_counter() - t0

        def verify(n: int) -> None:
            verify_step(call, cache, tokens[:, 0], tokens[:, 1:n])

        def rollback() -> None:
            # Keep none of the verified tokens: the context never changes. Untimed: this is the
            # loop's bookkeeping, not the forward the roofline models.
            cache.commit(zeros)

        def draft() -> None:
            draft_step(call, cache, tokens[:, :1], 0)

        def draft_quantized() -> None:
            draft_step(twin, cache, tokens[:, :1], 0)

        built = [first]

        def use_view(k: int):
            def before() -> None:
                if built[0] is not configs[k]:  # about the cost of one forward; untimed
                    cache.build_draft_views(view, configs[k], context, 64)
                    built[0] = configs[k]
                    if call.compiled is not None and device.type == "cuda":
                        cache.mark_static_addresses()
            return before

        jobs = {("target", 1): (None, lambda: verify(1), rollback)}
        jobs.update({("verify", g): (None, lambda g=g: verify(g + 1), rollback) for g in gammas})
        jobs.update({("draft", k): (use_view(k), draft, None) for k in budgets})
        if quantized:
            jobs.update({("draft_q", k): (use_view(k), draft_quantized, None) for k in budgets})
        # Compiled: one graph per budget and verify width, more than dynamo's default limit of 8.
        limit = torch._dynamo.config.patch(recompile_limit=64) if call.compiled is not None else contextlib.nullcontext()
        with limit:
            times = _time_rounds(jobs, repeats, sync, statistic)
    return StepTimes(batch, context, draft, times[("target", 1)], {g: times[("verify", g)] for g in gammas},
                     {k: times[("draft", k)] for k in budgets}, prefill_seconds,
                     draft_weights if quantized else "full",
                     {k: times[("draft_q", k)] for k in budgets} if quantized else {})


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
    draft_weights: Iterable[str] | None = None,
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
        Root of the cache (see :func:`hf_magicdec.planner.calibrate.cache_root`).
    progress : callable, optional
        Called with one line of text per measured point.
    draft_weights : iterable of str, optional
        Quantized draft formats whose draft steps are timed too, to fit their kernels' effective
        rate (``Calibration.quantized_flops``, used when the planner weighs ``draft_weights``).
        Default: every format the device has a kernel for and the model can use.

    Returns
    -------
    Calibration

    Examples
    --------
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
    formats = tuple(draft_weights) if draft_weights is not None else feasible_formats(model, param.device)
    best: dict[tuple, Measurement] = {}
    for _ in range(passes):
        for batch, context in points:
            usable = tuple(k for k in budgets if k < context) or (min(budgets),)
            timed = [measure_steps(model, batch, context, gammas=gammas, budgets=usable, repeats=repeats,
                                   statistic=statistic, draft_weights=formats[0] if formats else "full")]
            timed += [measure_steps(model, batch, context, gammas=(1,), budgets=usable, repeats=repeats,
                                    statistic=statistic, draft_weights=fmt) for fmt in formats[1:]]
            steps = timed[0]
            for m in (m for t in timed for m in t.measurements()):
                key = (m.kind, m.batch, m.query_tokens, m.kv_tokens, m.logit_tokens, m.weights)
                if key not in best or m.seconds < best[key].seconds:
                    best[key] = m
            if progress is not None:
                progress(f"  B={batch:<3} S={context:<6} T_T={steps.t_target * 1e3:8.2f} ms  "
                         + "  ".join(f"T_V(g={g})={t * 1e3:.2f} ms" for g, t in steps.t_verify.items()) + "  "
                         + "  ".join(f"T_D(K={k})={t * 1e3:.2f} ms" for k, t in steps.t_draft.items())
                         + "".join(f"  T_D(K={k}, {t.draft_weights})={v * 1e3:.2f} ms"
                                   for t in timed for k, v in t.t_draft_quantized.items()))
    measurements = list(best.values())
    full = [m for m in measurements if m.weights == "full"]
    fitted = fit(spec, full, base, form=form)
    quantized = fit_quantized(spec, measurements, fitted.hardware(base, spec.dtype))
    result = Calibration(
        model=name, spec=spec, device=device, dtype=spec.dtype, bandwidth=fitted.bandwidth, flops=fitted.flops,
        overhead=fitted.overhead, overlap=fitted.overlap, measurements=tuple(measurements),
        rel_rms_error=fitted.rel_rms_error, outliers=tuple(measurements.index(full[i]) for i in fitted.outliers),
        wall_seconds=time.perf_counter() - t0, quantized_flops=quantized,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        versions={**_versions(), "cpu_busy_before": f"{busy_before:.2f}"},
    )
    if cache:
        result.save(path)
    return result


# ---------------------------------------------------------------------------------------- acceptance


def probe_acceptance(
    model: Any,
    *,
    draft: str | DraftView = "streamingllm",
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
    draft, budget, gamma :
        The candidate to probe (``budget < context``); ``draft`` a view name or instance.
    batch, context, new_tokens :
        Prompt batch and length, tokens generated per row.
    input_ids : torch.LongTensor, optional
        ``[batch, context]`` prompts, e.g. real long text (``hf_magicdec_bench.data.prompt_batch``);
        by default random token ids, whose α says little about text.

    Returns
    -------
    float
        ``output.speculation.acceptance_rate``.

    Raises
    ------
    ValueError
        If ``budget >= context`` (the view would hold the whole prompt).
    """
    if budget >= context:
        raise ValueError(f"budget must be < context to probe a compressed view, got {budget=} and {context=}.")
    device = next(model.parameters()).device
    if input_ids is None:
        g = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g)
    input_ids = input_ids.to(device)
    config = MagicDecConfig(draft=draft, draft_budget=budget, gamma=gamma)
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, speculative=config, return_dict_in_generate=True)
    return float(out.speculation.acceptance_rate)

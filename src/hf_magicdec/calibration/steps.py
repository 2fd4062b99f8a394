"""Time the engine's own target, verify and draft forwards on one prefilled cache.

The planner (:mod:`hf_magicdec.planner`) is torch-free and never imports the engine; it fits the
numbers measured here (:func:`hf_magicdec.calibration.fit.fit`). Each forward is the engine's
own (:mod:`hf_magicdec.engine.steps`) on a :class:`~hf_magicdec.engine.cache.MagicDecCache`,
timed round-robin so that a burst of other work spreads over all of them.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Iterable

import torch

from ..config import AUTO, MagicDecConfig
from ..engine import attention
from ..engine.cache import CacheOptions, MagicDecCache
from ..engine.draft_weights import check_draft_weights, quantized_draft
from ..engine.drafters import new_cache, quantized_draft_call
from ..engine.steps import ModelCall, draft_step, prefill, verify_step
from ..checks import check_int
from ..planner.modelspec import ModelSpec
from ..views import DraftView
from .store import StepTimes

__all__ = ["measure_steps"]


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


def _timing_cache(model, batch: int, context: int, capacity: int, observation_window: int, fixed_shapes: bool,
                  input_ids=None) -> MagicDecCache:
    """A cache holding ``context`` prefilled tokens per row: ``input_ids`` prefilled through the
    engine, or random KV (step timings do not depend on KV values, and a real prefill of 8 × 2048
    tokens costs tens of seconds on a CPU, far more than the steps we want to time). A timing cache
    carries no generation length (no sliding-window check)."""
    param = next(model.parameters())
    on_cuda = param.device.type == "cuda"
    options = CacheOptions(observation_window=observation_window, fixed_shapes=fixed_shapes,
                           static_addresses=fixed_shapes and on_cuda)  # CUDA graphs may write it in place
    cache = new_cache(model, torch.zeros(batch, dtype=torch.long, device=param.device), capacity, options)
    if input_ids is not None:
        positions = torch.arange(context, device=param.device)[None].expand(batch, -1)
        prefill(ModelCall.of(model), cache, input_ids.to(param.device), positions, chunk=1024)
    else:
        spec = ModelSpec.from_config(model.config)
        cache.fill_synthetic(context, spec.kv_heads, spec.heads, spec.head_dim, param.dtype, param.device)
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
    capacity: int | None = None,
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
        ``"int8"`` / ``"fp16"`` / ``"int4"``: also time the draft steps on the model's quantized draft
        (:mod:`hf_magicdec.engine.draft_weights`; ``StepTimes.t_draft_quantized``), as
        ``draft_weights=`` runs them. ``"full"``: the full-precision draft only.
    capacity : int, optional
        Slots per row of the timed cache, at least ``context + max(gammas) + 2`` (the default). A
        compiled step reads the whole buffer, so to time the steps of a compiled ``generate`` pass
        the capacity it allocates: prompt + ``max_new_tokens`` + γ + 1, rounded up to 256.

    Returns
    -------
    StepTimes

    Raises
    ------
    ValueError
        For non-positive sizes or ``input_ids`` of the wrong shape.
    """
    gammas, budgets = tuple(gammas), tuple(budgets)
    _check_sizes(batch, context, repeats, gammas, budgets, statistic, input_ids, capacity)
    device = next(model.parameters()).device
    quantized = draft_weights not in ("full", AUTO)
    if quantized:
        check_draft_weights(model, draft_weights, device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    q_max = max(gammas) + 1
    # gamma=1 keeps every budget valid; the view's scratch size does not change step 0's cost.
    view = MagicDecConfig.from_any(draft=draft, draft_budget=budgets[0], gamma=1).view
    for k in budgets:
        view.check(k, 1)
    rng = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (batch, q_max), generator=rng).to(device)
    with torch.no_grad(), attention.switched(model):
        call = ModelCall.of(model, compile_config)
        quantized_call = (quantized_draft_call(quantized_draft(model, draft_weights), compile_config)
                          if quantized else None)
        compiled = call.compiled is not None
        t0 = time.perf_counter()
        cache = _timing_cache(model, batch, context, capacity or context + q_max + 1, view.observation_window(),
                              compiled, input_ids)
        cache.build_draft_views(view, budgets[0], 1, context, 64)
        sync()
        prefill_seconds = time.perf_counter() - t0
        jobs = _jobs(call, quantized_call, cache, view, tokens, gammas, budgets, context)
        # Compiled: one graph per budget and verify width, more than dynamo's default limit of 8.
        limit = torch._dynamo.config.patch(recompile_limit=64) if compiled else contextlib.nullcontext()
        with limit:
            times = _time_rounds(jobs, repeats, sync, statistic)
    return StepTimes(batch=batch, context=context, draft=draft, t_target=times[("target", 1)],
                     t_verify={g: times[("verify", g)] for g in gammas},
                     t_draft={k: times[("draft", k)] for k in budgets}, prefill_seconds=prefill_seconds,
                     draft_weights=draft_weights if quantized else "full",
                     t_draft_quantized={k: times[("draft_q", k)] for k in budgets} if quantized else {})


def _check_sizes(batch, context, repeats, gammas, budgets, statistic, input_ids, capacity) -> None:
    for name, value in (("batch", batch), ("context", context), ("repeats", repeats)):
        check_int(name, value)
    if not gammas or not budgets:
        raise ValueError(f"gammas and budgets must not be empty, got {gammas=} and {budgets=}.")
    if statistic not in _STATISTICS:
        raise ValueError(f"Unknown {statistic=!r}; choose one of {sorted(_STATISTICS)}.")
    if input_ids is not None and tuple(input_ids.shape) != (batch, context):
        raise ValueError(f"input_ids must have shape {(batch, context)}, got {tuple(input_ids.shape)}.")
    if capacity is not None:
        check_int("capacity", capacity)
        if capacity < context + max(gammas) + 2:
            raise ValueError(f"capacity must hold the context and a verification, at least "
                             f"{context + max(gammas) + 2}; got {capacity=}.")


def _jobs(call, quantized_call, cache, view, tokens, gammas, budgets, context) -> dict:
    """The timed forwards: ``key -> (before, fn, after)`` for :func:`_time_rounds`."""
    zeros = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)

    def verify(n: int) -> None:
        verify_step(call, cache, tokens[:, 0], tokens[:, 1:n])

    def rollback() -> None:
        # Keep none of the verified tokens: the context never changes. Untimed: this is the
        # loop's bookkeeping, not the forward the roofline models.
        cache.commit(zeros)

    built = [budgets[0]]

    def use_view(k: int):
        def before() -> None:
            if built[0] != k:  # about the cost of one forward; untimed
                cache.build_draft_views(view, k, 1, context, 64)
                built[0] = k
        return before

    jobs = {("target", 1): (None, lambda: verify(1), rollback)}
    jobs.update({("verify", g): (None, lambda g=g: verify(g + 1), rollback) for g in gammas})
    jobs.update({("draft", k): (use_view(k), lambda: draft_step(call, cache, tokens[:, :1], 0), None)
                 for k in budgets})
    if quantized_call is not None:
        jobs.update({("draft_q", k): (use_view(k), lambda: draft_step(quantized_call, cache, tokens[:, :1], 0), None)
                     for k in budgets})
    return jobs

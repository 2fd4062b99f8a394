"""Time the engine's own target, verify and draft forwards (:mod:`hf_magicdec.engine.steps`) on one
prefilled :class:`~hf_magicdec.engine.cache.MagicDecCache`, round-robin, for the fit of :mod:`.fit`."""

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
    """``{key: statistic of the seconds of fn}`` for ``jobs`` ``{key: (before, fn, after)}``, timed
    ``repeats`` times round-robin (a burst of other work spreads over all) after one warm-up; ``before``
    and ``after`` (or None) run untimed."""
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
    """A cache of ``context`` tokens per row: ``input_ids`` prefilled through the engine, or random KV
    (timings do not depend on KV values, and a real prefill costs far more than the steps)."""
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


def measure_steps(model: Any, batch: int, context: int, gammas: Iterable[int] = (4,), budgets: Iterable[int] = (256,),
                  draft: str | DraftView = "streamingllm", repeats: int = 5, input_ids: Any = None,
                  statistic: str = "median", compile_config: Any = None, draft_weights: str = "full",
                  capacity: int | None = None) -> StepTimes:
    """Time T_T, T_V(γ) for ``gammas`` and T_D (draft step 0) for ``budgets`` with the engine's own
    forwards on one cache of ``batch`` rows × ``context`` tokens; returns :class:`~.store.StepTimes`.

    Verifications are rolled back (untimed), so the context never changes; each time is the
    ``statistic`` (``"median"``, or ``"min"``, which resists other processes) of ``repeats`` runs after a
    warm-up. ``draft``: a view name or instance. ``input_ids`` ``[batch, context]``: prefill real
    prompts (slow) instead of random KV (same timings). ``compile_config``: time the draft and verify
    forwards compiled as ``compile=`` runs them (the warm-up includes compiling). ``draft_weights``
    ``"int8"``/``"fp16"``/``"int4"``: time the quantized draft's steps too. ``capacity``: slots per row
    (>= ``context + max(gammas) + 2``; a compiled step reads the whole buffer, so pass what ``generate``
    allocates: prompt + ``max_new_tokens`` + γ + 1, rounded up to 256).
    """
    gammas, budgets = tuple(gammas), tuple(budgets)
    _check_sizes(batch, context, repeats, gammas, budgets, statistic, input_ids, capacity)
    device = next(model.parameters()).device
    quantized = draft_weights not in ("full", AUTO)
    if quantized:
        check_draft_weights(model, draft_weights, device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    q_max = max(gammas) + 1
    view = _timing_view(draft, budgets)
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


def _timing_view(draft: Any, budgets: tuple[int, ...]) -> DraftView:
    """The view, checked at every budget (γ = 1 keeps them valid; its scratch size does not change step 0's cost)."""
    view = MagicDecConfig.from_any(draft=draft, draft_budget=budgets[0], gamma=1).view
    for k in budgets:
        view.check(k, 1)
    return view


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

"""From ``speculative="magicdec"`` with fields left ``"auto"`` to a concrete configuration, per call.

The planner sees the real workload, the model's shapes and the device model: ``config.hardware``,
else the cached calibration of this model, device and dtype, else the preset matching the GPU, else
the uncalibrated ``"cpu"`` preset. α: what earlier generations of this model measured
(``acceptance_memory``), else the prior.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from .calibration.store import load_calibration
from .config import AUTO, DEFAULT_BUDGET, DEFAULT_GAMMA, MagicDecConfig
from .engine.draft_weights import feasible_formats, has_quantized_draft, source_bytes, supported_formats
from .engine.steps import compile_config_for
from .parallel.lockstep import tp_size
from .planner import default_acceptance, get_hardware, search_plan
from .planner.memory import draft_key, observed_acceptance
from .planner.modelspec import ModelSpec
from .planner.search import DEFAULT_DRAFT_MODEL_DRAFTS, SearchSpace, Workload
from .planner.schedule import StepModel
from .views import get_view

log = logging.getLogger("hf_magicdec")


@dataclass(frozen=True)
class Target:
    """What a plan is made for: shapes, name, device, dtype, tensor-parallel degree and the model
    (None for a config alone: dense draft weights assumed, no acceptance memory)."""

    spec: ModelSpec
    name: str
    device: torch.device
    dtype: Any
    tp: int = 1
    model: Any = None
    generation_config: Any = None

    @classmethod
    def of(cls, model) -> "Target":
        spec = ModelSpec.from_config(model.config, dtype=model.dtype)
        name = getattr(model.config, "_name_or_path", None) or spec.name
        return cls(spec, name, next(model.parameters()).device, model.dtype, tp_size(model), model,
                   model.generation_config)

    @classmethod
    def of_config(cls, config, device: str | torch.device = "cpu", dtype: Any = None) -> "Target":
        """A model known by its config (``PretrainedConfig``, ``config.json`` dict or ModelSpec) only."""
        spec = config if isinstance(config, ModelSpec) else ModelSpec.from_config(config, dtype=dtype)
        name = getattr(config, "_name_or_path", None) or (config.get("_name_or_path") if isinstance(config, dict)
                                                           else None) or spec.name
        return cls(spec, name, torch.device(device), spec.dtype)


def device_hardware(target: Target, config: MagicDecConfig):
    """``(HardwareSpec, description)`` for ``target`` (see the module docstring)."""
    if config.hardware is not None:
        return get_hardware(config.hardware), config.hardware
    device = target.device
    try:
        cal = load_calibration(target.name, target.spec, device, target.dtype)
        if cal is not None:
            return cal.hardware(), f"calibrated {cal.device}"
    except Exception as exc:  # a broken cache file must never break generate
        log.debug("no usable calibration: %s", exc)
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device).lower()
        for key in ("h200", "h100", "a100", "l40s"):
            if key in gpu.replace(" ", ""):
                return get_hardware(key), key
        log.info("no preset for GPU %r: planning with the h100 preset", gpu)
        return get_hardware("h100"), "h100 (fallback)"
    return get_hardware("cpu"), "cpu (uncalibrated)"


@dataclass
class Resolution:
    """What ``generate`` runs: ``config`` (None: plain decoding), its plan, for adaptive γ the
    ``step_model`` it re-weighs γ with, and whether γ follows the context down to 0 (``schedule``)."""

    config: MagicDecConfig | None
    plan: Any = None
    step_model: StepModel | None = None
    schedule: bool = False
    use_draft_model: bool = True  # False: the planner preferred self-speculation to the draft model


def _changes(config: MagicDecConfig, p, pool) -> dict:
    """The ``"auto"`` fields of ``config`` set to the plan's choice (its view from ``pool``), or to the
    defaults where the plan has no candidate (the view keeps the prompt whole)."""
    if p.draft is None:
        chosen = {"draft": config.view if config.view is not None else config.candidates[0],
                  "draft_budget": DEFAULT_BUDGET if config.draft_budget == AUTO else config.draft_budget,
                  "gamma": DEFAULT_GAMMA if config.gamma == AUTO else config.gamma, "draft_weights": "full"}
    else:
        chosen = {"draft": {v.name: v for v in pool}[p.draft], "draft_budget": p.draft_budget,
                  "gamma": p.gamma if config.gamma == AUTO else config.gamma, "draft_weights": p.draft_weights}
    return {k: v for k, v in chosen.items() if _left_to_planner(config, k)}


def _first_valid(config: MagicDecConfig, changes: dict) -> MagicDecConfig | None:
    """``config`` with ``changes``, or the nearest choice its explicit fields allow (smaller γ first,
    then the other candidate views); None where the planner may decline, else the config's error."""
    gammas = [changes["gamma"], *range(changes["gamma"] - 1, 0, -1)] if "gamma" in changes else [None]
    drafts = [changes["draft"], *(v for v in config.candidates if v.name != changes["draft"].name)] \
        if "draft" in changes else [None]
    errors: dict[str, None] = {}  # distinct messages, in order
    for draft, gamma in itertools.product(drafts, gammas):
        trial = dict(changes, **({} if draft is None else {"draft": draft}),
                     **({} if gamma is None else {"gamma": gamma}))
        try:
            return config.replace(**trial, adaptive_gamma=config.adaptive)  # "auto" γ keeps adapting
        except ValueError as exc:
            errors.setdefault(str(exc))
    if config.planner_may_decline:
        return None
    raise ValueError(f"No draft view and gamma fit the explicit settings {config}: " + " / ".join(errors))


def resolve(config: MagicDecConfig, model, batch: int, prompt_len: int, new_tokens: int,
            draft_model=None, captured: bool | None = None, describe: bool = False) -> Resolution:
    """Fill the ``"auto"`` fields of ``config`` for ``batch`` rows of ``prompt_len`` tokens and
    ``new_tokens`` more; the returned plan is always the plan of what runs.

    With a ``draft_model``, its candidates are planned, and where view, budget and γ are all auto
    self-speculation competes (``Resolution.use_draft_model`` False if it wins). ``captured``: whether
    the steps run compiled (None: from ``config.compile``). ``describe``: plan an explicit
    configuration too (``hf_magicdec.plan``).
    """
    if config.is_resolved and config.draft_weights == AUTO:
        # View, budget and γ all explicit: the planner chooses nothing, so neither the weights
        # (an explicit configuration decodes the same way on every call, seeded sampling included).
        config = config.replace(draft_weights="full")
    explicit = config.is_resolved and not config.adaptive
    if explicit and not describe:
        return Resolution(config)

    target = model if isinstance(model, Target) else Target.of(model)
    spec = target.spec
    hardware, where = device_hardware(target, config)
    if target.tp > 1 and hardware.tp == 1:
        hardware = hardware.with_tp(target.tp)  # a tensor-parallel model plans as a TP group
    # Eager steps pay host time per layer on a GPU; captured ones (compile=) do not.
    if captured is None:
        captured = compile_config_for(config.compile, target.generation_config or GenerationConfig(),
                                      target.device) is not None
    hardware = hardware.replace(captured=captured)
    kwargs = search_space(config, target, draft_model, captured, batch, prompt_len, new_tokens, hardware)
    if explicit:
        return Resolution(config, _explicit_plan(config, spec, kwargs), use_draft_model=draft_model is not None)
    p = search_plan(spec, **kwargs)
    use_draft_model = p.draft_model is not None
    if config.planner_may_decline and (not p.speculate or p.draft is None):
        log.info("hf_magicdec planner (%s): plain decoding for batch %d x %d tokens: %s", where, batch, prompt_len,
                 p.reason)
        return Resolution(None, p, use_draft_model=False)
    space = kwargs["space"]
    resolved = _first_valid(config, _changes(config, p, space.draft_model_drafts if use_draft_model else space.drafts))
    if resolved is None:  # nothing fits the explicit fields (e.g. a budget too small for any γ)
        return Resolution(None, p, use_draft_model=False)
    p = _as_run(p, resolved, spec, kwargs)
    log.info("hf_magicdec planner (%s): %s budget %s gamma %s, predicted %.2fx", where, resolved.draft_name,
             resolved.draft_budget, resolved.gamma, p.predicted_speedup)
    if not resolved.adaptive:
        return Resolution(resolved, p, use_draft_model=use_draft_model)
    drafter = space.draft_model if use_draft_model else spec.with_weights(resolved.draft_weights)
    # Adaptive γ re-weighs γ each step with the same step-time model, at the batch and context reached.
    model = StepModel(spec, hardware, drafter, resolved.draft_budget, resolved.view,
                      tuple(range(1, resolved.max_gamma + 1)))
    schedule = space.schedule and not use_draft_model
    return Resolution(resolved, p, model, schedule=schedule, use_draft_model=use_draft_model)


def search_space(config: MagicDecConfig, target: Target | None, draft_model, captured: bool, batch: int,
                 prompt_len: int, new_tokens: int, hardware) -> dict[str, Any]:
    """:func:`~hf_magicdec.planner.search_plan`'s keywords (``workload``, ``hardware``, ``space``,
    ``acceptance``) for ``config``: what it leaves open, the draft weights the device runs, α observed
    or the prior. ``target`` None: a config on a named preset (full-precision draft weights)."""
    model = target.model if target is not None else None

    def prior_or_observed(draft, budget, context):
        if not config.acceptance_memory or model is None:  # the default: the same inputs plan alike on every call
            return default_acceptance(draft, budget, context, prompt_len)
        key = draft_key(draft.split(":", 1)[1], draft_model) if draft.startswith("model:") else draft
        seen = observed_acceptance(model, key, budget)
        return seen if seen is not None else default_acceptance(draft, budget, context, prompt_len)

    space = dict(drafts=(config.view,) if config.view is not None else config.candidates,
                 gammas=((config.gamma,) if config.gamma > 0 else (1,)) if config.gamma != AUTO
                 else tuple(range(1, config.max_gamma + 1)),
                 draft_weights=_weight_candidates(config, target, draft_model, captured),
                 # γ follows the context down to 0 where the planner may decline (a call that asked for a
                 # budget or a γ speculates throughout, adapting γ >= 1): the candidates are priced by that
                 # schedule.
                 schedule=config.adaptive and config.planner_may_decline)
    if config.draft_budget != AUTO:
        space["budgets"] = (config.draft_budget,)
    if draft_model is not None:
        own = {v.name: v for v in config.candidates}  # the candidates' options apply to the draft model's cache too
        space.update(draft_model=(ModelSpec.from_config(draft_model.config, dtype=draft_model.dtype)
                                  if hasattr(draft_model, "parameters") else draft_model),
                     self_speculation=config.planner_may_decline and config.view is None,
                     draft_model_drafts=((config.view,) if config.view is not None else
                                         tuple(own.get(d) or get_view(d) for d in DEFAULT_DRAFT_MODEL_DRAFTS)))
    return dict(workload=Workload(batch, max(prompt_len, 1), max(new_tokens, 1)), hardware=hardware,
                acceptance=prior_or_observed, space=SearchSpace(**space),
                setup_seconds=_build_seconds(target, space["draft_weights"], hardware))


def _build_seconds(target: Target | None, formats, hardware) -> dict[str, float]:
    """Seconds this call would spend building each quantized draft the model does not have yet
    (at the device's measured rate per weight byte; 0 for one already built)."""
    if target is None:
        return {}
    model = target.model
    rates = {fmt: hardware.format_build.get(fmt, 0.0) for fmt in formats if fmt != "full"}
    unbuilt = [fmt for fmt, rate in rates.items()
               if rate and not (model is not None and has_quantized_draft(model, fmt))]
    if not unbuilt:
        return {}
    nbytes = source_bytes(model) if model is not None else target.spec.params * target.spec.weight_bytes
    return {fmt: nbytes * rates[fmt] for fmt in unbuilt}


def _weight_candidates(config: MagicDecConfig, target: Target | None, draft_model, captured: bool) -> tuple[str, ...]:
    """The explicit draft weights, or for ``"auto"`` full and the quantized formats this model and device
    run (self-drafting, uncaptured steps only)."""
    if config.draft_weights != AUTO:
        return (config.draft_weights,)
    if target is None or draft_model is not None or config.draft_name == "full" or config.gamma == 0 or captured:
        return ("full",)
    if target.model is None:
        return ("full", *supported_formats(target.device))
    return ("full", *feasible_formats(target.model, target.device))


def _as_run(p, resolved: MagicDecConfig, spec, kwargs: dict):
    """The plan of what runs: the search's best if it runs (``speculate`` True even without a predicted
    gain where the planner may not decline), else the nearest choice the explicit settings allowed."""
    ran = (resolved.draft_name, resolved.draft_budget, resolved.gamma, resolved.draft_weights)
    if resolved.gamma == 0:
        return _plain_on_cache(p, draft=ran[0], draft_budget=ran[1], draft_weights="full")
    if p.draft is None:  # no budget below the prompt: the view holds it whole, as the defaults say
        return dataclasses.replace(p, speculate=True, draft=ran[0], draft_budget=ran[1], gamma=ran[2],
                                   draft_weights=ran[3], reason=f"speculating as asked, though {p.reason}")
    if (p.draft, p.draft_budget, p.gamma, p.draft_weights) != ran and not p.draft_model:
        nearest = _pinned(spec, kwargs, resolved, draft_model=False)
        if nearest.draft is not None:
            reason = (f"the explicit settings rule out the planner's best ({p.draft}/{p.draft_budget} γ={p.gamma}, "
                      f"{p.predicted_speedup:.2f}x); the nearest they allow")
            return dataclasses.replace(nearest, reason=reason, runner_ups=p.runner_ups)
    if not p.speculate:
        reason = f"speculating as asked (draft_budget or gamma set), though {p.reason}"
        return dataclasses.replace(p, speculate=True, reason=reason)
    return p


def _explicit_plan(config: MagicDecConfig, spec, kwargs: dict):
    """The plan of a configuration with nothing left to choose: its own estimate, run as given."""
    view = config.view
    p = _pinned(spec, kwargs, config, draft_model=True)
    if config.gamma == 0:
        return _plain_on_cache(p)
    if p.draft is None:  # the budget holds the whole prompt: the search has no candidate, the call runs it
        return dataclasses.replace(p, speculate=True, draft=view.name, draft_budget=config.draft_budget,
                                   gamma=config.gamma, draft_weights=config.draft_weights,
                                   reason=f"explicit settings, run as given ({p.reason})")
    return dataclasses.replace(p, speculate=True, reason=f"explicit settings, run as given (predicted "
                                                         f"{p.predicted_speedup:.2f}x)")


def _plain_on_cache(p, **changes):
    return dataclasses.replace(p, speculate=False, gamma=0, predicted_speedup=1.0, predicted_decode_speedup=1.0,
                               reason="gamma=0: plain decoding on MagicDec's cache (no draft)", **changes)


def _pinned(spec, kwargs: dict, config: MagicDecConfig, draft_model: bool):
    """The search of ``config``'s one candidate without a threshold: on the draft model's cache where
    ``draft_model`` and the search has one, else self-speculation."""
    view = config.view
    space = dataclasses.replace(kwargs["space"], drafts=(view,), budgets=(config.draft_budget,),
                                gammas=(max(config.gamma, 1),), draft_weights=(config.draft_weights,))
    if space.draft_model is not None:
        space = dataclasses.replace(space, draft_model_drafts=(view,), self_speculation=False) if draft_model \
            else dataclasses.replace(space, draft_model=None, draft_model_drafts=None, self_speculation=True)
    return search_plan(spec, **dict(kwargs, space=space, min_speedup=0.0))


def _left_to_planner(config: MagicDecConfig, field: str) -> bool:
    return (config.draft_name if field == "draft" else getattr(config, field)) == AUTO

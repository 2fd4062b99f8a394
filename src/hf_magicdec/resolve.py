"""From ``speculative="magicdec"`` with fields left ``"auto"`` to a concrete configuration.

At the start of every ``generate`` call the planner (:mod:`hf_magicdec.planner`) sees the real
workload (batch, prompt length, new tokens), the model's shapes and the device, and picks the
draft view, budget and γ, or plain decoding. During the call, :class:`GammaController` re-picks γ
each step from the acceptance observed so far, with the same cost model.

Device model, in order: ``MagicDecConfig.hardware`` if set; the cached calibration of this model
on this device and dtype (``hf-magicdec plan --model ... --calibrate``); the preset matching the
GPU's name; the uncalibrated ``"cpu"`` preset. Acceptance α: what earlier generations of this
model measured for the same draft view and budget (kept in memory while the model lives, at most
64 entries per model), else the documented prior (:func:`hf_magicdec.planner.default_acceptance`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from .config import AUTO, DEFAULT_BUDGET, DEFAULT_DRAFT, DEFAULT_GAMMA, MagicDecConfig
from .engine.draft_weights import feasible_formats
from .engine.steps import compile_config_for
from .parallel.lockstep import with_tp_degree
from .planner import default_acceptance, draft_step, get_hardware, target_step, verify_step
from .planner import plan as search_plan
from .planner.calibrate import load_calibration
from .planner.modelspec import ModelSpec
from .planner.search import DEFAULT_DRAFT_MODEL_DRAFTS, DEFAULT_DRAFTS
from .planner.selection import selection_seconds
from .views import get_view

log = logging.getLogger("hf_magicdec")

# Views an "auto" draft may fall back to when the explicit fields rule out the planner's choice.
SELF_DRAFTS = ("snapkv", "streamingllm")

# The acceptance memory: per live model, (draft key, budget) -> (accepted, drafted) over this
# process's generations. Keyed by the model object itself through weak references, so a model's
# entries go away with it and can never be inherited by a later model that happens to reuse its
# ``id()`` after garbage collection; each model keeps at most ``_MAX_ENTRIES_PER_MODEL`` entries
# (least recently used dropped first), so the memory is bounded by the models alive.
_OBSERVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Serial numbers naming models in draft keys (``model:<name>#<serial>:<view>``): never reused.
_SERIALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NEXT_SERIAL = itertools.count(1)
_MAX_ENTRIES_PER_MODEL = 64
_LOCK = threading.Lock()


def _model_key(model) -> str:
    """A name for ``model`` that no other model of this process ever gets (a serial number, not ``id()``)."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    with _LOCK:
        try:
            serial = _SERIALS.get(model)
            if serial is None:
                serial = _SERIALS[model] = next(_NEXT_SERIAL)
        except TypeError:  # not weak-referenceable: a name of its own, not remembered
            serial = f"u{next(_NEXT_SERIAL)}"
    return f"{name}#{serial}"


def record_acceptance(model, draft: str, budget: int, accepted: int, drafted: int) -> None:
    """Remember what a finished generation measured, for the next plan."""
    if drafted <= 0:
        return
    key = (draft, budget)
    with _LOCK:
        try:
            memory = _OBSERVED.get(model)
            if memory is None:
                memory = _OBSERVED[model] = OrderedDict()
        except TypeError:  # not weak-referenceable: nothing is remembered for it
            return
        a, d = memory.pop(key, (0, 0))
        memory[key] = (a + accepted, d + drafted)
        while len(memory) > _MAX_ENTRIES_PER_MODEL:
            memory.popitem(last=False)


def draft_key(draft: str, draft_model=None, draft_weights: str = "full") -> str:
    """The name α is recorded and planned under: the view (``<view>@int8`` for a self-draft on
    quantized weights), or ``model:<draft model>:<view>``."""
    if draft_model is not None:
        return f"model:{_model_key(draft_model)}:{draft}"
    return draft if draft_weights in ("full", AUTO) else f"{draft}@{draft_weights}"


def observed_acceptance(model, draft: str, budget: int) -> float | None:
    """What earlier generations of this model measured for this draft key and budget, or None."""
    with _LOCK:
        try:
            memory = _OBSERVED.get(model)
        except TypeError:
            return None
        a, d = memory.get((draft, budget), (0, 0)) if memory is not None else (0, 0)
    return a / d if d else None


def forget_acceptance(model=None) -> None:
    """Drop the acceptance memory of ``model`` (all models when None): plans start from the prior again."""
    with _LOCK:
        if model is None:
            _OBSERVED.clear()
        else:
            _OBSERVED.pop(model, None)


def hardware_for(model, config: MagicDecConfig, spec=None):
    """``(HardwareSpec, description)`` the planner uses for this model (see the module docstring);
    ``spec``: the model's :class:`~hf_magicdec.planner.ModelSpec` when the caller has it."""

    if config.hardware is not None:
        return get_hardware(config.hardware), config.hardware
    device = next(model.parameters()).device
    try:
        spec = spec if spec is not None else ModelSpec.from_config(model.config, dtype=model.dtype)
        name = getattr(model.config, "_name_or_path", None) or spec.name
        cal = load_calibration(name, spec, device, model.dtype)
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
    """What ``generate`` runs: ``config`` (None = plain decoding), the plan behind it, and the cost
    ratios adaptive γ needs (``draft_ratio`` = T_D/T_T, ``verify_ratio[g]`` = T_V(g)/T_T)."""

    config: MagicDecConfig | None
    plan: Any = None
    draft_ratio: float | None = None
    verify_ratio: dict[int, float] | None = None
    use_draft_model: bool = True  # False: the planner preferred self-speculation to the draft model


def _first_valid(config: MagicDecConfig, changes: dict) -> MagicDecConfig | None:
    """``config`` with the planner's ``changes``, or, where the explicit fields rule that choice out
    (a rolling window too small for the chosen γ, a budget not above StreamingLLM's sinks), the
    nearest choice they allow: smaller γ first, then the other views. None where the planner may
    decline and nothing fits; the config's own error otherwise."""
    gammas = [changes["gamma"]] + list(range(changes["gamma"] - 1, 0, -1)) if "gamma" in changes else [None]
    drafts = [changes["draft"]] + [d for d in SELF_DRAFTS if d != changes["draft"]] if "draft" in changes else [None]
    errors: list[str] = []
    for draft in drafts:
        for gamma in gammas:
            trial = dict(changes)
            if draft is not None:
                trial["draft"] = draft
            if gamma is not None:
                trial["gamma"] = gamma
            try:
                return config.replace(**trial, adaptive_gamma=config.adaptive)  # "auto" γ keeps adapting
            except ValueError as exc:
                if str(exc) not in errors:
                    errors.append(str(exc))
    if config.planner_may_decline:
        return None
    raise ValueError(f"No draft view and gamma fit the explicit settings {config}: " + " / ".join(errors))


def resolve(config: MagicDecConfig, model, batch: int, prompt_len: int, new_tokens: int,
            draft_model=None, captured: bool | None = None) -> Resolution:
    """Fill the ``"auto"`` fields of ``config`` for this workload (see module docstring).

    With a separate ``draft_model``, its candidates (each view on *its* cache) are planned; when
    ``draft``, ``draft_budget`` and ``gamma`` are all ``"auto"``, self-speculation competes too and
    may win (``Resolution.use_draft_model`` is then False). ``captured``: whether the call's steps
    run compiled (``generate`` decides it once); None: decided from ``config.compile`` and the
    model's generation config."""
    if config.is_resolved and config.draft_weights == AUTO:
        # View, budget and γ all explicit: the planner chooses nothing, so neither the weights
        # (an explicit configuration decodes the same way on every call, seeded sampling included).
        config = config.replace(draft_weights="full")
    if config.is_resolved and not config.adaptive:
        return Resolution(config)

    spec = ModelSpec.from_config(model.config, dtype=model.dtype)
    hardware, where = hardware_for(model, config, spec)
    hardware = with_tp_degree(hardware, model)  # a tensor-parallel model plans as a TP group
    # Eager steps pay host time per layer on a GPU; captured ones (compile=) do not.
    if captured is None:
        captured = compile_config_for(config.compile, model.generation_config, next(model.parameters()).device) \
            is not None
    hardware = hardware.replace(captured=captured)

    def prior_or_observed(draft, budget, context):
        key = draft_key(draft.split(":", 1)[1], draft_model) if draft.startswith("model:") else draft
        seen = observed_acceptance(model, key, budget)
        return seen if seen is not None else default_acceptance(draft, budget, context)

    kwargs = dict(batch_size=batch, prompt_len=max(prompt_len, 1), new_tokens=max(new_tokens, 1), hardware=hardware,
                  acceptance=prior_or_observed)
    # The candidate views, with the config's options (an "auto" draft's apply to whichever view has them).
    kwargs["drafts"] = (config.view,) if config.draft != AUTO else tuple(config.view_for(d) for d in DEFAULT_DRAFTS)
    if config.draft_budget != AUTO:
        kwargs["budgets"] = (config.draft_budget,)
    if config.gamma != AUTO:
        kwargs["gammas"] = (config.gamma,) if config.gamma > 0 else (1,)
    else:
        kwargs["gammas"] = tuple(range(1, config.max_gamma + 1))
    kwargs["draft_weights"] = _weight_candidates(config, model, draft_model, captured)
    if draft_model is not None:
        kwargs["draft_model"] = ModelSpec.from_config(draft_model.config, dtype=draft_model.dtype)
        kwargs["self_speculation"] = config.planner_may_decline and config.draft == AUTO
        kwargs["draft_model_drafts"] = ((config.view,) if config.draft != AUTO else
                                        tuple(config.view_for(d) for d in DEFAULT_DRAFT_MODEL_DRAFTS))
    p = search_plan(spec, **kwargs)
    use_draft_model = p.draft_model is not None
    if config.planner_may_decline and (not p.speculate or p.draft is None):
        log.info("hf_magicdec planner (%s): plain decoding for batch %d x %d tokens: %s", where, batch, prompt_len,
                 p.reason)
        return Resolution(None, p, use_draft_model=False)
    if p.draft is None:  # prompt shorter than every budget considered: the view keeps it whole
        chosen = {"draft": DEFAULT_DRAFT if config.draft == AUTO else config.draft,
                  "draft_budget": DEFAULT_BUDGET if config.draft_budget == AUTO else config.draft_budget,
                  "gamma": DEFAULT_GAMMA if config.gamma == AUTO else config.gamma, "draft_weights": "full"}
    else:
        chosen = {"draft": p.draft, "draft_budget": p.draft_budget,
                  "gamma": p.gamma if config.gamma == AUTO else config.gamma, "draft_weights": p.draft_weights}
    changes = {k: v for k, v in chosen.items() if getattr(config, k) == AUTO}
    resolved = _first_valid(config, changes)
    if resolved is None:  # nothing fits the explicit fields (e.g. a budget too small for any γ)
        return Resolution(None, p, use_draft_model=False)
    log.info("hf_magicdec planner (%s): %s budget %s gamma %s, predicted %.2fx", where, resolved.draft,
             resolved.draft_budget, resolved.gamma, p.predicted_speedup)
    if not resolved.adaptive:
        return Resolution(resolved, p, use_draft_model=use_draft_model)
    # Adaptive γ re-weighs γ each step with the same step-time model: T_D/T_T and T_V(γ)/T_T.
    context = max(int(p.context), 1)
    tt = target_step(spec, hardware, batch, context).seconds
    drafter = kwargs["draft_model"] if use_draft_model else spec.with_weights(resolved.draft_weights)
    draft_ratio = draft_step(drafter, hardware, batch, context, resolved.draft_budget).seconds / tt
    draft_ratio += selection_seconds(drafter, hardware, batch, context, resolved.draft_budget,
                                     resolved.view) / tt  # query-aware views (dynamic)
    verify_ratio = {g: verify_step(spec, hardware, batch, context, g).seconds / tt
                    for g in range(1, config.max_gamma + 1)}
    return Resolution(resolved, p, draft_ratio, verify_ratio, use_draft_model)


def _weight_candidates(config: MagicDecConfig, model, draft_model, captured: bool) -> tuple[str, ...]:
    """Draft weights the planner weighs: the explicit one, or for ``"auto"`` full precision and the
    quantized formats this model and device can run (self-drafting only; a CPU twin runs eagerly,
    so not when the steps are captured)."""
    if config.draft_weights != AUTO:
        return (config.draft_weights,)
    if draft_model is not None or config.draft == "full" or config.gamma == 0 or captured:
        return ("full",)
    return ("full", *feasible_formats(model, next(model.parameters()).device))


def plan(model_or_config, *, batch_size: int, prompt_len: int, new_tokens: int, hardware=None, drafts=None,
         draft_model_drafts=None, **kwargs):
    """The planner's choice for a workload: :func:`hf_magicdec.planner.plan` with the device model
    ``generate`` would use, and draft views given by name or as instances.

    Parameters
    ----------
    model_or_config : PreTrainedModel, PretrainedConfig, dict or ModelSpec
        Only shapes and dtype are read.
    batch_size, prompt_len, new_tokens : int
        The workload.
    hardware : str, HardwareSpec or None
        None: for a model, its cached calibration on its device, else the preset matching its
        device (as ``generate`` does); for a config, the ``h100`` preset.
    drafts, draft_model_drafts : iterable of str or DraftView, optional
        Views to consider: names (default options) or instances (``SnapKV(window=16)``). Default:
        ``streamingllm`` and ``snapkv``; for a ``draft_model``, also ``full``.
    **kwargs
        Passed to :func:`hf_magicdec.planner.plan` (``acceptance``, ``budgets``, ``gammas``,
        ``tp``, ``dtype``, ``min_speedup``, ``draft_model`` …).

    Returns
    -------
    hf_magicdec.planner.Plan
        ``plan.speculate``, ``MagicDecConfig.from_any(plan)``, ``plan.summary()``, runner-ups.

    Examples
    --------
    >>> p = hf_magicdec.plan(model, batch_size=8, prompt_len=4096, new_tokens=128)
    >>> out = model.generate(**inputs, speculative=p) if p.speculate else model.generate(**inputs)
    """

    def views(items):
        return tuple(get_view(v) if isinstance(v, str) else v for v in items)

    if hardware is None:
        if hasattr(model_or_config, "parameters") and hasattr(model_or_config, "config"):
            hardware, _ = hardware_for(model_or_config, MagicDecConfig())
            hardware = with_tp_degree(hardware, model_or_config)
        else:
            hardware = "h100"
    return search_plan(model_or_config, batch_size=batch_size, prompt_len=prompt_len, new_tokens=new_tokens,
                          hardware=hardware, drafts=views(DEFAULT_DRAFTS if drafts is None else drafts),
                          draft_model_drafts=views(DEFAULT_DRAFT_MODEL_DRAFTS if draft_model_drafts is None
                                                   else draft_model_drafts), **kwargs)

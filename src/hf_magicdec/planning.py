"""``hf_magicdec.plan``: what ``generate(speculative=...)`` would run, before running it (for a model,
the very resolution ``generate`` performs). What-if searches are :func:`hf_magicdec.planner.search_plan`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .config import MagicDecConfig
from .parallel.lockstep import with_tp_degree
from .planner import HardwareSpec, get_hardware, search_plan
from .planner.search import Plan
from .resolve import Target, device_hardware, resolve, search_space

__all__ = ["device_model", "plan"]


def _is_model(obj: Any) -> bool:
    return hasattr(obj, "parameters") and hasattr(obj, "config")


def plan(model_or_config, *, batch_size: int, prompt_len: int, new_tokens: int, speculative: Any = "magicdec",
         draft_model=None, device: Any = None, dtype: Any = None, tp: int = 1, **options) -> Plan:
    """The :class:`~hf_magicdec.planner.Plan` of ``model.generate(..., speculative=speculative, **options)``
    for ``batch_size`` rows of ``prompt_len`` tokens (cached ones included) and ``new_tokens`` more.

    A model is planned exactly as ``generate`` plans its call (its device, cached calibration, draft
    weights). A config with ``device=`` (and ``dtype``, ``tp``): as ``generate`` would plan that model
    there, its weights assumed dense. A config alone: on ``hardware=`` (a preset or a
    :class:`~hf_magicdec.planner.HardwareSpec`, default ``"h100"``), full-precision draft weights.
    ``speculative``, ``options`` and ``draft_model`` are what ``generate`` would get. ``plan.speculate``
    says whether the call speculates; ``draft``, ``draft_budget``, ``gamma``, ``draft_weights`` what it runs.
    """
    hardware = options.pop("hardware", None)
    on_device = _is_model(model_or_config) or device is not None
    if isinstance(hardware, HardwareSpec) or not on_device:
        options["hardware"] = None  # a spec, or a config's preset: used below, not by MagicDecConfig
    else:
        options["hardware"] = hardware
    config = MagicDecConfig.from_any(speculative, **options)
    if on_device:
        if isinstance(hardware, HardwareSpec):
            raise ValueError("hardware= takes a preset name for a model (as generate does); a HardwareSpec is for a "
                             "config: hf_magicdec.plan(model.config, ..., hardware=spec).")
        target = model_or_config if _is_model(model_or_config) else \
            dataclasses.replace(Target.of_config(model_or_config, device, dtype), tp=tp)
        return resolve(config, target, batch_size, prompt_len, new_tokens, draft_model=draft_model,
                       describe=True).plan
    spec = hardware if isinstance(hardware, HardwareSpec) else get_hardware(hardware or "h100", tp)
    kwargs = search_space(config, None, draft_model, False, batch_size, prompt_len, new_tokens, spec)
    return search_plan(model_or_config, dtype=dtype, **kwargs)


def device_model(model, hardware: str | None = None) -> HardwareSpec:
    """The device model ``generate`` plans ``model``'s calls with (``hardware``: a preset), with its
    tensor-parallel degree."""
    spec, _ = device_hardware(Target.of(model), MagicDecConfig(hardware=hardware))
    return with_tp_degree(spec, model)

"""``hf_magicdec.plan``: what ``generate(speculative=...)`` would run, before running it.

For a model it is the very resolution ``generate`` performs (:func:`hf_magicdec.resolve.resolve`:
the same candidates, draft weights included, the same device model, the same acceptance memory
setting), so the plan it returns is the plan the call runs. For a config alone there is no device
and no weights: it plans on a named preset with full-precision draft weights. What-if searches
(your own α, budgets, γ grid, speedup threshold) are :func:`hf_magicdec.planner.search_plan`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .config import MagicDecConfig
from .parallel.lockstep import with_tp_degree
from .planner import HardwareSpec, get_hardware, search_plan
from .planner.search import Plan
from .resolve import Target, hardware_for, resolve, search_space

__all__ = ["device_model", "plan"]


def _is_model(obj: Any) -> bool:
    return hasattr(obj, "parameters") and hasattr(obj, "config")


def plan(model_or_config, *, batch_size: int, prompt_len: int, new_tokens: int, speculative: Any = "magicdec",
         draft_model=None, device: Any = None, dtype: Any = None, tp: int = 1, **options) -> Plan:
    """The plan of ``model.generate(..., speculative=speculative, **options)`` for a workload.

    Parameters
    ----------
    model_or_config : PreTrainedModel, PretrainedConfig, dict or ModelSpec
        A model: planned exactly as ``generate`` plans its call (its device, its cached calibration,
        the draft weights it can run). A config with ``device=`` (``"cpu"``, ``"cuda"``): as
        ``generate`` would plan that model on that device (its cached calibration there, the
        device's draft-weight formats; its weights assumed dense, as loaded). A config alone: the
        plan is for ``hardware=`` (a preset name or a :class:`~hf_magicdec.planner.HardwareSpec`,
        default ``"h100"``) with full-precision draft weights.
    batch_size, prompt_len, new_tokens : int
        The workload (``prompt_len``: tokens per row the steps read, cached ones included).
    speculative, **options
        What ``generate`` would get: ``"magicdec"``, a dict or a :class:`~hf_magicdec.MagicDecConfig`,
        and its keywords (``draft``, ``draft_budget``, ``gamma``, ``draft_weights``, ``hardware``,
        ``candidates``, view options …).
    draft_model : a separate draft model, as ``draft_model=`` in ``generate``.
    device, dtype : for a config, the device its model would run on and the dtype it would be loaded
        in (default: the config's).
    tp : tensor-parallel degree for a config (a model's own degree is read from it).

    Returns
    -------
    hf_magicdec.planner.Plan
        ``plan.speculate`` is whether the call speculates (False: it decodes with stock code, or,
        with ``gamma=0``, plainly on MagicDec's cache); ``draft``, ``draft_budget``, ``gamma`` and
        ``draft_weights`` are what it runs; ``summary()``, ``runner_ups``.

    Examples
    --------
    >>> p = hf_magicdec.plan(model, batch_size=8, prompt_len=4096, new_tokens=128)
    >>> print(p.summary())
    >>> out = model.generate(**inputs, speculative="magicdec")   # runs what p says
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
    """The device model ``generate`` plans ``model``'s calls with: ``hardware`` (a preset) if given,
    else the cached calibration of this model on its device, else the preset matching the device;
    a tensor-parallel model's degree included."""
    spec, _ = hardware_for(model, MagicDecConfig(hardware=hardware))
    return with_tp_degree(spec, model)

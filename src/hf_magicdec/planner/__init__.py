"""MagicDec's torch-free cost model: when does self-speculation pay, with which view, budget and γ?

    views = [get_view("streamingllm"), get_view("snapkv", window=16)]
    p = search_plan(model.config, Workload(32, 32768, 256), "h100", SearchSpace(drafts=views))

(:func:`hf_magicdec.plan` does the same with view names and this device's model.) Views are read
duck-typed, never imported; a calibration reaches it as ``search_plan(..., calibration=)``. The
formulas and assumptions: docs/cost_model.md.
"""

from .acceptance import default_acceptance, resolve_acceptance
from .hardware import HARDWARE_PRESETS, HardwareSpec, get_hardware
from .modelspec import ModelSpec
from .memory import forget_acceptance, observed_acceptance, record_acceptance
from .search import Plan, SearchSpace, Workload, search_plan
from .roofline import StepCost, draft_step, draft_steps, forward_cost, target_step, verify_step
from .speculation import Estimate, critical_length, estimate, omega, speedup

__all__ = ["critical_length", "default_acceptance", "draft_step", "draft_steps", "Estimate", "estimate",
           "forget_acceptance", "forward_cost", "get_hardware", "HARDWARE_PRESETS", "HardwareSpec", "ModelSpec",
           "observed_acceptance", "omega", "Plan", "record_acceptance", "resolve_acceptance", "search_plan",
           "SearchSpace", "speedup", "StepCost", "target_step", "verify_step", "Workload"]

"""MagicDec's cost model: when does self-speculation pay, and with which draft view, budget and γ?

    from . import SearchSpace, Workload, search_plan
    from ..views import get_view
    views = [get_view("streamingllm"), get_view("snapkv", window=16)]
    p = search_plan(model.config, Workload(32, 32768, 256), "h100", SearchSpace(drafts=views))
    if p.speculate:
        out = model.generate(**inputs, speculative=p)

(``hf_magicdec.plan`` does the same with view names and this device's model.) The planner never
imports the views (they need torch): it asks the view objects its callers pass which budgets and
γ fit (``view.fits``) and what selecting costs (``query_aware``, ``page_size``).

Modules (all pure Python):

* :mod:`.hardware`    peak FLOP/s, bandwidth, tensor parallelism; presets
* :mod:`.modelspec`   shapes from any HF config
* :mod:`.roofline`    per-op-group roofline of T_T, T_D, T_V
* :mod:`.acceptance`  the default α and how α is passed in
* :mod:`.speculation` Ω(γ, α), speedup, critical context length
* :mod:`.search`      the search over (draft, budget, γ): :func:`search_plan`
* :mod:`.memory`      the acceptance measured by earlier generations
* :mod:`.schedule`    γ as a function of the context a generation has reached; the one best-γ choice
* :mod:`.gamma`       adaptive γ's controller
* :mod:`.selection`   the selection cost of query-aware views

Calibration (timing the engine, the fit, its cache) is :mod:`hf_magicdec.calibration`; the
planner takes its result as ``search_plan(..., calibration=)`` and never imports it.

See ``docs/cost_model.md`` for the formulas and assumptions.
"""

from .acceptance import default_acceptance, resolve_acceptance
from .hardware import HARDWARE_PRESETS, HardwareSpec, get_hardware
from .modelspec import ModelSpec
from .memory import forget_acceptance, observed_acceptance, record_acceptance
from .search import Plan, SearchSpace, Workload, search_plan
from .roofline import StepCost, draft_step, draft_steps, forward_cost, target_step, verify_step
from .speculation import Estimate, critical_length, estimate, omega, speedup

__all__ = [
    "HARDWARE_PRESETS",
    "Estimate",
    "HardwareSpec",
    "ModelSpec",
    "Plan",
    "SearchSpace",
    "StepCost",
    "critical_length",
    "default_acceptance",
    "draft_step",
    "draft_steps",
    "estimate",
    "forget_acceptance",
    "forward_cost",
    "get_hardware",
    "observed_acceptance",
    "omega",
    "record_acceptance",
    "search_plan",
    "resolve_acceptance",
    "speedup",
    "target_step",
    "verify_step",
    "Workload",
]

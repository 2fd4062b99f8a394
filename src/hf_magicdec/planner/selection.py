"""Selection costs of draft views that choose their pages as they go, on the roofline's terms.

A query-aware view (``view.query_aware``, ``dynamic``) re-selects at every draft step, per layer and
row (S context tokens, P = ``page_size``, K budget): it reads the page summaries (2·Hkv·⌈S/P⌉·Dh·kvb
bytes), scores them (4·H·⌈S/P⌉·Dh FLOPs) and gathers K tokens' K and V (2·2·Hkv·K·Dh·kvb bytes). A
view re-chosen by the verifier (``view.reselects``, ``attended``) pays per verification: see
docs/cost_model.md, "Views chosen by the verifier". Top-k and kernel launches are not modelled.
"""

from __future__ import annotations

import math
from typing import Any

from ..defaults import DEFAULT_PAGE_SIZE
from ..checks import check_int
from .hardware import HardwareSpec
from .modelspec import ModelSpec
from .roofline import _group

__all__ = ["selection_seconds", "choice_seconds"]


def _checked(batch: int, context: int, budget: int) -> None:
    check_int("batch", batch, 1)
    check_int("context", context, 0)
    check_int("budget", budget, 1)


def _seconds(model: ModelSpec, hardware: HardwareSpec, nbytes: float, flops: float = 0.0) -> float:
    """One group's seconds over all layers, as the roofline charges it."""
    return _group(flops, float(nbytes), hardware.peak(model.dtype), hardware.bandwidth, model.layers,
                  hardware.overlap).seconds


def _gather_seconds(model: ModelSpec, hardware: HardwareSpec, batch: int, budget: int) -> float:
    """Reading ``budget`` tokens' K and V and writing them into the view."""
    kv_heads = math.ceil(model.kv_heads / hardware.tp)
    return _seconds(model, hardware, 2 * 2 * batch * kv_heads * budget * model.head_dim * model.kv_bytes)


def selection_seconds(model: ModelSpec, hardware: HardwareSpec, batch: int, context: int, budget: int,
                      draft: Any) -> float:
    """Seconds (over all layers) one draft step of view ``draft`` spends selecting, at ``batch`` rows,
    ``context`` S and ``budget`` K tokens: 0 unless ``draft.query_aware`` (a name is a static view)
    and K < S; pages of ``draft.page_size`` (default :data:`~hf_magicdec.defaults.DEFAULT_PAGE_SIZE`)."""
    _checked(batch, context, budget)
    if not getattr(draft, "query_aware", False) or budget >= context:
        return 0.0
    page_size = check_int("page_size", getattr(draft, "page_size", DEFAULT_PAGE_SIZE), 1)
    heads, kv_heads = math.ceil(model.heads / hardware.tp), math.ceil(model.kv_heads / hardware.tp)
    pages = math.ceil(context / page_size)
    summaries = 2 * batch * kv_heads * pages * model.head_dim * model.kv_bytes
    score = _seconds(model, hardware, summaries, 4.0 * batch * heads * pages * model.head_dim)
    return score + _gather_seconds(model, hardware, batch, budget)


def choice_seconds(model: ModelSpec, hardware: HardwareSpec, batch: int, context: int, budget: int,
                   draft: Any, queries: int = 1) -> float:
    """Seconds per verification that ``draft`` (``reselects`` and not ``query_aware``) spends re-choosing
    its view from the verify pass's attention mass, amortized over its ``every`` verifications;
    arguments as :func:`selection_seconds`, ``queries`` = γ + 1 (the unfused twin reads its fp32
    probabilities once more: ``hardware.fused_mass`` False)."""
    _checked(batch, context, budget)
    check_int("queries", queries, 1)
    if not getattr(draft, "reselects", False) or getattr(draft, "query_aware", False) or budget >= context:
        return 0.0
    page_size = check_int("page_size", getattr(draft, "page_size", DEFAULT_PAGE_SIZE), 1)
    every = check_int("every", getattr(draft, "every", 1), 1)
    heads, kv_heads = math.ceil(model.heads / hardware.tp), math.ceil(model.kv_heads / hardware.tp)
    mass = 4 * batch * kv_heads * math.ceil(context / page_size)
    if not hardware.fused_mass:  # the twin's fp32 probabilities, read once more to sum the mass
        mass += 4 * batch * heads * queries * context
    # Only the verification a choice follows emits mass.
    return (_seconds(model, hardware, mass) + _gather_seconds(model, hardware, batch, budget)) / every

"""Per-draft-step selection cost of query-aware draft views (``dynamic``), on the same roofline.

A static view (``streamingllm``, ``snapkv``) is chosen once after prefill: its draft steps cost
:func:`~hf_magicdec.planner.roofline.draft_step` only. A query-aware view (``view.query_aware``,
e.g. ``dynamic``) re-selects pages at every draft step, in every layer, which adds, per layer and
row (``S`` context tokens, ``P`` the view's ``page_size``, ``K`` budget)::

    read summaries    bytes = 2·Hkv·⌈S/P⌉·Dh·kvb          (key min and max: 2/P of the keys)
    score pages       FLOPs = 4·H·⌈S/P⌉·Dh                (q⁺·max + q⁻·min, two products)
    gather the pages  bytes = 2·2·Hkv·K·Dh·kvb            (read K tokens' K and V, write them)

each group costing ``max(FLOPs / peak, bytes / bandwidth)`` (their sum without overlap) like the
roofline's. Not modelled: the top-k over ``⌈S/P⌉`` pages and the kernel launches of selection.
``S`` is the context the planner evaluates at (prompt + half the new tokens), a slight
overestimate: summaries only cover the prompt. No selection when the view holds the context.

A view that re-chooses its static part after verifications (``view.reselects`` without
``query_aware``, e.g. ``attended``) pays, once per ``every`` verifications and per layer, the
gather of its static part (``2·2·Hkv·K·Dh·kvb`` bytes) and a top-k over ``⌈S/P⌉`` page masses
(not modelled, like dynamic's); the mass itself comes out of the verify attention's kernel of
the verification the choice follows (``B·Hkv·⌈S/P⌉`` fp32 written per layer, included) — where
the fused kernel emits it (``hardware.fused_mass``). Where the PyTorch twin does (CPUs), that
verification's attention materialises the fp32 probabilities of its ``q = γ + 1`` queries, written
and read once more than a fused attention: ``2·4·B·H·q·S`` bytes per layer (at 8 rows, 9 heads,
q = 4, 4K context on 2 CPU cores: 0.8 ms measured per layer, 0.8 ms predicted at the ``cpu``
preset's 12 GB/s). :func:`choice_seconds` gives that per verification.
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


def selection_seconds(model: ModelSpec, hardware: HardwareSpec, batch: int, context: int, budget: int,
                      draft: Any) -> float:
    """Seconds one draft step of ``draft`` spends selecting its view (0 for static views).

    Parameters
    ----------
    model, hardware :
        What runs where (``hardware.tp`` splits the heads).
    batch : int
        Rows B.
    context : int
        Context S, tokens.
    budget : int
        Draft budget K, tokens.
    draft : draft view
        A view object (:mod:`hf_magicdec.views`, read duck-typed: only ``query_aware`` views cost
        anything, pages of their ``page_size``, else :data:`~hf_magicdec.defaults.DEFAULT_PAGE_SIZE`).
        A name stands for a static view.

    Returns
    -------
    float
        Seconds, summed over layers.
    """
    check_int("batch", batch, 1)
    check_int("context", context, 0)
    check_int("budget", budget, 1)
    if not getattr(draft, "query_aware", False) or budget >= context:
        return 0.0
    page_size = getattr(draft, "page_size", DEFAULT_PAGE_SIZE)
    check_int("page_size", page_size, 1)
    tp = hardware.tp
    heads, kv_heads = math.ceil(model.heads / tp), math.ceil(model.kv_heads / tp)
    pages = math.ceil(context / page_size)
    peak, bw = hardware.peak(model.dtype), hardware.bandwidth
    summaries = 2 * batch * kv_heads * pages * model.head_dim * model.kv_bytes
    flops = 4.0 * batch * heads * pages * model.head_dim
    gather = 2 * 2 * batch * kv_heads * budget * model.head_dim * model.kv_bytes
    score = _group(flops, float(summaries), peak, bw, model.layers, hardware.overlap)
    move = _group(0.0, float(gather), peak, bw, model.layers, hardware.overlap)
    return score.seconds + move.seconds


def choice_seconds(model: ModelSpec, hardware: HardwareSpec, batch: int, context: int, budget: int,
                   draft: Any, queries: int = 1) -> float:
    """Seconds per verification that ``draft`` spends re-choosing its view from the verify pass's
    attention mass (0 for views that do not: static views and query-aware ones, which
    :func:`selection_seconds` costs per draft step). Arguments as :func:`selection_seconds`;
    ``queries``: tokens per verification (γ + 1), which the PyTorch twin's explicit softmax scales
    with (``hardware.fused_mass`` False: one more read of its fp32 probabilities). The view's
    ``every`` (verifications per choice) amortizes the mass and the gather."""
    check_int("batch", batch, 1)
    check_int("context", context, 0)
    check_int("budget", budget, 1)
    check_int("queries", queries, 1)
    if not getattr(draft, "reselects", False) or getattr(draft, "query_aware", False) or budget >= context:
        return 0.0
    page_size = getattr(draft, "page_size", DEFAULT_PAGE_SIZE)
    every = getattr(draft, "every", 1)
    check_int("page_size", page_size, 1)
    check_int("every", every, 1)
    tp = hardware.tp
    heads, kv_heads = math.ceil(model.heads / tp), math.ceil(model.kv_heads / tp)
    mass = 4 * batch * kv_heads * math.ceil(context / page_size)
    if not hardware.fused_mass:  # the twin's fp32 probabilities, read once more to sum the mass
        mass += 4 * batch * heads * queries * context
    gather = 2 * 2 * batch * kv_heads * budget * model.head_dim * model.kv_bytes
    peak, bw = hardware.peak(model.dtype), hardware.bandwidth
    emit = _group(0.0, float(mass), peak, bw, model.layers, hardware.overlap)
    move = _group(0.0, float(gather), peak, bw, model.layers, hardware.overlap)
    return (emit.seconds + move.seconds) / every  # only the verification a choice follows emits mass

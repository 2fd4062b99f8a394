"""Per-op-group roofline of one forward pass, and the three step times of speculation.

A forward of ``q`` query tokens for ``B`` rows attending to ``L`` keys costs, per op group (linear,
attention, lm_head), ``max(FLOPs / peak, bytes / bandwidth)`` (their sum with ``overlap=False``),
plus all-reduces (``tp > 1``) and host overhead; on a device with a measured row curve
(:attr:`~.hardware.HardwareSpec.linear_rows`) the full-precision linear layers and LM head cost their
weight read times the curve instead. T_T, T_D and T_V are this forward with different
``q``, ``L`` and logits: see docs/cost_model.md, §2–3.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Mapping

from ..checks import check_int
from .hardware import HardwareSpec
from .modelspec import ModelSpec

__all__ = ["GroupCost", "StepCost", "forward_cost", "rows_factor", "target_step", "draft_step", "draft_steps",
           "verify_step"]


@dataclass(frozen=True)
class GroupCost:
    """One op group of one forward summed over layers: FLOPs and bytes per device, seconds, and
    whether the FLOP term is the larger (always False for ``allreduce`` and ``overhead``)."""

    flops: float
    bytes: float
    seconds: float
    compute_bound: bool = False


@dataclass(frozen=True)
class StepCost:
    """Predicted seconds of one forward and its ``groups``: ``linear``, ``attention``, ``lm_head``,
    ``allreduce``, ``overhead``."""

    seconds: float
    groups: Mapping[str, GroupCost] = field(hash=False)

    @property
    def flops(self) -> float:
        return sum(g.flops for g in self.groups.values())

    @property
    def bytes(self) -> float:
        return sum(g.bytes for g in self.groups.values())


def _group(flops: float, nbytes: float, peak: float, bandwidth: float, layers: int, overlap: bool) -> GroupCost:
    compute, memory = flops / peak, nbytes / bandwidth
    seconds = max(compute, memory) if overlap else compute + memory
    return GroupCost(flops * layers, nbytes * layers, layers * seconds, compute > memory)


def rows_factor(points: tuple[tuple[int, float], ...], rows: int) -> float:
    """A matmul's time over ``rows`` rows relative to one row, from measured ``(rows, factor)`` ``points``:
    linear between them, the first point's factor below it, proportional to ``rows`` past the last (the
    GEMM is compute-bound there)."""
    first, last = points[0], points[-1]
    if rows <= first[0]:
        return first[1]
    if rows >= last[0]:
        return last[1] * rows / last[0]
    for (r0, f0), (r1, f1) in zip(points, points[1:]):
        if rows <= r1:
            return f0 + (f1 - f0) * (rows - r0) / (r1 - r0)
    raise AssertionError("unreachable")


def curve_factor(curve: tuple[tuple[int, float], ...], name: str, batch: int, query_tokens: int,
                 logit_tokens: int) -> float | None:
    """The row ``curve``'s factor for op group ``name`` (``linear``: batch × query tokens rows, ``lm_head``:
    batch × logit tokens), which then costs its weight read times it; None for the other groups or
    without a curve."""
    rows = {"linear": batch * query_tokens, "lm_head": batch * logit_tokens}.get(name)
    return rows_factor(curve, rows) if curve and rows is not None else None


def group_work(model: ModelSpec, tp: int, *, batch: int, query_tokens: int, kv_tokens: int,
               logit_tokens: int) -> dict[str, tuple[float, float, int]]:
    """``{group: (FLOPs, bytes, repeats)}`` per device of ``linear`` and ``attention`` (per layer,
    repeated ``layers`` times) and ``lm_head`` (once); the calibration fit reads it too."""
    heads = math.ceil(model.heads / tp)
    # Fewer KV heads than devices: each device holds a replica of its KV head.
    kv_heads = math.ceil(model.kv_heads / tp)
    mlp = math.ceil(model.intermediate / tp)
    d, dh = model.hidden, model.head_dim
    weights = 2 * d * heads * dh + 2 * d * kv_heads * dh + model.mlp_matrices * d * mlp
    tokens = batch * query_tokens
    linear = (2.0 * tokens * weights, float(weights * model.linear_weight_bytes), model.layers)
    # KV read for every key attended plus the write of the new tokens' KV.
    kv_elems = 2 * batch * kv_heads * (kv_tokens + query_tokens) * dh
    attention = (4.0 * tokens * kv_tokens * heads * dh, float(kv_elems * model.kv_bytes), model.layers)
    vocab = math.ceil(model.vocab / tp)
    lm_head = (2.0 * batch * logit_tokens * vocab * d, float(vocab * d * model.linear_weight_bytes), 1)
    return {"linear": linear, "attention": attention, "lm_head": lm_head}


def forward_cost(model: ModelSpec, hardware: HardwareSpec, *, batch: int, query_tokens: int, kv_tokens: int,
                 logit_tokens: int) -> StepCost:
    """Roofline :class:`StepCost` of one forward: ``batch`` rows of ``query_tokens`` new tokens each
    attending to ``kv_tokens`` keys (cached plus new, >= ``query_tokens``), logits for ``logit_tokens``
    per row. ValueError for a count that is not a positive int."""
    check_int("batch", batch, 1)
    check_int("query_tokens", query_tokens, 1)
    check_int("kv_tokens", kv_tokens, query_tokens)
    check_int("logit_tokens", logit_tokens, 1)
    return _forward_cost(model, hardware, batch, query_tokens, kv_tokens, logit_tokens)


# A plan prices the same forwards for many candidates (every view and budget verifies alike), and
# generate plans every call: specs are frozen, so a forward's cost is kept.
@functools.lru_cache(maxsize=4096)
def _forward_cost(model: ModelSpec, hardware: HardwareSpec, batch: int, query_tokens: int, kv_tokens: int,
                  logit_tokens: int) -> StepCost:
    tp = hardware.tp
    peak, bw = hardware.peak(model.dtype), hardware.bandwidth
    work = group_work(model, tp, batch=batch, query_tokens=query_tokens, kv_tokens=kv_tokens,
                      logit_tokens=logit_tokens)
    # Quantized linear layers run at the device's rate for their format where it lists one (CPU
    # int8 GEMMs); weight-only formats (GPU) compute in the model's dtype.
    linear_peak = hardware.linear_peak(model.weight_format, model.dtype)
    # Quantized drafts keep their fitted rate and per-layer time: the curve is the dense kernels'.
    curve = hardware.linear_rows if model.weight_format is None else ()
    groups = {}
    for name, (f, b, n) in work.items():
        factor = curve_factor(curve, name, batch, query_tokens, logit_tokens)
        if factor is None:
            groups[name] = _group(f, b, peak if name == "attention" else linear_peak, bw, n, hardware.overlap)
        else:
            groups[name] = GroupCost(f * n, b * n, n * b / bw * factor)
    comm = 0.0
    if tp > 1:
        # Ring all-reduce moves 2(tp-1)/tp of the message per device; two per layer (after
        # attention and after the MLP), plus one all-gather of the vocab-split logits.
        message = batch * query_tokens * model.hidden * model.weight_bytes
        per_allreduce = 2 * (tp - 1) / tp * message / hardware.link_bandwidth + hardware.allreduce_latency
        logits = batch * logit_tokens * model.vocab * model.weight_bytes
        gather = (tp - 1) / tp * logits / hardware.link_bandwidth + hardware.allreduce_latency
        comm = 2 * model.layers * per_allreduce + gather
    groups["allreduce"] = GroupCost(0.0, 0.0, comm)
    host = hardware.overhead + (0.0 if hardware.captured else model.layers * hardware.layer_overhead)
    if model.weight_format is not None:  # per-layer work of quantized linear layers (dynamic quantization)
        host += model.layers * hardware.format_overhead.get(model.weight_format, 0.0)
    groups["overhead"] = GroupCost(0.0, 0.0, host)
    return StepCost(sum(g.seconds for g in groups.values()), groups)


def target_step(model: ModelSpec, hardware: HardwareSpec, batch: int, context: int) -> StepCost:
    """T_T(B, S): one plain decode step of the target on the full cache of ``context`` tokens."""
    check_int("context", context, 0)
    return forward_cost(model, hardware, batch=batch, query_tokens=1, kv_tokens=context + 1, logit_tokens=1)


def draft_step(model: ModelSpec, hardware: HardwareSpec, batch: int, context: int, budget: int,
               step: int = 0) -> StepCost:
    """T_D(B, S, K): draft step ``step`` (0-based) on a view of ``min(K, S)`` tokens, plus the
    ``step`` tokens drafted before it and its own."""
    check_int("budget", budget, 1)
    check_int("step", step, 0)
    check_int("context", context, 0)
    kv = min(budget, context) + step + 1
    return forward_cost(model, hardware, batch=batch, query_tokens=1, kv_tokens=kv, logit_tokens=1)


def draft_steps(model: ModelSpec, hardware: HardwareSpec, batch: int, context: int, budget: int,
                gamma: int) -> float:
    """Total seconds of the γ draft steps of one speculation step (Σ over ``step = 0 … γ-1``)."""
    check_int("gamma", gamma, 1)
    return sum(draft_step(model, hardware, batch, context, budget, i).seconds for i in range(gamma))


def verify_step(model: ModelSpec, hardware: HardwareSpec, batch: int, context: int, gamma: int) -> StepCost:
    """T_V(B, S, γ): one verification of γ+1 tokens per row on the full cache (logits for all)."""
    check_int("gamma", gamma, 1)
    check_int("context", context, 0)
    q = gamma + 1
    return forward_cost(model, hardware, batch=batch, query_tokens=q, kv_tokens=context + q, logit_tokens=q)

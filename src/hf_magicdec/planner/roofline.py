"""Per-op-group roofline of one forward pass, and the three step times of speculation.

A forward of ``q`` query tokens per row, for ``B`` rows, attending to ``L`` cached tokens, is
split into op groups per layer; each group costs ``max(FLOPs / peak FLOP/s, bytes / bandwidth)``
(or the sum of the two on hardware with ``overlap=False``, i.e. CPUs) and the groups are summed
over layers::

    linear     projections + MLP     bytes = layer weights          FLOPs = 2·B·q·weights
    attention  KV read + write       bytes = 2·B·Hkv·(L+q)·Dh·kvb   FLOPs = 4·B·q·L·H·Dh
    lm_head    once per forward      bytes = V·d·wb                 FLOPs = 2·B·n_logits·V·d
    allreduce  2 per layer if tp>1   ring all-reduce of B·q·d activations + latency
    overhead   once per forward      hardware.overhead (+ layers · layer_overhead when not captured)

With tensor parallelism the weights, heads, KV heads (replicated when fewer than ``tp``) and
vocabulary are split over ``tp`` devices. The three steps of MagicDec (``T_T``, ``T_D``, ``T_V``)
are this forward with different ``q``, ``L`` and ``n_logits`` (``logits_to_keep``):

=========  ===  ==========================  ========
step       q    L (keys per query)          n_logits
=========  ===  ==========================  ========
target     1    S + 1                       1
draft i    1    min(K, S) + i + 1           1
verify     γ+1  S + γ + 1                   γ+1
=========  ===  ==========================  ========

(``i`` = tokens drafted so far in this step; the engine's attention is masked, not causal-skipping,
so every query of a verify block pays for all ``S + γ + 1`` keys.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from ..checks import check_int
from .hardware import HardwareSpec
from .modelspec import ModelSpec

__all__ = ["GroupCost", "StepCost", "forward_cost", "target_step", "draft_step", "draft_steps", "verify_step"]


@dataclass(frozen=True)
class GroupCost:
    """One op group of one forward, summed over layers.

    Attributes
    ----------
    flops : float
        FLOPs per device.
    bytes : float
        Bytes moved from/to memory per device.
    seconds : float
        Time of the group, seconds: ``max(flops / peak, bytes / bandwidth)`` per layer summed
        over layers, or the communication / fixed time of ``allreduce`` / ``overhead``.
    compute_bound : bool
        True when the FLOP term is the larger one (always False for ``allreduce``/``overhead``).
    """

    flops: float
    bytes: float
    seconds: float
    compute_bound: bool = False


@dataclass(frozen=True)
class StepCost:
    """Predicted cost of one forward pass.

    Attributes
    ----------
    seconds : float
        Total predicted time, seconds.
    groups : Mapping[str, GroupCost]
        ``linear``, ``attention``, ``lm_head``, ``allreduce``, ``overhead``.
    """

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


def group_work(model: ModelSpec, tp: int, *, batch: int, query_tokens: int, kv_tokens: int,
               logit_tokens: int) -> dict[str, tuple[float, float, int]]:
    """FLOPs and bytes per device of each roofline group, per layer.

    Returns
    -------
    dict
        ``{group: (flops, bytes, repeats)}`` for ``linear``, ``attention`` (``repeats`` =
        layers) and ``lm_head`` (``repeats`` = 1). Shared by :func:`forward_cost` and the
        calibration fit, which needs the raw work to fit effective rates.
    """
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
    """Roofline time of one forward pass.

    Parameters
    ----------
    model : ModelSpec
        Shapes and dtype.
    hardware : HardwareSpec
        Device (and tensor-parallel degree).
    batch : int
        Rows B.
    query_tokens : int
        New tokens per row q.
    kv_tokens : int
        Keys each query attends to L (cached tokens plus the new ones).
    logit_tokens : int
        Tokens per row whose logits are computed (``logits_to_keep``).

    Returns
    -------
    StepCost
        Total seconds and the per-group breakdown.

    Raises
    ------
    ValueError
        If a count is not a positive int (``kv_tokens`` may not be below ``query_tokens``).
    """
    check_int("batch", batch, 1)
    check_int("query_tokens", query_tokens, 1)
    check_int("kv_tokens", kv_tokens, query_tokens)
    check_int("logit_tokens", logit_tokens, 1)
    tp = hardware.tp
    peak, bw = hardware.peak(model.dtype), hardware.bandwidth
    work = group_work(model, tp, batch=batch, query_tokens=query_tokens, kv_tokens=kv_tokens,
                      logit_tokens=logit_tokens)
    # Quantized linear layers run at the device's rate for their format where it lists one (CPU
    # int8 GEMMs); weight-only formats (GPU) compute in the model's dtype.
    linear_peak = hardware.linear_peak(model.weight_format, model.dtype)
    groups = {name: _group(f, b, peak if name == "attention" else linear_peak, bw, n, hardware.overlap)
              for name, (f, b, n) in work.items()}
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
    groups["overhead"] = GroupCost(0.0, 0.0, host)
    return StepCost(sum(g.seconds for g in groups.values()), groups)


def target_step(model: ModelSpec, hardware: HardwareSpec, batch: int, context: int) -> StepCost:
    """T_T(B, S): one plain decode step of the target on the full cache of ``context`` tokens."""
    check_int("context", context, 0)
    return forward_cost(model, hardware, batch=batch, query_tokens=1, kv_tokens=context + 1, logit_tokens=1)


def draft_step(model: ModelSpec, hardware: HardwareSpec, batch: int, context: int, budget: int,
               step: int = 0) -> StepCost:
    """T_D(B, S, K): draft step ``step`` (0-based) on a view of ``min(K, S)`` tokens.

    The draft also attends to the ``step`` tokens it drafted earlier in this speculation step
    and to its own new token.
    """
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

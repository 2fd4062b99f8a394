"""The attention function the engine registers with transformers under the name ``"magicdec"``.

It never replaces HF's own ``sdpa``/``eager``: the engine switches the model to ``"magicdec"``
for the duration of one ``generate`` call and restores the previous implementation afterwards.

Why a function of our own: HF's sdpa path calls ``repeat_kv`` for multi-token queries under GQA
with a mask, copying the whole KV cache g times per layer per verify step (3x the cost of a
1-token step at batch 8, context 2048 on CPU). Folding the g query heads that share a KV head
into the query axis reads each KV byte once, which is what makes verifying γ+1 tokens cost about
the same as decoding one.
"""

from __future__ import annotations

import torch

from . import kernels
from .kernels.reference import gqa_attention

ATTENTION_NAME = "magicdec"

def magicdec_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    magicdec_cache=None,
    **kwargs,
):
    """HF ``AttentionInterface`` function (see ``transformers-seams`` §4).

    ``magicdec_cache`` is the engine's :class:`~hf_magicdec.cache.MagicDecCache`, passed down as a
    forward kwarg. During prefill it records the observation-window queries SnapKV scores with;
    during draft and verify it describes each row's key ranges (:class:`~hf_magicdec.kernels.Segments`),
    which the kernels read instead of the 4-D mask.
    """
    if magicdec_cache is not None:
        segments = magicdec_cache.attention_segments(key.device)
        if segments is not None:
            magicdec_cache.before_attention(module.layer_idx, query, scaling)  # dynamic view / refresh
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return kernels.segment_attention(query, key, value, segments, scale), None
        magicdec_cache.observe(module.layer_idx, query, scaling)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise TypeError(f"magicdec attention expects a bool mask, got {attention_mask.dtype=}")
    return gqa_attention(query, key, value, attention_mask, scaling), None


_registered = False


def register() -> None:
    """Register ``"magicdec"`` with transformers' attention and mask interfaces (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, magicdec_attention_forward)
    # The engine always passes its own 4-D masks; this entry only keeps any forward that does
    # not (e.g. a user calling the model while it is switched) causal and correct.
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    _registered = True

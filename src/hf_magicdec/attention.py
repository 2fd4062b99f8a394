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
import torch.nn.functional as F

ATTENTION_NAME = "magicdec"

# Above this many query rows, tiling the mask g times costs more than it saves.
_FOLD_MAX_QUERY = 64


def gqa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    """Grouped-query attention without copying KV.

    Parameters
    ----------
    query : ``[B, H, q, D]``
    key, value : ``[B, Hkv, L, D]`` with ``H % Hkv == 0``
    mask : ``[B, 1, q, L]`` bool (True = attend) or None (attend everywhere)
    scaling : softmax scale (None: 1/√D)

    Returns
    -------
    ``[B, q, H, D]`` (the layout HF attention functions return).
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    if group == 1 or q_len > _FOLD_MAX_QUERY:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, enable_gqa=group > 1
        )
        return out.transpose(1, 2).contiguous()
    # [B, Hkv*g, q, D] -> [B, Hkv, g*q, D]: query head h = kv*g + j serves KV head kv.
    folded = query.reshape(batch, kv_heads, group * q_len, head_dim)
    if mask is not None and q_len > 1:
        mask = mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(batch, mask.shape[1], group * q_len, -1)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, q_len, -1).transpose(1, 2).contiguous()


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
    forward kwarg so that prefill can record the observation-window queries SnapKV scores with.
    """
    if magicdec_cache is not None:
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

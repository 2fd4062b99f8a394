"""PyTorch twins of the Triton kernels: same signatures, the production path on CPU and the
fallback wherever Triton is unavailable. Each twin is written to be read, not to be fast on GPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .segments import Segments

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


def segment_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: Segments, scaling: float
) -> torch.Tensor:
    """Attention of a short query block over two key ranges per row.

    Parameters
    ----------
    query : ``[B, H, q, D]``
    key : ``[B, Hkv, L, D]``, value ``[B, Hkv, L, Dv]`` with ``H % Hkv == 0``
    segments : the ranges each row attends to (:class:`Segments`).
    scaling : softmax scale.

    Returns
    -------
    ``[B, q, H, Dv]`` in the query's dtype.
    """
    mask = segments.to(query.device).mask(query.shape[2], key.shape[2])
    return gqa_attention(query, key, value, mask, scaling)


def snapkv_mass(
    queries: torch.Tensor, keys: torch.Tensor, pad: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention mass each prompt key receives from the observation window, summed over the
    window queries and over the query heads that share its KV head.

    Parameters
    ----------
    queries : ``[B, H, w, D]`` queries of the last ``w`` prompt slots.
    keys : ``[B, Hkv, S, D]`` prompt keys.
    pad : ``[B]`` left-padding slots per row (slots ``< pad[b]`` are not tokens).
    scaling : softmax scale.

    Returns
    -------
    ``[B, Hkv, S]`` float32. Window query ``i`` sits at slot ``S - w + i`` and sees keys up to
    itself; padding queries contribute nothing.
    """
    batch, heads, window, head_dim = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    dev = keys.device
    query_slot = slots - window + torch.arange(window, device=dev).repeat(group)  # [g*w]
    key_slot = torch.arange(slots, device=dev)
    pad = pad.to(dev)
    allowed = (key_slot[None, None, :] <= query_slot[None, :, None]) & (key_slot[None, None, :] >= pad[:, None, None])
    query_ok = query_slot[None, :] >= pad[:, None]  # [B, g*w]
    out = torch.empty((batch, kv_heads, slots), dtype=torch.float32, device=dev)
    # One KV head at a time: the logits never exceed [B, g*w, S] (not [B, H, w, S]).
    for h in range(kv_heads):
        q = queries[:, h * group : (h + 1) * group].float().reshape(batch, group * window, head_dim)
        logits = torch.matmul(q, keys[:, h].float().transpose(-1, -2)) * scaling  # [B, g*w, S]
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        probs = torch.where(query_ok[:, :, None], probs, torch.zeros((), device=dev))  # NaN rows of padding
        out[:, h] = probs.sum(dim=1)
    return out

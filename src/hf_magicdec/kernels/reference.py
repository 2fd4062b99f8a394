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
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query attention without copying KV.

    Parameters
    ----------
    query : ``[B, H, q, D]``
    key, value : ``[B, Hkv, L, D]`` with ``H % Hkv == 0``
    mask : ``[B, 1, q, L]`` bool (True = attend), or additive float (0 / -inf, biases), or None
        (attend everywhere)
    scaling : softmax scale (None: 1/√D)
    softcap : logit soft-capping (Gemma 2): logits ``s`` become ``softcap · tanh(s / softcap)``
        before the mask is applied; None = off.
    sinks : ``[H]`` attention-sink logits (gpt-oss ``s_aux``): one extra logit per query head in
        the softmax denominator, attending to nothing; None = off.

    Returns
    -------
    ``[B, q, H, D]`` (the layout HF attention functions return).
    """
    if softcap is not None or sinks is not None:
        return _explicit_attention(query, key, value, mask, scaling, softcap, sinks)
    fold = _folds(query, key)
    return _sdpa(query, key, value, _fold_mask(mask, query.shape[1] // key.shape[1]) if fold else mask, scaling, fold)


def _folds(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether :func:`_sdpa` folds the query heads of a KV head into one block of query rows."""
    group = query.shape[1] // key.shape[1]
    return group > 1 and query.shape[2] <= _FOLD_MAX_QUERY


def _sdpa(query, key, value, mask, scaling, fold: bool) -> torch.Tensor:
    """SDPA without copying KV; ``mask`` already folded (:func:`_fold_mask`) when ``fold``."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    if not fold:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, enable_gqa=heads > kv_heads
        )
        return out.transpose(1, 2).contiguous()
    # [B, Hkv*g, q, D] -> [B, Hkv, g*q, D]: query head h = kv*g + j serves KV head kv.
    folded = query.reshape(batch, kv_heads, heads // kv_heads * q_len, head_dim)
    out = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, q_len, -1).transpose(1, 2).contiguous()


def _fold_mask(mask: torch.Tensor | None, group: int) -> torch.Tensor | None:
    """``[B, 1|H, q, L]`` mask for the folded ``[B, Hkv, g*q, L]`` logits."""
    if mask is None or group == 1:
        return mask
    batch, mask_heads, q_len, length = mask.shape
    if mask_heads == 1:
        if q_len == 1:
            return mask  # broadcasts over the g*q rows
        return mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(batch, 1, group * q_len, length)
    # A per-head mask (biases): head h = kv*g + j lands on folded row j*q + i of KV head kv.
    return mask.reshape(batch, mask_heads // group, group * q_len, length)


def _explicit_attention(query, key, value, mask, scaling, softcap, sinks) -> torch.Tensor:
    """Soft-capped and/or sink attention, in the order of the models' own eager code: scale,
    cap, mask, softmax over [keys | sink], drop the sink. GQA folded as in :func:`gqa_attention`."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    scaling = head_dim**-0.5 if scaling is None else scaling
    folded = query.reshape(batch, kv_heads, group * q_len, head_dim)
    logits = torch.matmul(folded, key.transpose(-1, -2)) * scaling  # [B, Hkv, g*q, L]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    mask = _fold_mask(mask, group)
    if mask is not None:
        if mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask, float("-inf"))
        else:
            logits = logits + mask
    if sinks is None:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(value.dtype)
    else:
        combined = torch.cat([logits, _folded_sinks(sinks, logits, q_len)], dim=-1)
        combined = combined - combined.amax(dim=-1, keepdim=True)
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(value.dtype)
    out = torch.matmul(probs, value)  # [B, Hkv, g*q, Dv]
    return out.reshape(batch, heads, q_len, -1).transpose(1, 2).contiguous()


def _folded_sinks(sinks: torch.Tensor, logits: torch.Tensor, q_len: int) -> torch.Tensor:
    """Each folded row's sink logit ``[B, Hkv, g*q, 1]`` (``logits``' dtype and device) from the
    per-query-head ``sinks [H]``: row ``j*q + i`` of KV head ``kv`` belongs to query head ``kv*g + j``."""
    batch, kv_heads, rows = logits.shape[:3]
    sink = sinks.to(logits).reshape(1, kv_heads, rows // q_len, 1, 1).expand(batch, -1, -1, q_len, 1)
    return sink.reshape(batch, kv_heads, rows, 1)


def segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Segments,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    page_size: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a short query block over two key ranges per row.

    Parameters
    ----------
    query : ``[B, H, q, D]``
    key : ``[B, Hkv, L, D]``, value ``[B, Hkv, L, Dv]`` with ``H % Hkv == 0``
    segments : the ranges each row attends to (:class:`Segments`).
    scaling : softmax scale.
    softcap, sinks : logit soft-capping and attention sinks, as in :func:`gqa_attention`.
    page_size : 0, or also return the attention mass per page of this many keys.

    Returns
    -------
    ``out [B, q, H, Dv]`` in the query's dtype; with ``page_size > 0``, ``(out, mass)``, ``mass
    [B, Hkv, ceil(L / page_size)]`` float32: ``mass[b, h, p]`` sums, over the ``g`` query heads of
    KV head ``h`` and the ``q`` query positions of row ``b``, the softmax probabilities this
    attention gives the keys of slots ``[p * page_size, (p + 1) * page_size)`` (after soft-capping,
    the sink in the denominator): keys outside row ``b``'s ranges get 0, and so does every key
    from a query that sees none. Computed explicitly (logits ``[B, Hkv, g*q, L]`` in fp32, GQA
    folded): ``out`` is made from the same probabilities.
    """
    if page_size < 0:
        raise ValueError(f"page_size must be >= 0, got {page_size}.")
    segments = segments.to(query.device)
    q_len, kv_len = query.shape[2], key.shape[2]
    group = query.shape[1] // key.shape[1]
    if softcap is None and sinks is None and not page_size:
        # The mask in the form SDPA takes as is (folded for GQA, additive: a bool mask is turned
        # into one inside every call), built once per forward and shared by its layers.
        fold = _folds(query, key)
        mask = segments.derived(
            ("sdpa", q_len, kv_len, group if fold else 1, query.dtype),
            lambda: _additive(_fold_mask(segments.mask(q_len, kv_len), group if fold else 1), query.dtype),
        )
        return _sdpa(query, key, value, mask, scaling, fold)
    if not page_size:
        return gqa_attention(query, key, value, segments.mask(q_len, kv_len), scaling, softcap, sinks)
    hidden, seen = segments.derived(("mass", q_len, kv_len, group), lambda: _mass_masks(segments.mask(q_len, kv_len), group))
    bias = None
    if softcap is None and query.device.type == "cpu":
        # The mask as the additive bias the product starts from (capping comes before the mask): one
        # pass fewer over the logits. A second [B*Hkv, g*q, L] buffer per forward, small on a CPU;
        # elsewhere (a GPU without Triton, at its batches and contexts) the mask is applied in place.
        shape = (query.shape[0], key.shape[1], group * q_len, kv_len)
        bias = segments.derived(("mass bias", shape, query.dtype),
                                lambda: _additive(~hidden, query.dtype).expand(shape).reshape(-1, *shape[2:]))
    probs, share = _probabilities(query, key, hidden, bias, scaling, softcap, sinks)  # [B, Hkv, g*q, L], [B, Hkv, g*q, 1]
    # Each row's probabilities times its factor (0 for a row that sees nothing, the keys' share
    # with sinks): applied to the [g*q, Dv] output and the [1, L] mass, not to the [g*q, L] probabilities.
    factor = seen if share is None else share * seen  # [B, 1 | Hkv, g*q, 1]
    out = torch.matmul(probs.to(value.dtype), value).mul_(factor.to(value.dtype))  # [B, Hkv, g*q, Dv]
    out = out.reshape(query.shape[0], query.shape[1], q_len, -1).transpose(1, 2).contiguous()
    per_key = torch.matmul(factor.transpose(-1, -2), probs)[:, :, 0]  # [B, Hkv, L]: summed over the g*q rows
    pages = -(-kv_len // page_size)
    per_key = F.pad(per_key, (0, pages * page_size - kv_len))
    return out, per_key.view(query.shape[0], key.shape[1], pages, page_size).sum(-1)


def _mass_masks(mask: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mass path's masks from the ``[B, 1, q, L]`` bool mask: what each folded row hides ``[B, 1,
    g*q, L]`` and whether it sees any key ``[B, 1, g*q, 1]`` (fp32 0 / 1). A row that sees nothing
    hides nothing, so that its softmax stays finite (no pass to clear NaN), and its factor 0 drops it."""
    folded = _fold_mask(mask, group)  # one query: [B, 1, 1, L], broadcast over the g rows
    seen = folded.any(dim=-1, keepdim=True)
    return ~folded & seen, seen.float().expand(-1, -1, group * mask.shape[2], -1)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = attend) as 0 / -inf in ``dtype``, as SDPA converts it."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _probabilities(query, key, hidden, bias, scaling, softcap, sinks) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fp32 softmax probabilities ``[B, Hkv, g*q, L]`` of the folded queries over the keys (row
    ``j*q + i`` of KV head ``kv`` is query head ``kv*g + j`` at position ``i``): scale, cap, hide,
    softmax. Hidden: ``hidden [B, 1, g*q | 1, L]`` (bool, every row sees some key: :func:`_mass_masks`),
    or, where the caller built it (no ``softcap``, a CPU), ``bias [B*Hkv, g*q, L]`` (0 / -inf, the
    same mask) which the product starts from. With ``sinks``, also the keys' share of each row's
    mass ``[B, Hkv, g*q, 1]`` (the sink logit takes the rest: ``sigmoid(logsumexp - sink)``), else None.

    Every step after the product is a pass over the ``[g*q, L]`` logits, so there are few: the mask
    rides in the product (a GEMM that starts from the bias), fp32 queries are scaled before it
    (``[g*q, D]``, not ``[g*q, L]``) and the softmax is one fused call."""
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    rows = heads // kv_heads * q_len
    folded = query.reshape(batch, kv_heads, rows, head_dim)
    scale_first = query.dtype == torch.float32  # 16-bit queries are scaled in fp32, after the product
    if scale_first:
        folded = folded * scaling
    if bias is not None:
        keys = key.reshape(batch * kv_heads, kv_len, head_dim).transpose(1, 2)  # a view for the cache's slices
        logits = torch.baddbmm(bias, folded.reshape(-1, rows, head_dim), keys).view(batch, kv_heads, rows, kv_len)
    else:
        logits = torch.matmul(folded, key.transpose(-1, -2))
    logits = logits.float()
    if not scale_first:
        logits = logits.mul_(scaling)
    if bias is None:
        if softcap is not None:
            logits = logits.div_(softcap).tanh_().mul_(softcap)
        logits = logits.masked_fill_(hidden, float("-inf"))
    share = None
    if sinks is not None:
        share = torch.sigmoid(torch.logsumexp(logits, dim=-1, keepdim=True) - _folded_sinks(sinks, logits, q_len))
    return torch.softmax(logits, dim=-1, out=logits), share  # in place: one [g*q, L] buffer


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
    tail = slots - window  # keys before the window are visible to every real window query
    query_slot = tail + torch.arange(window, device=dev).repeat(group)  # [g*w]
    pad = pad.to(dev)
    query_ok = query_slot[None, :] >= pad[:, None]  # [B, g*w]
    # Inside the window: causal, and no padding key. A padding query blocks nothing (no all -inf
    # row, so no NaN) and is weighted 0 in the sum below.
    window_slot = tail + torch.arange(window, device=dev)
    blocked = ((window_slot[None, None, :] > query_slot[None, :, None])
               | (window_slot[None, None, :] < pad[:, None, None])) & query_ok[:, :, None]  # [B, g*w, w]
    # Before the window only a row's left padding is hidden: a slice per padded row instead of a
    # mask pass over all the logits (one host read of the padding, once per layer).
    hidden = [min(p, tail) for p in pad.tolist()]
    weights = query_ok.float()[:, None, :]  # [B, 1, g*w]
    out = torch.empty((batch, kv_heads, slots), dtype=torch.float32, device=dev)
    # On CPU one row at a time: its [g*w, S] logits per KV head (1.5 MB at 96 x 4K) stay in cache
    # through the mask, the softmax and the sum instead of streaming [B, g*w, S] through memory
    # each time (2x faster on 2 cores). Elsewhere (a GPU without Triton) all rows at once: fewer
    # launches. The scale is applied to the queries.
    rows = 1 if dev.type == "cpu" else batch
    for first in range(0, batch, rows):
        block = slice(first, first + rows)
        for h in range(kv_heads):
            q = queries[block, h * group : (h + 1) * group].float()
            q = q.reshape(q.shape[0], group * window, head_dim) * scaling
            logits = torch.matmul(q, keys[block, h].float().transpose(-1, -2))  # [rows, g*w, S]
            logits[:, :, tail:].masked_fill_(blocked[block], float("-inf"))
            for b in range(first, min(first + rows, batch)):
                if hidden[b]:
                    logits[b - first, :, : hidden[b]] = float("-inf")
            out[block, h] = torch.bmm(weights[block], torch.softmax(logits, dim=-1))[:, 0]
    return out

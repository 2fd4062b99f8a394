"""A transformers cache in and out of ``generate``: continue from it, and hand the generation back.

**In.** ``generate(input_ids=prefix + new_turn, past_key_values=cache)`` where ``cache`` (a
``DynamicCache`` or ``StaticCache`` filled by a plain forward, a plain ``generate`` or an earlier
MagicDec call) holds the KV of the first ``n`` tokens of every row, left padding included: the
layout of :class:`~hf_magicdec.engine.cache.MagicDecCache` too, so slots ``[0, n)`` are copied as
they are and prefill runs on the suffix only (plus the last few cached tokens again when SnapKV
needs their queries; their cached KV is kept). The draft views are then built over the whole
context. :func:`check_cache` refuses, before any forward, a cache that does not fit the call.

**Out.** Stock ``generate`` hands a cache back when it outlives the call (``return_dict_in_generate``,
or a cache the user passed in, which it extends in place) holding every token of the returned
sequences but the last. Its rows all have that length: a row that finished early kept decoding pad
tokens after its end, whose KV stock computed. The engine's rows are ragged and nothing of a
rejected draft is committed, so :meth:`MagicDecCache.committed_kv` lays out each row's committed KV, and
:func:`fill_tails` computes what stock would hold after a row's end (one forward of the missing
tokens, as stock computes them). :func:`hand_back` then fills the cache object like stock's.

**Memory.** A ``DynamicCache`` passed in is *moved*, not copied: each layer's KV goes into the
engine's cache and the user's tensors are released at once, so the prefix is never held twice;
the object gets the extended KV back at the end, exactly where stock leaves it. A ``StaticCache``
keeps its preallocated buffers (its prefix is copied) and is extended in them. Nothing is kept for
the hand-back unless the cache outlives the call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import (Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, StaticLayer,
                                      StaticSlidingWindowLayer)

from ..parallel.lockstep import tp_size
from .cache import MagicDecCache
from .steps import forward_cache_kwarg, num_layers

__all__ = ["Continuation", "check_cache", "fill_tails", "hand_back", "outlives_call"]

_DYNAMIC = (DynamicLayer, DynamicSlidingWindowLayer)
_STATIC = (StaticLayer, StaticSlidingWindowLayer)

#: Per layer ``(keys, values)``, ``[B, Hkv, S, D]``.
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Continuation:
    """The cache ``generate`` received and what to do with it.

    Attributes
    ----------
    cache : the ``past_key_values`` object (``generate`` passes an empty ``DynamicCache`` of its
        own when the user gave none), or None (``use_cache=False``).
    length : tokens per row it holds (0: nothing to continue from).
    outlives : whether it outlives the call (returned or the user's), so the generation's KV must
        be handed back in it.
    """

    cache: Cache | None
    length: int = 0
    outlives: bool = False

    def adopt(self, target: MagicDecCache) -> None:
        """Move the cached prefix into ``target`` layer by layer; a dynamic layer's own tensors are
        released right after (the object gets the whole KV back from :func:`hand_back`)."""
        for i, layer in enumerate(self.cache.layers):
            target.load_prefix(i, layer.keys[:, :, : self.length], layer.values[:, :, : self.length])
            if isinstance(layer, _DYNAMIC):
                layer.keys = layer.keys.new_empty((*layer.keys.shape[:2], 0, layer.keys.shape[-1]))
                layer.values = layer.values.new_empty((*layer.values.shape[:2], 0, layer.values.shape[-1]))
                if hasattr(layer, "cumulative_length"):
                    layer.cumulative_length = 0


def outlives_call(cache, generation_config) -> bool:
    """Whether ``cache`` must hold the generation afterwards, decided as stock ``_sample`` does:
    it is returned (``return_dict_in_generate``) or it is the user's (extended in place)."""
    return cache is not None and (bool(generation_config.return_dict_in_generate)
                                  or bool(getattr(cache, "_is_user_defined", False)))


def _fail(problem: str) -> None:
    raise ValueError(f"speculative='magicdec' cannot continue from this past_key_values: {problem}")


def check_cache(model, cache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, max_length: int,
                outlives: bool) -> int:
    """Refuse a ``past_key_values`` that does not fit the call, before any forward; returns the
    tokens per row it holds.

    Parameters
    ----------
    model : the target.
    cache : ``generate``'s ``past_key_values`` (None: no cache).
    input_ids : ``[B, P]`` the whole sequences: the cached tokens, then the new ones.
    attention_mask : ``[B, P]`` or None.
    max_length : ``P`` + new tokens.
    outlives : the cache outlives the call (a ``StaticCache`` must then hold ``max_length - 1`` slots).

    Raises
    ------
    ValueError
        A cache that is not a transformers ``Cache`` of dynamic or static layers, the engine's own
        cache, a number of layers, batch size or KV heads other than the model's, layers of
        different lengths or with evicted tokens, no new token after the cached ones, or an
        ``input_ids`` that leaves the cached tokens out.
    """
    if cache is None:
        return 0
    if isinstance(cache, MagicDecCache):
        _fail("it is MagicDec's working cache, which no call hands out; pass the returned `out.past_key_values`.")
    if not isinstance(cache, Cache):
        _fail(f"expected a transformers Cache (DynamicCache, StaticCache), got {type(cache).__name__}.")
    length = int(cache.get_seq_length())
    static = [layer for layer in cache.layers if isinstance(layer, _STATIC)]
    if outlives and static and any(layer.max_cache_len < max_length - 1 for layer in static):
        _fail(f"its static layers hold {min(layer.max_cache_len for layer in static)} tokens per row and this "
              f"generation returns {max_length - 1}; allocate the StaticCache with max_cache_len >= {max_length - 1}.")
    if length == 0:
        return 0
    batch, prompt = input_ids.shape
    if getattr(cache, "offloading", False):
        _fail("offloaded caches are not supported; pass a DynamicCache or a StaticCache on the model's devices.")
    layers = num_layers(model)
    if len(cache.layers) != layers:
        _fail(f"it has {len(cache.layers)} layers and the model {layers}; was it filled by another model?")
    heads = _kv_heads(model)
    for i, layer in enumerate(cache.layers):
        _check_layer(i, layer, length, batch, heads)
    if attention_mask is not None and attention_mask.shape[1] != prompt:
        _fail(f"attention_mask covers {attention_mask.shape[1]} tokens and input_ids {prompt}: pass input_ids with "
              "the cached tokens included (prefix + new tokens), as long as the mask.")
    if length >= prompt:
        _fail(f"it holds {length} tokens per row and input_ids has {prompt}: pass the whole sequences (the cached "
              "tokens followed by at least one new token).")
    return length


def _kv_heads(model) -> int | None:
    """KV heads the model's cache layers hold, or None where that is not knowable up front."""
    if tp_size(model) > 1:
        return None  # each rank holds its own heads
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None)
    return heads if isinstance(heads, int) else None


def _check_layer(i: int, layer, length: int, batch: int, heads: int | None) -> None:
    if type(layer) not in _DYNAMIC + _STATIC:  # exact types: quantized / linear-attention layers subclass them
        _fail(f"layer {i} is a {type(layer).__name__}; MagicDec continues from DynamicCache and StaticCache layers "
              "(not quantized or linear-attention ones).")
    if not layer.is_initialized or layer.keys is None or layer.keys.dim() != 4:
        _fail(f"layer {i} holds no KV while layer 0 holds {length} tokens.")
    b, h, slots, _ = layer.keys.shape
    if b != batch:
        _fail(f"it holds {b} rows and input_ids has {batch} (after num_return_sequences); pass one cache row per "
              "sequence, e.g. expanded with cache.batch_repeat_interleave(n).")
    if heads is not None and h != heads:
        _fail(f"layer {i} holds {h} KV heads and the model has {heads}; was it filled by another model?")
    held = int(layer.get_seq_length())
    stored = slots if isinstance(layer, _DYNAMIC) else min(held, layer.max_cache_len)
    if held != length or stored < length:
        _fail(f"layer {i} holds {stored} of {held} tokens while layer 0 holds {length}: every layer must keep "
              "every token (no sliding-window eviction).")


def fill_tails(model, kv: LayerKV, filled: torch.Tensor, sequences: torch.Tensor, pad: torch.Tensor,
               lockstep) -> None:
    """Fill slots ``[filled[b], S)`` of every row of ``kv`` (``S`` = ``sequences.shape[1] - 1``) in
    place with the KV stock ``generate`` holds there: a row that ended before the longest kept
    decoding its pad tokens. One plain forward of those tokens, over the rows that need it.

    Parameters
    ----------
    kv : per layer ``(keys, values) [B, Hkv, S, D]`` (:meth:`MagicDecCache.committed_kv`).
    filled : ``[B]`` KV slots each row holds.
    sequences : ``[B, S + 1]`` the returned sequences (left padding, then tokens, then pad).
    pad : ``[B]`` left-padding slots of each row.
    lockstep : ranks under ``synced_gpus`` run the same number of forwards.
    """
    total = sequences.shape[1] - 1
    need = (filled < total).nonzero().squeeze(1)
    lockstep.plan_forwards(int(need.numel() > 0))
    if need.numel():
        _tail_forward(model, kv, filled, sequences, pad, need, total)
    lockstep.match_forwards()


def _tail_forward(model, kv: LayerKV, filled, sequences, pad, need, total: int) -> None:
    device = sequences.device
    start = int(filled[need].min())
    sub = DynamicCache()  # plain layers: nothing evicted, layer i is the model's cache layer i
    for i, (k, v) in enumerate(kv):
        r = need.to(k.device)
        sub.update(k.index_select(0, r)[:, :, :start], v.index_select(0, r)[:, :, :start], i)
    slot = torch.arange(total, device=device)
    row_pad = pad.to(device)[need]
    mask = (slot[None, :] >= row_pad[:, None]).long()  # [k, S]: the row's tokens (left padding masked)
    positions = (slot[None, start:] - row_pad[:, None]).clamp(min=0)
    extra = {"logits_to_keep": 1} if model._supports_logits_to_keep() else {}
    extra[forward_cache_kwarg(model)] = sub
    model(input_ids=sequences[need, start:total], attention_mask=mask, position_ids=positions, use_cache=True,
          return_dict=True, **extra)
    # Slots a row committed itself keep the verified KV; only the missing ones are taken.
    write = slot[None, :] >= filled.to(device)[need][:, None]  # [k, S]
    for i, (k, v) in enumerate(kv):
        r, w = need.to(k.device), write.to(k.device)[:, None, :, None]
        k[r] = torch.where(w, sub.layers[i].keys.to(k.device), k.index_select(0, r))
        v[r] = torch.where(w, sub.layers[i].values.to(v.device), v.index_select(0, r))


def hand_back(cache: Cache | None, kv: LayerKV, cached: int, model) -> Cache:
    """``cache`` holding ``kv`` (its first ``cached`` slots are what it held before the call), as
    stock leaves it: a dynamic cache gets its layers replaced, a static one is extended in its
    buffers; anything else is left alone and a new ``DynamicCache`` is returned."""
    if isinstance(cache, Cache) and cache.layers and all(isinstance(layer, _STATIC) for layer in cache.layers):
        for layer, (k, v) in zip(cache.layers, kv):
            layer.update(k[:, :, cached:], v[:, :, cached:])
        return cache
    fresh = DynamicCache(config=model.config.get_text_config(decoder=True))  # layer types as stock builds them
    for i in range(len(kv)):
        k, v = kv[i]
        kv[i] = None  # one layer held twice at a time
        fresh.update(k, v, i)
    if type(cache) is DynamicCache and not getattr(cache, "offloading", False):
        cache.layers = fresh.layers
        return cache
    return fresh

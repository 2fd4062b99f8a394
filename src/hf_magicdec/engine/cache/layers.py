"""The cache's layers, in the manner of transformers' ``cache_utils``: what a model's attention sees.

:class:`MagicDecLayer` is an HF ``CacheLayerMixin``: the **full KV** of one decoder layer,
``[B, Hkv, capacity, D]``, row ``b``'s committed tokens in slots ``[0, lengths[b])`` (left padding
included, always masked), and its **draft view** ``[B, Hkv, Ks + W + scratch + 1, D]``
(:mod:`.geometry`). Both are views of the stacked buffers of the layer's group
(:class:`~.store.LayerStack`): the layer owns no storage of its own, so the operations between
forwards run once per group, not once per layer.

A layer learns its device, dtype and local head count from the first keys it receives (device
maps, tensor parallelism), so the stacks can only be allocated once every layer has reported: the
first prefill forward hands each layer's keys back to attention as they are and keeps them
(:meth:`MagicDecLayer.pending`); the cache stacks them before the next forward
(:meth:`~hf_magicdec.engine.cache.MagicDecCache.materialize`).

Writes arrive through ``update`` while a forward is open; which slots they go to is the open
forward's business (:mod:`.forwards`), so a layer never guesses what the model is doing.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .buffers import flat_slots

__all__ = ["MagicDecLayer"]


class MagicDecLayer(CacheLayerMixin):
    """One layer of a :class:`~hf_magicdec.engine.cache.MagicDecCache`: views of its group's
    stacked full KV and draft view, and the layer's SnapKV observation. ``cache``: the
    :class:`~hf_magicdec.engine.cache.MagicDecCache` it belongs to."""

    is_sliding = False

    def __init__(self, cache: Cache, layer_idx: int):
        super().__init__()
        self._cache = cache
        self.layer_idx = layer_idx
        self.stack = None  # its LayerStack once materialised
        self.index = 0  # its position in the stack
        #: Keys / values of the first prefill forward (or of a cache continued from), kept until
        #: the stacks exist: ``(keys, values)`` ``[B, Hkv, n, D]`` for slots ``[0, n)``.
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.draft_keys: torch.Tensor | None = None
        self.draft_values: torch.Tensor | None = None
        self.observed_queries: torch.Tensor | None = None  # [B, H, w, D], SnapKV's observation window
        self.scaling: float | None = None  # the attention's softmax scale, recorded with them

    # ------------------------------------------------------------------ HF's layer interface
    @property
    def is_compileable(self) -> bool:
        """Whether the draft and verify forwards are captured: then every step sees fixed shapes."""
        return self._cache.options.fixed_shapes

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self._cache._write(self, key_states, value_states)

    def get_seq_length(self) -> int:
        return self._cache.max_length()

    def get_max_length(self) -> int:
        return self._cache.capacity

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.max_length() + query_length, 0

    # ------------------------------------------------------------------ views of the stack
    def bind(self) -> None:
        """Take this layer's views of its stack (after the stack's buffers changed)."""
        if self.stack is None:
            return
        self.keys, self.values = self.stack.layer_full(self.index)
        if self.stack.draft_keys is not None:
            self.draft_keys, self.draft_values = self.stack.layer_draft(self.index)
        else:
            self.draft_keys = self.draft_values = None

    # ------------------------------------------------------------------ the full KV's writes
    def write_prompt(self, start: int, frozen: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Prompt slots ``[start, start + q)``, except those below ``frozen`` (a continued cache's
        KV, kept as the user gave it); returns the cache up to their end. Before the stacks exist
        (the first prefill forward) the keys are kept as they are and returned."""
        end = start + key_states.shape[2]
        if self.stack is None:
            if start or frozen:
                raise RuntimeError("MagicDecCache: a layer's first prompt chunk must start at slot 0.")
            self.pending = (key_states, value_states)
            self.keys, self.values = key_states, value_states
            return key_states, value_states
        first = min(max(start, frozen), end)
        self.keys[:, :, first:end] = key_states[:, :, first - start :]
        self.values[:, :, first:end] = value_states[:, :, first - start :]
        return self.keys[:, :, :end], self.values[:, :, :end]

    def write_rows(self, flat: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor, end: int):
        """Each row's tokens at its own slots, given as ``flat`` rows of the ``[-1, D]`` views of
        this layer's buffers (:func:`~.buffers.flat_slots`; every layer of a stack has the same);
        returns the cache up to ``end``."""
        self.keys.view(-1, self.keys.shape[-1]).index_copy_(0, flat, key_states.reshape(-1, key_states.shape[-1]))
        self.values.view(-1, self.values.shape[-1]).index_copy_(
            0, flat, value_states.reshape(-1, value_states.shape[-1]))
        return self.keys[:, :, :end], self.values[:, :, :end]

    def write_draft_range(self, start: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Draft tokens into view slots ``[start, start + q)``; returns the view up to their end."""
        end = start + key_states.shape[2]
        self.draft_keys[:, :, start:end] = key_states
        self.draft_values[:, :, start:end] = value_states
        return self.draft_keys[:, :, :end], self.draft_values[:, :, :end]

    def write_draft_slots(self, slots: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor):
        """Draft tokens into view slots ``slots [q]`` (a tensor, so that one compiled graph serves
        every draft step); returns the whole view (fixed shapes)."""
        self.draft_keys.index_copy_(2, slots, key_states)
        self.draft_values.index_copy_(2, slots, value_states)
        return self.draft_keys, self.draft_values

    def replace_static(self, slots: torch.Tensor, start: int, where: torch.Tensor) -> None:
        """View slots ``[start, start + n)`` take the full KV at ``slots [B, Hkv, n]`` where ``where``
        (bool, broadcastable to ``[B, Hkv, n]``) holds; elsewhere they keep what they hold (those
        copies go to the trash slot, the buffer's last: masked, not branched on, no host read).
        One layer's part of :meth:`~hf_magicdec.engine.cache.MagicDecCache.replace_static`, for a
        query-aware view that re-chooses inside the draft forward."""
        n = slots.shape[-1]
        target = torch.arange(start, start + n, device=slots.device).expand_as(slots)
        target = torch.where(where.to(slots.device), target, self.draft_keys.shape[2] - 1)
        src = flat_slots(self.keys, slots)
        dst = flat_slots(self.draft_keys, target)
        for source, dest in ((self.keys, self.draft_keys), (self.values, self.draft_values)):
            picked = source.view(-1, source.shape[-1]).index_select(0, src)
            dest.view(-1, dest.shape[-1]).index_copy_(0, dst, picked)

    def observe(self, query: torch.Tensor, scaling: float | None, window: int) -> None:
        """Keep the last ``window`` prefill queries ``[B, H, w, D]`` (they arrive chunk by chunk)."""
        tail = query[:, :, -window:]
        if self.observed_queries is not None and tail.shape[2] < window:
            tail = torch.cat([self.observed_queries, tail], dim=2)[:, :, -window:]
        self.observed_queries = tail.detach().clone()
        self.scaling = scaling

    def forget_observation(self) -> None:
        self.observed_queries = None

    # ------------------------------------------------------------------ lifetime
    def load(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Start from ``keys / values [B, Hkv, n, D]`` (slots ``[0, n)``), copied into the stack
        when it is made."""
        self.lazy_initialization(keys, values)
        self.pending = (keys, values)
        self.keys, self.values = keys, values

    def release(self) -> None:
        """Forget everything (the cache's KV has been handed back)."""
        if self.is_initialized:
            self.keys = self.values = self.keys.new_empty(0)
        self.stack = None
        self.pending = None
        self.draft_keys = self.draft_values = None
        self.observed_queries = None

"""The cache's layers, in the manner of transformers' ``cache_utils``: each owns its tensors, their
allocation, their writes and their row operations.

* :class:`MagicDecLayer` is what a model's attention sees (an HF ``CacheLayerMixin``): the **full
  KV** of one decoder layer, ``[B, Hkv, capacity, D]``, row ``b``'s committed tokens in slots
  ``[0, lengths[b])`` (left padding included, always masked). It allocates lazily from the first
  keys it receives, so it lives on its layer's device with its local head count (device maps,
  tensor parallelism). It also holds the layer's SnapKV observation (the last prefill queries) and
  its draft view.
* :class:`DraftKV` is that layer's **draft view**: a separate fixed-size buffer
  ``[B, Hkv, Ks + W + scratch + 1, D]`` (:mod:`.geometry`), built from the full KV after prefill,
  appended to after every verification, written by draft steps in its scratch.

Writes arrive through ``update`` while a forward is open; which slots they go to is the open
forward's business (:mod:`.forwards`), so a layer never guesses what the model is doing.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .buffers import copy_slots, flat_slots, gather_slots, move_rows, scatter_slots, widened

__all__ = ["DraftKV", "MagicDecLayer"]


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    # A new empty tensor, not a zero-length slice, which would keep the old storage alive.
    return t.new_empty((*t.shape[:2], 0, t.shape[-1]))


class DraftKV:
    """The draft view of one layer: ``keys / values [B, Hkv, Ks + W + scratch + 1, D]``."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    @classmethod
    def gathered(cls, full_keys: torch.Tensor, full_values: torch.Tensor, total: int,
                 source: torch.Tensor | None) -> "DraftKV":
        """A view of ``total`` slots whose first ``source.shape[-1]`` slots hold the full KV at
        ``source [B, Hkv, n]`` (None: nothing copied yet); the rest zeros."""
        batch, heads = full_keys.shape[:2]
        keys = full_keys.new_zeros((batch, heads, total, full_keys.shape[-1]))
        values = full_values.new_zeros((batch, heads, total, full_values.shape[-1]))
        if source is not None:
            n = source.shape[-1]
            keys[:, :, :n] = gather_slots(full_keys, source)
            values[:, :, :n] = gather_slots(full_values, source)
        return cls(keys, values)

    def write_range(self, start: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Draft tokens into slots ``[start, start + q)``; returns the view up to their end."""
        end = start + key_states.shape[2]
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]

    def write_slots(self, slots: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor):
        """Draft tokens into slots ``slots [q]`` (a tensor, so that one compiled graph serves every
        draft step); returns the whole buffer (fixed shapes)."""
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        return self.keys, self.values

    def append(self, source_keys: torch.Tensor, source_values: torch.Tensor, src: torch.Tensor,
               dst: torch.Tensor) -> None:
        """``self[b, :, dst[b, j]] = source[b, :, src[b, j]]`` (``[B, n]`` slots): committed tokens
        into the rolling window, from the full KV or from this buffer's own scratch."""
        copy_slots(source_keys, src, self.keys, dst)
        copy_slots(source_values, src, self.values, dst)

    def replace_static(self, full_keys: torch.Tensor, full_values: torch.Tensor, slots: torch.Tensor,
                       start: int, where: torch.Tensor) -> None:
        """View slots ``[start, start + n)`` take the full KV at ``slots [B, Hkv, n]`` where ``where``
        (bool, broadcastable to ``[B, Hkv, n]``) holds; elsewhere they keep what they hold (those
        copies go to the trash slot, the buffer's last: masked, not branched on, no host read)."""
        n = slots.shape[-1]
        target = torch.arange(start, start + n, device=slots.device).expand_as(slots)
        target = torch.where(where.to(slots.device), target, self.keys.shape[2] - 1)
        both = full_keys.is_contiguous() and full_values.is_contiguous() and self.keys.is_contiguous() \
            and self.values.is_contiguous()  # then the keys' flat indices serve the values too
        src = flat_slots(full_keys, slots) if both else None
        dst = flat_slots(self.keys, target) if both else None
        for source, dest in ((full_keys, self.keys), (full_values, self.values)):
            scatter_slots(dest, target, gather_slots(source, slots, src), dst)

    def drop_rows(self, holes: torch.Tensor, sources: torch.Tensor, kept: int) -> None:
        """Rows ``sources`` into ``holes`` in place, then the first ``kept`` rows are the view's."""
        for buffer in (self.keys, self.values):
            if holes.numel():
                move_rows(buffer, holes, sources, None, swap=False)
        self.keys, self.values = self.keys[:kept], self.values[:kept]

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values


class MagicDecLayer(CacheLayerMixin):
    """One layer of a :class:`~hf_magicdec.engine.cache.MagicDecCache`: the full KV, the SnapKV
    observation and the draft view (:class:`DraftKV`, None until built). ``cache``: the
    :class:`~hf_magicdec.engine.cache.MagicDecCache` it belongs to (which allocates through it)."""

    is_sliding = False

    def __init__(self, cache: Cache, layer_idx: int):
        super().__init__()
        self._cache = cache
        self.layer_idx = layer_idx
        self.draft: DraftKV | None = None
        self.observed_queries: torch.Tensor | None = None  # [B, H, w, D], SnapKV's observation window
        self.scaling: float | None = None  # the attention's softmax scale, recorded with them

    # ------------------------------------------------------------------ HF's layer interface
    @property
    def is_compileable(self) -> bool:
        """Whether the draft and verify forwards are captured: then every step sees fixed shapes."""
        return self._cache.options.fixed_shapes

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, head_dim = key_states.shape
        capacity = self._cache.capacity
        self.keys = key_states.new_zeros((batch, kv_heads, capacity, head_dim))
        self.values = value_states.new_zeros((batch, kv_heads, capacity, value_states.shape[-1]))
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True
        self._cache._made(self.keys, self.values)

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

    @property
    def draft_keys(self) -> torch.Tensor | None:
        return self.draft.keys if self.draft is not None else None

    @property
    def draft_values(self) -> torch.Tensor | None:
        return self.draft.values if self.draft is not None else None

    # ------------------------------------------------------------------ the full KV's writes
    def write_prompt(self, start: int, frozen: int, key_states: torch.Tensor, value_states: torch.Tensor):
        """Prompt slots ``[start, start + q)``, except those below ``frozen`` (a continued cache's
        KV, kept as the user gave it); returns the cache up to their end."""
        end = start + key_states.shape[2]
        first = min(max(start, frozen), end)
        self.keys[:, :, first:end] = key_states[:, :, first - start :]
        self.values[:, :, first:end] = value_states[:, :, first - start :]
        return self.keys[:, :, :end], self.values[:, :, :end]

    def write_rows(self, slots: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor, end: int):
        """Each row's tokens at its own slots ``slots [B, q]``; returns the cache up to ``end``."""
        slots = slots[:, None, :]
        flat = flat_slots(self.keys, slots) if self.keys.is_contiguous() and self.values.is_contiguous() else None
        scatter_slots(self.keys, slots, key_states, flat)  # whole head vectors: no per-element index
        scatter_slots(self.values, slots, value_states, flat)
        return self.keys[:, :, :end], self.values[:, :, :end]

    def observe(self, query: torch.Tensor, scaling: float | None, window: int) -> None:
        """Keep the last ``window`` prefill queries ``[B, H, w, D]`` (they arrive chunk by chunk)."""
        tail = query[:, :, -window:]
        if self.observed_queries is not None and tail.shape[2] < window:
            tail = torch.cat([self.observed_queries, tail], dim=2)[:, :, -window:]
        self.observed_queries = tail.detach().clone()
        self.scaling = scaling

    def forget_observation(self) -> None:
        self.observed_queries = None

    # ------------------------------------------------------------------ allocation and rows
    def load(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Start from ``keys / values [B, Hkv, n, D]`` (slots ``[0, n)``), copied into own buffers."""
        self.lazy_initialization(keys, values)
        n = keys.shape[2]
        self.keys[:, :, :n] = keys
        self.values[:, :, :n] = values

    def widen(self, capacity: int, filled: int) -> None:
        """Move into ``capacity`` slots per row, keeping ``[0, filled)`` (an empty layer stays empty)."""
        if self.is_initialized and self.keys.shape[2]:
            self.keys, self.values = widened(self.keys, capacity, filled), widened(self.values, capacity, filled)

    def drop_rows(self, holes: torch.Tensor, sources: torch.Tensor, kept: int, filled: int,
                  keep_finished: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Finished rows leave in place (:meth:`~hf_magicdec.engine.cache.MagicDecCache.drop_rows`):
        rows ``sources`` into ``holes`` (slots ``[0, filled)`` of the full KV, the whole draft
        view), then the first ``kept`` rows are the layer's. With ``keep_finished`` the holes'
        rows go to ``sources`` and the rows from ``kept`` on are returned, slots ``[0, filled)``:
        views of the buffers (no copy)."""
        if not self.is_initialized:
            return None
        if holes.numel():
            for buffer in (self.keys, self.values):
                move_rows(buffer, holes, sources, filled, keep_finished)
        gone = (self.keys[kept:, :, :filled], self.values[kept:, :, :filled]) if keep_finished else None
        self.keys, self.values = self.keys[:kept], self.values[:kept]
        if self.draft is not None:
            self.draft.drop_rows(holes, sources, kept)
        return gone

    def build_view(self, total: int, source: torch.Tensor | None) -> None:
        """A new draft view of ``total`` slots (:meth:`DraftKV.gathered`)."""
        self.draft = DraftKV.gathered(self.keys, self.values, total, source)
        self._cache._made(*self.draft.buffers())

    def release_full(self) -> None:
        """Free the full KV (a separate draft model attends to its views only)."""
        if self.is_initialized:
            self.keys, self.values = _empty_like(self.keys), _empty_like(self.values)

    def release(self) -> None:
        """Free everything this layer holds (its KV has been handed back)."""
        if self.is_initialized:
            self.keys = self.values = self.keys.new_empty(0)
        self.draft = None
        self.observed_queries = None

    def buffers(self) -> list[torch.Tensor]:
        """Every KV buffer this layer holds (full and draft)."""
        out = [self.keys, self.values] if self.is_initialized else []
        return out + (list(self.draft.buffers()) if self.draft is not None else [])

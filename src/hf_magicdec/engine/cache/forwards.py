"""One forward's view of the cache: where its keys go and which keys each query reads.

Models call ``cache.update(k, v, layer_idx)`` without metadata, so the engine opens a forward
before calling the model (``MagicDecCache.begin_prefill`` / ``begin_draft`` / ``begin_verify``),
which returns one of these values; the cache routes every ``update`` of that forward to it and the
attention function asks it for the forward's key ranges (:class:`~hf_magicdec.kernels.Segments`).
A forward lives until the next one opens or the step is committed; nothing of it outlives that.

What a forward costs outside the model is a handful of operations whatever the model's depth: the
key ranges are built from per-row tensors the cache keeps up to date (a draft round's ranges
change only at commit), the write indices of a verify are made once and shared by every layer of
a stack, and the model is handed :meth:`Forward.model_mask`, a ``[B, 1, q, kv]`` tensor that
costs nothing to make; the PyTorch attention twin builds the real mask from the ranges, inside
the forward, only when it runs (the Triton kernels read the ranges).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers.cache_utils import Cache

from ...kernels import Segments
from .buffers import flat_slots
from .layers import MagicDecLayer

__all__ = ["DraftForward", "Forward", "PrefillForward", "VerifyForward"]


class Forward:
    """What every forward knows: its query length, its key ranges, and which cache layer each key
    tensor handed to attention came from. ``cache``: the :class:`MagicDecCache` that opened it."""

    kind: ClassVar[str] = ""

    def __init__(self, cache: Cache, num_tokens: int, segments: Segments | None = None):
        self.cache = cache
        self.num_tokens = num_tokens
        self._segments = segments
        self._segments_on: dict[torch.device, Segments] = {}
        self._memo: dict[Any, torch.Tensor] = {}
        self._key_owner: dict[int, int] = {}  # data_ptr of keys handed to attention -> cache layer
        self.given_mask: torch.Tensor | None = None  # what the engine passed the model (model_mask or a real one)

    # ------------------------------------------------------------------ the attention's questions
    def layer_of(self, key: torch.Tensor, default: Any) -> Any:
        """Cache layer whose buffer ``key`` (as handed to attention) came from. Models may index the
        cache differently from their modules' ``layer_idx`` (HRM cycles its layers over several
        cache slots); ``default`` for keys this forward did not hand out, and inside a compiled step
        (torch < 2.13 cannot trace a ``data_ptr()`` key; 2.13 finds none there either)."""
        if torch.compiler.is_compiling():
            return default
        return self._key_owner.get(key.data_ptr(), default)

    def segments(self, device: torch.device) -> Segments | None:
        """Key ranges of this forward on ``device`` (one copy per device); None for prefill, which
        attends through its mask."""
        if self._segments is None:
            return None
        if self._segments.lo1.device == device:
            return self._segments
        hit = self._segments_on.get(device)
        if hit is None:
            hit = self._segments_on[device] = self._segments.to(device)
        return hit

    def mask(self, q_len: int, kv_len: int) -> torch.Tensor:
        """The ``[B, 1, q_len, kv_len]`` bool mask of these key ranges."""
        return self.segments(self.cache.lengths.device).mask(q_len, kv_len)

    @property
    def kv_length(self) -> int:
        """Key slots this forward's attention reads (masked beyond each row's ranges)."""
        raise NotImplementedError

    def model_mask(self) -> torch.Tensor:
        """The ``attention_mask`` the model is called with: a broadcast ``[B, 1, q, kv]`` tensor that
        transformers' mask builders pass through as it is (a 4-D mask), which the ``magicdec``
        attention recognises and replaces with the key ranges. A model that rewrites its mask (Doge
        adds per-key biases) gets the real mask instead: its rewrite must start from the truth."""
        if self.cache.real_masks:
            return self.mask(self.num_tokens, self.kv_length)
        return self.cache.broadcast_mask(self.num_tokens, self.kv_length)

    def record_mask(self, mask: torch.Tensor) -> None:
        """The ``attention_mask`` the engine is calling the model with (see :meth:`passed`)."""
        self.given_mask = mask

    def passed(self, mask: torch.Tensor | None) -> bool:
        """Whether ``mask`` (as attention received it) is, or slices, what the engine gave the model."""
        given = self.given_mask
        if mask is None or given is None or mask.dtype != given.dtype:
            return False
        if torch.compiler.is_compiling():  # torch < 2.13 cannot trace data_ptr() comparisons
            return mask is given
        return mask.data_ptr() == given.data_ptr()

    def before_attention(self, layer_idx: int, query: torch.Tensor, scaling: float | None) -> None:
        """Called by the attention function before the attention of a draft or verify forward."""

    def mass_page_size(self, layer_idx: int) -> int:
        """Pages of keys whose attention mass this forward's attention emits (0: none)."""
        return 0

    def observe(self, layer_idx: int, query: torch.Tensor, scaling: float | None) -> None:
        """Called by the attention function during prefill."""

    # ------------------------------------------------------------------ writes
    def write(self, layer: MagicDecLayer, key_states: torch.Tensor, value_states: torch.Tensor):
        keys, values = self._write(layer, key_states, value_states)
        if not torch.compiler.is_compiling():  # see layer_of
            self._key_owner[keys.data_ptr()] = layer.layer_idx
        return keys, values

    def _write(self, layer, key_states, value_states):
        raise NotImplementedError

    def on(self, name: str, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``tensor`` on ``device``, copied once per device for this forward (device maps)."""
        if tensor.device == device:
            return tensor
        key = (name, device)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = tensor.to(device, non_blocking=True)
        return hit


class PrefillForward(Forward):
    """Prompt slots ``[start, start + q)`` of every row (padding is on the left, so one offset)."""

    kind = "prefill"

    def __init__(self, cache, start: int, num_tokens: int, frozen: int, observation_window: int):
        super().__init__(cache, num_tokens)
        self.start, self.frozen, self.observation_window = start, frozen, observation_window

    @property
    def kv_length(self) -> int:
        return self.start + self.num_tokens

    def _write(self, layer, key_states, value_states):
        return layer.write_prompt(self.start, self.frozen, key_states, value_states)

    def observe(self, layer_idx, query, scaling) -> None:
        if self.observation_window > 0:
            self.cache.layers[layer_idx].observe(query, scaling, self.observation_window)


class DraftForward(Forward):
    """``q`` draft tokens per row into scratch slots ``[step, step + q)`` of the draft views,
    attending to each row's filled view and causally to the scratch written so far (but its
    first ``skip[b]`` slots). ``step`` is an int, or a 0-d tensor inside a compiled draft step
    (one graph for every step of a round)."""

    kind = "draft"

    def __init__(self, cache, step, num_tokens: int, skip: torch.Tensor | None):
        geometry = cache.geometry
        scratch = geometry.view_slots
        fixed = isinstance(step, torch.Tensor)
        if fixed:
            end = cache.row_constant(scratch + num_tokens) + step
        else:
            end = cache.row_constant(scratch + step + num_tokens)
        start = cache.row_constant(scratch) if skip is None else (scratch + skip).to(torch.int32)
        super().__init__(cache, num_tokens, Segments(cache.row_constant(0), cache.draft_filled(), start, end))
        self.step = step
        self.first_slot = scratch + step  # an int, or a tensor when `step` is one
        self.fixed = fixed or cache.options.fixed_shapes
        # Under captured steps the slots are a tensor, so that one graph serves every draft step.
        self.slots = cache.draft_slots(self.first_slot, num_tokens) if self.fixed else None

    @property
    def kv_length(self) -> int:
        return self.cache.geometry.total_slots if self.fixed else self.first_slot + self.num_tokens

    def _write(self, layer, key_states, value_states):
        if self.fixed:
            return layer.write_draft_slots(self.on("slots", self.slots, layer.draft_keys.device), key_states,
                                           value_states)
        return layer.write_draft_range(self.first_slot, key_states, value_states)

    def before_attention(self, layer_idx, query, scaling) -> None:
        for state in self.cache.row_states:
            state.on_draft_query(self.cache, layer_idx, query, scaling)


class VerifyForward(Forward):
    """``q`` tokens per row at each row's own offset on the full cache, causal among themselves."""

    kind = "verify"

    def __init__(self, cache, num_tokens: int):
        lengths = cache.lengths
        end = (lengths + num_tokens).to(torch.int32)
        super().__init__(cache, num_tokens, Segments(cache.row_constant(0), cache.row_constant(0), cache.pad32, end))
        self._page_size: int | None = None

    @property
    def kv_length(self) -> int:
        return self.cache.capacity if self.cache.options.fixed_shapes else self.cache.max_length() + self.num_tokens

    def _write(self, layer, key_states, value_states):
        keys = layer.keys
        # The stack, by its first layer: a traced shape as the key would specialise the graph on it.
        key = layer.stack.layers[0]
        flat = self._memo.get(key)
        if flat is None:  # made by the first layer of each stack, used by all of them
            lengths = self.on("lengths", self.cache.lengths, keys.device)
            slots = lengths[:, None] + torch.arange(self.num_tokens, device=keys.device)  # [B, q]
            flat = self._memo[key] = flat_slots(keys, slots[:, None, :])
        return layer.write_rows(flat, key_states, value_states, self.kv_length)

    def before_attention(self, layer_idx, query, scaling) -> None:
        for state in self.cache.row_states:
            state.on_verify_query(self.cache, layer_idx, query, scaling)

    def mass_page_size(self, layer_idx: int) -> int:
        """Pages this verify's attention emits its attention mass for (0: none): asked of the
        attached state once per forward (the verification-guided view chooses the draft's KV from it)."""
        if self._page_size is None:
            sizes = (state.verify_page_size(self.num_tokens) for state in self.cache.row_states)
            self._page_size = next((size for size in sizes if size), 0)
        return self._page_size

    def record_mass(self, layer_idx: int, mass: torch.Tensor) -> None:
        """The attention mass ``[B, Hkv, pages]`` this verify's layer ``layer_idx`` emitted."""
        for state in self.cache.row_states:
            state.on_verify_mass(self.cache, layer_idx, mass)

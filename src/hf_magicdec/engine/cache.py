"""`MagicDecCache`: the full KV cache with ragged per-row lengths, plus compressed draft views.

Layout per layer (``B`` rows, ``Hkv`` local KV heads, ``D`` head dim)::

    keys / values        [B, Hkv, capacity, D]   the full cache; row b's committed tokens are
                                                 slots [0, lengths[b]) (left padding included,
                                                 always masked); grows in chunks (``reserve``)
    draft_keys / values  [B, Hkv, Ks + W + gamma + 1, D]
                         [ static selection Ks | rolling window W | draft scratch gamma | trash 1 ]

Models call ``cache.update(k, v, layer_idx)`` without metadata, so the engine tells the cache
what the next forward is (``begin_prefill`` / ``begin_draft`` / ``begin_verify``) and the cache
owns every per-row offset. Commit and rollback are O(1) per row: rejected tokens' KV stays in
slots that the next verify overwrites, and only ``lengths`` moves.

Memory follows what is generated, not ``max_new_tokens``: the full cache starts at the prompt plus
a modest headroom (:func:`initial_capacity`) and :meth:`MagicDecCache.reserve` grows it
geometrically, capped at what the call can generate, when the next verify would write past it.
Growing allocates the larger buffers (on each layer's own device), copies the filled prefix and
replaces them: one contiguous layout, so kernels, masks and key ranges are unchanged. The draft
views are separate fixed-size buffers and never move.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..kernels import Segments
from ..views import DraftView, ScoreContext
from .buffers import copy_slots, grown_capacity, per_device, widened
from .refresh import Refresher

if TYPE_CHECKING:
    from ..config import MagicDecConfig

_PREFILL, _DRAFT, _VERIFY = "prefill", "draft", "verify"

class MagicDecLayer(CacheLayerMixin):
    """One layer of a :class:`MagicDecCache`. Allocates lazily on the first keys it receives, so it
    lives on its layer's device with its local head count (device maps, tensor parallelism)."""

    is_sliding = False

    @property
    def is_compileable(self) -> bool:
        """Whether the draft and verify forwards are captured (``MagicDecConfig.compile``): then
        every step sees fixed shapes (``MagicDecCache.fixed_shapes``)."""
        return self.owner.fixed_shapes

    def __init__(self, owner: "MagicDecCache", layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.draft_keys: torch.Tensor | None = None
        self.draft_values: torch.Tensor | None = None
        self.observed_queries: torch.Tensor | None = None  # [B, H, w, D] for SnapKV
        self.scaling: float | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, kv_heads, _, head_dim = key_states.shape
        shape = (batch, kv_heads, self.owner.capacity, head_dim)
        self.keys = key_states.new_zeros(shape)
        self.values = value_states.new_zeros((batch, kv_heads, self.owner.capacity, value_states.shape[-1]))
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.owner._layer_update(self, key_states, value_states)
        self.owner._key_owner[keys.data_ptr()] = self.layer_idx
        return keys, values

    def get_seq_length(self) -> int:
        return self.owner.max_length()

    def get_max_length(self) -> int:
        return self.owner.capacity

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.max_length() + query_length, 0


class MagicDecCache(Cache):
    """Full KV cache with per-row write offsets and per-layer draft views.

    Parameters
    ----------
    num_layers : int
        Decoder layers of the model.
    batch_size : int
        Rows.
    capacity : int
        Slots per row allocated now: at least the prompt length (prefill writes ``[0, prompt)``)
        and, before each verify, the longest row + the verified tokens (:meth:`reserve`).
    pad_lengths : torch.LongTensor
        ``[batch]`` left-padding slots of each row's prompt.
    max_capacity : int, optional
        What :meth:`reserve` grows to at most (prompt + new tokens + gamma + 1: all the call can
        write); default ``capacity``.

    Notes
    -----
    Not meant to be reused across ``generate`` calls: the engine builds one per call.
    """

    def __init__(self, num_layers: int, batch_size: int, capacity: int, pad_lengths: torch.Tensor,
                 max_capacity: int | None = None):
        layers = [MagicDecLayer(self, i) for i in range(num_layers)]
        super().__init__(layers=layers)
        self.num_rows = batch_size
        self.capacity = capacity  # slots per row allocated in every layer's keys / values
        self.max_capacity = max(capacity, max_capacity if max_capacity is not None else capacity)
        self.growths = 0  # times reserve() grew the full cache
        self.pad = pad_lengths.long()  # [B]
        self.lengths = torch.zeros_like(self.pad)  # [B] committed slots
        self._max_len = 0  # host mirror of lengths.max()
        # Prefill leaves slots below this untouched: they hold a continued cache's KV as the user
        # gave it, and prefill re-runs their last tokens only to record SnapKV's observation queries.
        self.frozen_slots = 0
        self._mode: str | None = None
        self._start = 0  # prefill write offset (uniform: padding is on the left)
        self._q = 0
        self._draft_step = 0
        self._memo: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._key_owner: dict[int, int] = {}  # data_ptr of keys handed to attention -> cache layer
        self._segments: Segments | None = None  # key ranges of the current draft/verify forward
        self._segments_on: dict[torch.device, Segments] = {}
        # Draft-view state (shared by all layers: counts depend only on row lengths).
        self.view: DraftView | None = None
        self.static_slots = 0  # Ks
        self.window_slots = 0  # W
        self.gamma = 0
        self.static_count: torch.Tensor | None = None  # [B] static slots in use per row (sc)
        self.ring_size: torch.Tensor | None = None  # [B] rolling-window slots per row (Ks + W - sc)
        self.ring_ptr: torch.Tensor | None = None  # [B] tokens ever written to the window
        self.observation_window = 0
        # Largest position this generation reaches (prompt slots + new tokens), checked by the
        # attention against sliding windows; None = unchecked (synthetic caches of calibration).
        self.position_limit: int | None = None
        # Compiled steps: draft and verify forwards read whole buffers (draft views with all their
        # scratch, the full cache up to its capacity), masked by their key ranges, so a captured
        # graph sees the same shapes at every step (it changes only when the cache grows).
        self.fixed_shapes = False
        # Compiled on CUDA: the KV buffers are marked as static inputs (mark_static_addresses) each
        # time they are replaced, so CUDA graphs read and write them in place instead of copying
        # the whole cache into the graph's own input buffers at every step.
        self.static_addresses = False
        # Per-row tensors of query-aware views and refresh, keyed (name, layer or -1); they follow select_rows.
        self.row_state: dict[tuple[str, int], torch.Tensor] = {}
        self.refresher: Refresher | None = None  # refresh_every / refresh_below (hf_magicdec.engine.refresh)

    # ------------------------------------------------------------------ bookkeeping
    def max_length(self) -> int:
        """Longest committed row, in slots (padding included)."""
        return self._max_len

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._max_len

    def reserve(self, slots: int) -> bool:
        """Make the full cache hold at least ``slots`` slots per row; call it between steps, e.g.
        with ``max_length() + q`` before a ``q``-token verify (host-side, no device sync).

        Grows geometrically (:func:`grown_capacity`, capped at ``max_capacity``) so that the copies
        are amortised: every initialized layer gets new ``keys`` / ``values`` on its own device
        with the filled prefix ``[0, max_length())`` copied. Layers whose full KV was released
        (:meth:`release_full_kv`) stay empty. Returns whether the cache grew.
        """
        if slots <= self.capacity:
            return False
        if self._mode is not None:
            raise RuntimeError(f"MagicDecCache.reserve() during a {self._mode} forward; grow it between steps.")
        capacity = grown_capacity(self.capacity, slots, self.max_capacity)
        filled = self._max_len  # every row's committed KV lies in [0, lengths[b]) within it
        for layer in self.layers:
            if not layer.is_initialized or layer.keys.shape[2] == 0:
                continue
            layer.keys = widened(layer.keys, capacity, filled)
            layer.values = widened(layer.values, capacity, filled)
        self.capacity = capacity
        self.max_capacity = max(self.max_capacity, capacity)
        self.growths += 1
        self._buffers_replaced()
        return True

    def _on(self, name: str, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``tensor`` on ``device``, memoised until the next ``begin_*`` (one copy per device)."""
        if tensor.device == device:
            return tensor
        key = (name, device)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = tensor.to(device, non_blocking=True)
        return hit

    def layer_of(self, key: torch.Tensor, default: int) -> int:
        """Cache layer whose buffer ``key`` (as handed to attention) was returned from. Models may
        index the cache differently from their modules' ``layer_idx`` (HRM cycles its layers over
        several cache slots); ``default`` for keys the cache did not hand out this forward."""
        return self._key_owner.get(key.data_ptr(), default)

    def _begin(self, mode: str) -> None:
        self._mode = mode
        self._key_owner.clear()
        self._memo.clear()
        self._segments = None
        self._segments_on.clear()

    def attention_segments(self, device: torch.device) -> Segments | None:
        """Key ranges of the current draft or verify forward on ``device`` (memoised per device);
        None during prefill, which attends through its mask."""
        if self._segments is None:
            return None
        hit = self._segments_on.get(device)
        if hit is None:
            hit = self._segments_on[device] = self._segments.to(device)
        return hit

    def forward_mask(self, q_len: int, kv_len: int) -> torch.Tensor:
        """The ``[B, 1, q_len, kv_len]`` bool mask of the current draft or verify forward, built
        from its key ranges (the PyTorch attention twin reuses this very tensor)."""
        return self.attention_segments(self.lengths.device).mask(q_len, kv_len)

    def begin_prefill(self, start: int, length: int) -> None:
        """Next forward writes prompt slots ``[start, start + length)`` in every row."""
        self._begin(_PREFILL)
        self._start, self._q = start, length

    def end_prefill(self, prompt_slots: int) -> None:
        self.lengths.fill_(prompt_slots)
        self._max_len = prompt_slots
        self._mode = None

    def begin_draft(self, step: int, num_tokens: int = 1, skip: torch.Tensor | None = None) -> None:
        """Next forward drafts on the draft views: ``num_tokens`` tokens per row written to draft
        scratch slots ``[step, step + num_tokens)``, attending to the view and causally to the
        scratch written so far, except its first ``skip[b]`` slots (``[B]``; a separate draft
        model re-feeds a token whose KV is already in the view)."""
        if self.view is None:
            raise RuntimeError("build_draft_views() must run before drafting.")
        self._begin(_DRAFT)
        self._draft_step, self._q = step, num_tokens
        scratch_start = self.static_slots + self.window_slots + step
        # A tensor, not an int, so that a compiled draft step is one graph for every step.
        self._draft_slots = torch.arange(scratch_start, scratch_start + num_tokens, device=self.lengths.device)
        scratch = self.static_slots + self.window_slots
        self._segments = Segments.prefix_and_block(self._draft_filled(), scratch, scratch + step + num_tokens, skip)

    def begin_verify(self, num_tokens: int) -> None:
        """Next forward verifies ``num_tokens`` tokens per row at each row's own offset."""
        self._begin(_VERIFY)
        self._q = num_tokens
        self._write_slots = self.lengths[:, None] + torch.arange(num_tokens, device=self.lengths.device)
        self._segments = Segments.causal(self.pad, self.lengths + num_tokens)

    def verify_kv_length(self, num_tokens: int) -> int:
        """Key slots a ``num_tokens``-token verify attends over (masked beyond each row's end)."""
        return self.capacity if self.fixed_shapes else self._max_len + num_tokens

    def draft_kv_length(self, end: int) -> int:
        """Key slots a draft forward writing draft slots up to ``end`` attends over."""
        return self.static_slots + self.window_slots + self.gamma + 1 if self.fixed_shapes else end

    def _buffers_replaced(self) -> None:
        if self.static_addresses:
            self.mark_static_addresses()

    def mark_static_addresses(self) -> None:
        """Tell ``torch.compile`` that the full and draft KV buffers keep their addresses, so CUDA
        graphs (``mode="reduce-overhead"``) may capture steps that write them in place. Valid until
        the buffers are replaced (``reserve`` growth, ``select_rows``, new views), which mark the
        new ones again when ``static_addresses`` is set (compiled generation on CUDA); those
        events change the buffers' shapes too, so they cost no recompilation of their own."""
        for layer in self.layers:
            for buffer in (layer.keys, layer.values, getattr(layer, "draft_keys", None),
                           getattr(layer, "draft_values", None)):
                if buffer is not None and buffer.numel():
                    torch._dynamo.mark_static_address(buffer)

    # ------------------------------------------------------------------ the write path
    def _layer_update(self, layer: MagicDecLayer, key_states: torch.Tensor, value_states: torch.Tensor):
        mode = self._mode
        if mode == _VERIFY:
            # [B, q] per-row slots; scatter along the sequence axis.
            slots = self._on("write_slots", self._write_slots, layer.keys.device)
            index = slots[:, None, :, None].expand(-1, key_states.shape[1], -1, key_states.shape[-1])
            layer.keys.scatter_(2, index, key_states)
            index_v = slots[:, None, :, None].expand(-1, value_states.shape[1], -1, value_states.shape[-1])
            layer.values.scatter_(2, index_v, value_states)
            end = self.verify_kv_length(self._q)
            return layer.keys[:, :, :end], layer.values[:, :, :end]
        if mode == _DRAFT:
            if self.fixed_shapes:
                slots = self._on("draft_slots", self._draft_slots, layer.draft_keys.device)
                layer.draft_keys.index_copy_(2, slots, key_states)
                layer.draft_values.index_copy_(2, slots, value_states)
                return layer.draft_keys, layer.draft_values
            slot = self.static_slots + self.window_slots + self._draft_step
            end = slot + self._q
            layer.draft_keys[:, :, slot:end] = key_states
            layer.draft_values[:, :, slot:end] = value_states
            return layer.draft_keys[:, :, :end], layer.draft_values[:, :, :end]
        if mode == _PREFILL:
            end = self._start + self._q
            start = min(max(self._start, self.frozen_slots), end)
            layer.keys[:, :, start:end] = key_states[:, :, start - self._start :]
            layer.values[:, :, start:end] = value_states[:, :, start - self._start :]
            return layer.keys[:, :, :end], layer.values[:, :, :end]
        raise RuntimeError(
            "MagicDecCache.update() called outside a MagicDec step; this cache is driven by hf_magicdec's engine."
        )

    def observe(self, layer_idx: int, query: torch.Tensor, scaling: float | None) -> None:
        """Keep the last ``observation_window`` prefill queries of a layer (SnapKV scoring)."""
        if self._mode != _PREFILL or self.observation_window <= 0:
            return
        layer = self.layers[layer_idx]
        tail = query[:, :, -self.observation_window :]
        if layer.observed_queries is not None and tail.shape[2] < self.observation_window:
            tail = torch.cat([layer.observed_queries, tail], dim=2)[:, :, -self.observation_window :]
        layer.observed_queries = tail.detach().clone()
        layer.scaling = scaling

    def before_attention(self, layer_idx: int, query: torch.Tensor, scaling: float | None) -> None:
        """Called by the attention function before each draft / verify attention: a query-aware
        view refills this layer's static part from the draft query (``views/dynamic.py``); the
        refresh policy records verify queries (``refresh.py``). A no-op otherwise."""
        if self._mode == _DRAFT and self.view is not None and self.view.query_aware:
            self.view.refill(self, layer_idx, query, scaling)
        elif self._mode == _VERIFY and self.refresher is not None:
            self.refresher.record(self, layer_idx, query, scaling)

    # ------------------------------------------------------------------ continued / returned KV
    def load_prefix(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Start layer ``layer_idx`` from a cache's KV ``keys / values [B, Hkv, n, D]`` (slots
        ``[0, n)`` of every row, left padding included): allocated on their device and copied, so
        the caller may drop its own. Prefill then continues at slot ``n`` (:attr:`frozen_slots`)."""
        layer = self.layers[layer_idx]
        layer.lazy_initialization(keys, values)
        n = keys.shape[2]
        layer.keys[:, :, :n] = keys
        layer.values[:, :, :n] = values
        self.frozen_slots = n

    def export_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Copies of the committed KV of working rows ``rows [k]``: ``(lengths [k], per layer
        (keys, values) [k, Hkv, max(lengths), D])``; slots past a row's length are not its KV."""
        rows = rows.to(self.lengths.device)
        lengths = self.lengths.index_select(0, rows)
        filled = int(lengths.max()) if rows.numel() else 0
        on = per_device(rows)
        kv = []
        for layer in self.layers:
            (r,) = on(layer.keys.device)
            kv.append((layer.keys[:, :, :filled].index_select(0, r), layer.values[:, :, :filled].index_select(0, r)))
        return lengths, kv

    # ------------------------------------------------------------------ draft views
    def build_draft_views(self, view: DraftView, config: "MagicDecConfig", prompt_slots: int, max_new_tokens: int,
                          scratch: int | None = None):
        """Select every layer's draft view from the prefilled prompt.

        The view of row ``b`` has ``Ks + W`` slots. With ``n`` real prompt tokens, the static part
        keeps ``sc = min(Ks, n)`` tokens and the rest, ``Wb = Ks + W - sc`` slots, is the rolling
        window, which starts with the last ``min(n - sc, Wb)`` prompt tokens; the static part is
        selected among the tokens before those. So no token is ever in the view twice, a prompt
        shorter than the budget is kept whole, and budget the prompt does not use goes to the
        window.

        ``scratch`` is the number of draft slots per step (default ``config.gamma``; the largest
        γ when γ adapts during generation).
        """
        self.view = view
        self.gamma = config.gamma if scratch is None else scratch  # draft slots per step (adaptive: the max)
        ks = view.static_slots(config.draft_budget, prompt_slots)
        w = view.window_slots(config.draft_budget, config.gamma, prompt_slots, max_new_tokens)
        self.static_slots, self.window_slots = ks, w
        device = self.lengths.device
        n_valid = prompt_slots - self.pad  # [B]
        self.static_count = torch.clamp(n_valid, max=ks)  # [B] sc
        self.ring_size = ks + w - self.static_count  # [B] Wb >= W
        ring_init = torch.minimum(n_valid - self.static_count, self.ring_size)  # [B]
        region = n_valid - ring_init  # [B] candidates for the static part
        self.ring_ptr = ring_init.clone()
        slot = torch.arange(prompt_slots, device=device)
        valid = slot[None, :] >= self.pad[:, None]  # [B, P]
        candidate = valid & (slot[None, :] < (self.pad + region)[:, None])
        view_slot = torch.arange(ks + w, device=device)[None, :]  # [1, Ks+W]
        ring_src = (prompt_slots - ring_init)[:, None] + (view_slot - self.static_count[:, None])
        ring_src = ring_src.clamp(min=0, max=max(prompt_slots - 1, 0))  # [B, Ks+W]; unfilled slots are masked
        is_static = view_slot < self.static_count[:, None]  # [B, Ks+W]
        for layer in self.layers:
            self._build_layer_view(layer, view, config, prompt_slots, valid, candidate, ring_src, is_static)
            layer.observed_queries = None
        view.prepare(self, config, prompt_slots)  # e.g. dynamic's page summaries
        self.refresher = Refresher.create(view, config, self)
        self._mode = None
        self._buffers_replaced()

    def _build_layer_view(self, layer, view, config, prompt_slots, valid, candidate, ring_src, is_static) -> None:
        keys, values = layer.keys, layer.values
        dev = keys.device
        batch, kv_heads, _, head_dim = keys.shape
        ks, w = self.static_slots, self.window_slots
        total = ks + w + self.gamma + 1
        layer.draft_keys = keys.new_zeros((batch, kv_heads, total, head_dim))
        layer.draft_values = values.new_zeros((batch, kv_heads, total, values.shape[-1]))
        if prompt_slots == 0:
            return
        source = ring_src.to(dev)[:, None, :].expand(-1, kv_heads, -1).clone()  # [B, Hkv, Ks+W]
        k = min(ks, prompt_slots)
        if k > 0:
            ctx = ScoreContext(
                keys=keys[:, :, :prompt_slots],
                valid=valid.to(dev),
                queries=layer.observed_queries,
                scaling=layer.scaling if layer.scaling is not None else head_dim**-0.5,
                config=config,
            )
            scores = view.score(ctx).float()  # [B, Hkv, P]
            scores = scores.masked_fill(~candidate.to(dev)[:, None, :], float("-inf"))
            picked = torch.topk(scores, k, dim=-1, sorted=True).indices  # [B, Hkv, k], candidates first
            static = is_static.to(dev)[:, None, :k]
            source[:, :, :k] = torch.where(static, picked, source[:, :, :k])
        layer.draft_keys[:, :, : ks + w] = torch.gather(keys, 2, source[..., None].expand(-1, -1, -1, head_dim))
        layer.draft_values[:, :, : ks + w] = torch.gather(
            values, 2, source[..., None].expand(-1, -1, -1, values.shape[-1])
        )

    def draft_valid(self) -> torch.Tensor:
        """``[B, Ks + W]`` bool: which slots of the draft view hold a token (a prefix of each row)."""
        view_slot = torch.arange(self.static_slots + self.window_slots, device=self.lengths.device)[None, :]
        return view_slot < self._draft_filled()[:, None]

    def _draft_filled(self) -> torch.Tensor:
        """``[B]`` filled slots of each row's view: static part, then the window as it fills."""
        return self.static_count + torch.minimum(self.ring_ptr, self.ring_size)

    # ------------------------------------------------------------------ commit / rows
    def commit(self, num_tokens: torch.Tensor, max_length: int | None = None) -> None:
        """Keep the first ``num_tokens[b]`` verified tokens of each row (the rest is rolled back)
        and append their target KV to every draft view's rolling window.

        Parameters
        ----------
        num_tokens : ``[B]`` int, in ``[0, q]`` where ``q`` is the last verify's token count.
        max_length : the new ``lengths.max()`` when the caller read it already (the engine reads
            it with its one host sync per step); None: read here.
        """
        num_tokens = num_tokens.to(self.lengths.device).long()
        if self.view is not None:
            j = torch.arange(self._q, device=self.lengths.device)
            src = (self.lengths[:, None] + j).clamp(max=self.capacity - 1)  # [B, q]
            self._append_to_windows(src, num_tokens, from_full_cache=True)
        self.lengths += num_tokens
        self._max_len = max_length if max_length is not None else self._read_max_length()
        self._mode = None

    def _read_max_length(self) -> int:
        return int(self.lengths.max().item()) if self.lengths.numel() else 0

    def commit_scratch(self, src: torch.Tensor, count: torch.Tensor) -> None:
        """Append draft scratch slots ``src[b, :count[b]]`` (relative to the scratch start) to each
        row's rolling window: a separate draft model's own KV of the committed tokens.

        Parameters
        ----------
        src : ``[B, n]`` scratch slot of each token to append, in order.
        count : ``[B]`` tokens to append per row, ``<= n``.
        """
        dev = self.lengths.device
        scratch = self.static_slots + self.window_slots
        self._append_to_windows(scratch + src.to(dev), count.to(dev).long(), from_full_cache=False)
        self._mode = None

    def _append_to_windows(self, src: torch.Tensor, count: torch.Tensor, from_full_cache: bool) -> None:
        """Copy slots ``src[b, :count[b]]`` of each row, taken from the full cache or from the draft
        buffer itself, into the next slots of its rolling window (the rest go to the trash slot)."""
        j = torch.arange(src.shape[1], device=src.device)
        ring = self.static_count[:, None] + (self.ring_ptr[:, None] + j) % self.ring_size[:, None]
        trash = self.static_slots + self.window_slots + self.gamma
        dst = torch.where(j[None, :] < count[:, None], ring, torch.full_like(ring, trash))
        on = per_device(src, dst)
        for layer in self.layers:
            s, d = on(layer.draft_keys.device)
            keys, values = (layer.keys, layer.values) if from_full_cache else (layer.draft_keys, layer.draft_values)
            copy_slots(keys, s, layer.draft_keys, d)
            copy_slots(values, s, layer.draft_values, d)
        self.ring_ptr += count

    def release_full_kv(self) -> None:
        """Free the full cache once the draft views are built, for a draft model that only ever
        attends to its views (their rolling windows are fed by :meth:`commit_scratch`)."""
        for layer in self.layers:
            if layer.is_initialized:
                # New empty tensors: a zero-length slice would keep the old storage alive.
                layer.keys = layer.keys.new_empty((*layer.keys.shape[:2], 0, layer.keys.shape[-1]))
                layer.values = layer.values.new_empty((*layer.values.shape[:2], 0, layer.values.shape[-1]))
        self.capacity = self.max_capacity = 0  # nothing left to write into or grow

    def select_rows(self, rows: torch.Tensor, max_length: int | None = None) -> None:
        """Keep only ``rows`` (``[B']`` indices), dropping finished rows from the working batch
        (``max_length``: the kept rows' longest length when the caller knows it; None: read here)."""
        rows = rows.to(self.lengths.device)
        self.pad = self.pad.index_select(0, rows)
        self.lengths = self.lengths.index_select(0, rows)
        if self.static_count is not None:
            self.static_count = self.static_count.index_select(0, rows)
            self.ring_size = self.ring_size.index_select(0, rows)
            self.ring_ptr = self.ring_ptr.index_select(0, rows)
        on = per_device(rows)
        for layer in self.layers:
            if not layer.is_initialized:
                continue
            (r,) = on(layer.keys.device)
            layer.keys = layer.keys.index_select(0, r)
            layer.values = layer.values.index_select(0, r)
            if layer.draft_keys is not None:
                layer.draft_keys = layer.draft_keys.index_select(0, r)
                layer.draft_values = layer.draft_values.index_select(0, r)
        for key, t in self.row_state.items():
            self.row_state[key] = t.index_select(0, rows.to(t.device))
        self.num_rows = int(rows.numel())
        self._max_len = max_length if max_length is not None else self._read_max_length()
        self._memo.clear()
        self._buffers_replaced()

    # Generic Cache API that would silently corrupt ragged state: refuse loudly.
    def crop(self, max_length: int):
        raise NotImplementedError("MagicDecCache keeps ragged per-row lengths; use commit() instead of crop().")

    def reorder_cache(self, beam_idx: torch.LongTensor):
        raise NotImplementedError("MagicDecCache does not support beam search.")

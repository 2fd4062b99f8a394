"""`MagicDecCache`: the full KV cache with ragged per-row lengths, plus compressed draft views.

Layout per layer (``B`` rows, ``Hkv`` local KV heads, ``D`` head dim; :mod:`.layers`)::

    full KV      [B, Hkv, capacity, D]    row b's committed tokens are slots [0, lengths[b]) (left
                                          padding included, always masked); grows (``reserve``)
    draft view   [B, Hkv, Ks + W + scratch + 1, D]
                 [ static selection Ks | rolling window W | draft scratch | trash 1 ]  (:mod:`.geometry`)

Layers that share a device and head shapes keep these in stacked buffers (:mod:`.store`), so that
what happens between forwards (the commit feeding every layer's draft window, a view re-choosing
its static part, rows leaving, the cache growing) costs a fixed number of operations whatever the
depth.

Models call ``cache.update(k, v, layer_idx)`` without metadata, so the engine opens each forward
first (:meth:`~MagicDecCache.begin_prefill` / ``begin_draft`` / ``begin_verify``, which return the
forward's value, :mod:`.forwards`) and the cache owns every per-row offset. Commit and rollback are
O(1) per row: rejected tokens' KV stays in slots that the next verify overwrites, and only
``lengths`` moves.

Memory follows what is generated, not ``max_new_tokens``: the full cache starts at the prompt plus
a modest headroom (:func:`~.buffers.initial_capacity`) and :meth:`MagicDecCache.reserve` grows it
geometrically, capped at what the call can generate, when the next verify would write past it
(compiled steps allocate the whole call up front instead: their graphs never see a new shape
mid-call). The draft views are separate fixed-size buffers and never move.

Rows that finish leave the working batch (:meth:`MagicDecCache.drop_rows`); when the generation's
KV is handed back they are kept by the cache (:meth:`MagicDecCache.committed_kv`).

Whoever needs per-row state beside the cache's (a query-aware view's page summaries, the refresh
policy's query rings) keeps it in a :class:`~hf_magicdec.views.RowState` and
:meth:`~MagicDecCache.attach`-es it. Nothing outside this package writes the cache's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from ...views import DraftView, RowState, ScoreContext
from .buffers import grown_capacity, row_moves
from .forwards import DraftForward, Forward, PrefillForward, VerifyForward
from .geometry import DraftGeometry
from .layers import MagicDecLayer
from .options import CacheOptions
from .store import LayerStack, stack_key

__all__ = ["MagicDecCache", "PromptSnapshot", "RowState"]

#: Per layer ``(keys, values)``, ``[B, Hkv, S, D]``.
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class PromptSnapshot:
    """A prefilled prompt copied out of a cache (:meth:`MagicDecCache.snapshot_prompt`): per layer
    ``(keys, values) [B, Hkv, prompt, D]``, the observed queries and their scale."""

    prompt: int
    pad: torch.Tensor
    layers: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, float | None]]


@dataclass
class _Finished:
    """Rows that left the batch while their KV is to be handed back: their original indices
    ``rows [k]``, committed ``lengths [k]`` and, per stack, ``(keys, values) [L, k, Hkv, filled, D]``
    (views of the stack's buffers until the cache replaces them, then copies)."""

    rows: torch.Tensor
    lengths: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    copied: bool = False


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
    options : CacheOptions
        Fixed for the cache's life (observation window, position limit, growth bound, compiled
        steps' fixed shapes and static addresses).

    Notes
    -----
    Not meant to be reused across ``generate`` calls: the engine builds one per call.
    """

    def __init__(self, num_layers: int, batch_size: int, capacity: int, pad_lengths: torch.Tensor,
                 options: CacheOptions | None = None):
        super().__init__(layers=[MagicDecLayer(self, i) for i in range(num_layers)])
        self.options = options if options is not None else CacheOptions()
        self._capacity = capacity
        self._max_capacity = max(capacity, self.options.max_capacity or capacity)
        self._growths = 0
        self._pad = pad_lengths.long()  # [B]
        self._lengths = torch.zeros_like(self._pad)  # [B] committed slots
        #: ``[B]`` original batch index of each row (rows leave as they finish).
        self.row_ids = torch.arange(self._pad.shape[0], device=self._pad.device)
        self._max_len = 0  # host mirror of lengths.max()
        # Prefill leaves slots below this untouched: they hold a continued cache's KV as the user
        # gave it, and prefill re-runs their last tokens only to record SnapKV's observation queries.
        self._frozen = 0
        self._stacks: list[LayerStack] = []
        self._forward: Forward | None = None
        self._view: DraftView | None = None
        self._geometry: DraftGeometry | None = None
        self._view_state: RowState | None = None
        self._row_states: list[RowState] = []
        self._finished: list[_Finished] = []
        self._row_tensors: dict = {}  # per-row constants of the current rows (key ranges, masks)
        #: Whether the model rewrites the attention mask it is given (seen during prefill): its
        #: draft and verify forwards then get the real mask (:meth:`Forward.model_mask`).
        self.real_masks = False

    # ------------------------------------------------------------------ what others read
    @property
    def num_rows(self) -> int:
        return int(self._pad.shape[0])

    @property
    def pad(self) -> torch.Tensor:
        """``[B]`` left-padding slots of each row."""
        return self._pad

    @property
    def lengths(self) -> torch.Tensor:
        """``[B]`` committed slots of each row (padding included)."""
        return self._lengths

    @property
    def capacity(self) -> int:
        """Slots per row allocated in every layer's full KV."""
        if torch.compiler.is_compiling() and self._stacks:
            # A size, not the int attribute: a compiled step then serves every capacity (dynamo
            # specialises an attribute's int, and marks a changing size dynamic).
            return self.layers[self._stacks[0].layers[0]].keys.shape[2]
        return self._capacity

    @property
    def max_capacity(self) -> int:
        return self._max_capacity

    @property
    def growths(self) -> int:
        """Times :meth:`reserve` grew the full cache."""
        return self._growths

    @property
    def view(self) -> DraftView | None:
        return self._view

    @property
    def geometry(self) -> DraftGeometry | None:
        """The draft views' slot layout (None before :meth:`build_draft_views`)."""
        return self._geometry

    @property
    def static_slots(self) -> int:
        return self._geometry.static_slots if self._geometry is not None else 0

    @property
    def window_slots(self) -> int:
        return self._geometry.window_slots if self._geometry is not None else 0

    @property
    def forward(self) -> Forward | None:
        """The open forward (None between steps)."""
        return self._forward

    @property
    def row_states(self) -> tuple[RowState, ...]:
        """The attached per-row states (:meth:`attach`), in the order they were attached."""
        return tuple(self._row_states)

    @property
    def stacks(self) -> tuple[LayerStack, ...]:
        """The stacked buffers, one per group of layers sharing a device and head shapes."""
        return tuple(self._stacks)

    @property
    def layer_groups(self) -> list[list[int]]:
        """The layers of each stack (:attr:`stacks`), in stack order."""
        return [stack.layers for stack in self._stacks]

    def max_length(self) -> int:
        """Longest committed row, in slots (padding included)."""
        return self._max_len

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._max_len

    # ------------------------------------------------------------------ per-row constants
    def _per_rows(self, key, build):
        """``build()``, kept until the rows change (or the views move, for the views' fill). Inside
        a compiled step it is simply built: there it costs nothing, and a memo would make every
        state of the dict a graph of its own."""
        if torch.compiler.is_compiling():
            return build()
        hit = self._row_tensors.get(key)
        if hit is None:
            hit = self._row_tensors[key] = build()
        return hit

    def row_constant(self, value: int) -> torch.Tensor:
        """``[B]`` int32 tensor of ``value`` (key-range bounds)."""
        return self._per_rows(("const", value), lambda: torch.full_like(self._pad, value, dtype=torch.int32))

    @property
    def pad32(self) -> torch.Tensor:
        return self._per_rows("pad32", lambda: self._pad.to(torch.int32))

    def draft_filled(self) -> torch.Tensor:
        """``[B]`` int32 filled slots of each row's draft view (valid until the next commit)."""
        return self._per_rows("filled", lambda: self._geometry.filled().to(torch.int32))

    def positions(self, num_tokens: int) -> torch.Tensor:
        """``[B, num_tokens]`` positions of each row's next ``num_tokens`` tokens (the pending one
        first): a step's draft and verify positions."""
        return (self._lengths - self._pad)[:, None] + self._window_offsets(num_tokens)

    def draft_slots(self, first, num_tokens: int) -> torch.Tensor:
        """``[num_tokens]`` draft-view slots from ``first`` (an int, or a 0-d tensor in a compiled
        draft step)."""
        if isinstance(first, torch.Tensor):
            return first + self._window_offsets(num_tokens)
        return self._per_rows(("slots", first, num_tokens), lambda: first + self._window_offsets(num_tokens))

    def broadcast_mask(self, q_len: int, kv_len: int) -> torch.Tensor:
        """A ``[B, 1, q_len, kv_len]`` bool tensor of one stored element (see :meth:`Forward.model_mask`)."""
        one = self._per_rows("one", lambda: torch.ones((), dtype=torch.bool, device=self._pad.device))
        return self._per_rows(("mask", q_len, kv_len), lambda: one.expand(self.num_rows, 1, q_len, kv_len))

    def mask_rewritten(self) -> None:
        """The model's attention received another mask than the one it was called with: the model
        rewrites its mask (seen during prefill), so later forwards hand it the real one."""
        self.real_masks = True

    def _views_moved(self) -> None:
        """The draft views' fill changed (a commit, a re-layout). Compiled steps keep no memo."""
        if not torch.compiler.is_compiling():
            self._row_tensors.pop("filled", None)

    def _rows_changed(self) -> None:
        one = self._row_tensors.get("one")
        self._row_tensors = {} if one is None else {"one": one}

    # ------------------------------------------------------------------ forwards
    def begin_prefill(self, start: int, length: int) -> PrefillForward:
        """Next forward writes prompt slots ``[start, start + length)`` in every row."""
        self.materialize()
        self._forward = PrefillForward(self, start, length, self._frozen, self.options.observation_window)
        return self._forward

    def end_prefill(self, prompt_slots: int) -> None:
        self.materialize()
        self._lengths.fill_(prompt_slots)
        self._max_len = prompt_slots
        self._forward = None

    def begin_draft(self, step, num_tokens: int = 1, skip: torch.Tensor | None = None) -> DraftForward:
        """Next forward drafts on the draft views: ``num_tokens`` tokens per row written to draft
        scratch slots ``[step, step + num_tokens)`` (``step``: an int, or a 0-d tensor in a compiled
        draft step), attending to the view and causally to the scratch written so far, except its
        first ``skip[b]`` slots (``[B]``; a separate draft model re-feeds a token whose KV is
        already in the view)."""
        if self._geometry is None:
            raise RuntimeError("build_draft_views() must run before drafting.")
        self._forward = DraftForward(self, step, num_tokens, skip)
        return self._forward

    def begin_verify(self, num_tokens: int) -> VerifyForward:
        """Next forward verifies ``num_tokens`` tokens per row at each row's own offset."""
        self._forward = VerifyForward(self, num_tokens)
        return self._forward

    def _write(self, layer: MagicDecLayer, key_states: torch.Tensor, value_states: torch.Tensor):
        if self._forward is None:
            raise RuntimeError(
                "MagicDecCache.update() called outside a MagicDec step; this cache is driven by hf_magicdec's engine."
            )
        return self._forward.write(layer, key_states, value_states)

    # ------------------------------------------------------------------ buffers
    def materialize(self) -> None:
        """Stack the layers that have received keys but hold no buffers yet (the first prefill
        forward, a continued cache's prefix): one :class:`~.store.LayerStack` per device and head
        shape, ``capacity`` slots per row, the keys received copied into slots ``[0, n)``."""
        waiting = [layer for layer in self.layers if layer.pending is not None]
        if not waiting:
            return
        groups: dict[tuple, list[MagicDecLayer]] = {}
        for layer in waiting:
            groups.setdefault(stack_key(*layer.pending), []).append(layer)
        for members in groups.values():
            k0, v0 = members[0].pending
            shape = (len(members), k0.shape[0], k0.shape[1], self._capacity)
            keys = k0.new_zeros((*shape, k0.shape[-1]))
            values = v0.new_zeros((*shape, v0.shape[-1]))
            for j, layer in enumerate(members):
                k, v = layer.pending
                keys[j, :, :, : k.shape[2]] = k
                values[j, :, :, : v.shape[2]] = v
                layer.pending = None
            stack = LayerStack([layer.layer_idx for layer in members], keys, values)
            self._stacks.append(stack)
            for j, layer in enumerate(members):
                layer.stack, layer.index = stack, j
                layer.bind()
            self._made(stack)

    def _bind(self, stack: LayerStack) -> None:
        for layer_idx in stack.layers:
            self.layers[layer_idx].bind()
        self._made(stack)

    def reserve(self, slots: int) -> bool:
        """Make the full cache hold at least ``slots`` slots per row; call it between steps, e.g.
        with ``max_length() + q`` before a ``q``-token verify (host-side, no device sync).

        Grows geometrically (:func:`~.buffers.grown_capacity`, capped at ``max_capacity``) so that
        the copies are amortised: every stack gets new buffers on its own device with the filled
        prefix ``[0, max_length())`` copied. Finished rows kept for the hand-back are copied out
        of the old buffers first. Stacks whose full KV was released (:meth:`release_full_kv`) stay
        empty. Returns whether the cache grew.
        """
        if slots <= self._capacity:
            return False
        if self._forward is not None:
            raise RuntimeError(f"MagicDecCache.reserve() during a {self._forward.kind} forward; grow it between steps.")
        capacity = grown_capacity(self._capacity, slots, self._max_capacity)
        self._capacity = capacity  # stacks made later allocate from it
        for finished in self._finished:  # they view the buffers about to be replaced
            if not finished.copied:
                finished.kv = [(k.clone(), v.clone()) for k, v in finished.kv]
                finished.copied = True
        for stack in self._stacks:
            if stack.capacity:
                stack.widen(capacity, self._max_len)  # every row's committed KV lies in [0, lengths[b])
                self._bind(stack)
        self._max_capacity = max(self._max_capacity, capacity)
        self._growths += 1
        return True

    def _made(self, stack: LayerStack) -> None:
        """New KV buffers exist: when the steps are captured on CUDA, mark the tensors the forwards
        read (each layer's views of them) static for CUDA graphs, which then write them in place."""
        if self.options.static_addresses:
            for layer_idx in stack.layers:
                layer = self.layers[layer_idx]
                for view in (layer.keys, layer.values, layer.draft_keys, layer.draft_values):
                    if view is not None and view.numel():
                        torch._dynamo.mark_static_address(view)

    def load_prefix(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Start layer ``layer_idx`` from a cache's KV ``keys / values [B, Hkv, n, D]`` (slots
        ``[0, n)`` of every row, left padding included), copied into the stacks when they are made
        (:meth:`materialize`, before the next forward), so the caller may then drop its own.
        Prefill then continues at slot ``n``, which it leaves as given."""
        self.layers[layer_idx].load(keys, values)
        self._frozen = keys.shape[2]

    def fill_synthetic(self, context: int, kv_heads: int, heads: int, head_dim: int, dtype: torch.dtype,
                       device: torch.device) -> None:
        """Random KV (and observation queries) as if ``context`` tokens had been prefilled: step
        timings do not depend on KV values, and a real prefill costs far more than the steps."""
        seed = torch.zeros(self.num_rows, kv_heads, 1, head_dim, dtype=dtype, device=device)
        for layer in self.layers:
            layer.load(seed, seed)
        self.materialize()
        window = self.options.observation_window
        for stack in self._stacks:
            stack.keys.normal_()
            stack.values.normal_()
        for layer in self.layers:
            if window:
                queries = torch.randn(self.num_rows, heads, min(window, context), head_dim, dtype=dtype, device=device)
                layer.observe(queries, head_dim ** -0.5, window)
        self.end_prefill(context)

    def snapshot_prompt(self) -> PromptSnapshot:
        """Copies of the prefilled prompt's KV and observations (right after :meth:`end_prefill`)."""
        prompt = self._max_len
        layers = [(layer.keys[:, :, :prompt].clone(), layer.values[:, :, :prompt].clone(),
                   None if layer.observed_queries is None else layer.observed_queries.clone(), layer.scaling)
                  for layer in self.layers]
        return PromptSnapshot(prompt, self._pad.clone(), layers)

    @classmethod
    def from_snapshot(cls, snapshot: PromptSnapshot, capacity: int, options: CacheOptions) -> "MagicDecCache":
        """A prefilled cache of ``capacity`` slots per row holding ``snapshot``'s prompt, keeping the
        last ``options.observation_window`` observed queries of each layer."""
        cache = cls(len(snapshot.layers), snapshot.pad.shape[0], capacity, snapshot.pad.clone(), options)
        window = options.observation_window
        for layer, (keys, values, queries, scaling) in zip(cache.layers, snapshot.layers):
            layer.load(keys, values)
            if window and queries is not None:
                layer.observe(queries, scaling, window)
        cache.end_prefill(snapshot.prompt)
        return cache

    def release_full_kv(self) -> None:
        """Free the full cache once the draft views are built, for a draft model that only ever
        attends to its views (their rolling windows are fed by :meth:`commit_scratch`)."""
        for stack in self._stacks:
            stack.release_full()
            self._bind(stack)
        self._capacity = self._max_capacity = 0  # nothing left to write into or grow

    # ------------------------------------------------------------------ draft views
    def build_draft_views(self, view: DraftView, budget: int, gamma: int, prompt_slots: int, max_new_tokens: int,
                          scratch: int | None = None) -> None:
        """Select every layer's draft view from the prefilled prompt (layout: :mod:`.geometry`).

        ``budget`` and ``gamma`` size the view (``view.static_slots`` / ``view.window_slots``);
        ``scratch`` is the number of draft slots per step (default ``gamma``; the largest γ when γ
        adapts during generation). A view with per-row state (``view.prepare``) gets it attached.
        """
        self.materialize()
        ks = view.static_slots(budget, prompt_slots)
        w = view.window_slots(budget, gamma, prompt_slots, max_new_tokens)
        geometry = DraftGeometry.for_prompt(ks, w, gamma if scratch is None else scratch, prompt_slots, self._pad)
        self._view, self._geometry = view, geometry
        device = self._lengths.device
        slot = torch.arange(prompt_slots, device=device)
        valid = slot[None, :] >= self._pad[:, None]  # [B, P]
        candidate = valid & (slot[None, :] < (self._pad + geometry.static_candidates)[:, None])
        ring_src = geometry.initial_sources(prompt_slots)  # [B, Ks+W]
        is_static = torch.arange(ks + w, device=device)[None, :] < geometry.static_count[:, None]
        for stack in self._stacks:
            sources = None
            if prompt_slots:
                sources = torch.stack([self._view_sources(self.layers[i], view, prompt_slots, valid, candidate,
                                                          ring_src, is_static) for i in stack.layers])
            stack.build_draft(geometry.total_slots, sources)
            self._bind(stack)
        for layer in self.layers:
            layer.forget_observation()
        if self._view_state is not None:
            self._row_states.remove(self._view_state)
        self._view_state = view.prepare(self, prompt_slots)  # e.g. dynamic's page summaries
        if self._view_state is not None:
            self.attach(self._view_state)
        self._forward = None
        self._views_moved()

    def _view_sources(self, layer, view, prompt_slots, valid, candidate, ring_src, is_static) -> torch.Tensor:
        """``[B, Hkv, Ks + W]`` full-cache slot of each view slot of ``layer``: the view's top-scored
        candidates in the static part, the prompt's tail in the window."""
        keys = layer.keys
        dev = keys.device
        kv_heads, head_dim = keys.shape[1], keys.shape[-1]
        source = ring_src.to(dev)[:, None, :].expand(-1, kv_heads, -1).clone()
        k = min(self._geometry.static_slots, prompt_slots)
        if k > 0:
            ctx = ScoreContext(keys=keys[:, :, :prompt_slots], valid=valid.to(dev), queries=layer.observed_queries,
                               scaling=layer.scaling if layer.scaling is not None else head_dim**-0.5)
            scores = view.score(ctx).float()  # [B, Hkv, P]
            scores = scores.masked_fill(~candidate.to(dev)[:, None, :], float("-inf"))
            picked = torch.topk(scores, k, dim=-1, sorted=True).indices  # [B, Hkv, k], candidates first
            static = is_static.to(dev)[:, None, :k]
            source[:, :, :k] = torch.where(static, picked, source[:, :, :k])
        return source

    def replace_static(self, layer_idx: int, slots: torch.Tensor, where: torch.Tensor, start: int = 0) -> None:
        """Layer ``layer_idx``'s view slots ``[start, start + n)`` take the full KV at ``slots
        [B, Hkv, n]`` where ``where`` (bool, broadcastable to ``[B, Hkv, n]``) holds: a query-aware
        view's refill, a refresh's re-selection."""
        self.layers[layer_idx].replace_static(slots, start, where)

    def replace_static_group(self, group: int, slots: torch.Tensor, where: torch.Tensor, start: int = 0) -> None:
        """As :meth:`replace_static` for every layer of stack ``group`` at once (``slots
        [L, B, Hkv, n]`` in the stack's layer order; one gather and one scatter per K and V)."""
        stack = self._stacks[group]
        target = self._window_offsets(slots.shape[-1])
        target = torch.where(where.to(slots.device), target + start if start else target, self._geometry.trash_slot)
        # target [B|1, Hkv|1, n]: the same view slots in every layer
        stack.copy(stack.full_index(slots), stack.draft_index(target[None]), from_full=True)

    def attach(self, state: RowState) -> None:
        """Keep ``state`` aligned with the cache's rows (and call its query and commit methods)."""
        self._row_states.append(state)

    # ------------------------------------------------------------------ commit / rows
    def commit(self, num_tokens: torch.Tensor, max_length: int | None = None, feed_views: bool = True) -> None:
        """Keep the first ``num_tokens[b]`` verified tokens of each row (the rest is rolled back)
        and append their target KV to every draft view's rolling window.

        Parameters
        ----------
        num_tokens : ``[B]`` int, in ``[0, q]`` where ``q`` is the open verify's token count.
        max_length : the new ``lengths.max()`` when the caller read it already (the engine reads
            it with its one host read per step); None: read here.
        feed_views : False: leave the windows as they are (plain-decoding steps of a schedule,
            whose views nobody reads); :meth:`sync_windows` brings them up to date before drafting.
        """
        self.commit_tokens(num_tokens, feed_views)
        self.end_step(max_length if max_length is not None else self._read_max_length())

    def commit_tokens(self, num_tokens: torch.Tensor, feed_views: bool = True) -> None:
        """The device part of :meth:`commit` (what a compiled step captures): the lengths move and
        the windows take the committed KV. :meth:`end_step` must follow."""
        verify = self._forward
        if not isinstance(verify, VerifyForward):
            raise RuntimeError("MagicDecCache.commit() follows a verify forward (begin_verify).")
        num_tokens = num_tokens.to(self._lengths.device)
        if self._geometry is not None and feed_views:
            src = self._lengths[:, None] + self._window_offsets(verify.num_tokens)  # in range: reserve()
            dst = self._geometry.ring_targets(num_tokens, verify.num_tokens)
            for stack in self._stacks:
                stack.full_to_draft(*self._on(stack.device, src, dst))
            self._geometry.advance(num_tokens)
            self._views_moved()
        self._lengths += num_tokens

    def end_step(self, max_length: int) -> None:
        """The host part of :meth:`commit`: ``max_length`` is the new ``lengths.max()`` (read by the
        caller); the attached row states see the commit (e.g. the verification-guided view chooses)."""
        self._max_len = max_length
        self._forward = None
        for state in self._row_states:
            state.on_commit(self)

    def _window_offsets(self, n: int) -> torch.Tensor:
        """``[n]`` arange on the rows' device, made once."""
        return self._per_rows(("arange", n), lambda: torch.arange(n, device=self._lengths.device))

    def _on(self, device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tensors if tensors[0].device == device else tuple(t.to(device) for t in tensors)

    def _read_max_length(self) -> int:
        return int(self._lengths.max().item()) if self._lengths.numel() else 0

    def commit_scratch(self, src: torch.Tensor, count: torch.Tensor) -> None:
        """Append draft scratch slots ``src[b, :count[b]]`` (relative to the scratch start) to each
        row's rolling window: a separate draft model's own KV of the committed tokens.

        Parameters
        ----------
        src : ``[B, n]`` scratch slot of each token to append, in order.
        count : ``[B]`` tokens to append per row, ``<= n``.
        """
        dev = self._lengths.device
        src = self._geometry.view_slots + src.to(dev)
        count = count.to(dev).long()
        dst = self._geometry.ring_targets(count, src.shape[1])
        for stack in self._stacks:
            stack.draft_to_draft(*self._on(stack.device, src, dst))
        self._geometry.advance(count)
        self._views_moved()
        self._forward = None

    def sync_windows(self) -> None:
        """Make every rolling window hold what committing with ``feed_views=True`` all along would
        have put there: the last tokens of each row after its static region, at the same slots
        (commits with ``feed_views=False`` left them behind)."""
        geometry = self._geometry
        dev = self._lengths.device
        count = (self._lengths - self._pad) - geometry.static_candidates  # tokens that entered the window
        held = torch.minimum(count, geometry.ring_size)
        j = torch.arange(geometry.view_slots, device=dev)[None, :]
        token = (count - held)[:, None] + j  # window token index, oldest kept first
        src = (self._pad + geometry.static_candidates)[:, None] + token
        src = src.clamp(max=max(self._capacity - 1, 0))
        dst = geometry.static_count[:, None] + token % geometry.ring_size[:, None]
        dst = torch.where(j < held[:, None], dst, torch.full_like(dst, geometry.trash_slot))
        for stack in self._stacks:
            stack.full_to_draft(*self._on(stack.device, src, dst))
        geometry.advance(count - geometry.ring_ptr)
        self._views_moved()

    def full_layout(self, rows: torch.Tensor) -> None:
        """Rows (``[B]`` bool) whose static part holds fewer tokens than its ``static_slots`` (their
        prompt fitted the view, so the window took the rest) get the full layout: the static part
        all its slots, the window ``window_slots`` holding the row's latest tokens. The static part's
        contents are then the caller's to write (:meth:`replace_static`). Masked: no host read; a
        row must hold at least ``static_slots + window_slots`` tokens."""
        g = self._geometry
        rows = rows.to(self._lengths.device) & (g.static_count < g.static_slots)
        width = g.window_slots
        window_start = (self._lengths - self._pad) - width  # tokens before the new window
        j = torch.arange(width, device=rows.device)[None, :]
        src = ((self._pad + window_start)[:, None] + j).clamp(min=0, max=max(self._capacity - 1, 0))
        dst = torch.where(rows[:, None], g.static_slots + j, torch.full_like(j, g.trash_slot))
        for stack in self._stacks:
            stack.full_to_draft(*self._on(stack.device, src, dst))
        g.relayout(rows, window_start)
        self._views_moved()

    def drop_rows(self, finished: Sequence[bool], max_length: int | None = None, keep_finished: bool = False
                  ) -> torch.Tensor:
        """Finished rows leave the working batch in place: each finished row among the first
        ``kept`` (alive) positions takes an alive row from the end (:func:`~.buffers.row_moves`),
        so only as many rows move as finished early, and no new buffer holds the kept rows beside
        the old ones (peak memory stays the cache's).

        Parameters
        ----------
        finished : ``[n]`` on the host, the working rows that finished.
        max_length : the kept rows' longest length when the caller knows it (None: read here).
        keep_finished : keep the finished rows' KV for :meth:`committed_kv` (a hand-back): they
            are swapped to the end of the buffers, not overwritten, and copied out before the
            buffers are ever replaced.

        Returns
        -------
        ``order [n]`` long on the cache's device: the row each position holds afterwards; the
        working rows are now ``order[:kept]``, in that order (index per-row state with it).
        """
        order, holes, sources = row_moves(finished)
        kept = sum(not f for f in finished)
        device = self._lengths.device
        order = torch.tensor(order, dtype=torch.long, device=device)
        if keep_finished and kept < len(finished):
            self._finished.append(_Finished(self.row_ids.index_select(0, order[kept:]),
                                            self._lengths.index_select(0, order[kept:]), []))
        filled = self._max_len
        for stack in self._stacks:
            rows = stack.rows
            stack.move_rows(holes, sources, kept, filled, swap=keep_finished)
            if keep_finished and kept < len(finished):
                self._finished[-1].kv.append((stack.keys[:, kept:rows, :, :filled],
                                              stack.values[:, kept:rows, :, :filled]))
            self._bind(stack)
        self._pad = self._pad.index_select(0, order[:kept])
        self._lengths = self._lengths.index_select(0, order[:kept])
        self.row_ids = self.row_ids.index_select(0, order[:kept])
        if self._geometry is not None:
            self._geometry.select_rows(order[:kept])
        for state in self._row_states:
            state.select_rows(order[:kept])
        self._rows_changed()
        self._max_len = max_length if max_length is not None else self._read_max_length()
        return order

    def committed_kv(self, batch: int, total: int) -> tuple[LayerKV, torch.Tensor]:
        """Every row's committed KV laid out as stock's cache: ``(per layer (keys, values)
        [batch, Hkv, total, D], filled [batch])`` where original row ``b`` holds its KV in slots
        ``[0, filled[b])``: the working rows and the ones kept when they left
        (``drop_rows(keep_finished=True)``). Slots past ``filled[b]`` are the caller's to fill.

        Spends the cache. When every row is still where it started, the layers are views of the
        stacked buffers (no copy, no second cache at the peak); otherwise each layer is assembled
        in a new tensor."""
        device = self._lengths.device
        filled = torch.zeros(batch, dtype=torch.long, device=device)
        filled[self.row_ids] = self._lengths.clamp(max=total)
        for gone in self._finished:
            filled[gone.rows] = gone.lengths.clamp(max=total)
        in_place = not self._finished and self.num_rows == batch and all(s.capacity >= total for s in self._stacks)
        out: list = [None] * len(self.layers)
        for s, stack in enumerate(self._stacks):
            full_k, full_v = stack.full()
            pieces = [(self.row_ids, full_k, full_v)] + [(gone.rows, *gone.kv[s]) for gone in self._finished]
            for j, layer_idx in enumerate(stack.layers):
                if in_place:
                    out[layer_idx] = (full_k[j, :, :, :total], full_v[j, :, :, :total])
                    continue
                keys = full_k.new_zeros((batch, full_k.shape[2], total, full_k.shape[-1]))
                values = full_v.new_zeros((batch, full_v.shape[2], total, full_v.shape[-1]))
                for where, k, v in pieces:
                    n = min(k.shape[3], total)
                    where = where.to(keys.device)
                    keys[where, :, :n] = k[j, :, :, :n]
                    values[where, :, :n] = v[j, :, :, :n]
                out[layer_idx] = (keys, values)
        for layer in self.layers:
            layer.release()
        self._stacks, self._finished = [], []
        return out, filled

    # Generic Cache API that would silently corrupt ragged state: refuse loudly.
    def crop(self, max_length: int):
        raise NotImplementedError("MagicDecCache keeps ragged per-row lengths; use commit() instead of crop().")

    def reorder_cache(self, beam_idx: torch.LongTensor):
        raise NotImplementedError("MagicDecCache does not support beam search.")

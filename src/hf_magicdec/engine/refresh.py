"""Refresh of a static draft view: re-select its static part during generation.

A static view (``snapkv``; also ``streamingllm``, whose sinks then become the most attended
tokens) chooses its static part once, from the prompt. As the generation drifts, the tokens the
draft needs move. With ``refresh_every=N`` and/or ``refresh_below=a`` the static part is chosen
again:

* every ``N`` committed tokens of a row (rows are refreshed on their own schedule), and/or
* when the running acceptance, pooled over rows over the last ``8`` verification steps since the
  previous refresh, drops below ``a`` (then every row is refreshed).

Re-selection scores every committed token that is **not** in the rolling window (prompt tokens
and generated tokens the window has evicted alike) by the attention mass it receives from the
row's most recent ``window`` committed queries (their verify queries, recorded by the attention
function; non-causal: every recent query sees every candidate), pooled like SnapKV (``window`` and
``pool_kernel`` are the view's when it has them, else SnapKV's defaults) and summed
over the query heads of each KV head, keeps the top ``static_count`` per KV head, and gathers
their target KV from the full cache into the static part (in position order). Nothing else in
the view moves, so no token is ever in it twice. Lossless by construction: the target verifies.

Cost: only when enabled, each verify keeps its queries (``[B, H, γ+1, D]`` per layer, a
``[B, H, window, D]`` ring per layer); a refresh reads the rows' whole committed keys once per
layer (like one full-cache attention of ``window`` queries) and gathers the static part.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..defaults import DEFAULT_POOL_KERNEL, DEFAULT_WINDOW
from ..views import RowState

if TYPE_CHECKING:
    from ..config import MagicDecConfig
    from ..views import DraftView
    from .cache import MagicDecCache

#: Verification steps the running acceptance of ``refresh_below`` is measured over.
ACCEPTANCE_WINDOW = 8


def recent_attention_mass(queries: torch.Tensor, keys: torch.Tensor, key_valid: torch.Tensor,
                          query_valid: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention mass each key receives from recent queries, without a causal mask.

    Parameters
    ----------
    queries : ``[B, H, w, D]`` recent queries.
    keys : ``[B, Hkv, S, D]`` with ``H % Hkv == 0``.
    key_valid : ``[B, S]`` bool, keys the queries attend to (the softmax runs over these).
    query_valid : ``[B, w]`` bool, queries that count (others contribute nothing).
    scaling : softmax scale.

    Returns
    -------
    ``[B, Hkv, S]`` float32: softmax probabilities summed over the valid queries and over the
    query heads of each KV head; 0 on invalid keys.
    """
    batch, heads, window, head_dim = queries.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    dev = keys.device
    key_valid, query_valid = key_valid.to(dev), query_valid.to(dev)
    q_ok = query_valid.repeat(1, group)[:, :, None]  # [B, g*w, 1], head-major like the fold below
    out = torch.empty((batch, kv_heads, slots), dtype=torch.float32, device=dev)
    for h in range(kv_heads):  # logits never exceed [B, g*w, S]
        q = queries[:, h * group : (h + 1) * group].float().reshape(batch, group * window, head_dim)
        logits = torch.matmul(q, keys[:, h].float().transpose(-1, -2)) * scaling
        probs = torch.softmax(logits.masked_fill(~key_valid[:, None, :], float("-inf")), dim=-1)
        out[:, h] = torch.where(q_ok, probs, torch.zeros((), device=dev)).nan_to_num_(0.0).sum(dim=1)
    return out


class Refresher(RowState):
    """Refresh policy of one generation (built by :meth:`create`), attached to the cache, which keeps
    its per-row state aligned with the rows (:meth:`select_rows`) and hands it every verify query
    (:meth:`on_verify_query`).

    Per-row state: ``since [B]`` committed tokens since the row's last refresh, ``recorded [B]``
    committed queries ever recorded; per layer ``rings[i] [B, H, window + 1, D]`` the last committed
    queries (+ a trash slot) and ``pending[i] [B, H, q, D]`` the last verify's queries.
    """

    def __init__(self, config: "MagicDecConfig", view: "DraftView | None", rows: torch.Tensor):
        self.every = config.refresh_every
        self.below = config.refresh_below
        # Scored as SnapKV scores: the view's observation window and pooling when it has them.
        self.window = getattr(view, "window", DEFAULT_WINDOW)
        self.pool_kernel = getattr(view, "pool_kernel", DEFAULT_POOL_KERNEL)
        self.history: deque[tuple[int, int]] = deque(maxlen=ACCEPTANCE_WINDOW)
        self.scaling: dict[int, float] = {}
        self.refreshes = 0
        self.since = torch.zeros_like(rows)
        self.recorded = torch.zeros_like(rows)
        self.rings: dict[int, torch.Tensor] = {}
        self.pending: dict[int, torch.Tensor] = {}

    @classmethod
    def create(cls, view: "DraftView", config: "MagicDecConfig", cache: "MagicDecCache") -> "Refresher | None":
        """A refresher when ``config`` asks for one and the view has a static part to refresh."""
        if config.refresh_every is None and config.refresh_below is None:
            return None
        if getattr(view, "reselects", False) or cache.static_slots == 0:
            return None  # re-selected by the view itself / nothing static (full)
        return cls(config, view, cache.lengths)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.since = self.since.index_select(0, rows.to(self.since.device))
        self.recorded = self.recorded.index_select(0, rows.to(self.recorded.device))
        self.rings = {i: t.index_select(0, rows.to(t.device)) for i, t in self.rings.items()}
        self.pending = {i: t.index_select(0, rows.to(t.device)) for i, t in self.pending.items()}

    # ------------------------------------------------------------------ recording
    def on_verify_query(self, cache: "MagicDecCache", layer_idx: int, query: torch.Tensor,
                        scaling: float | None) -> None:
        """Called before each verify attention: keep this layer's queries until commit."""
        self.pending[layer_idx] = query
        self.scaling[layer_idx] = scaling if scaling is not None else query.shape[-1] ** -0.5

    def _append(self, emitted: torch.Tensor) -> None:
        """Append the committed tokens' queries (the first ``emitted[b]`` of the last verify) to each
        layer's ring of recent queries."""
        w = self.window
        recorded = self.recorded
        moved: dict[torch.device, torch.Tensor] = {}
        for i, pending in self.pending.items():
            batch, heads, q, dim = pending.shape
            ring = self.rings.get(i)
            if ring is None:
                ring = self.rings[i] = pending.new_zeros((batch, heads, w + 1, dim))
            dev = pending.device
            if dev not in moved:
                j = torch.arange(q, device=recorded.device)
                k = emitted.to(recorded.device)[:, None]
                # Only the last w kept queries survive; the rest go to the trash slot w.
                live = (j[None, :] < k) & (j[None, :] >= k - w)
                trash = torch.full_like(live, w, dtype=torch.long)
                moved[dev] = torch.where(live, (recorded[:, None] + j) % w, trash).to(dev)
            dst = moved[dev][:, None, :, None].expand(-1, heads, -1, dim)
            ring.scatter_(2, dst, pending)
        self.pending = {}
        self.recorded = recorded + emitted.to(recorded.device)

    # ------------------------------------------------------------------ trigger
    def after_commit(self, cache: "MagicDecCache", emitted: torch.Tensor, accepted: torch.Tensor, gamma: int) -> int:
        """Called by the drafter after each commit. Returns 1 if the static part was re-selected
        (for some rows), else 0.

        Parameters
        ----------
        emitted : ``[b]`` tokens committed per row.
        accepted : ``[b]`` draft tokens accepted per row at the last verification.
        gamma : γ of the last verification.
        """
        emitted = emitted.to(cache.lengths.device).long()
        self._append(emitted)
        since = self.since + emitted
        due = torch.zeros_like(since, dtype=torch.bool)
        if self.every is not None:
            due |= since >= self.every
        if self.below is not None and gamma > 0:
            self.history.append((int(accepted.sum()), gamma * int(accepted.numel())))
            if len(self.history) == ACCEPTANCE_WINDOW:
                acc, drafted = map(sum, zip(*self.history))
                if drafted and acc / drafted < self.below:
                    due |= True
        if not bool(due.any()):
            self.since = since
            return 0
        self.reselect(cache, due)
        self.since = torch.where(due, torch.zeros_like(since), since)
        self.history.clear()  # acceptance before the refresh says nothing about the new view
        self.refreshes += 1
        return 1

    # ------------------------------------------------------------------ re-selection
    def reselect(self, cache: "MagicDecCache", rows: torch.Tensor) -> None:
        """Re-select the static part of the rows where ``rows`` (``[b]`` bool) is True."""
        length = cache.max_length()
        geometry = cache.geometry
        static = min(geometry.static_slots, length)
        if static == 0:
            return
        slot = torch.arange(length, device=cache.lengths.device)
        key_valid = (slot[None, :] >= cache.pad[:, None]) & (slot[None, :] < cache.lengths[:, None])
        not_in_window = slot[None, :] < (cache.lengths - geometry.window_filled())[:, None]
        candidate = key_valid & not_in_window
        query_valid = torch.arange(self.window, device=slot.device)[None, :] < self.recorded[:, None]
        use = torch.arange(static, device=slot.device)[None, :] < geometry.static_count[:, None]  # [b, static]
        write = use & rows[:, None]
        for i, ring in self.rings.items():
            keys = cache.layers[i].keys
            dev = keys.device
            scores = recent_attention_mass(ring[:, :, : self.window], keys[:, :, :length], key_valid, query_valid,
                                           self.scaling[i])
            if self.pool_kernel > 1:
                b, h = scores.shape[:2]
                scores = F.avg_pool1d(scores.reshape(b * h, 1, length), self.pool_kernel, 1,
                                      self.pool_kernel // 2).reshape(b, h, length)
            scores = scores.masked_fill(~candidate.to(dev)[:, None, :], float("-inf"))
            top = torch.topk(scores, static, dim=-1, sorted=True).indices  # best first
            # Rows use their first static_count picks (all candidates), stored in position order.
            top = torch.where(use.to(dev)[:, None, :], top, torch.full_like(top, length)).sort(dim=-1).values
            cache.replace_static(i, top.clamp(max=length - 1), write.to(dev)[:, None, :])

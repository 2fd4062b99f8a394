"""Query-aware dynamic draft view, in the spirit of Quest (Tang et al., 2024, arXiv 2406.10774).

The static part of the view is re-chosen at **every draft step, in every layer**, from that
step's query, instead of once after prefill::

    [ sinks (sink_tokens) | top pages (n_pages · page_size) | rolling recent window ]

* **Page summaries** are built once after prefill: the prompt's candidate tokens (those neither
  sinks nor in the initial rolling window) are cut into pages of ``P = page_size`` tokens per row
  and KV head, and each page keeps the elementwise ``min`` and ``max`` of its keys. Pages start at
  each row's first candidate token (``pad[b] + sink_tokens``), so no page ever mixes left padding
  with tokens; a row's last page may be partial.
* **Selection** (:meth:`PageSelection.on_draft_query`, called by the cache before each
  draft attention): Quest's upper bound of the attention logit of query ``q`` on any key of a
  page, ``Σ_d max(q_d·min_d, q_d·max_d)``, summed over the query heads that share the KV head;
  the best pages fill the ``n_pages · P`` page slots (in score order, a partial page counting for
  its real tokens only, so the last slots may take the first tokens of the next best page); the
  selected tokens' *target* KV is gathered from the full cache into the static part.
* The sinks and the rolling window behave as in the other views: the window starts with the
  last prompt tokens and then receives every committed token's target KV.
* Rows whose prompt fits the budget (at most ``draft_budget`` real tokens) keep their whole
  prompt and are never re-selected.

Cost, per draft step, layer, row and KV head: reading the summaries, ``2·D`` values per page,
i.e. ``2/P`` of the prompt's keys (``1/P`` of its KV), two ``[g, D] × [D, S/P]`` products, a
top-k over ``S/P`` pages, and gathering ``n_pages · P`` tokens of K and V from the full cache
(the budget). Memory: the summaries, ``2/P`` of the prompt's keys. So selection stays bounded at
``≈ S/P + budget`` tokens' worth of reads, against ``S`` for a full-cache step; at ``P = 16``
and long prompts the summaries dominate, and a larger ``page_size`` trades selection
granularity for speed (``hf_magicdec.planner`` charges the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checks import is_int
from ..defaults import DEFAULT_PAGE_SIZE, DEFAULT_SINK_TOKENS
from .base import DraftView, RowState, ScoreContext, ViewCache, check_sizes, require_int


def page_summaries(keys: torch.Tensor, first: torch.Tensor, span: torch.Tensor, page_size: int):
    """Elementwise key min / max of each page of candidate tokens.

    Parameters
    ----------
    keys : ``[B, Hkv, S, D]`` keys of the cache (at least the prompt slots).
    first : ``[B]`` first candidate slot of each row (pages start there).
    span : ``[B]`` candidate tokens of each row (0: no pages).
    page_size : tokens per page ``P``.

    Returns
    -------
    ``(kmin, kmax, page_start, page_tokens)``: ``[B, Hkv, N, D]`` twice (zeros for empty pages),
    ``[B, N]`` first slot of each page and ``[B, N]`` real tokens in each page, where
    ``N = ceil(max(span) / P)``.
    """
    batch, kv_heads, slots, head_dim = keys.shape
    dev = keys.device
    first, span = first.to(dev), span.to(dev)
    n_pages = -(-int(span.max()) // page_size) if span.numel() else 0
    page = torch.arange(n_pages, device=dev)
    page_start = first[:, None] + page * page_size  # [B, N]
    page_tokens = (span[:, None] - page * page_size).clamp(min=0, max=page_size)  # [B, N]
    j = torch.arange(n_pages * page_size, device=dev)
    slot = (first[:, None] + j).clamp(max=max(slots - 1, 0))  # [B, N*P]
    real = (j[None, :] < span[:, None]).view(batch, 1, n_pages, page_size, 1)
    picked = torch.gather(keys, 2, slot[:, None, :, None].expand(-1, kv_heads, -1, head_dim))
    picked = picked.view(batch, kv_heads, n_pages, page_size, head_dim)
    kmin = picked.masked_fill(~real, float("inf")).amin(dim=3)
    kmax = picked.masked_fill(~real, float("-inf")).amax(dim=3)
    empty = (page_tokens == 0)[:, None, :, None]
    return kmin.masked_fill(empty, 0), kmax.masked_fill(empty, 0), page_start, page_tokens


def page_scores(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound ``Σ_d max(q_d·min_d, q_d·max_d)``, summed over the query heads (and
    query tokens) that share a KV head.

    Parameters
    ----------
    query : ``[B, H, q, D]`` with ``H % Hkv == 0`` (query head ``h`` serves KV head ``h // g``).
    kmin, kmax : ``[B, Hkv, N, D]`` page summaries.

    Returns
    -------
    ``[B, Hkv, N]`` float32.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads = kmin.shape[1]
    folded = query.reshape(batch, kv_heads, (heads // kv_heads) * q_len, head_dim).to(kmin.dtype)
    positive = folded.clamp(min=0)
    # max(q·lo, q·hi) per dimension = q⁺·hi + q⁻·lo: two matmuls, no [.., N, D] temporary.
    bound = positive @ kmax.transpose(-1, -2) + (folded - positive) @ kmin.transpose(-1, -2)  # [B, Hkv, g*q, N]
    return bound.float().sum(dim=2)


def select_page_slots(scores: torch.Tensor, page_start: torch.Tensor, page_tokens: torch.Tensor,
                      slots: int, page_size: int) -> torch.Tensor:
    """Cache slots filling ``slots`` static slots with the best pages.

    Pages are taken in score order; a page counts for its real tokens only, so when the best
    pages include a partial page the last slots hold the first tokens of the next best page.
    Pages with no real tokens are never taken.

    Parameters
    ----------
    scores : ``[B, Hkv, N]`` page scores.
    page_start, page_tokens : ``[B, N]`` first slot and real tokens of each page.
    slots : static slots to fill (``n_pages · P``).
    page_size : ``P``.

    Returns
    -------
    ``[B, Hkv, slots]`` cache slots in increasing order. Meaningful only for rows with at least
    ``slots`` candidate tokens; others hold arbitrary (in-range for the candidate pages) slots.
    """
    batch, kv_heads, n_pages = scores.shape
    size = page_tokens[:, None, :].expand(-1, kv_heads, -1)
    scores = scores.masked_fill(size == 0, float("-inf"))
    k = min(n_pages, -(-slots // page_size) + 1)  # enough pages even if one is partial
    top = torch.topk(scores, k, dim=-1, sorted=True).indices  # [B, Hkv, k]
    top_size = size.gather(2, top)
    end = top_size.cumsum(-1)  # [B, Hkv, k]
    t = torch.arange(slots, device=scores.device).expand(batch, kv_heads, slots).contiguous()
    which = torch.searchsorted(end, t, right=True).clamp(max=k - 1)  # page (rank) of static slot t
    offset = t - (end - top_size).gather(2, which)
    start = page_start[:, None, :].expand(-1, kv_heads, -1).gather(2, top.gather(2, which))
    return (start + offset).sort(dim=-1).values


@dataclass(frozen=True)
class DynamicPages(DraftView):
    """Sinks + the pages with the highest Quest bound for each draft query + a rolling window.

    Budget split: ``recent = recent_window`` (default ``draft_budget // 4``), ``n_pages =
    (draft_budget - sink_tokens - recent) // page_size``, static part ``sink_tokens + n_pages ·
    page_size`` tokens, rolling window the rest (at least ``recent``).

    Parameters
    ----------
    sink_tokens : int
        The first tokens of the prompt that always stay in the view (>= 0).
    page_size : int
        Prompt tokens per page ``P`` (per-page key min / max summaries, 2/P of the prompt's keys,
        are scored against every draft query).
    recent_window : int or None
        Smallest size of the rolling window of recent tokens. Default None: ``draft_budget // 4``.
    """

    name = "dynamic"
    query_aware = True
    reselects = True

    sink_tokens: int = DEFAULT_SINK_TOKENS
    page_size: int = DEFAULT_PAGE_SIZE
    recent_window: int | None = None

    def __post_init__(self) -> None:
        require_int("sink_tokens", self.sink_tokens)
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got sink_tokens={self.sink_tokens}.")
        if not is_int(self.page_size) or self.page_size < 1:
            raise ValueError(f"page_size must be a positive int, got page_size={self.page_size!r}.")
        if self.recent_window is not None and (not is_int(self.recent_window) or self.recent_window < 1):
            raise ValueError(f"recent_window must be a positive int or None, got recent_window={self.recent_window!r}.")

    def _recent(self, budget: int) -> int:
        return self.recent_window if self.recent_window is not None else budget // 4

    def _pages(self, budget: int) -> int:
        return (budget - self.sink_tokens - self._recent(budget)) // self.page_size

    def check(self, budget: int, gamma: int) -> None:
        check_sizes(budget, gamma)
        if self._pages(budget) < 1:
            raise ValueError(
                "dynamic needs room for at least one page: draft_budget >= sink_tokens + recent window + page_size, "
                f"got draft_budget={budget}, sink_tokens={self.sink_tokens}, recent window {self._recent(budget)}, "
                f"page_size={self.page_size}."
            )
        super().check(budget, gamma)

    def static_slots(self, budget: int, prompt_len: int) -> int:
        return self.sink_tokens + self._pages(budget) * self.page_size

    def window_slots(self, budget: int, gamma: int, prompt_len: int, max_new_tokens: int) -> int:
        return budget - self.static_slots(budget, prompt_len)

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        # The initial static part: earliest tokens first, so it starts with the sinks; the page
        # slots are refilled at every draft step (rows whose prompt fits keep everything anyway).
        batch, kv_heads, slots, _ = ctx.keys.shape
        order = -torch.arange(slots, device=ctx.keys.device, dtype=torch.float32)
        return order.expand(batch, kv_heads, slots)

    def prepare(self, cache: ViewCache, prompt_slots: int) -> "PageSelection | None":
        """Build the page summaries of every layer (once, after the views are built); None when
        every prompt fits the budget (nothing to select, ever)."""
        geometry = cache.geometry
        region = geometry.static_candidates  # candidates of the static part, as the cache laid them out
        selecting = region > geometry.static_slots
        if not bool(selecting.any()):
            return None
        sinks = min(self.sink_tokens, geometry.static_slots)
        span = torch.where(selecting, region - sinks, torch.zeros_like(region))
        first = cache.pad + sinks
        state = PageSelection(self, sinks, geometry.static_slots - sinks, selecting)
        for layer in cache.layers:
            kmin, kmax, state.page_start, state.page_tokens = page_summaries(layer.keys[:, :, :prompt_slots], first,
                                                                             span, self.page_size)
            state.kmin.append(kmin)
            state.kmax.append(kmax)
        return state


@dataclass
class PageSelection(RowState):
    """Per-row state of a :class:`DynamicPages` view in one cache: page summaries per layer and which
    rows select (the cache keeps it aligned with its rows and calls :meth:`on_draft_query`).

    Attributes
    ----------
    view : the view.
    sinks, page_slots : static slots kept as sinks, and filled with pages.
    selecting : ``[B]`` bool, the row's prompt exceeds the budget.
    kmin, kmax : per layer ``[B, Hkv, N, D]`` page summaries.
    page_start, page_tokens : ``[B, N]`` first slot and real tokens of each page.
    """

    view: DynamicPages
    sinks: int
    page_slots: int
    selecting: torch.Tensor
    kmin: list[torch.Tensor] = field(default_factory=list)
    kmax: list[torch.Tensor] = field(default_factory=list)
    page_start: torch.Tensor | None = None
    page_tokens: torch.Tensor | None = None

    def select_rows(self, rows: torch.Tensor) -> None:
        self.selecting = self.selecting.index_select(0, rows.to(self.selecting.device))
        self.page_start = self.page_start.index_select(0, rows.to(self.page_start.device))
        self.page_tokens = self.page_tokens.index_select(0, rows.to(self.page_tokens.device))
        self.kmin = [t.index_select(0, rows.to(t.device)) for t in self.kmin]
        self.kmax = [t.index_select(0, rows.to(t.device)) for t in self.kmax]

    def on_draft_query(self, cache: ViewCache, layer_idx: int, query: torch.Tensor,
                       scaling: float | None) -> None:
        """Rewrite the page slots of ``layer_idx``'s static part from this draft step's ``query``
        ``[B, H, 1, D]`` (rows whose prompt fits are left alone)."""
        keys = cache.layers[layer_idx].keys
        if keys.shape[2] == 0:
            return  # full cache released (a separate draft model): the view stays as built
        kmin = self.kmin[layer_idx]
        dev = kmin.device
        scores = page_scores(query, kmin, self.kmax[layer_idx])
        slot = select_page_slots(scores, self.page_start.to(dev), self.page_tokens.to(dev), self.page_slots,
                                 self.view.page_size)
        slot = slot.clamp(max=keys.shape[2] - 1)  # rows that do not select: any valid slot
        cache.replace_static(layer_idx, slot, self.selecting.to(dev)[:, None, None], start=self.sinks)

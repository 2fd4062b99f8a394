"""The verification-guided draft view: the draft's KV chosen by the verification pass's attention
(in the spirit of Vegas, arXiv 2602.07223, and SparseSpec's PillarAttn, arXiv 2512.01278)::

    [ sinks (sink_tokens) | pages chosen by the verifier (static part) | rolling recent window ]

After every ``every`` verifications, in every layer and per KV head, the pages of ``page_size``
committed tokens that received the most attention mass from the last verification's queries (all
γ + 1 of them, every query head of the KV head) become the static part, beside the first
``sink_tokens`` tokens and the rolling window of the most recent ones, from the first verification
on: while the window still holds every generated token a choice re-ranks the prompt's pages, and the
verifier's queries rank them better than SnapKV's prefill window (8 x 4K -> 128, budget 256, int8
draft weights, eight prompt batches: mean acceptance 0.836 against 0.799 waiting for the window to
roll over first and 0.787 for SnapKV; 7 % and 11 % fewer steps). The mass comes out of the verify
attention itself: the kernels emit it per page (``kernels.segment_attention(..., page_size=P)``,
Triton and twin), so choosing costs no second pass over the full cache, only gathering the chosen
pages' K and V into the view.

Before the first choice the static part is SnapKV's (the prompt scored by its last ``window``
queries, sinks kept). A row whose context still fits the view (static part + window) keeps every
token and is not re-chosen; once it outgrows it, its view is laid out at full size (the static part
``static_slots`` tokens, the window ``window_slots``) and chosen from then on. Plain steps (γ = 0, a
schedule waiting for the context to grow) emit no mass and choose nothing. Lossless as every view:
the target verifies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checks import is_int
from ..defaults import DEFAULT_PAGE_SIZE, DEFAULT_POOL_KERNEL, DEFAULT_SINK_TOKENS, DEFAULT_WINDOW
from .base import DraftView, RowState, ScoreContext, ViewCache, check_sizes, require_int
from .dynamic import select_page_slots
from .snapkv import snapkv_scores

__all__ = ["AttendedPages", "AttendedPageSelection"]


@dataclass(frozen=True)
class AttendedPages(DraftView):
    """Sinks + the pages the verifier attended to most + a rolling window.

    Re-chooses its static part itself (``reselects``): not with ``refresh_every`` /
    ``refresh_below``.

    Budget split: ``recent = recent_window`` (default ``draft_budget // 4``), static part
    ``draft_budget - recent`` (sinks first, then pages), rolling window ``recent``.

    Parameters
    ----------
    sink_tokens : int
        The first tokens of every row that always stay in the view (>= 0).
    page_size : int
        Committed tokens per page: the granularity of the choice (a power of two >= 16 is what
        the Triton kernel emits mass for; other sizes use the PyTorch twin's).
    recent_window : int or None
        Size of the rolling window of recent tokens. Default None: ``draft_budget // 4``.
    every : int
        Verifications between two choices; only the last one's attention emits mass (the most
        recent queries predict the next drafts best: summing the mass of the last 4 accepted
        0.764, the last one's alone 0.792, at 8 x 1K prompts, int8 draft weights, budget 128,
        γ = 3). Default 2: on 2 CPU cores every choice costs ~11-23 ms and its mass emission
        then cost ~0.3-0.6 ms per layer (8 rows, 1K-4K context; ~0.1 ms at 4K since the twin's
        mass path got cheaper), and choosing every second verification decoded 7 % faster at
        8 x 1K and 8 % at 8 x 4K for 0.02 less acceptance (4 % slower on a long generation).
    window, pool_kernel : int
        SnapKV's observation window and pooling, for the static part before the first choice.
    """

    name = "attended"
    reselects = True

    sink_tokens: int = DEFAULT_SINK_TOKENS
    page_size: int = DEFAULT_PAGE_SIZE
    recent_window: int | None = None
    every: int = 2
    window: int = DEFAULT_WINDOW
    pool_kernel: int = DEFAULT_POOL_KERNEL

    def __post_init__(self) -> None:
        for name in ("sink_tokens", "page_size", "every", "window", "pool_kernel"):
            require_int(name, getattr(self, name))
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got sink_tokens={self.sink_tokens}.")
        for name in ("page_size", "every", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {name}={getattr(self, name)}.")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel must be a positive odd int, got pool_kernel={self.pool_kernel}.")
        if self.recent_window is not None and (not is_int(self.recent_window) or self.recent_window < 1):
            raise ValueError(f"recent_window must be a positive int or None, got recent_window={self.recent_window!r}.")

    def _recent(self, budget: int) -> int:
        return self.recent_window if self.recent_window is not None else budget // 4

    def check(self, budget: int, gamma: int) -> None:
        check_sizes(budget, gamma)
        if budget - self._recent(budget) < self.sink_tokens + self.page_size:
            raise ValueError(
                "attended needs room for the sinks and one page: draft_budget - recent window >= sink_tokens + "
                f"page_size, got draft_budget={budget}, recent window {self._recent(budget)}, "
                f"sink_tokens={self.sink_tokens}, page_size={self.page_size}."
            )
        super().check(budget, gamma)

    def static_slots(self, budget: int, prompt_len: int) -> int:
        return budget - self._recent(budget)

    def window_slots(self, budget: int, gamma: int, prompt_len: int, max_new_tokens: int) -> int:
        return self._recent(budget)

    def observation_window(self) -> int:
        return self.window

    def score(self, ctx: ScoreContext) -> torch.Tensor:
        """SnapKV's scores of the prompt, with the first ``sink_tokens`` real tokens first."""
        keys = ctx.keys
        if ctx.queries is not None:
            window = min(ctx.queries.shape[2], keys.shape[2])
            scores = snapkv_scores(ctx.queries[:, :, -window:], keys, ctx.valid, ctx.scaling, self.pool_kernel)
        else:  # no observation queries (a timing cache): earliest first
            scores = -torch.arange(keys.shape[2], device=keys.device, dtype=torch.float32).expand(*keys.shape[:3])
        rank = ctx.valid.long().cumsum(dim=1)  # [B, S]: 1 for a row's first real token
        sink = ctx.valid & (rank <= self.sink_tokens)
        return scores.masked_fill(sink[:, None, :], float("inf")).nan_to_num(posinf=1e30)

    def prepare(self, cache: ViewCache, prompt_slots: int) -> "AttendedPageSelection":
        geometry = cache.geometry
        # One host read per generation: whether some row's prompt fitted the view (it will need
        # the full layout once it outgrows it); long prompts never do, and skip that work.
        short = bool((geometry.static_count < geometry.static_slots).any())
        return AttendedPageSelection(self, geometry.static_slots, geometry.window_slots, needs_layout=short)


@dataclass
class AttendedPageSelection(RowState):
    """Per-row state of a :class:`AttendedPages` view in one cache: the verify attention's mass per page
    of the verification the next choice follows, per layer (the cache keeps it aligned with its rows, asks it which
    page size verify forwards emit mass for, hands it that mass, and calls :meth:`on_commit`).

    Attributes
    ----------
    view : the view; static, window : its static part and window, slots.
    mass : per layer ``[B, Hkv, pages]`` fp32, of the verification the next choice follows.
    verifications : since the last choice.
    verifying : tokens of the verify forward under way (set when it asks for pages; 0 after commit).
    rounds : choice rounds run (each rewrites the static part of the rows that have outgrown their view).
    needs_layout : whether some row may still need the full layout (its prompt fitted the view).
    commits : steps committed since the view was built (each adds a token to every live row).
    """

    view: AttendedPages
    static: int
    window: int
    mass: dict[int, torch.Tensor] = field(default_factory=dict)
    verifications: int = 0
    rounds: int = 0
    needs_layout: bool = True
    commits: int = 0
    verifying: int = 0
    _memo: dict = field(default_factory=dict, repr=False)  # per-row constants of the choice (_constants)

    def verify_page_size(self, num_tokens: int) -> int:
        """Pages the verify forward of ``num_tokens`` tokens emits mass for: only the verification
        the next choice is made after (0 for the others, and for plain steps, which verify one)."""
        self.verifying = num_tokens
        due = self.verifications + 1 >= self.view.every
        return self.view.page_size if num_tokens > 1 and due else 0

    def on_verify_mass(self, cache: ViewCache, layer_idx: int, mass: torch.Tensor) -> None:
        heads = cache.layers[layer_idx].keys.shape[1]
        if mass.shape[1] != heads:
            # The attention saw more key heads than the cache stores (keys shared by several heads
            # after the cache, e.g. MLA and JetMoE layers): a stored head's mass is its heads' sum.
            if mass.shape[1] % heads:
                return  # no mapping onto the stored heads: keep the view as it is (still lossless)
            mass = mass.reshape(mass.shape[0], heads, -1, mass.shape[-1]).sum(2)
        self.mass[layer_idx] = mass

    def select_rows(self, rows: torch.Tensor) -> None:
        self.mass = {i: t.index_select(0, rows.to(t.device)) for i, t in self.mass.items()}
        self._memo = {}

    def on_commit(self, cache: ViewCache) -> None:
        """Count a verification; every ``every`` of them, choose the static part of every row that
        has outgrown its view, from the mass the last one emitted."""
        self.commits += 1
        speculated, self.verifying = self.verifying > 1, 0
        if not speculated:
            return  # a plain step
        self.verifications += 1
        if self.verifications < self.view.every:
            return  # not due (no mass was emitted)
        # Masked, not branched on: no host read. A row is chosen for once its context outgrows the
        # view; one whose prompt fitted it gets the full layout first.
        ready = (cache.lengths - cache.pad) >= self.static + self.window  # [B]
        if self.needs_layout:
            cache.full_layout(ready)
            # Every commit adds at least one token to every live row: after this many, every row
            # is ready, so this call laid out the last of them (known on the host, no read).
            self.needs_layout = self.commits < self.static + self.window
        self._choose(cache, ready)
        self.rounds += 1
        self.mass, self.verifications = {}, 0

    def _choose(self, cache: ViewCache, ready: torch.Tensor) -> None:
        """Every layer's static part from its mass: the layers whose buffers are stacked together
        (``cache.layer_groups``) are chosen together, one top-k over all their heads and one copy
        into all their views, so the choice costs the same at any depth."""
        page, sinks = self.view.page_size, min(self.view.sink_tokens, self.static)
        hi = (cache.lengths - cache.geometry.window_filled())[:, None]  # [B, 1] candidates end before the window
        for group, members in enumerate(cache.layer_groups):
            layers = [i for i in members if i in self.mass]
            if not layers:
                continue
            mass = torch.cat([self.mass[i] for i in layers], dim=1)  # [B, layers * Hkv, N]
            heads, n_pages = self.mass[layers[0]].shape[1], mass.shape[-1]
            lower, upper, lo, first = self._constants(cache, n_pages, page, sinks, mass.device)
            start = torch.maximum(lower, lo)  # [B, N] candidates: after the sinks, before the window
            tokens = (torch.minimum(upper, hi.to(mass.device)) - start).clamp_(min=0)
            chosen = select_page_slots(mass, start, tokens, self.static - sinks, page)
            slots = torch.cat([first.expand(-1, chosen.shape[1], -1), chosen], dim=-1) if sinks else chosen
            slots = slots.clamp_(max=cache.layers[layers[0]].keys.shape[2] - 1)
            where = ready.to(mass.device)[:, None, None]
            if len(layers) == len(members):  # the whole group: one copy
                slots = slots.view(slots.shape[0], len(layers), heads, -1).transpose(0, 1)  # [L, B, Hkv, n]
                cache.replace_static_group(group, slots, where)
                continue
            for i, layer_idx in enumerate(layers):  # some layers emitted no usable mass
                cache.replace_static(layer_idx, slots[:, i * heads:(i + 1) * heads], where)

    def _constants(self, cache: ViewCache, n_pages: int, page: int, sinks: int, device):
        """Tensors that change only with the rows or the page count, made once: each page's first
        and past-the-end slot ``[1, N]``, each row's first candidate slot ``[B, 1]`` and its sink
        slots ``[B, 1, sinks]``."""
        key = (n_pages, device)
        hit = self._memo.get(key)
        if hit is None:
            pages = torch.arange(n_pages, device=device)[None, :]
            pad = cache.pad.to(device)[:, None]
            first = (pad + torch.arange(sinks, device=device)[None, :])[:, None, :]
            hit = self._memo[key] = (pages * page, (pages + 1) * page, pad + sinks, first)
        return hit

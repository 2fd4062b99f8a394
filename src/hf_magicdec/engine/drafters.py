"""Who drafts: the model itself on its draft views, or a separate small draft model. One interface.

The loop (:mod:`hf_magicdec.engine.loop`) only ever talks to a :class:`Drafter`:

* :meth:`~Drafter.prepare` after the target's prefill (build the draft views);
* :meth:`~Drafter.round` at the start of each speculation step: a function ``step(i, tok [b, 1])
  -> logits [b, V]`` for draft steps ``i = 0 … γ-1``;
* :meth:`~Drafter.commit` after verification, with the tokens each row kept;
* :meth:`~Drafter.drop_rows` when finished rows leave the working batch.

**Self-drafting** (:class:`SelfDrafter`) runs the target on the draft views that live inside the
target's own cache, so committing and compacting are the cache's business; its one extra duty is
refreshing a static view (:mod:`hf_magicdec.engine.refresh`), whose per-row state it attaches to the cache.

**A separate draft model** (:class:`ModelDrafter`, ``draft_model=`` in ``generate``) keeps its own
cache, compressed with any draft view (``"full"`` keeps all of it: the paper's small-draft
baseline). Bookkeeping per row, with ``C`` the target's committed length (the pending token sits
at slot ``C``): the first draft step of every round feeds *two* tokens, the one at ``C - 1`` and
the pending one. When the previous round accepted all γ drafts, the last draft token was never fed
to the draft model, so its KV is missing: it is the token at ``C - 1`` and gets computed now
(``refeed``). Otherwise that token's KV is already in the view, and the pending token's query skips
the re-fed copy. After verification, the draft model's own KV of the committed tokens moves from
the draft scratch into its rolling window; its full cache is freed after prefill, except for a
query-aware view (``dynamic``), which re-selects prompt pages from it at every draft step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, Protocol

import torch

from .cache import CacheOptions, MagicDecCache
from .refresh import Refresher
from .steps import ModelCall, draft_step, num_layers, prefill
from .validation import check_model

__all__ = ["Drafter", "ModelDrafter", "SelfDrafter", "check_draft_model", "new_cache", "quantized_draft_call"]

#: ``step(i, tok [b, 1]) -> float logits [b, 1, V]`` of draft step ``i``.
DraftStep = Callable[[int, torch.Tensor], torch.Tensor]


class Drafter(Protocol):
    """What the loop needs from whoever drafts."""

    #: Name reported in the statistics (the draft model's), None for self-drafting.
    name: str | None
    #: Whether draft forwards run the (possibly sharded) target: ranks in lockstep mirror them.
    on_target: bool
    #: Times the draft view was re-selected during the generation (hf_magicdec.engine.refresh).
    refreshes: int

    def observation_window(self) -> int:
        """Trailing prompt queries the *target's* prefill must record for this drafter."""

    def prepare(self, target: MagicDecCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
                max_new_tokens: int, scratch: int) -> None:
        """After the target's prefill: build the draft views (``scratch``: draft slots per round)."""

    def round(self, target: MagicDecCache, tokens: torch.Tensor, rows: torch.Tensor, seq_len: torch.Tensor,
              gamma: int, positions: torch.Tensor) -> DraftStep:
        """The draft step function of one round (``tokens``: the ``[B, capacity]`` token history,
        ``rows [b]`` the working rows, ``seq_len [b]`` their lengths including the pending token,
        ``positions [b, γ + 1]`` the positions of the pending token and the drafts)."""

    def feeds_views(self, gamma: int) -> bool:
        """Whether the target's commit after a step of ``gamma`` drafts updates the draft views."""

    def commit(self, emitted: torch.Tensor, accepted: torch.Tensor, gamma: int) -> None:
        """After the target committed ``emitted [b]`` tokens per row (``accepted [b]`` of ``gamma`` drafts)."""

    def drop_rows(self, finished: Sequence[bool], rows: torch.Tensor) -> None:
        """The finished working rows leave: ``finished [n]`` on the host, ``rows [b']`` the kept
        ones in their new order (as :meth:`~hf_magicdec.engine.cache.MagicDecCache.drop_rows`
        moves a cache's rows for the same ``finished``)."""


def quantized_draft_call(draft, compile_config) -> ModelCall | None:
    """How the engine calls a quantized draft (:func:`hf_magicdec.engine.draft_weights.quantized_draft`),
    or None without one. PyTorch's CPU int8 kernels are not traceable: a CPU quantized draft stays eager."""
    if draft is None:
        return None
    on_cpu = next(draft.module.parameters()).device.type == "cpu"
    return ModelCall.of(draft.module, None if on_cpu else compile_config)


def new_cache(model, pad: torch.Tensor, capacity: int, options: CacheOptions) -> MagicDecCache:
    """An empty :class:`MagicDecCache` for ``model`` and prompts left-padded by ``pad [B]``."""
    return MagicDecCache(num_layers(model), pad.shape[0], capacity, pad, options)


class SelfDrafter:
    """The target drafts for itself on the draft views inside its own cache."""

    name = None
    on_target = True

    def __init__(self, call: ModelCall, view, config, draft_call: ModelCall | None = None):
        # draft_call: the forwards of the draft steps (a quantized copy of the model,
        # hf_magicdec.engine.draft_weights), or the target's own call.
        self.call, self.view, self.config = call, view, config
        self.draft_call = draft_call if draft_call is not None else call
        self.cache: MagicDecCache | None = None
        self.refresher: Refresher | None = None
        self.refreshes = 0
        self.stale = False  # plain-decoding steps left the views' windows behind

    def observation_window(self) -> int:
        return self.view.observation_window() if self.config.gamma != 0 else 0

    def feeds_views(self, gamma: int) -> bool:
        # A schedule's plain steps (γ = 0) leave the windows alone: syncing them once, before the
        # next draft, costs one gather of the window instead of a copy at every plain step.
        if gamma == 0 and self.cache is not None and self.cache.geometry is not None:
            self.stale = True
            return False
        return True

    def prepare(self, target, input_ids, position_ids, max_new_tokens, scratch) -> None:
        self.cache = target
        if self.config.gamma == 0:  # plain decoding, no view
            return
        target.build_draft_views(self.view, self.config.draft_budget, self.config.gamma, input_ids.shape[1],
                                 max_new_tokens, scratch=scratch)
        self.refresher = Refresher.create(self.view, self.config, target)
        if self.refresher is not None:
            target.attach(self.refresher)

    def round(self, target, tokens, rows, seq_len, gamma, positions) -> DraftStep:
        if self.stale:
            target.sync_windows()
            self.stale = False
        call = self.draft_call
        return lambda i, tok: draft_step(call, target, tok, i, positions[:, i:i + 1])

    def commit(self, emitted, accepted, gamma) -> None:
        if self.refresher is not None and not self.stale:  # re-select a static view (engine/refresh.py)
            self.refreshes += self.refresher.after_commit(self.cache, emitted, accepted, gamma)

    def drop_rows(self, finished, rows) -> None:
        pass  # the views live in the target cache, which the loop compacts (the refresher with it)


def check_draft_model(model, draft_model, config=None) -> None:
    """Refuse a draft model that cannot draft for ``model`` (or a ``config`` it cannot honour),
    before any forward."""
    if config is not None and (config.refresh_every is not None or config.refresh_below is not None):
        raise ValueError(
            "refresh_every / refresh_below re-select the target's own draft view; with draft_model= the target has "
            f"none (got {config.refresh_every=}, {config.refresh_below=}). Drop them or drop draft_model."
        )
    if draft_model is model:
        raise ValueError("draft_model is the target model itself; for self-speculation omit draft_model.")
    check_model(draft_model)
    target_vocab = model.get_output_embeddings().weight.shape[0]
    draft_vocab = draft_model.get_output_embeddings().weight.shape[0]
    if target_vocab != draft_vocab:
        raise ValueError(
            f"draft_model must share the target's vocabulary: its LM head has {draft_vocab} rows, the target's "
            f"{target_vocab}. Use a draft model from the same family (same tokenizer)."
        )


class ModelDrafter:
    """Drafts γ tokens per round with a separate model on its own compressed cache.

    Parameters
    ----------
    model : the draft model.
    view : the draft view compressing the draft model's cache.
    config : the resolved :class:`~hf_magicdec.MagicDecConfig`.
    chunk : prompt tokens per prefill forward.
    position_limit : largest position the generation reaches.
    compile_config : compile its draft forwards (``transformers.CompileConfig``), or None.
    """

    on_target = False
    refreshes = 0  # its views are never re-selected

    def __init__(self, model, view, config, chunk: int, position_limit: int | None, compile_config=None):
        self.model, self.view, self.config = model, view, config
        self.call = ModelCall.of(model, compile_config)
        self.chunk, self.position_limit = chunk, position_limit
        self.cache: MagicDecCache | None = None
        self.refeed: torch.Tensor | None = None  # [b] bool: the token at C - 1 is not in the view yet
        self.round_gamma = 0
        self.name = getattr(model.config, "_name_or_path", "") or type(model).__name__

    def observation_window(self) -> int:
        return 0  # the target keeps no view of its own

    def feeds_views(self, gamma: int) -> bool:
        return True  # the target has no views; this drafter feeds its own from its scratch

    def prepare(self, target, input_ids, position_ids, max_new_tokens, scratch) -> None:
        """Prefill the draft model on the prompts, build its views, free its full cache."""
        prompt = input_ids.shape[1]
        compiled = self.call.compiled is not None
        options = CacheOptions(observation_window=self.view.observation_window(), position_limit=self.position_limit,
                               fixed_shapes=compiled, static_addresses=compiled and input_ids.device.type == "cuda")
        self.cache = new_cache(self.model, target.pad.clone(), prompt, options)
        prefill(self.call, self.cache, input_ids, position_ids, self.chunk)
        # One scratch slot more than γ: the first step of a round re-feeds the token at C - 1.
        self.cache.build_draft_views(self.view, self.config.draft_budget, self.config.gamma, prompt, max_new_tokens,
                                     scratch=scratch + 1)
        if not self.view.query_aware:  # a query-aware view (dynamic) refills from the full cache
            self.cache.release_full_kv()
        self.refeed = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def round(self, target, tokens, rows, seq_len, gamma, positions) -> DraftStep:
        cache, call = self.cache, self.call
        self.round_gamma = gamma
        previous = tokens[rows, seq_len - 2]  # the token at slot C - 1
        base, draft_positions = positions[:, 0], positions  # the pending token's, then the drafts'
        skip = (~self.refeed).long()

        def step(i: int, tok: torch.Tensor) -> torch.Tensor:
            if i == 0:
                tok = torch.cat([previous[:, None], tok], dim=1)
                positions = torch.stack([(base - 1).clamp(min=0), base], dim=1)
                forward = cache.begin_draft(0, 2, skip)
            else:
                positions = draft_positions[:, i:i + 1]
                forward = cache.begin_draft(i + 1, 1, skip)
            return call(cache, tok, positions, forward.model_mask(), logits_to_keep=1)[:, -1:].float()

        return step

    def commit(self, emitted, accepted, gamma) -> None:
        """Move the draft model's KV of this round's committed tokens into its views."""
        gamma, refeed = self.round_gamma, self.refeed.long()
        # Scratch slot 0 holds the token at C - 1 (committed now if it was missing), slot j >= 1
        # the j-th committed token of this round; the last of γ+1 emitted tokens was never fed.
        count = torch.clamp(emitted, max=gamma) + refeed
        src = (torch.arange(gamma + 1, device=emitted.device)[None, :] + 1 - refeed[:, None]).clamp(max=gamma)
        self.cache.commit_scratch(src, count)
        self.refeed = emitted > gamma

    def drop_rows(self, finished, rows) -> None:
        self.cache.drop_rows(finished)
        self.refeed = self.refeed.index_select(0, rows.to(self.refeed.device))

"""A separate small draft model, batched and ragged.

``model.generate(..., speculative="magicdec", draft_model=small)`` drafts with ``small`` (same
tokenizer) instead of the target itself; the target verifies exactly as in self-speculation, so
the output is the target's. The draft model keeps its own cache, compressed with any draft view
(``draft="full"`` keeps all of it: the paper's small-draft baseline; ``"streamingllm"`` /
``"snapkv"`` give its "small model + compressed KV" ablation).

Bookkeeping per row, with ``C`` the target's committed length (the pending token sits at slot
``C``): the draft model only ever attends to its draft views, and the first draft step of every
round feeds *two* tokens, the one at ``C - 1`` and the pending one. When the previous round
accepted all γ drafts, the last draft token ``d_γ`` was never fed to the draft model, so its KV is
missing: it is the token at ``C - 1`` and gets computed now (``refeed``). Otherwise that token's
KV is already in the view, and the pending token's query skips the re-fed copy. After
verification, the draft model's own KV of the committed tokens moves from the draft scratch into
its rolling window (:meth:`~hf_magicdec.cache.MagicDecCache.commit_scratch`); the full draft
cache is freed after prefill, except for a query-aware view (``dynamic``), which re-selects
prompt pages from it at every draft step.
"""

from __future__ import annotations

from typing import Callable

import torch

from .cache import MagicDecCache
from .validation import check_model


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


class DraftModelDrafter:
    """Drafts γ tokens per round with a separate model on its own compressed cache.

    Parameters
    ----------
    engine : the generation's ``_Engine`` (its forward helpers and the target cache).
    model : the draft model.
    view : the draft view compressing the draft model's cache.
    config : the resolved :class:`~hf_magicdec.MagicDecConfig`.
    """

    def __init__(self, engine, model, view, config):
        self.engine, self.model, self.view, self.config = engine, model, view, config
        self.cache: MagicDecCache | None = None
        self.refeed: torch.Tensor | None = None  # [b] bool: the token at C - 1 is not in the view yet
        self.round_gamma = 0
        self.name = getattr(model.config, "_name_or_path", "") or type(model).__name__

    def prefill(self, input_ids, position_ids, pad, max_new_tokens: int, scratch: int) -> None:
        """Prefill the draft model on the prompts, build its views, free its full cache."""
        batch, prompt = input_ids.shape
        observe = self.view.observation_window()
        self.cache, _ = self.engine.prefill_model(self.model, input_ids, position_ids, pad, prompt, observe)
        # One scratch slot more than γ: the first step of a round re-feeds the token at C - 1.
        self.cache.build_draft_views(self.view, self.config, prompt, max_new_tokens, scratch=scratch + 1)
        if not self.view.query_aware:  # a query-aware view (dynamic) refills from the full cache
            self.cache.release_full_kv()
        self.refeed = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)

    def start_round(self, rb, rows, seq_len_rows, gamma: int) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """Return ``step(i, tok [b, 1]) -> logits [b, V]`` for draft steps ``i = 0 … γ-1``."""
        cache, target = self.cache, self.engine.cache
        self.round_gamma = gamma
        previous = rb.tokens[rows, seq_len_rows - 2]  # the token at slot C - 1
        base = target.lengths - target.pad  # position of the pending token
        skip = (~self.refeed).long()
        view_end = cache.static_slots + cache.window_slots

        def step(i: int, tok: torch.Tensor) -> torch.Tensor:
            if i == 0:
                tok = torch.cat([previous[:, None], tok], dim=1)
                positions = torch.stack([(base - 1).clamp(min=0), base], dim=1)
                cache.begin_draft(0, 2, skip)
                kv_len = view_end + 2
            else:
                positions = (base + i)[:, None]
                cache.begin_draft(i + 1, 1, skip)
                kv_len = view_end + i + 2
            mask = cache.forward_mask(tok.shape[1], kv_len)
            return self.engine._forward(tok, positions, mask, 1, model=self.model, cache=cache)[:, -1].float()

        return step

    def commit(self, keep: torch.Tensor) -> None:
        """Move the draft model's KV of this round's ``keep [b]`` committed tokens into its views."""
        gamma, refeed = self.round_gamma, self.refeed.long()
        # Scratch slot 0 holds the token at C - 1 (committed now if it was missing), slot j >= 1
        # the j-th committed token of this round; the last of γ+1 kept tokens was never fed.
        count = torch.clamp(keep, max=gamma) + refeed
        src = (torch.arange(gamma + 1, device=keep.device)[None, :] + 1 - refeed[:, None]).clamp(max=gamma)
        self.cache.commit_scratch(src, count)
        self.refeed = keep > gamma

    def select_rows(self, rows: torch.Tensor) -> None:
        self.cache.select_rows(rows)
        self.refeed = self.refeed.index_select(0, rows.to(self.refeed.device))

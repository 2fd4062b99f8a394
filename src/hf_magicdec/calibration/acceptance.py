"""Measure the acceptance rate α of one candidate with one short speculative generation."""

from __future__ import annotations

from typing import Any

import torch

from ..config import MagicDecConfig
from ..views import DraftView

__all__ = ["probe_acceptance"]


def probe_acceptance(model: Any, *, draft: str | DraftView = "streamingllm", budget: int = 256, gamma: int = 4,
                     batch: int = 1, context: int = 1024, new_tokens: int = 64, input_ids: Any = None) -> float:
    """``acceptance_rate`` of one greedy generation of ``new_tokens`` per row with view ``draft`` (a name
    or instance), ``budget`` < ``context`` and ``gamma``, on ``input_ids`` ``[batch, context]`` (default:
    random token ids, whose α says little about text)."""
    if budget >= context:
        raise ValueError(f"budget must be < context to probe a compressed view, got {budget=} and {context=}.")
    device = next(model.parameters()).device
    if input_ids is None:
        g = torch.Generator().manual_seed(0)
        input_ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g)
    input_ids = input_ids.to(device)
    config = MagicDecConfig.from_any(draft=draft, draft_budget=budget, gamma=gamma)
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, speculative=config, return_dict_in_generate=True)
    return float(out.speculation.acceptance_rate)

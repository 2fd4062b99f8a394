"""Measure the acceptance rate α of one candidate with one short speculative generation."""

from __future__ import annotations

from typing import Any

import torch

from ..config import MagicDecConfig
from ..views import DraftView

__all__ = ["probe_acceptance"]


def probe_acceptance(
    model: Any,
    *,
    draft: str | DraftView = "streamingllm",
    budget: int = 256,
    gamma: int = 4,
    batch: int = 1,
    context: int = 1024,
    new_tokens: int = 64,
    input_ids: Any = None,
) -> float:
    """Measure α with one short speculative generation.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    draft, budget, gamma :
        The candidate to probe (``budget < context``); ``draft`` a view name or instance.
    batch, context, new_tokens :
        Prompt batch and length, tokens generated per row.
    input_ids : torch.LongTensor, optional
        ``[batch, context]`` prompts, e.g. real long text (``hf_magicdec_bench.data.prompt_batch``);
        by default random token ids, whose α says little about text.

    Returns
    -------
    float
        ``output.speculation.acceptance_rate``.

    Raises
    ------
    ValueError
        If ``budget >= context`` (the view would hold the whole prompt).
    """
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

"""``hf_magicdec.plan``: the planner's choice for a workload, before generating."""

from __future__ import annotations

from .config import MagicDecConfig
from .parallel.lockstep import with_tp_degree
from .planner import search_plan
from .planner.search import DEFAULT_DRAFT_MODEL_DRAFTS, DEFAULT_DRAFTS
from .resolve import hardware_for
from .views import get_view

__all__ = ["plan"]


def plan(model_or_config, *, batch_size: int, prompt_len: int, new_tokens: int, hardware=None, drafts=None,
         draft_model_drafts=None, **kwargs):
    """The planner's choice for a workload: :func:`hf_magicdec.planner.search_plan` with the device model
    ``generate`` would use, and draft views given by name or as instances.

    Parameters
    ----------
    model_or_config : PreTrainedModel, PretrainedConfig, dict or ModelSpec
        Only shapes and dtype are read.
    batch_size, prompt_len, new_tokens : int
        The workload.
    hardware : str, HardwareSpec or None
        None: for a model, its cached calibration on its device, else the preset matching its
        device (as ``generate`` does); for a config, the ``h100`` preset.
    drafts, draft_model_drafts : iterable of str or DraftView, optional
        Views to consider: names (default options) or instances (``SnapKV(window=16)``). Default:
        ``streamingllm`` and ``snapkv``; for a ``draft_model``, also ``full``.
    **kwargs
        Passed to :func:`hf_magicdec.planner.search_plan` (``acceptance``, ``budgets``, ``gammas``,
        ``tp``, ``dtype``, ``min_speedup``, ``draft_model`` …).

    Returns
    -------
    hf_magicdec.planner.Plan
        ``plan.speculate``, ``MagicDecConfig.from_any(plan)``, ``plan.summary()``, runner-ups.

    Examples
    --------
    >>> p = hf_magicdec.plan(model, batch_size=8, prompt_len=4096, new_tokens=128)
    >>> out = model.generate(**inputs, speculative=p) if p.speculate else model.generate(**inputs)
    """

    def views(items):
        return tuple(get_view(v) if isinstance(v, str) else v for v in items)

    if hardware is None:
        if hasattr(model_or_config, "parameters") and hasattr(model_or_config, "config"):
            hardware, _ = hardware_for(model_or_config, MagicDecConfig())
            hardware = with_tp_degree(hardware, model_or_config)
        else:
            hardware = "h100"
    return search_plan(model_or_config, batch_size=batch_size, prompt_len=prompt_len, new_tokens=new_tokens,
                       hardware=hardware, drafts=views(DEFAULT_DRAFTS if drafts is None else drafts),
                       draft_model_drafts=views(DEFAULT_DRAFT_MODEL_DRAFTS if draft_model_drafts is None
                                                else draft_model_drafts), **kwargs)

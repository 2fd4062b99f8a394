"""Prefill, the draft step and the verify step: functions of tensors and the cache.

Each step is one model forward whose inputs are tensors (token ids, positions, a mask) and the
:class:`~hf_magicdec.engine.cache.MagicDecCache`, whose per-row lengths, offsets and segments say
which keys each query may read. No Python state is read or written here, so a step can be
compiled as it is. The token choice that follows (processors, sampling, acceptance) lives in
:mod:`hf_magicdec.engine.sampling`; the loop that strings the steps together in
:mod:`hf_magicdec.engine.loop`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers import CompileConfig

from ..defaults import AUTO
from . import attention
from .cache import MagicDecCache

__all__ = ["ModelCall", "compile_config_for", "draft_step", "num_layers", "prefill", "verify_step"]


def num_layers(model) -> int:
    """Decoder layers of ``model`` (composite models keep them in their text config)."""
    return model.config.get_text_config(decoder=True).num_hidden_layers


def compile_config_for(setting: Any, generation_config, device: torch.device) -> CompileConfig | None:
    """The ``CompileConfig`` the draft and verify forwards run under, or None (eager).

    ``setting`` is ``MagicDecConfig.compile``: ``"auto"`` compiles on CUDA only and yields to
    ``generation_config.disable_compile`` as stock ``generate`` does; ``True`` always compiles;
    both use ``generation_config.compile_config`` when set. A ``CompileConfig`` is used as given.
    """
    if setting is False or (setting == AUTO and (device.type != "cuda" or generation_config.disable_compile)):
        return None
    if isinstance(setting, CompileConfig):
        return setting
    return getattr(generation_config, "compile_config", None) or CompileConfig()


def forward_cache_kwarg(model) -> str:
    """The keyword ``model.forward`` takes its cache under: ``"cache"`` where its signature names it
    (transformers >= 5.24 models, where ``past_key_values`` is a deprecated alias that warns), else
    ``"past_key_values"`` (5.23, and remote-code models written for it)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"


@dataclass(frozen=True)
class ModelCall:
    """How the engine calls one model on a :class:`MagicDecCache` (fixed per model and generation).

    Attributes
    ----------
    model : the ``PreTrainedModel``.
    keep_logits : whether its forward takes ``logits_to_keep``.
    mask_per_layer_type : hybrid models (sliding + full layers) index their mask by layer type.
    compiled : the model's ``torch.compile``'d call (``model.get_compiled_call``, cached on the
        model by transformers) for draft and verify forwards, or None (eager).
    cache_kwarg : the keyword its forward takes the cache under (``cache`` from transformers 5.24).
    """

    model: Any
    keep_logits: bool
    mask_per_layer_type: bool
    compiled: Callable | None = None
    cache_kwarg: str = "past_key_values"

    @classmethod
    def of(cls, model, compile_config: CompileConfig | None = None) -> "ModelCall":
        layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or []
        compiled = model.get_compiled_call(compile_config) if compile_config is not None else None
        return cls(model, bool(model._supports_logits_to_keep()), "sliding_attention" in layer_types, compiled,
                   forward_cache_kwarg(model))

    def __call__(self, cache: MagicDecCache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                 logits_to_keep: int | None, eager: bool = False) -> torch.Tensor:
        """One forward of ``ids [b, q]`` at ``positions [b, q]``; logits ``[b, q or 1, V]``.

        The ``magicdec`` attention reads the open forward's per-row key ranges (draft / verify) or
        records SnapKV's observation queries (prefill); ``mask [b, 1, q, kv]`` serves any layer
        that does not use them. ``eager``: never the compiled call (prefill, whose shapes change
        with every chunk).
        """
        # The context variable is set outside the compiled region (dynamo does not trace it).
        with attention.engine_forward(cache):
            return self.forward(cache, ids, positions, mask, logits_to_keep,
                                self.model if eager or self.compiled is None else self.compiled)

    def forward(self, cache: MagicDecCache, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                logits_to_keep: int | None, forward: Callable | None = None) -> torch.Tensor:
        """:meth:`__call__` inside :func:`~hf_magicdec.engine.attention.engine_forward` (which a
        compiled step sets around its graph), with ``forward`` (default: the eager model)."""
        kwargs: dict[str, Any] = {"magicdec_cache": cache, self.cache_kwarg: cache}
        if self.keep_logits and logits_to_keep is not None:
            kwargs["logits_to_keep"] = logits_to_keep
        model_mask = {"full_attention": mask, "sliding_attention": mask} if self.mask_per_layer_type else mask
        if cache.forward is not None:
            cache.forward.record_mask(mask)
        out = (forward or self.model)(input_ids=ids, position_ids=positions, attention_mask=model_mask,
                                      use_cache=True, return_dict=True, **kwargs)
        logits = out.logits
        return logits[:, -1:] if logits_to_keep == 1 and logits.shape[1] != 1 else logits


def prefill(call: ModelCall, cache: MagicDecCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
            chunk: int, first: int = 0) -> torch.Tensor:
    """Fill the ``cache`` with the left-padded prompts ``input_ids [B, P]`` from slot ``first`` on
    (slots before it already hold the prompt's KV: a continued cache) in chunks of ``chunk``
    tokens; returns the last logits ``[B, 1, V]``."""
    prompt = input_ids.shape[1]
    pad = cache.pad
    slot = torch.arange(prompt, device=input_ids.device)
    logits = None
    for start in range(first, prompt, chunk):
        end = min(prompt, start + chunk)
        cache.begin_prefill(start, end - start)
        q_slot = slot[start:end]
        mask = (slot[None, None, :end] >= pad[:, None, None]) & (slot[None, None, :end] <= q_slot[None, :, None])
        mask |= slot[None, None, :end] == q_slot[None, :, None]  # padding queries see themselves: no NaN
        logits = call(cache, input_ids[:, start:end], position_ids[:, start:end], mask[:, None], logits_to_keep=1,
                      eager=True)
    cache.end_prefill(prompt)
    return logits


def draft_step(call: ModelCall, cache: MagicDecCache, tok: torch.Tensor, step: int,
               positions: torch.Tensor | None = None) -> torch.Tensor:
    """Draft step ``step`` of the model on its own draft views: ``tok [b, 1]`` (the pending token
    or the previous draft) at each row's next position (``positions [b, 1]`` when the caller has
    them); float logits ``[b, 1, V]``."""
    forward = cache.begin_draft(step)
    if positions is None:
        positions = (cache.lengths - cache.pad + step)[:, None]
    return _float(call(cache, tok, positions, forward.model_mask(), logits_to_keep=1))


def verify_step(call: ModelCall, cache: MagicDecCache, pending: torch.Tensor, drafts: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
    """One forward of ``[pending, d_1 … d_γ]`` per row at its own offset on the full cache
    (``pending [b]``, ``drafts [b, γ]``, their ``positions [b, γ + 1]`` when the caller has them);
    float logits ``[b, γ + 1, V]``."""
    q = drafts.shape[1] + 1
    forward = cache.begin_verify(q)
    if positions is None:
        positions = cache.lengths[:, None] - cache.pad[:, None] + torch.arange(q, device=pending.device)
    ids = torch.cat([pending[:, None], drafts], dim=1) if q > 1 else pending[:, None]
    return _float(call(cache, ids, positions, forward.model_mask(), logits_to_keep=0))


def _float(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.dtype == torch.float32 else logits.float()

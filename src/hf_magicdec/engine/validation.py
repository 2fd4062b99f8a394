"""Checks run before any forward pass, so misuse fails fast with a message naming the problem."""

from __future__ import annotations

import re
from typing import Any

import torch

from .attention import check_attention_keywords

#: Model kwargs that ``generate`` prepares and the engine knows how to honour.
_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "past_key_values", "use_cache", "logits_to_keep", "cache_position"}
_FULL_LAYER_TYPES = {"full_attention", "sliding_attention"}
# Layers that carry a running state instead of (or beside) a KV cache: state-space / Mamba mixers,
# gated delta rules, lightning / linear attention, short convolutions, RNN blocks.
_RECURRENT_CLASS = re.compile(r"Mamba|Mixer|DeltaNet|DeltaAttention|Lightning|ShortConv|Recurrent|Rwkv|RWKV|xLSTM|"
                              r"mLSTM|LinearAttention|SSM|Ssm")


def _recurrent_layers(model) -> list[str]:
    return sorted({type(m).__name__ for m in model.modules() if _RECURRENT_CLASS.search(type(m).__name__)})


def check_model(model, max_length: int | None = None) -> None:
    """Refuse models the engine cannot run losslessly.

    Raises
    ------
    NotImplementedError
        Encoder-decoder models; models whose attention does not go through transformers'
        ``AttentionInterface``; linear-attention / recurrent layers; sliding-window layers whose
        window is shorter than the generation (prompt + new tokens).
    """
    config = model.config.get_text_config(decoder=True)
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise NotImplementedError(f"speculative='magicdec' supports decoder-only models; {name} is encoder-decoder.")
    recurrent = _recurrent_layers(model)
    if recurrent:
        raise NotImplementedError(
            f"{name} has recurrent or linear-attention layers ({', '.join(recurrent[:4])}): their state is a running "
            "summary of every token, which can neither be rolled back per row after rejected drafts nor read "
            "through a compressed draft view. MagicDec supports models whose layers all attend over a KV cache."
        )
    bidirectional = [type(m).__name__ for m in model.modules()
                     if getattr(m, "is_causal", None) is False and hasattr(m, "layer_idx")
                     and not getattr(m, "is_cross_attention", False)]
    if bidirectional and getattr(config, "is_decoder", None) is False:
        raise NotImplementedError(
            f"{name} attends bidirectionally ({bidirectional[0]}.is_causal=False, config.is_decoder=False), so its "
            "earlier hidden states change with every new token and cannot be cached for speculation. Load it with "
            "is_decoder=True to use it as a causal language model."
        )
    if not getattr(model, "_supports_attention_backend", False):
        raise NotImplementedError(
            f"{name} does not route attention through transformers' AttentionInterface, which MagicDec needs to "
            "attend to the draft view and to verify ragged rows. Supported: Llama, Mistral, Qwen2/3, Gemma, Phi-3 "
            "and other models with `_supports_attention_backend = True`."
        )
    check_attention_keywords(model)
    if model.training:
        _check_training_mode(model, config, name)
    layer_types = list(getattr(config, "layer_types", None) or [])
    other = sorted(set(layer_types) - _FULL_LAYER_TYPES)
    if other:
        raise NotImplementedError(
            f"{name} has layers of type {other}; MagicDec supports full and sliding-window attention layers only."
        )
    window = getattr(config, "sliding_window", None)
    uses_window = window is not None and (
        "sliding_attention" in layer_types
        or (not layer_types and getattr(config, "use_sliding_window", True) is not False)
    )
    if uses_window and max_length is not None and max_length > window:
        raise NotImplementedError(
            f"{name} uses sliding-window attention ({window=}) and this generation reaches {max_length=} tokens: "
            "the window would evict tokens, which MagicDec's cache does not model. Generate at most "
            f"{window} tokens in total (prompt + new), or use stock generate."
        )


#: Config fields that set the attention's own dropout (applied inside the attention function, no ``nn.Dropout``).
_ATTENTION_DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def _check_training_mode(model, config, name: str) -> None:
    """A model in training mode (RL trainers generate without ``eval()``) decodes as stock does in
    that state only without randomness and with its cache: refuse dropout and gradient checkpointing."""
    dropout = [type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    rates = {f: getattr(config, f) for f in _ATTENTION_DROPOUT_FIELDS
             if isinstance(getattr(config, f, None), (int, float)) and getattr(config, f) > 0}
    if dropout or rates:
        what = f"dropout ({dropout[0]})" if dropout else f"attention dropout ({rates})"
        raise NotImplementedError(
            f"{name} is in training mode with {what}, so its outputs are random and speculation could not match "
            "them; call model.eval() before generating with speculative='magicdec' (or set the dropout to 0)."
        )
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise NotImplementedError(
            f"{name} is in training mode with gradient checkpointing on, whose checkpointed layers drop the KV "
            "cache; call model.gradient_checkpointing_disable() (TRL does so around generate) or model.eval() "
            "before generating with speculative='magicdec'."
        )


def check_generation_config(generation_config) -> None:
    """Refuse generation settings that speculative decoding here cannot honour."""
    gc = generation_config
    if (gc.num_beams or 1) > 1:
        raise ValueError(f"speculative='magicdec' does not support beam search ({gc.num_beams=}).")
    if getattr(gc, "prompt_lookup_num_tokens", None):
        raise ValueError(
            f"speculative='magicdec' cannot be combined with prompt lookup ({gc.prompt_lookup_num_tokens=})."
        )
    if getattr(gc, "assistant_early_exit", None):
        raise ValueError("speculative='magicdec' cannot be combined with assistant_early_exit.")
    if gc.return_dict_in_generate and (gc.output_attentions or gc.output_hidden_states):
        raise NotImplementedError(
            "speculative='magicdec' does not return attentions or hidden states "
            f"({gc.output_attentions=}, {gc.output_hidden_states=})."
        )


def check_model_kwargs(model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keep the kwargs the engine honours; refuse the ones it would silently ignore. A non-empty
    ``past_key_values`` is continued from (checked by :func:`hf_magicdec.engine.continuation.check_cache`)."""
    unknown = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _KNOWN_MODEL_KWARGS)
    if unknown:
        raise NotImplementedError(f"speculative='magicdec' does not support these generate inputs: {unknown}.")
    return model_kwargs


def take_assistant_model(kwargs: dict[str, Any]) -> None:
    """``assistant_model=`` names the draft model, as in HF's assisted generation: move it to
    ``draft_model`` (MagicDec drafts with it at any batch size). Refuses two different models."""
    assistant = kwargs.pop("assistant_model", None)
    if assistant is None:
        return
    draft = kwargs.get("draft_model")
    if draft is not None and draft is not assistant:
        raise ValueError(
            "speculative='magicdec' got both assistant_model= and draft_model=, and they differ: both name the "
            "draft model; pass one of them."
        )
    kwargs["draft_model"] = assistant


def check_route_kwargs(kwargs: dict[str, Any]) -> None:
    """Checks on raw ``generate`` kwargs that HF would drop before the engine sees them."""
    if kwargs.get("prompt_lookup_num_tokens"):
        raise ValueError(
            f"speculative='magicdec' cannot be combined with {kwargs['prompt_lookup_num_tokens']=} (prompt lookup)."
        )
    if kwargs.get("num_beams") not in (None, 1):
        raise ValueError(f"speculative='magicdec' does not support beam search ({kwargs['num_beams']=}).")
    if kwargs.get("assistant_early_exit") is not None:
        raise ValueError("speculative='magicdec' cannot be combined with assistant_early_exit.")

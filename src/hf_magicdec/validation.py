"""Checks run before any forward pass, so misuse fails fast with a message naming the problem."""

from __future__ import annotations

from typing import Any

#: Model kwargs that ``generate`` prepares and the engine knows how to honour.
_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "past_key_values", "use_cache", "logits_to_keep", "cache_position"}
_FULL_LAYER_TYPES = {"full_attention", "sliding_attention"}


def check_model(model, max_length: int | None = None) -> None:
    """Refuse models the engine cannot run losslessly.

    Raises
    ------
    NotImplementedError
        Encoder-decoder models; models whose attention does not go through transformers'
        ``AttentionInterface``; linear-attention / recurrent layers; sliding-window layers whose
        window is shorter than the generation (prompt + new tokens).
    """
    config = model.config
    name = type(model).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(f"speculative='magicdec' supports decoder-only models; {name} is encoder-decoder.")
    if not getattr(model, "_supports_attention_backend", False):
        raise NotImplementedError(
            f"{name} does not route attention through transformers' AttentionInterface, which MagicDec needs to "
            "attend to the draft view and to verify ragged rows. Supported: Llama, Mistral, Qwen2/3, Gemma, Phi-3 "
            "and other models with `_supports_attention_backend = True`."
        )
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
    """Keep the kwargs the engine honours; refuse the ones it would silently ignore."""
    unknown = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _KNOWN_MODEL_KWARGS)
    if unknown:
        raise NotImplementedError(f"speculative='magicdec' does not support these generate inputs: {unknown}.")
    cache = model_kwargs.get("past_key_values")
    if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0:
        raise NotImplementedError(
            "speculative='magicdec' builds its own cache and cannot continue from a non-empty past_key_values."
        )
    return model_kwargs


def check_route_kwargs(kwargs: dict[str, Any]) -> None:
    """Checks on raw ``generate`` kwargs that HF would drop before the engine sees them."""
    if kwargs.get("assistant_model") is not None:
        raise ValueError(
            "speculative='magicdec' does not take assistant_model: it drafts with the model itself, or with a separate "
            "small model passed as draft_model= (any batch size)."
        )
    if kwargs.get("prompt_lookup_num_tokens"):
        raise ValueError(
            f"speculative='magicdec' cannot be combined with {kwargs['prompt_lookup_num_tokens']=} (prompt lookup)."
        )
    if kwargs.get("num_beams") not in (None, 1):
        raise ValueError(f"speculative='magicdec' does not support beam search ({kwargs['num_beams']=}).")
    if kwargs.get("assistant_early_exit") is not None:
        raise ValueError("speculative='magicdec' cannot be combined with assistant_early_exit.")

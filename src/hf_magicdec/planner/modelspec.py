"""Model shapes the cost model needs, read from a ``PretrainedConfig``, a ``config.json`` dict or any
object with the usual attributes (no weights loaded, transformers not imported), and the canonical
dtype names (``"float32"``, ``"bfloat16"``, ``"float16"``, ``"float8"``, ``"int8"``) from aliases or
``torch.dtype`` objects (through their ``str``), without importing torch."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

from ..checks import check_int

__all__ = ["ModelSpec", "DTYPE_BYTES", "canonical_dtype", "dtype_bytes"]

#: canonical name -> bytes per element
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1}

_ALIASES = {"fp32": "float32", "f32": "float32", "float": "float32", "float32": "float32", "tf32": "float32",
            "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16",
            "float16": "float16", "fp8": "float8", "float8": "float8", "float8_e4m3fn": "float8",
            "float8_e5m2": "float8", "f8": "float8",
            "int8": "int8", "qint8": "int8"}  # int8: quantized linear layers (a peak FLOP/s key; weights only)


def canonical_dtype(dtype: Any) -> str:
    """The canonical name of ``dtype`` (``"fp32"``, ``"bf16"``, ``torch.bfloat16`` …); ValueError if unknown."""
    key = str(dtype).strip().lower()
    if key.startswith("torch."):
        key = key[len("torch."):]
    if key not in _ALIASES:
        raise ValueError(f"Unknown dtype {dtype=!r}; use one of {sorted(set(_ALIASES))}.")
    return _ALIASES[key]


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of ``dtype`` (see :func:`canonical_dtype`)."""
    return DTYPE_BYTES[canonical_dtype(dtype)]


# Bytes per weight of the quantized linear formats (None: the model's dtype).
_WEIGHT_FORMAT_BYTES = {None: None, "int8": 1.0, "fp16": 2.0, "int4": 0.5}

# Architectures with a two-matrix MLP; all others are gated (SwiGLU/GeGLU, as Llama, Qwen, Gemma).
_UNGATED = frozenset({"gpt2", "gpt_neox", "gptj", "gpt_bigcode", "opt", "bloom", "falcon", "phi", "starcoder2",
                      "codegen", "gpt_neo", "mpt"})
_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _get(config: Any, *names: str, default: Any = None) -> Any:
    """First non-None value among ``names`` (attribute or key)."""
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    return default


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only transformer, as the roofline sees them.

    ``hidden`` d, ``heads`` H, ``kv_heads`` (must divide ``heads``), ``head_dim`` (may differ from
    ``hidden // heads``), ``intermediate`` (MLP inner size), ``vocab`` (LM head rows).
    ``tied_embeddings`` only changes the parameter count (the LM head is read every forward either
    way). ``gated_mlp``: gate, up and down matrices instead of two. ``dtype``: weights and activations
    (canonical name); ``kv_dtype`` None: ``dtype``. ``weight_format``: linear layers (LM head
    included) stored as ``"int8"`` (1 byte a weight), ``"fp16"`` (2) or ``"int4"`` (0.5); None: ``dtype``
    (a quantized self-draft is :meth:`with_weights`). ValueError for a size that is not a positive int.
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    gated_mlp: bool = True
    dtype: str = "bfloat16"
    kv_dtype: str | None = None
    weight_format: str | None = None

    def __post_init__(self) -> None:
        if self.weight_format not in _WEIGHT_FORMAT_BYTES:
            raise ValueError(f"weight_format must be one of {sorted(_WEIGHT_FORMAT_BYTES, key=str)}, got "
                             f"{self.weight_format!r}.")
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            check_int(name, getattr(self, name))
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads must divide heads, got heads={self.heads} and kv_heads={self.kv_heads}.")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.kv_dtype is not None:
            object.__setattr__(self, "kv_dtype", canonical_dtype(self.kv_dtype))

    @property
    def group(self) -> int:
        """Query heads per KV head (g); the arithmetic intensity of attention in FLOP/element."""
        return self.heads // self.kv_heads

    @property
    def weight_bytes(self) -> int:
        """Bytes per weight/activation element."""
        return dtype_bytes(self.dtype)

    @property
    def linear_weight_bytes(self) -> float:
        """Bytes per weight of the linear layers and the LM head (``weight_format``, else ``dtype``)."""
        quantized = _WEIGHT_FORMAT_BYTES[self.weight_format]
        return float(self.weight_bytes) if quantized is None else quantized

    def with_weights(self, weight_format: str | None) -> "ModelSpec":
        """The same model with its linear layers in ``weight_format`` (``"full"`` / None: the dtype's)."""
        fmt = None if weight_format in (None, "full") else weight_format
        return dataclasses.replace(self, weight_format=fmt)

    @property
    def kv_bytes(self) -> int:
        """Bytes per KV cache element."""
        return dtype_bytes(self.kv_dtype or self.dtype)

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def layer_params(self) -> int:
        """Weights of one layer's projections and MLP (norms and biases are negligible)."""
        q_o = 2 * self.hidden * self.heads * self.head_dim
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        return q_o + k_v + self.mlp_matrices * self.hidden * self.intermediate

    @property
    def params(self) -> int:
        """All parameters: layers, embedding and (if untied) LM head."""
        embeddings = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * self.layer_params + embeddings

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes of one token over all layers (keys and values)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes

    def memory_bytes(self, batch: int, tokens: int) -> int:
        """Weights plus a full KV cache for ``batch`` rows of ``tokens`` tokens, bytes."""
        return self.params * self.weight_bytes + batch * tokens * self.kv_bytes_per_token

    def with_dtype(self, dtype: Any, kv_dtype: Any = None) -> "ModelSpec":
        """The same shapes in another dtype (``kv_dtype=None`` keeps the KV in ``dtype``)."""
        return dataclasses.replace(self, dtype=canonical_dtype(dtype),
                                   kv_dtype=None if kv_dtype is None else canonical_dtype(kv_dtype))

    def key(self) -> str:
        """Short stable hash of the shapes (not the name or dtype): identifies calibrations."""
        shape = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("name", "dtype", "kv_dtype",
                                                                                 "weight_format")}
        return hashlib.sha1(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:8]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: Any, *, dtype: Any = None, name: str | None = None) -> "ModelSpec":
        """The shapes of a Hugging Face config (object or dict; a ``text_config`` wins; GPT-2 style names
        too). ``dtype`` overrides the config's (default bfloat16); ``name`` defaults to ``_name_or_path``
        or ``model_type``. Missing: ``num_key_value_heads`` → ``heads`` (``multi_query`` → 1), ``head_dim``
        → ``hidden // heads``, ``intermediate_size`` → ``4 * hidden``, ``tie_word_embeddings`` → False;
        sliding windows count as full attention. ValueError for a missing size, a mixture of experts
        (routing-dependent weight traffic is not modelled) or inconsistent sizes.
        """
        text = _get(config, "text_config")
        if text is not None and _get(text, "num_hidden_layers", "n_layer") is not None:
            config = text
        for field_name in _MOE_FIELDS:
            experts = _get(config, field_name)
            if isinstance(experts, int) and experts > 1:
                raise ValueError(f"Mixture-of-experts models are not modelled ({field_name}={experts}): weight "
                                 "traffic per step depends on expert routing.")
        layers = _get(config, "num_hidden_layers", "n_layer", "num_layers")
        hidden = _get(config, "hidden_size", "n_embd", "d_model")
        heads = _get(config, "num_attention_heads", "n_head", "num_heads")
        vocab = _get(config, "vocab_size")
        for field_name, value in (("num_hidden_layers", layers), ("hidden_size", hidden),
                                  ("num_attention_heads", heads), ("vocab_size", vocab)):
            if value is None:
                raise ValueError(f"The config has no {field_name!r} (nor an alias); cannot model it.")
        hidden, heads = check_int("hidden_size", hidden), check_int("num_attention_heads", heads)
        if _get(config, "multi_query", default=False) is True:
            kv_heads = 1
        else:
            kv_heads = _get(config, "num_key_value_heads", "num_kv_heads", "n_head_kv", default=heads)
        head_dim = _get(config, "head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ValueError(f"No head_dim in the config and {hidden=} is not a multiple of {heads=}.")
            head_dim = hidden // heads
        intermediate = _get(config, "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", default=4 * hidden)
        model_type = str(_get(config, "model_type", default="") or "")
        if dtype is None:
            dtype = _get(config, "dtype", "torch_dtype", default="bfloat16")
        label = name or _get(config, "_name_or_path", default=None) or model_type or "model"
        return cls(name=str(label), layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                   intermediate=intermediate, vocab=vocab,
                   tied_embeddings=bool(_get(config, "tie_word_embeddings", default=False)),
                   gated_mlp=model_type not in _UNGATED, dtype=canonical_dtype(dtype))

"""Canonical dtype names (``"float32"``, ``"bfloat16"``, ``"float16"``, ``"float8"``, ``"int8"``) and
their sizes, from aliases or ``torch.dtype`` objects (through their ``str``), without importing torch."""

from __future__ import annotations

from typing import Any

#: canonical name -> bytes per element
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int8": 1}

_ALIASES = {
    "fp32": "float32", "f32": "float32", "float": "float32", "float32": "float32", "tf32": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "f16": "float16", "half": "float16", "float16": "float16",
    "fp8": "float8", "float8": "float8", "float8_e4m3fn": "float8", "float8_e5m2": "float8",
    "f8": "float8",
    "int8": "int8", "qint8": "int8",  # quantized linear layers (a peak FLOP/s key; weights only)
}


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

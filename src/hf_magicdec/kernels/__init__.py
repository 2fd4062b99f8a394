"""Attention kernels and the one place that chooses between Triton and their PyTorch twins.

Backends, chosen by the environment variable ``HF_MAGICDEC_KERNELS``:

``auto`` (default)
    Triton for CUDA tensors when ``triton`` is importable, the PyTorch twin otherwise (CPU,
    MPS, no Triton installed).
``torch``
    Always the PyTorch twin.
``triton``
    Always Triton. On CPU this needs ``TRITON_INTERPRET=1`` set before Triton is imported (the
    tests do that); without a GPU or the interpreter it raises instead of silently falling back.

Both backends take the same arguments and return the same layouts; see
:mod:`hf_magicdec.kernels.reference` for the contracts.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from . import reference
from .segments import Segments

ENV_VAR = "HF_MAGICDEC_KERNELS"
BACKENDS = ("auto", "torch", "triton")

__all__ = ["BACKENDS", "ENV_VAR", "Segments", "requested_backend", "segment_attention", "snapkv_mass", "use_triton"]


def requested_backend() -> str:
    """The value of ``HF_MAGICDEC_KERNELS`` (default ``auto``), validated."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={os.environ.get(ENV_VAR)!r} is not one of {BACKENDS}.")
    return value


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    # Once per process: the dispatch runs in every attention call, and find_spec searches sys.path.
    return importlib.util.find_spec("triton") is not None


def check_backend(device: torch.device) -> str:
    """Resolve the backend for tensors on ``device``; raise early when ``triton`` is forced but
    cannot run there (called by ``generate`` before any heavy work)."""
    choice = requested_backend()
    on_cuda = torch.device(device).type == "cuda"
    if choice == "torch" or (choice == "auto" and not on_cuda):
        return "torch"  # the interpreter is a test tool, never an automatic choice
    usable = triton_available() and (on_cuda or _interpreting())
    if choice == "triton" and not usable:
        why = "triton is not installed" if not triton_available() else (
            f"tensors are on {torch.device(device).type!r} and TRITON_INTERPRET is not set"
        )
        raise RuntimeError(f"{ENV_VAR}=triton but Triton cannot run here: {why}. Use {ENV_VAR}=auto or torch.")
    return "triton" if usable else "torch"


def use_triton(tensor: torch.Tensor) -> bool:
    return check_backend(tensor.device) == "triton"


def _triton():
    from . import triton_kernels

    return triton_kernels


def segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Segments,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[B, H, q, D]`` queries over two key ranges per row of ``[B, Hkv, L, D]`` keys/values;
    returns ``[B, q, H, Dv]``. ``softcap``: logit soft-capping; ``sinks``: ``[H]`` sink logits.
    See :func:`hf_magicdec.kernels.reference.segment_attention`."""
    if use_triton(query):
        kernels = _triton()
        group = query.shape[1] // key.shape[1]
        if group * query.shape[2] <= kernels.MAX_PACKED_ROWS:
            return kernels.segment_attention(query, key, value, segments, scaling, softcap, sinks)
    return reference.segment_attention(query, key, value, segments, scaling, softcap, sinks)


def snapkv_mass(queries: torch.Tensor, keys: torch.Tensor, pad: torch.Tensor, scaling: float) -> torch.Tensor:
    """SnapKV attention mass ``[B, Hkv, S]`` (fp32). See :func:`hf_magicdec.kernels.reference.snapkv_mass`."""
    if use_triton(keys):
        return _triton().snapkv_mass(queries, keys, pad, scaling)
    return reference.snapkv_mass(queries, keys, pad, scaling)

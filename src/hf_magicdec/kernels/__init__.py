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
:mod:`hf_magicdec.kernels.reference` for the contracts. A call the Triton kernels cannot serve on
its device (a dtype they do not take, a head too wide for its shared memory, a packed query tile
over :data:`MAX_PACKED_ROWS` rows, ...; see :mod:`hf_magicdec.kernels.launch`) runs the twin
instead, the reason logged once on the ``hf_magicdec`` logger: never an error mid-generation.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from . import launch, reference
from .launch import MAX_PACKED_ROWS
from .segments import Segments

log = logging.getLogger("hf_magicdec")

ENV_VAR = "HF_MAGICDEC_KERNELS"
BACKENDS = ("auto", "torch", "triton")

__all__ = ["BACKENDS", "ENV_VAR", "MAX_PACKED_ROWS", "Segments", "requested_backend", "segment_attention",
           "snapkv_mass", "use_triton"]


def requested_backend() -> str:
    """The value of ``HF_MAGICDEC_KERNELS`` (default ``auto``), validated."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={os.environ.get(ENV_VAR)!r} is not one of {BACKENDS}.")
    return value


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Looked up once, at import: the dispatch runs in every attention call (find_spec searches
# sys.path), and inside compiled steps, where torch 2.11 refuses to trace find_spec or a cached call.
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON_INSTALLED


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
    if usable and on_cuda:
        launch.device_spec(device)  # query the device now, eagerly, not inside a traced step
    return "triton" if usable else "torch"


def use_triton(tensor: torch.Tensor) -> bool:
    return check_backend(tensor.device) == "triton"


def _triton():
    from . import triton_kernels

    return triton_kernels


# Fallback reasons already logged (once each: the dispatch runs in every layer of every step).
_LOGGED: set[str] = set()
# Launches the compiler refused at run time despite the plan's shared-memory estimate, by
# (kernel, device, dtype, head dims): they take the twin from then on instead of failing again.
_REFUSED: dict[tuple, str] = {}


def _fall_back(reason: str) -> None:
    # Not while torch.compile traces a step: a log call there would break the graph (an error
    # under fullgraph); eager calls log it.
    if reason not in _LOGGED and not torch.compiler.is_compiling():
        _LOGGED.add(reason)
        log.warning("hf_magicdec kernels: using the PyTorch twin: %s", reason)


def _refused_key(kernel: str, query: torch.Tensor, other: torch.Tensor, rows: int) -> tuple:
    """What selects a launch's tiles: device, dtype, head dims, packed query rows."""
    return (kernel, query.device, query.dtype, query.shape[-1], other.shape[-1], rows)


def _refuse(key: tuple, error: Exception) -> str:
    # The shared-memory estimate in `launch` was wrong for this device: remember, so the next call
    # takes the twin at once instead of compiling and failing again.
    _REFUSED[key] = f"{key[0]} on {key[1]} in {key[2]} (head dims {key[3]}, {key[4]}; {key[5]} rows): {error}"
    return _REFUSED[key]


def segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Segments,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    page_size: int = 0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, q, D]`` queries over two key ranges per row of ``[B, Hkv, L, D]`` keys/values;
    returns ``[B, q, H, Dv]``. ``softcap``: logit soft-capping; ``sinks``: ``[H]`` sink logits.
    ``page_size > 0``: returns ``(out, mass)``, ``mass [B, Hkv, ceil(L / page_size)]`` fp32 the
    attention mass per page of keys (the Triton kernel emits it for powers of two >= 16; other page
    sizes take the twin). See :func:`hf_magicdec.kernels.reference.segment_attention`."""
    if page_size < 0:
        raise ValueError(f"page_size must be >= 0, got {page_size}.")
    if use_triton(query):
        name = "segment_attention" + (f" (mass per {page_size}-key page)" if page_size else "")
        refused = _refused_key(name, query, value, query.shape[1] // key.shape[1] * query.shape[2])
        reason = _REFUSED.get(refused) or launch.segment_attention_refusal(
            query, key, value, launch.device_spec(query.device), page_size)
        if reason is None:
            kernels = _triton()
            try:
                return kernels.segment_attention(query, key, value, segments, scaling, softcap, sinks,
                                                 page_size=page_size)
            except kernels.OutOfResources as error:
                reason = _refuse(refused, error)
        _fall_back(reason)
    return reference.segment_attention(query, key, value, segments, scaling, softcap, sinks, page_size)


def snapkv_mass(queries: torch.Tensor, keys: torch.Tensor, pad: torch.Tensor, scaling: float) -> torch.Tensor:
    """SnapKV attention mass ``[B, Hkv, S]`` (fp32). See :func:`hf_magicdec.kernels.reference.snapkv_mass`."""
    if use_triton(keys):
        refused = _refused_key("snapkv_mass", queries, keys, 0)
        reason = _REFUSED.get(refused) or launch.snapkv_refusal(queries, keys, launch.device_spec(keys.device))
        if reason is None:
            kernels = _triton()
            try:
                return kernels.snapkv_mass(queries, keys, pad, scaling)
            except kernels.OutOfResources as error:
                reason = _refuse(refused, error)
        _fall_back(reason)
    return reference.snapkv_mass(queries, keys, pad, scaling)

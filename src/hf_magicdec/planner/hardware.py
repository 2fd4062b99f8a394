"""Hardware specifications: peak FLOP/s per dtype, memory bandwidth, tensor-parallel degree. GPU presets
are datasheet peaks (optimistic, MagicDec §3; :mod:`hf_magicdec.calibration` fits real rates), the
``"cpu"`` preset one 2-core VM's calibration."""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..defaults import QUANTIZED_FORMATS
from ..checks import check_int, check_number
from .modelspec import canonical_dtype

__all__ = ["HardwareSpec", "HARDWARE_PRESETS", "get_hardware"]


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator, or ``tp`` identical ones in tensor parallel (rates are per device).

    ``peak_flops``: dense FLOP/s per dtype (:func:`~.modelspec.canonical_dtype` names); ``bandwidth``:
    memory bytes/s; ``memory_bytes``: capacity (the "does it fit" check). ``tp`` devices split weights,
    heads and vocabulary, with two all-reduces per layer over ``link_bandwidth`` (bytes/s per
    direction) at ``allreduce_latency`` seconds each. ``overhead``: seconds per forward;
    ``layer_overhead``: host seconds per layer of an eager forward, unpaid when ``captured``
    (``compile=``). ``format_flops``, ``format_overhead``, ``format_build``: per quantized weight format
    (``"int8"``, ``"fp16"``, ``"int4"``), the linear layers' FLOP/s (default: ``peak_flops[format]``,
    else the model's dtype), the host seconds per layer a forward adds, and the seconds per weight
    byte to build the draft. ``linear_rows``: ``((rows, factor), ...)``, rows ascending, the dense
    linear layers' and LM head's time over ``rows`` rows relative to one (a CPU's GEMM switches kernels
    as rows grow); where given they cost ``bytes / bandwidth × factor``. ``overlap``: an op group costs
    ``max(compute, memory)``, else their sum. ``fused_mass``: the verify kernel emits ``attended``'s
    page mass (CUDA), else the twin reads its probabilities once more. docs/cost_model.md §3, §6.
    ValueError for a bad value (``overhead``, ``layer_overhead``, ``allreduce_latency`` may be 0).
    """

    name: str
    peak_flops: Mapping[str, float] = field(hash=False)
    bandwidth: float
    memory_bytes: float = float("inf")
    tp: int = 1
    link_bandwidth: float = 300e9
    allreduce_latency: float = 5e-6
    overhead: float = 0.0
    overlap: bool = True
    layer_overhead: float = 0.0
    captured: bool = True
    format_flops: Mapping[str, float] = field(default_factory=dict, hash=False)
    fused_mass: bool = True
    format_overhead: Mapping[str, float] = field(default_factory=dict, hash=False)
    format_build: Mapping[str, float] = field(default_factory=dict, hash=False)
    linear_rows: tuple[tuple[int, float], ...] = ()

    def __reduce__(self):  # picklable (a step model is broadcast to the other ranks): mappings as dicts
        return (_rebuild, (type(self), self._fields()))

    def _fields(self) -> dict[str, Any]:
        return {f.name: dict(v) if isinstance(v := getattr(self, f.name), Mapping) else v
                for f in dataclasses.fields(self)}

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}.")
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise ValueError(f"peak_flops must be a non-empty mapping dtype -> FLOP/s, got {self.peak_flops!r}.")
        _freeze(self, "peak_flops", {canonical_dtype(k): check_number(f"peak_flops[{k!r}]", v)
                                     for k, v in self.peak_flops.items()})
        for name in ("format_flops", "format_overhead", "format_build"):
            mapping = getattr(self, name)
            if not isinstance(mapping, Mapping) or not set(mapping) <= set(QUANTIZED_FORMATS):
                raise ValueError(f"{name} must map weight formats {QUANTIZED_FORMATS} to numbers, got {mapping!r}.")
            _freeze(self, name, {k: check_number(f"{name}[{k!r}]", v, allow_zero=name != "format_flops")
                                 for k, v in mapping.items()})
        for name in ("bandwidth", "link_bandwidth"):
            check_number(name, getattr(self, name))
        if self.memory_bytes != float("inf"):  # inf: capacity unknown, not checked
            check_number("memory_bytes", self.memory_bytes)
        for name in ("allreduce_latency", "overhead", "layer_overhead"):
            check_number(name, getattr(self, name), allow_zero=True)
        check_int("tp", self.tp)
        for name in ("overlap", "fused_mass", "captured"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}.")
        object.__setattr__(self, "linear_rows", _checked_rows(self.linear_rows))

    def peak(self, dtype: Any) -> float:
        """Peak FLOP/s of one device for ``dtype``, else for the nearest wider dtype listed (float8 →
        bfloat16/float16 → float32); ValueError if none is."""
        name = canonical_dtype(dtype)
        order = {"float8": ("float8", "bfloat16", "float16", "float32"),
                 "bfloat16": ("bfloat16", "float16", "float32"),
                 "float16": ("float16", "bfloat16", "float32"),
                 "float32": ("float32",), "int8": ("int8",)}[name]
        for key in order:
            if key in self.peak_flops:
                return self.peak_flops[key]
        raise ValueError(f"{self.name!r} lists no peak FLOP/s for {dtype=!r} (has {sorted(self.peak_flops)}).")

    def linear_peak(self, weight_format: str | None, dtype: Any) -> float:
        """FLOP/s of linear layers stored as ``weight_format`` (None: in ``dtype``), see ``format_flops``."""
        if weight_format is None:
            return self.peak(dtype)
        if weight_format in self.format_flops:
            return self.format_flops[weight_format]
        return self.peak_flops.get(weight_format, self.peak(dtype))

    def replace(self, **changes: Any) -> "HardwareSpec":
        """Copy with ``changes`` applied (validated again)."""
        return type(self)(**{**self._fields(), **changes})

    def with_tp(self, tp: int) -> "HardwareSpec":
        """The same device, ``tp`` of them in tensor parallel."""
        return self.replace(tp=tp)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return self._fields()


def _checked_rows(points: Any) -> tuple[tuple[int, float], ...]:
    """``linear_rows`` as a tuple of ``(int, float)`` pairs; ValueError unless rows are positive ints in
    ascending order and factors positive numbers."""
    try:
        pairs = tuple((rows, factor) for rows, factor in points)
    except (TypeError, ValueError):
        raise ValueError(f"linear_rows must be (rows, factor) pairs, got {points!r}.") from None
    for i, (rows, factor) in enumerate(pairs):
        check_int(f"linear_rows[{i}] rows", rows, 1 if i == 0 else pairs[i - 1][0] + 1)
        check_number(f"linear_rows[{i}] factor", factor)
    return tuple((int(rows), float(factor)) for rows, factor in pairs)


def _freeze(spec: HardwareSpec, name: str, mapping: dict) -> None:
    object.__setattr__(spec, name, types.MappingProxyType(mapping))  # frozen dataclass, read-only mappings


_GB = 1e9
_GIB = 1024**3
# Host time per layer of an eager GPU forward (~60 aten launches of ~5 µs; docs/cost_model.md §3).
_EAGER_LAYER_OVERHEAD = 0.3e-3

#: Vendor datasheet peaks, dense, per device. NVLink figures are per direction.
HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "a100": HardwareSpec(
        name="A100 80GB SXM",
        peak_flops={"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12},
        bandwidth=2039 * _GB, memory_bytes=80 * _GIB, link_bandwidth=300 * _GB,
        layer_overhead=_EAGER_LAYER_OVERHEAD,
    ),
    "h100": HardwareSpec(
        name="H100 SXM",
        peak_flops={"float32": 67e12, "bfloat16": 989e12, "float16": 989e12, "float8": 1979e12},
        bandwidth=3350 * _GB, memory_bytes=80 * _GIB, link_bandwidth=450 * _GB,
        layer_overhead=_EAGER_LAYER_OVERHEAD,
    ),
    "h200": HardwareSpec(
        name="H200 SXM",
        peak_flops={"float32": 67e12, "bfloat16": 989e12, "float16": 989e12, "float8": 1979e12},
        bandwidth=4800 * _GB, memory_bytes=141 * _GB, link_bandwidth=450 * _GB,
        layer_overhead=_EAGER_LAYER_OVERHEAD,
    ),
    "l40s": HardwareSpec(
        # No NVLink: all-reduce goes over PCIe Gen4 x16 (~32 GB/s per direction, less in practice).
        name="L40S",
        peak_flops={"float32": 91.6e12, "bfloat16": 362e12, "float16": 362e12, "float8": 733e12},
        bandwidth=864 * _GB, memory_bytes=48 * _GIB, link_bandwidth=25 * _GB, allreduce_latency=15e-6,
        layer_overhead=_EAGER_LAYER_OVERHEAD,
    ),
    "cpu": HardwareSpec(
        # A calibration of SmolLM2-135M fp32 on a 2-core Xeon VM, its per-forward host time spread over
        # the layers: right on that machine, a placeholder elsewhere (docs/cost_model.md, "The `cpu` preset").
        name="cpu (uncalibrated)",
        fused_mass=False,
        peak_flops={"float32": 75e9, "bfloat16": 50e9, "float16": 25e9},
        bandwidth=20 * _GB, link_bandwidth=10 * _GB, allreduce_latency=20e-6, overlap=False,
        layer_overhead=0.5e-3, captured=False,
        format_flops={"int8": 210e9, "fp16": 190e9},
        format_overhead={"int8": 0.29e-3, "fp16": 0.29e-3},
        format_build={"int8": 1.7e-9, "fp16": 2.2e-9},
        linear_rows=((1, 1.0), (2, 1.07), (3, 1.15), (4, 2.28), (6, 2.37), (8, 2.83), (12, 3.36), (16, 4.65),
                     (24, 4.88), (32, 5.27), (48, 5.81), (128, 6.38)),
    ),
}

_PRESET_ALIASES = {"a100-80gb": "a100", "a100-sxm": "a100", "h100-sxm": "h100", "h200-sxm": "h200"}


def get_hardware(name: str | HardwareSpec, tp: int = 1) -> HardwareSpec:
    """The preset ``name`` (``"a100"``, ``"h100"``, ``"h200"``, ``"l40s"``, ``"cpu"``; case-insensitive;
    ValueError if unknown) or the spec given, ``tp`` devices in tensor parallel."""
    if isinstance(name, HardwareSpec):
        return name if tp == 1 else name.with_tp(tp)
    key = str(name).strip().lower()
    key = _PRESET_ALIASES.get(key, key)
    if key not in HARDWARE_PRESETS:
        raise ValueError(f"Unknown hardware {name=!r}; presets: {sorted(HARDWARE_PRESETS)}.")
    spec = HARDWARE_PRESETS[key]
    return spec if tp == 1 else spec.with_tp(tp)


def _rebuild(cls, fields):
    return cls(**fields)

"""Hardware specifications: peak FLOP/s per dtype, memory bandwidth, tensor-parallel degree.

GPU presets are vendor datasheet peaks (dense, per device): a roofline on them is optimistic
(MagicDec §3: 2–3× predicted where 1.2–2.5× was measured), which :mod:`hf_magicdec.calibration`
corrects with rates fitted on the device. The ``"cpu"`` preset is an order of magnitude only.
"""

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

    ``peak_flops``: dense FLOP/s per dtype (canonical names, :func:`~.modelspec.canonical_dtype`).
    ``bandwidth``: memory bytes/s; ``memory_bytes``: capacity (only for the "does it fit" check).
    ``tp``: weights, heads and vocabulary are split over ``tp`` devices, two all-reduces per layer
    over ``link_bandwidth`` (bytes/s per direction), each costing ``allreduce_latency`` seconds more.
    ``overhead``: seconds per forward (fitted by calibration; 0 in the GPU presets). ``layer_overhead``:
    host seconds per decoder layer of an eager forward (~0.3 ms on a GPU), paid unless ``captured``
    (steps under CUDA graphs, ``compile=``; the per-call planner sets it). ``format_flops``: FLOP/s of
    linear layers stored as ``"int8"``, ``"fp16"``, ``"int4"`` (a quantized self-draft), fitted by
    calibration; without an entry a format runs at ``peak_flops[format]`` if listed, else at the
    model's dtype (``"fp16"`` weights are not the float16 dtype: fbgemm computes them in fp32).
    ``format_overhead``: host seconds per decoder layer a forward in such a format adds (CPU dynamic
    quantization's per-call work, which sets a quantized draft's step time at small batches);
    ``format_build``: seconds per byte of the model's linear weights to build a quantized draft (once
    per model and process), both from calibration. ``linear_rows``: ``((rows, factor), ...)``, the
    measured time of the full-precision linear layers and LM head over ``rows`` rows (batch × query
    tokens) relative to one row, rows ascending (CPUs: a GEMM switches kernels as rows grow, so a
    5-token verify costs about twice a 1-token step where a roofline says 1.1×); where given, those
    layers cost ``bytes / bandwidth × factor`` instead of their roofline. Empty (GPUs): the roofline.
    ``overlap``: an op group costs ``max(compute, memory)`` (GPUs) or, False, their sum (small CPU
    matmuls). ``fused_mass``: the verify attention emits ``attended``'s page mass inside its fused
    kernel (CUDA); False (CPUs): the PyTorch twin's explicit softmax writes and reads its fp32
    probabilities once more. ValueError for a non-positive number (``overhead``, ``layer_overhead``
    and ``allreduce_latency`` may be 0) or a ``tp`` that is not a positive int.
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

    def __reduce__(self):
        # Picklable (a step model is broadcast to the other ranks): the read-only mappings travel as dicts.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return (_rebuild, (type(self), {**fields, **self._mapping_dicts()}))

    def _mapping_dicts(self) -> dict[str, dict[str, float]]:
        """The read-only mapping fields as plain dicts (to pickle, copy and serialise)."""
        return {name: dict(getattr(self, name)) for name in _MAPPINGS}

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}.")
        if not isinstance(self.peak_flops, Mapping) or not self.peak_flops:
            raise ValueError(f"peak_flops must be a non-empty mapping dtype -> FLOP/s, got {self.peak_flops!r}.")
        flops = {}
        for key, value in self.peak_flops.items():
            check_number(f"peak_flops[{key!r}]", value)
            flops[canonical_dtype(key)] = float(value)
        # Read-only copies: the dataclass is frozen, its mappings should be too.
        object.__setattr__(self, "peak_flops", types.MappingProxyType(flops))
        for name, unit in (("format_flops", "FLOP/s"), ("format_overhead", "seconds per layer"),
                           ("format_build", "seconds per byte")):
            mapping = getattr(self, name)
            if not isinstance(mapping, Mapping):
                raise ValueError(f"{name} must be a mapping weight format -> {unit}, got {mapping!r}.")
            for key, value in mapping.items():
                if key not in QUANTIZED_FORMATS:
                    raise ValueError(f"{name} keys are weight formats {QUANTIZED_FORMATS}, got {key!r}.")
                check_number(f"{name}[{key!r}]", value, allow_zero=name != "format_flops")
            object.__setattr__(self, name, types.MappingProxyType({k: float(v) for k, v in mapping.items()}))
        unknown_memory = self.memory_bytes == float("inf")  # capacity unknown: not checked
        for name in ("bandwidth",) + (() if unknown_memory else ("memory_bytes",)) + ("link_bandwidth",):
            check_number(name, getattr(self, name))
        for name in ("allreduce_latency", "overhead", "layer_overhead"):
            check_number(name, getattr(self, name), allow_zero=True)
        check_int("tp", self.tp)
        for name in ("overlap", "fused_mass"):
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
        return dataclasses.replace(self, **{**self._mapping_dicts(), **changes})

    def with_tp(self, tp: int) -> "HardwareSpec":
        """The same device, ``tp`` of them in tensor parallel."""
        return self.replace(tp=tp)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        return {**dataclasses.asdict(self), **self._mapping_dicts()}


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


#: HardwareSpec's mapping fields, held read-only.
_MAPPINGS = ("peak_flops", "format_flops", "format_overhead", "format_build")
_GB = 1e9
_GIB = 1024**3
# Host time per decoder layer of an eager GPU forward: torch.profiler counts ~1,900 top-level aten
# operators in one 32-layer Llama decode forward (~60 per layer), at ~5 µs of launch and Python each.
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
        # Effective rates, not peaks: what `hf-magicdec plan --calibrate` fitted on the 2-core x86 VM of
        # docs/benchmarks.md (SmolLM2-135M, fp32: 11.5 GB/s, 181 GFLOP/s, additive). Calibrate to replace them.
        name="cpu (uncalibrated)",
        fused_mass=False,  # the PyTorch twin emits attended's mass (explicit softmax)
        peak_flops={"float32": 180e9, "bfloat16": 50e9, "float16": 25e9},
        # Dynamically quantized int8 and fbgemm's fp16 weights (fp32 math): slower per FLOP, fewer bytes.
        # No format_overhead / format_build: only a calibration prices those (a preset that did declined
        # calls that beat the static cache, docs/cost_model.md "Where the constants come from").
        format_flops={"int8": 85e9, "fp16": 95e9},
        bandwidth=12 * _GB, link_bandwidth=10 * _GB, allreduce_latency=20e-6, overhead=0.0, overlap=False,
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

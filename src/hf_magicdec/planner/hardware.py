"""Hardware specifications: peak FLOP/s per dtype, memory bandwidth, tensor-parallel degree.

Presets use vendor datasheet numbers for dense (non-sparse) tensor-core math, per GPU. They are
*peaks*: a pure roofline built on them is optimistic (MagicDec §3 notes the roofline predicts 2–3×
where 1.2–2.5× was measured), which is why :mod:`hf_magicdec.calibration` replaces
them with effective values fitted on the real device. The ``"cpu"`` preset is only a placeholder
of the right order of magnitude for a few-core x86 machine; calibrate before trusting it.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..defaults import QUANTIZED_FORMATS
from ..checks import check_int, check_number
from .dtypes import canonical_dtype

__all__ = ["HardwareSpec", "HARDWARE_PRESETS", "get_hardware"]


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator (or a tensor-parallel group of identical ones).

    Parameters
    ----------
    name : str
        Label shown in plans and plots.
    peak_flops : Mapping[str, float]
        Peak dense FLOP/s of one device per dtype (keys: canonical dtype names, see
        :func:`~hf_magicdec.planner.dtypes.canonical_dtype`).
    bandwidth : float
        Memory bandwidth of one device, bytes/s.
    memory_bytes : float
        Memory capacity of one device, bytes (used only for the "does it fit" check).
    tp : int
        Tensor-parallel degree: weights, KV heads, query heads and vocabulary are split over
        ``tp`` devices, and each layer adds two all-reduces.
    link_bandwidth : float
        Per-device, per-direction interconnect bandwidth used by all-reduce, bytes/s.
    allreduce_latency : float
        Fixed cost of one all-reduce, seconds (only when ``tp > 1``).
    overhead : float
        Fixed cost of one forward pass (kernel launches, Python), seconds. 0 in the GPU presets
        (their host time is ``layer_overhead``); fitted by calibration.
    layer_overhead : float
        Host time per decoder layer of an *eager* forward, seconds: on a GPU each of a layer's ~60
        operators costs a launch and some Python (about 0.3 ms per layer, 10 ms for a 32-layer
        model, whatever the batch). Paid only when ``captured`` is False.
    captured : bool
        Whether the steps run captured (``compile=``: CUDA graphs), which removes the per-layer
        host time. True by default (``compile="auto"`` captures on CUDA); the per-call planner sets
        it from the call's ``compile`` setting. Calibrated CPUs fit their host time into ``overhead``.
    format_flops : Mapping[str, float]
        Effective FLOP/s of linear layers stored in a compressed weight format (keys ``"int8"``,
        ``"fp16"``, ``"int4"``: a quantized self-draft's ``draft_weights``), fitted by calibration;
        a format without an entry runs at ``peak_flops``' rate for its name if listed (CPU int8
        GEMMs), else at the model's dtype (weight-only formats dequantize and compute in it). Kept
        apart from ``peak_flops`` because ``"fp16"`` weights are not the float16 dtype: fbgemm's
        fp16-weight linear layers compute in fp32.
    overlap : bool
        True (roofline): an op group costs ``max(compute, memory)``, the two overlap perfectly,
        as on GPUs. False: ``compute + memory``, which describes small CPU matmuls better (see
        :mod:`~hf_magicdec.calibration.fit`, which picks whichever fits the device).
    fused_mass : bool
        Whether the verify attention emits the attention mass per page (the ``attended`` view's
        choice) inside its fused kernel (the Triton kernel, on CUDA): then it costs a few bytes per
        page. False (the ``cpu`` preset and CPU calibrations): the PyTorch twin computes that
        verification's attention with an explicit softmax, writing and reading its fp32
        probabilities once more than a fused attention does (at 8 rows x 4K on 2 CPU cores, 5.2 ms
        per layer against 4.4 ms).

    Raises
    ------
    ValueError
        If a number is non-positive (``overhead``/``allreduce_latency`` may be 0) or ``tp`` is
        not a positive int.

    Examples
    --------
    >>> get_hardware("h100", tp=8).tp
    8
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

    def __reduce__(self):
        """Picklable (a plan's step model is broadcast to the other ranks): the read-only mapping
        travels as a dict and is made read-only again on the other side."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["peak_flops"] = dict(self.peak_flops)
        fields["format_flops"] = dict(self.format_flops)
        return (_rebuild, (type(self), fields))

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
        if not isinstance(self.format_flops, Mapping):
            raise ValueError(f"format_flops must be a mapping weight format -> FLOP/s, got {self.format_flops!r}.")
        for key, value in self.format_flops.items():
            if key not in QUANTIZED_FORMATS:
                raise ValueError(f"format_flops keys are weight formats {QUANTIZED_FORMATS}, got {key!r}.")
            check_number(f"format_flops[{key!r}]", value)
        object.__setattr__(self, "format_flops",
                           types.MappingProxyType({k: float(v) for k, v in self.format_flops.items()}))
        check_number("bandwidth", self.bandwidth)
        if self.memory_bytes != float("inf"):  # inf = capacity unknown / not checked
            check_number("memory_bytes", self.memory_bytes)
        check_number("link_bandwidth", self.link_bandwidth)
        check_number("allreduce_latency", self.allreduce_latency, allow_zero=True)
        check_number("overhead", self.overhead, allow_zero=True)
        check_number("layer_overhead", self.layer_overhead, allow_zero=True)
        check_int("tp", self.tp)
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be a bool, got {self.overlap!r}.")
        if not isinstance(self.fused_mass, bool):
            raise ValueError(f"fused_mass must be a bool, got {self.fused_mass!r}.")

    def peak(self, dtype: Any) -> float:
        """Peak FLOP/s of one device for ``dtype``.

        A dtype without its own entry falls back to the nearest wider one that has one
        (float8 → bfloat16/float16 → float32): the math then runs at that rate.

        Raises
        ------
        ValueError
            If neither the dtype nor a wider one is listed.
        """
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
        """FLOP/s of linear layers stored as ``weight_format`` (None: in ``dtype``), see
        ``format_flops``."""
        if weight_format is None:
            return self.peak(dtype)
        if weight_format in self.format_flops:
            return self.format_flops[weight_format]
        return self.peak_flops.get(weight_format, self.peak(dtype))

    def replace(self, **changes: Any) -> "HardwareSpec":
        """Copy with ``changes`` applied (validated again)."""
        for name in ("peak_flops", "format_flops"):
            if name not in changes:
                changes[name] = dict(getattr(self, name))
        return dataclasses.replace(self, **changes)

    def with_tp(self, tp: int) -> "HardwareSpec":
        """The same device, ``tp`` of them in tensor parallel."""
        return self.replace(tp=tp)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        out = dataclasses.asdict(self)
        out["peak_flops"] = dict(self.peak_flops)
        out["format_flops"] = dict(self.format_flops)
        return out


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
        # Effective rates, not datasheet peaks: what `hf-magicdec plan --calibrate` fitted on the
        # 2-core x86 VM the benchmarks of docs/benchmarks.md ran on (Xeon, AVX2, torch 2.13, 2026-12;
        # SmolLM2-135M in fp32: 11.5 GB/s, 181 GFLOP/s, additive, no fixed overhead; another such VM
        # fitted 15.7 GB/s and 116 GFLOP/s). The ratio of FLOP/s to bytes/s decides how much more a
        # verification of γ + 1 tokens costs than one decode step: measured 1.1x at γ = 1 and 1.4x at
        # γ = 4 at 8 rows, predicted 1.2x and 1.8x (the former preset, 100 GFLOP/s and 20 GB/s: 1.5x
        # and 2.7x). A machine with more cores has more of both: calibrate to replace them.
        name="cpu (uncalibrated)",
        fused_mass=False,  # the PyTorch twin emits attended's mass (explicit softmax)
        peak_flops={"float32": 180e9, "bfloat16": 50e9, "float16": 25e9},
        # Linear layers of a compressed self-draft: dynamically quantized int8 (activations
        # quantized per call) and fbgemm's fp16 weights (fp32 math), both slower per FLOP than
        # fp32 GEMMs there; they win by reading fewer bytes.
        format_flops={"int8": 85e9, "fp16": 95e9},
        bandwidth=12 * _GB, link_bandwidth=10 * _GB, allreduce_latency=20e-6, overhead=0.0, overlap=False,
    ),
}

_PRESET_ALIASES = {"a100-80gb": "a100", "a100-sxm": "a100", "h100-sxm": "h100", "h200-sxm": "h200"}


def get_hardware(name: str | HardwareSpec, tp: int = 1) -> HardwareSpec:
    """Return a preset by name (case-insensitive), ``tp`` devices in tensor parallel.

    Parameters
    ----------
    name : str or HardwareSpec
        ``"a100"``, ``"h100"``, ``"h200"``, ``"l40s"`` or ``"cpu"``; a spec is returned as is
        (with ``tp`` applied when ``tp != 1``).
    tp : int
        Tensor-parallel degree.

    Raises
    ------
    ValueError
        If the name is unknown.
    """
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

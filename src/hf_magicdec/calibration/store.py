"""Calibration records (:class:`Measurement`, :class:`StepTimes`, :class:`Fit`, :class:`Calibration`)
and their JSON cache, one file per model, device and dtype under ``cache_root() / "calibration"``.
Only :func:`device_key` uses torch."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from ..notices import notice
from ..checks import check_number
from ..planner.hardware import HardwareSpec, get_hardware
from ..planner.modelspec import ModelSpec
from ..planner.roofline import forward_cost

__all__ = ["Calibration", "Measurement", "StepTimes", "Fit", "cache_root", "calibration_path", "cpu_name",
           "device_key", "load_calibration", "other_thread_counts"]

# Raised whenever files of the previous format would misprice plans (4: the CPU row curve; git log has why).
_FORMAT = 4


@dataclass(frozen=True)
class Measurement:
    """One timed forward: ``kind`` ``"target"``, ``"verify"`` or ``"draft"`` (step 0), its shape as in
    :func:`~hf_magicdec.planner.roofline.forward_cost`, wall ``seconds`` (median or minimum of the
    repeats) and its linear layers' ``weights`` (``"full"`` or a quantized draft's format)."""

    kind: str
    batch: int
    query_tokens: int
    kv_tokens: int
    logit_tokens: int
    seconds: float
    weights: str = "full"

    def predict(self, model: ModelSpec, hardware: HardwareSpec) -> float:
        """Roofline prediction of this forward on ``hardware``, seconds."""
        return forward_cost(model.with_weights(self.weights), hardware, batch=self.batch,
                            query_tokens=self.query_tokens, kv_tokens=self.kv_tokens,
                            logit_tokens=self.logit_tokens).seconds


@dataclass(frozen=True)
class StepTimes:
    """Step times (seconds) on one prefilled cache of ``batch`` rows × ``context`` tokens: ``t_target``
    (T_T), ``t_verify`` {γ: T_V}, ``t_draft`` {budget: T_D of draft step 0 with ``draft``},
    ``t_draft_quantized`` the same on ``draft_weights`` (``"full"``: none timed), and
    ``prefill_seconds`` (filling the cache and building the views)."""

    batch: int
    context: int
    draft: str
    t_target: float
    t_verify: Mapping[int, float] = field(hash=False)
    t_draft: Mapping[int, float] = field(hash=False)
    prefill_seconds: float = 0.0
    draft_weights: str = "full"
    t_draft_quantized: Mapping[int, float] = field(default_factory=dict, hash=False)

    def measurements(self) -> list[Measurement]:
        """The times as :class:`Measurement` rows (the shapes the roofline needs)."""
        s, b = self.context, self.batch
        rows = [Measurement("target", b, 1, s + 1, 1, self.t_target)]
        rows += [Measurement("verify", b, g + 1, s + g + 1, g + 1, t) for g, t in sorted(self.t_verify.items())]
        # The draft attends to its whole view buffer (budget slots, masked where empty) + itself.
        rows += [Measurement("draft", b, 1, k + 1, 1, t) for k, t in sorted(self.t_draft.items())]
        rows += [Measurement("draft", b, 1, k + 1, 1, t, self.draft_weights)
                 for k, t in sorted(self.t_draft_quantized.items())]
        return rows


@dataclass(frozen=True)
class Calibration:
    """Fitted effective rates of ``model`` (shapes ``spec``) on ``device`` (:func:`device_key`) in ``dtype``:
    ``bandwidth`` bytes/s, ``flops`` FLOP/s, ``overhead`` seconds per forward, ``overlap`` (roofline
    ``max`` or ``compute + memory`` fitted better), ``quantized_flops`` {format: FLOP/s} of quantized
    draft linears (empty if none timed), ``quantized_overhead`` {format: host seconds per layer} and
    ``quantized_build`` {format: seconds per weight byte to build the quantized draft}, ``linear_rows``
    the CPU's row curve (:func:`~.rows.measure_linear_rows`; empty on a GPU). Also the
    ``measurements``, their ``rel_rms_error`` and the ``outliers`` left out (indices), ``wall_seconds``
    of the run, ``created`` (ISO) and ``versions``."""

    model: str
    spec: ModelSpec
    device: str
    dtype: str
    bandwidth: float
    flops: float
    overhead: float
    overlap: bool
    measurements: tuple[Measurement, ...]
    rel_rms_error: float
    outliers: tuple[int, ...] = ()
    wall_seconds: float = 0.0
    created: str = ""
    versions: Mapping[str, str] = field(default_factory=dict, hash=False)
    quantized_flops: Mapping[str, float] = field(default_factory=dict, hash=False)
    quantized_overhead: Mapping[str, float] = field(default_factory=dict, hash=False)
    quantized_build: Mapping[str, float] = field(default_factory=dict, hash=False)
    linear_rows: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        check_number("bandwidth", self.bandwidth)
        check_number("flops", self.flops)
        check_number("overhead", self.overhead, allow_zero=True)

    def hardware(self, base: HardwareSpec | str = "cpu") -> HardwareSpec:
        """``base`` with the fitted rates (FLOP/s for :attr:`dtype`), overhead, form and row curve; its
        tensor-parallel degree and interconnect are kept."""
        fitted = Fit(self.bandwidth, self.flops, self.overhead, self.overlap, self.rel_rms_error)
        hardware = fitted.hardware(base, self.dtype, name=f"{self.device} (calibrated)")
        # Only CUDA runs the Triton kernel that emits attended's mass fused; a CPU runs the twin.
        hardware = hardware.replace(fused_mass=not self.device.startswith("cpu"), linear_rows=self.linear_rows)
        if not self.quantized_flops:
            return hardware
        return hardware.replace(format_flops={**hardware.format_flops, **self.quantized_flops},
                                format_overhead={**hardware.format_overhead, **self.quantized_overhead},
                                format_build={**hardware.format_build, **self.quantized_build})

    def predictions(self) -> list[tuple[Measurement, float]]:
        """``(measurement, predicted seconds)`` for every measured forward."""
        hw = self.hardware()
        spec = self.spec.with_dtype(self.dtype)
        return [(m, m.predict(spec, hw)) for m in self.measurements]

    def table(self) -> str:
        """Predicted vs measured, one line per forward."""
        lines = [f"{'kind':<7}{'B':>4}{'q':>4}{'keys':>7}  {'measured ms':>12}{'predicted ms':>13}{'error':>8}"]
        for i, (m, p) in enumerate(self.predictions()):
            mark = "  (outlier, not fitted)" if i in self.outliers else ""
            lines.append(f"{m.kind:<7}{m.batch:>4}{m.query_tokens:>4}{m.kv_tokens:>7}  {m.seconds * 1e3:>12.2f}"
                         f"{p * 1e3:>13.2f}{(p - m.seconds) / m.seconds:>+8.1%}{mark}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["format"] = _FORMAT
        out["versions"] = dict(self.versions)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Calibration":
        """Inverse of :meth:`to_dict`; ValueError for another format version."""
        if data.get("format") != _FORMAT:
            raise ValueError(f"Calibration format {data.get('format')!r} is not {_FORMAT}; recalibrate.")
        kwargs = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        kwargs.update(spec=ModelSpec(**data["spec"]), measurements=tuple(Measurement(**m) for m in data["measurements"]),
                      outliers=tuple(kwargs.get("outliers", ())),
                      linear_rows=tuple((rows, factor) for rows, factor in kwargs.get("linear_rows", ())))
        return cls(**kwargs)

    def save(self, path: str | os.PathLike) -> Path:
        """Write JSON atomically; returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=2))
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Calibration":
        return cls.from_dict(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class Fit:
    """What :func:`~hf_magicdec.calibration.fit.fit` returns: ``bandwidth`` bytes/s, ``flops`` FLOP/s,
    ``overhead`` seconds per forward, ``overlap`` (True: ``max(compute, memory)`` per group, False: their
    sum), ``rel_rms_error`` on the measurements kept and the ``outliers`` (indices) left out."""

    bandwidth: float
    flops: float
    overhead: float
    overlap: bool
    rel_rms_error: float
    outliers: tuple[int, ...] = ()

    def hardware(self, base: HardwareSpec | str, dtype: str, name: str | None = None) -> HardwareSpec:
        """``base`` with the fitted numbers (FLOP/s for ``dtype``)."""
        base = get_hardware(base)
        flops = dict(base.peak_flops)
        flops[dtype] = self.flops
        # The fitted overhead is the measured host time of eager forwards: it replaces the preset's
        # per-layer estimate (not added to it).
        return base.replace(name=name or base.name, peak_flops=flops, bandwidth=self.bandwidth,
                            overhead=self.overhead, overlap=self.overlap, layer_overhead=0.0)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-").lower() or "unknown"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform`` elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_key(device: Any = "cpu") -> str:
    """The key of the device a calibration belongs to: ``"cpu-<model name>-<threads>t"`` (torch's intra-op
    threads change CPU timings as much as the chip) or ``"cuda-<device name>"``."""
    device = torch.device(device)
    if device.type == "cuda":
        return _slug(f"cuda-{torch.cuda.get_device_name(device)}")
    return _slug(f"{device.type}-{cpu_name()}-{torch.get_num_threads()}t")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where hf_magicdec keeps files: ``cache_dir``, else ``$HF_MAGICDEC_CACHE``, else
    ``$XDG_CACHE_HOME/hf_magicdec/models`` (``~/.cache/hf_magicdec/models``)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("HF_MAGICDEC_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "hf_magicdec" / "models"


def calibration_path(model_name: str, spec: ModelSpec, device: str, dtype: str,
                     cache_dir: str | os.PathLike | None = None) -> Path:
    """``<cache_root(cache_dir)>/calibration/<model>-<shape hash>__<device>__<dtype>.json``."""
    model = _slug(Path(model_name).name or model_name)  # a Hub id or a path: its last part
    dtype = spec.with_dtype(dtype).dtype
    return cache_root(cache_dir) / "calibration" / f"{model}-{spec.key()}__{_slug(device)}__{dtype}.json"


def other_thread_counts(path: str | os.PathLike) -> list[str]:
    """The device keys of the cached calibrations of the model, shapes, dtype and CPU of ``path`` (a
    :func:`calibration_path` on a CPU, ``...__cpu-<name>-<threads>t__<dtype>.json``) at other torch
    thread counts."""
    path = Path(path)
    model, device, dtype = path.stem.split("__")
    cpu = device.rsplit("-", 1)[0]  # the key without its "-<threads>t"
    keys = (p.stem.split("__")[1] for p in path.parent.glob(f"{model}__{cpu}-*t__{dtype}.json") if p != path)
    return sorted(k for k in keys if re.fullmatch(rf"{re.escape(cpu)}-\d+t", k))


def load_calibration(model_name: str, spec: ModelSpec, device: Any = "cpu", dtype: Any = None,
                     cache_dir: str | os.PathLike | None = None) -> Calibration | None:
    """The cached calibration of this model, device and dtype, or None; an unreadable file is named in a
    :class:`MagicDecWarning` and ignored, and so, where this CPU has none at this process's torch thread
    count, are its calibrations at other counts (:func:`other_thread_counts`)."""
    dtype = spec.with_dtype(dtype).dtype if dtype is not None else spec.dtype
    path = calibration_path(model_name, spec, device_key(device), dtype, cache_dir)
    if not path.is_file():
        others = other_thread_counts(path) if torch.device(device).type == "cpu" else []
        if others:
            notice(f"No calibration of {model_name} for this process's {torch.get_num_threads()} torch threads; the "
                   f"cached ones are for {', '.join(others)} (a CPU's step times depend on its threads). Plans use the "
                   "uncalibrated cost model: run with as many threads (torch.set_num_threads, OMP_NUM_THREADS) or "
                   "calibrate at this count.")
        return None
    try:
        return Calibration.load(path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        notice(f"Ignoring the calibration file {path}: it cannot be read ({type(err).__name__}: {err}). Plans use "
               "the uncalibrated cost model until it is written again (hf_magicdec.calibrate(model) or "
               "`hf-magicdec plan ... --calibrate`).")
        return None

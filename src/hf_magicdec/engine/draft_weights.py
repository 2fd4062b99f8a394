"""Draft weights: the self-draft may read its linear layers from a compressed copy.

A draft token never reaches the user unverified, so the draft forward may use cheaper weights:
only the acceptance can change, never the output. :func:`quantized_draft` returns a *quantized draft* of the model
for the draft forwards: a shallow copy of its module tree that shares every parameter, buffer and
config with the model, except that each ``nn.Linear`` (LM head included) is replaced by a quantized
copy. The model itself is never altered: its modules, weights and ``state_dict`` stay as they are,
prefill and verification run it unchanged, and the quantized draft is cached beside it (in a
``WeakKeyDictionary``, not as an attribute, which would register it as a submodule) and freed with
it. A quantized draft whose source weights were replaced or modified in place since it was made is rebuilt.

Formats and kernels (chosen by speed measured on this project's CPUs, ``docs/benchmarks.md``):

``"int8"`` on CPU
    PyTorch's dynamically quantized linear (``quantized::linear_dynamic``, the op behind
    ``torch.ao.nn.quantized.dynamic.Linear``: int8 per-channel weights, activations quantized per
    call; fbgemm / oneDNN / QNNPACK GEMMs). At batch 8 the SmolLM2 LM head (576 → 49,152) costs
    12 ms in fp32 and 0.9–2.6 ms this way; torchao's int8 configs run eagerly at several times the
    fp32 cost on CPU, and ``torch._weight_int8pack_mm`` (weight-only, AVX2 machines) 6x the fp32
    cost, so neither is used there. The 7-bit activations cost acceptance: 0.05-0.08 below the
    full-weight draft on SmolLM2 at batch 8.
``"fp16"`` on CPU (x86, fbgemm)
    fbgemm's fp16-weight linear (``quantized::linear_dynamic_fp16``): half the bytes of fp32
    weights, computed in fp32 with no activation quantization (2e-4 relative error), so the draft
    accepts as the full-weight one does. On 2 AVX2 cores at batch 8 its draft forward is as fast as
    int8's (the draft is bound by the cost of its thousands of small operator calls there, not by
    weight bytes).
A PEFT model (LoRA and kin) gets a quantized draft whose tuner layers quantize their base layer only; the
adapters stay in full precision and are shared with the model, so training them is seen by the
draft at once, without rebuilding the quantized draft.

``"int8"`` / ``"int4"`` on CUDA
    torchao's weight-only configs (``Int8WeightOnlyConfig`` / ``Int4WeightOnlyConfig``), when
    torchao is installed. Not yet measured on a GPU.

Everything else (int4 on CPU, a GPU without torchao, models whose weights are sharded, offloaded
or already quantized) is refused by :func:`check_draft_weights` before any forward.
"""

from __future__ import annotations

import copy
import importlib.util
import time
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from ..defaults import AUTO, QUANTIZED_FORMATS

__all__ = ["QUANTIZED_FORMATS", "QuantizedDraft", "check_draft_weights", "feasible_formats", "has_quantized_draft",
           "quantized_draft", "source_bytes", "supported_formats"]

# model -> {format: QuantizedDraft}. Weak keys: the quantized draft holds no reference to the model
# object itself (only to its parameters), so the entry and the quantized copy go when the model does.
_QUANTIZED: "weakref.WeakKeyDictionary[nn.Module, dict[str, QuantizedDraft]]" = weakref.WeakKeyDictionary()


@dataclass
class QuantizedDraft:
    """A model's quantized draft and what it was made from.

    Attributes
    ----------
    module : the quantized draft (an instance of the model's class sharing all but its linear layers).
    fmt : ``"int8"`` or ``"int4"``.
    nbytes : bytes of the quantized copies (the extra memory the quantized draft costs).
    linears : how many linear layers were replaced.
    source : ``(id, version)`` of every replaced weight, to notice updates to the model.
    build_seconds : wall time it took to make, seconds.
    """

    module: nn.Module
    fmt: str
    nbytes: int
    linears: int
    source: tuple
    build_seconds: float = 0.0


def supported_formats(device: torch.device) -> tuple[str, ...]:
    """Quantized draft-weight formats with a kernel on ``device`` (``()``: none)."""
    if device.type == "cpu":
        engines = torch.backends.quantized.supported_engines
        int8 = _cpu_int8_kernel() and ("fbgemm" in engines or "qnnpack" in engines)
        fp16 = _cpu_op("linear_prepack_fp16", "linear_dynamic_fp16") and "fbgemm" in engines
        return ("int8",) * int8 + ("fp16",) * fp16
    if device.type == "cuda" and importlib.util.find_spec("torchao") is not None:
        return ("int8", "int4")
    return ()


def _cpu_int8_kernel() -> bool:
    """PyTorch's dynamic int8 linear is still there (its quantized tensors are deprecated upstream:
    once a release drops them, int8 is refused on CPU instead of failing mid-call)."""
    return _cpu_op("linear_prepack", "linear_dynamic") and hasattr(torch, "quantize_per_channel")


def _cpu_op(*names: str) -> bool:
    try:
        return all(hasattr(torch.ops.quantized, op) for op in names)
    except (AttributeError, RuntimeError):
        return False


def check_draft_weights(model, fmt: str, device: torch.device, draft_model=None) -> None:
    """Refuse a ``draft_weights`` setting this call cannot honour, before any forward."""
    if fmt in ("full", AUTO):
        return
    if draft_model is not None:
        raise ValueError(f"draft_weights={fmt!r} quantizes the model's own draft forwards; with draft_model= the draft "
                         "is a separate model (quantize it yourself, or drop draft_model).")
    available = supported_formats(device)
    if fmt not in available:
        if device.type == "cuda":
            hint = ("fp16 draft weights are a CPU format (fbgemm); a GPU model is usually 16-bit already"
                    if fmt == "fp16" else "install torchao for int8/int4 draft weights on CUDA")
        else:
            hint = f"this CPU has kernels for {list(available)}" if available else f"no quantized kernel on {device.type}"
        raise ValueError(f"draft_weights={fmt!r} is not available on {device.type} ({hint}); "
                         f"available: {['full', *available]}.")
    why = _unquantizable(model)
    if why is not None:
        raise ValueError(f"draft_weights={fmt!r}: {why}")


def _unquantizable(model) -> str | None:
    """Why no quantized draft can be built for ``model`` (whatever the format), or None."""
    chosen = {id(m) for m in _quantized_linears(model)}
    linears = []
    for name, module in model.named_modules():
        if hasattr(module, "_hf_hook") or _patched_forward(module):
            return (f"module {name!r} carries an accelerate hook or a patched forward (device_map offloading?), and a "
                    "quantized draft needs a model whose forwards are its own. Use draft_weights='full'.")
        if id(module) in chosen:
            linears.append((name, module))
    if not linears:
        return "the model has no plain torch.nn.Linear layer to quantize (already quantized?). Use draft_weights='full'."
    for name, linear in linears:
        weight = linear.weight
        if not weight.is_floating_point() or weight.device.type == "meta" or type(weight.data) is not torch.Tensor:
            return (f"{name}.weight is {type(weight.data).__name__} {weight.dtype} on {weight.device}; only dense "
                    "floating-point weights can be quantized (sharded, offloaded or quantized models: use "
                    "draft_weights='full').")
    return None


def _patched_forward(module: nn.Module) -> bool:
    """Whether ``module`` carries a forward of its own (accelerate's hooks, a user's patch); its
    class's forward bound to itself (what ``monkeypatch`` leaves behind) is not one."""
    own = vars(module).get("forward")
    return own is not None and not _rebound_class_forward(module, own)


def _rebound_class_forward(module: nn.Module, forward) -> bool:
    return getattr(forward, "__self__", None) is module and \
        getattr(forward, "__func__", None) is getattr(type(module), "forward", None)


def feasible_formats(model, device: torch.device, draft_model=None) -> tuple[str, ...]:
    """The quantized formats an ``"auto"`` ``draft_weights`` may pick for this call (no error)."""
    formats = supported_formats(device)
    if draft_model is not None or not formats or _unquantizable(model) is not None:
        return ()
    return tuple(formats)


def has_quantized_draft(model, fmt: str) -> bool:
    """Whether a current quantized draft of ``model`` in ``fmt`` is cached (:func:`quantized_draft` would
    not build one)."""
    draft = _QUANTIZED.get(model, {}).get(fmt)
    return draft is not None and draft.source == _source(model)


def quantized_draft(model, fmt: str) -> QuantizedDraft:
    """The model's quantized draft with ``fmt`` linear layers, made once and reused while the weights last."""
    drafts = _QUANTIZED.setdefault(model, {})
    source = _source(model)
    draft = drafts.get(fmt)
    if draft is None or draft.source != source:
        drafts.pop(fmt, None)  # free the stale copy before making the new one
        draft = drafts[fmt] = _make_quantized_draft(model, fmt, source)
    return draft


def _is_tuner(module: nn.Module) -> bool:
    """A PEFT tuner layer (LoRA and kin): a ``peft`` module wrapping the model's layer as ``base_layer``."""
    return type(module).__module__.startswith("peft.") and "base_layer" in module._modules


def _quantized_linears(model) -> list[nn.Linear]:
    """The linear layers a quantized draft quantizes: every plain ``nn.Linear`` but a PEFT tuner's adapters
    (``lora_A`` / ``lora_B`` …), which stay in full precision (their forwards read e.g.
    ``lora_A.weight.dtype``; they are small) and are shared with the model as they are."""
    adapters = {id(m) for tuner in model.modules() if _is_tuner(tuner)
                for name, child in tuner.named_children() if name != "base_layer" for m in child.modules()}
    return [m for m in model.modules() if type(m) is nn.Linear and id(m) not in adapters]


def _source(model) -> tuple:
    # Adapters are left out: they are shared, so training them never makes the quantized draft stale.
    return tuple((id(m.weight), m.weight._version) for m in _quantized_linears(model))


def _make_quantized_draft(model, fmt: str, source: tuple) -> QuantizedDraft:
    device = next(model.parameters()).device
    on_cpu = device.type == "cpu"
    quantize = {"int8": _DynamicInt8Linear, "fp16": _Fp16Linear}[fmt] if on_cpu else _torchao(fmt)
    start = time.perf_counter()
    linears = _quantized_linears(model)

    def build(linear: nn.Linear) -> nn.Module:
        with torch.no_grad():  # grad mode is per thread
            return quantize(linear)

    # Quantized tensors are deprecated upstream, still the fastest CPU path. The filter is set here, once:
    # warnings.catch_warnings is not thread-safe, and the layers are built side by side.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor, torch\.quantize_per_channel")
        if on_cpu and len(linears) > 1:
            # fbgemm packs a weight on one thread: pack a few layers at once (torch ops release the GIL);
            # a few, as each holds a float copy of its weight while it is built.
            with ThreadPoolExecutor(min(4, max(1, torch.get_num_threads()))) as pool:
                made = list(pool.map(build, linears))
        else:
            made = [build(m) for m in linears]
    quantized = {id(m): q for m, q in zip(linears, made)}

    def copy_of(module: nn.Module) -> nn.Module:
        if id(module) in quantized:
            return quantized[id(module)]
        # Everything else is cloned (a PEFT tuner's adapters too, so that the quantized draft's eval() leaves
        # the model's own training flags alone); clones share parameters, buffers, config, hooks.
        clone = copy.copy(module)
        clone.__dict__.pop("_compiled_call", None)  # transformers' cached torch.compile of the model
        if _rebound_class_forward(module, vars(module).get("forward")):
            del clone.__dict__["forward"]  # bound to the model: the copy would run the model's own forward
        clone._modules = {name: (copy_of(child) if child is not None else None)
                          for name, child in module._modules.items()}
        return clone

    module = copy_of(model)
    module.eval()  # the clones' own flags: the model's stay as the user set them
    nbytes = sum(_quantized_bytes(m) for m in made)
    return QuantizedDraft(module, fmt, nbytes, len(made), source, time.perf_counter() - start)


def source_bytes(model) -> int:
    """Bytes of the weights a quantized draft of ``model`` quantizes (what its build time scales with)."""
    return sum(_tensor_bytes(m.weight) for m in _quantized_linears(model))


class _DynamicInt8Linear(nn.Module):
    """PyTorch's dynamically quantized int8 linear (``quantized::linear_dynamic``: int8 weights per
    output channel, activations quantized per call, 7-bit as ``torch.ao``'s module runs them so
    fbgemm's int16 accumulation never saturates), fed float32 whatever the model's dtype.

    The weight is quantized as ``torch.ao.nn.quantized.dynamic.Linear.from_float`` does it (the scales
    of ``per_channel_dynamic_qconfig``'s per-channel symmetric observer, computed directly), and packed
    once: that module packs a zero weight of the full size first, which tripled the build time."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        # What torch.ao's per-channel symmetric qint8 observer computes (scale: |w|max / 127.5 per row).
        scale = torch.maximum(-weight.amin(1).clamp(max=0), weight.amax(1).clamp(min=0)) / 127.5
        scale = scale.clamp(min=torch.finfo(torch.float32).eps)
        zero_point = torch.zeros(scale.shape, dtype=torch.long)
        qweight = torch.quantize_per_channel(weight, scale.double(), zero_point, 0, torch.qint8)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self._packed = torch.ops.quantized.linear_prepack(qweight, bias)
        self.out_features = linear.out_features
        extra = (scale, zero_point, *([bias] if bias is not None else []))
        self.nbytes = qweight.numel() + sum(_tensor_bytes(t) for t in extra)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x.float(), self._packed, reduce_range=True).to(x.dtype)


class _Fp16Linear(nn.Module):
    """fbgemm's fp16-weight linear (``quantized::linear_dynamic_fp16``): the weight stored in IEEE
    half precision, the product computed in fp32 (no activation quantization), fed float32."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self._packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), bias)
        self.out_features = linear.out_features
        self.nbytes = 2 * linear.weight.numel() + (_tensor_bytes(bias) if bias is not None else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x.float(), self._packed).to(x.dtype)


def _torchao(fmt: str):
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    config = Int8WeightOnlyConfig() if fmt == "int8" else Int4WeightOnlyConfig()

    def quantize(linear: nn.Linear) -> nn.Module:
        copy_ = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                          device=linear.weight.device, dtype=linear.weight.dtype)
        copy_.load_state_dict(linear.state_dict())
        holder = nn.Sequential(copy_)
        quantize_(holder, config)
        return holder[0]

    return quantize


def _quantized_bytes(module: nn.Module) -> int:
    if isinstance(module, (_DynamicInt8Linear, _Fp16Linear)):
        return module.nbytes
    return sum(_tensor_bytes(t) for t in [*module.parameters(), *module.buffers()])


def _tensor_bytes(tensor: torch.Tensor) -> int:
    inner = getattr(tensor, "__tensor_flatten__", None)
    if inner is not None:  # a torchao tensor subclass: sum its packed components
        names, _ = inner()
        return sum(_tensor_bytes(getattr(tensor, n)) for n in names)
    return tensor.numel() * tensor.element_size()

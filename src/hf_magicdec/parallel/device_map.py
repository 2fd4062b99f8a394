"""Device maps that leave room for MagicDec's caches, not just for the weights.

``device_map="auto"`` (accelerate's ``infer_auto_device_map``) fills each device with weights up to
its ``max_memory``; the KV cache allocated later by ``generate`` then has to fit in what is left.
MagicDec's cache is larger than a plain decode cache (γ + 1 scratch slots per row, plus one draft
view per layer), and it lives on the device that *runs* each layer: under accelerate that is the
layer's own device, or the main (first) accelerator for layers offloaded to ``"cpu"`` / ``"disk"``.

:func:`plan_device_map` charges every decoder layer its cache bytes for the given workload and
asks accelerate for a map in which weights, caches and a working-memory reserve fit together::

    plan = hf_magicdec.parallel.device_map.plan_device_map("meta-llama/Llama-3.1-8B", batch_size=8,
                                                 context_length=8192 + 256, max_memory={0: "70GiB", 1: "70GiB"})
    model = AutoModelForCausalLM.from_pretrained(name, device_map=plan.device_map, dtype=torch.bfloat16)
    print(plan.summary())
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import infer_auto_device_map, init_empty_weights
from accelerate.utils import compute_module_sizes, get_max_memory
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from ..config import AUTO, MagicDecConfig
from ..defaults import QUANTIZED_FORMATS
from ..planner.modelspec import ModelSpec

__all__ = ["DeviceMapPlan", "cache_bytes_per_layer", "draft_weight_bytes", "plan_device_map"]

# The planner's largest draft budget (``costmodel.planner.DEFAULT_BUDGETS``): what an "auto"
# budget may grow to.
_LARGEST_AUTO_BUDGET = 2048
_OFFLOAD = ("cpu", "disk")


@dataclass(frozen=True)
class DeviceMapPlan:
    """A device map with MagicDec's cache accounted for.

    Attributes
    ----------
    device_map : dict
        Module name -> device, for ``from_pretrained(device_map=...)`` or accelerate's
        ``dispatch_model``.
    max_memory : dict
        Bytes available per device, as planned for.
    weight_bytes : dict
        Weight bytes placed on each device (``"cpu"`` / ``"disk"`` when offloaded).
    cache_bytes : dict
        MagicDec cache bytes (full KV + scratch + draft views) on each device that runs layers.
    layers : dict
        Decoder layers whose cache lives on each device that runs layers.
    cache_bytes_per_layer : int
        Cache bytes of one decoder layer for the planned workload.
    workspace_bytes : int
        Working memory kept free on each device that runs layers (activations, masks, logits).
    """

    device_map: dict[str, Any]
    max_memory: dict[Any, int]
    weight_bytes: dict[Any, int]
    cache_bytes: dict[Any, int]
    layers: dict[Any, int]
    cache_bytes_per_layer: int
    workspace_bytes: int
    offload_buffer_bytes: int = 0
    draft_weight_bytes: int = 0  # the quantized draft's copy of the linear layers (draft_weights=)
    notes: tuple[str, ...] = field(default=())

    def summary(self) -> str:
        """One line per device: weights, cache, workspace and capacity."""
        lines = [f"MagicDec cache per layer {_size(self.cache_bytes_per_layer)}; workspace "
                 f"{_size(self.workspace_bytes)} per device that runs layers"]
        if self.draft_weight_bytes:
            lines.append(f"quantized draft weights {_size(self.draft_weight_bytes)} beside the layers they copy")
        for device, total in self.max_memory.items():
            weights, cache = self.weight_bytes.get(device, 0), self.cache_bytes.get(device, 0)
            runs = self.layers.get(device, 0) > 0
            used = weights + cache + (self.workspace_bytes if runs else 0)
            lines.append(f"  {device!s:>5}: weights {_size(weights):>10}  cache {_size(cache):>10} "
                         f"({self.layers.get(device, 0)} layers)  used {_size(used):>10} of {_size(total)}")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


def cache_bytes_per_layer(model_or_config, batch_size: int, context_length: int,
                          config: MagicDecConfig | None = None, dtype: Any = None) -> int:
    """Bytes of MagicDec cache one decoder layer holds for a workload.

    Full KV of ``context_length`` (prompt + new tokens) plus the γ + 1 verify slots, the draft
    view (``draft_budget`` slots, or the whole context for ``draft="full"``, plus its γ + 1
    scratch slots) and, for SnapKV, the observation-window queries kept until the views are built.
    ``"auto"`` fields count at their largest: budget 2048, γ = ``max_gamma``.

    Parameters
    ----------
    model_or_config : model, ``PretrainedConfig``, ``config.json`` dict or ``ModelSpec``
    batch_size, context_length : int
    config : MagicDecConfig, optional (default ``MagicDecConfig()``)
    dtype : KV dtype (default: the model's / config's, else bfloat16)
    """
    if batch_size < 1 or context_length < 1:
        raise ValueError(f"batch_size and context_length must be >= 1, got {batch_size=}, {context_length=}.")
    cfg = config if config is not None else MagicDecConfig()
    if isinstance(model_or_config, ModelSpec):
        spec = model_or_config
    else:
        spec = ModelSpec.from_config(getattr(model_or_config, "config", model_or_config),
                                     dtype=dtype if dtype is not None else _dtype_of(model_or_config))
    scratch = cfg.max_gamma if cfg.gamma == AUTO or cfg.adaptive else cfg.gamma
    slots = context_length + scratch + 1  # the full cache
    if scratch > 0:
        if cfg.draft_name == "full":
            view = context_length + scratch + 1
        else:
            view = cfg.draft_budget if cfg.draft_budget != AUTO else _LARGEST_AUTO_BUDGET
        slots += view + scratch + 1  # [static | window | scratch | trash]
    kv_per_slot = spec.kv_bytes_per_token // spec.layers  # keys + values of one token in one layer
    total = batch_size * slots * kv_per_slot
    if scratch > 0:
        # Prefill keeps each layer's last observation-window queries for the views scoring with
        # them (snapkv); an "auto" draft: the largest of the views it may become.
        views = [cfg.view] if cfg.view is not None else list(cfg.candidates)
        observe = max(view.observation_window() for view in views)
        total += batch_size * spec.heads * observe * spec.head_dim * spec.weight_bytes
    return int(total)


def plan_device_map(model_or_config, batch_size: int, context_length: int, *, config: MagicDecConfig | None = None,
                    max_memory: dict | None = None, dtype: Any = None, no_split_module_classes: list[str] | None = None,
                    workspace_bytes: int | None = None) -> DeviceMapPlan:
    """Plan a ``device_map`` with room for MagicDec's cache on every device that runs layers.

    Each decoder layer is charged its weights plus :func:`cache_bytes_per_layer`; accelerate's
    ``infer_auto_device_map`` then places the modules. Layers it offloads to ``"cpu"`` / ``"disk"``
    run on the main (first) accelerator, so their caches are reserved there, and the plan is
    redone until that reservation is stable.

    Parameters
    ----------
    model_or_config : ``PreTrainedModel`` (real or on the meta device), ``PretrainedConfig``, or a
        Hub id / local path (only its config is read; no weights are loaded).
    batch_size : int
        Rows per ``generate`` call (after ``num_return_sequences``).
    context_length : int
        Longest prompt plus ``max_new_tokens``.
    config : MagicDecConfig, optional
        The speculation settings (draft view, budget, γ); default all ``"auto"``, counted at their
        largest.
    max_memory : dict, optional
        Device -> bytes or strings like ``"70GiB"`` (accelerate's format, e.g.
        ``{0: "70GiB", 1: "70GiB", "cpu": "200GiB"}``); default: what accelerate finds free.
    dtype : torch.dtype or str, optional
        Weight and KV dtype (default: the model's or the config's, else bfloat16).
    no_split_module_classes : list of str, optional
        Default: the model's ``_no_split_modules``.
    workspace_bytes : int, optional
        Memory kept free on each device that runs layers for activations, masks and logits;
        default: an estimate from the prefill chunk and the verify logits.

    Returns
    -------
    DeviceMapPlan
        ``plan.device_map`` for ``from_pretrained(device_map=...)``; ``plan.summary()``.

    Raises
    ------
    ValueError
        If a device that runs layers cannot hold its weights, caches and workspace (the cache of
        every offloaded layer must fit on the main accelerator).

    Examples
    --------
    >>> plan = plan_device_map("HuggingFaceTB/SmolLM2-135M", batch_size=4, context_length=4096,
    ...                        max_memory={0: "1GiB", "cpu": "8GiB"})          # doctest: +SKIP
    >>> model = AutoModelForCausalLM.from_pretrained(name, device_map=plan.device_map)  # doctest: +SKIP
    """
    cfg = config if config is not None else MagicDecConfig()
    model, dtype = _meta_model(model_or_config, dtype)
    per_layer = cache_bytes_per_layer(model, batch_size, context_length, cfg, dtype=dtype)
    # A quantized self-draft keeps a copy of every layer's linear weights next to them (and of
    # the LM head next to it, on the main device): charged like the cache.
    quantized_per_layer, quantized_head = draft_weight_bytes(model, cfg.draft_weights, dtype)
    memory = get_max_memory(dict(max_memory) if max_memory is not None else None)
    layer_names = _decoder_layer_names(model)
    sizes = compute_module_sizes(model, dtype=dtype)
    layer_weights = max(sizes[name] for name in layer_names)
    workspace = _workspace(model.config, batch_size, context_length, cfg, dtype, workspace_bytes)
    runners = [d for d in memory if d not in _OFFLOAD] or ["cpu"]
    main = runners[0]
    # Scaling a device's budget by w / (w + c) makes every layer placed there also fit its cache.
    ratio = layer_weights / (layer_weights + per_layer + quantized_per_layer)

    device_map, placed, offloaded = _place(model, memory, runners, workspace, per_layer, quantized_head, ratio,
                                           no_split_module_classes, dtype, layer_names)
    weight_bytes, cache, layers = _tally(device_map, sizes, placed, runners, per_layer)
    # accelerate keeps one offloaded layer's weights on the main device while it runs.
    buffer = layer_weights if offloaded and main not in _OFFLOAD else 0
    for device in runners:
        if layers[device] or weight_bytes.get(device, 0):  # a device that runs something
            quantized = layers[device] * quantized_per_layer + (quantized_head if device == main else 0)
            _check_fits(device, memory, weight_bytes.get(device, 0), cache[device], layers[device], quantized,
                        workspace, buffer if device == main else 0, batch_size, context_length)
    return DeviceMapPlan(device_map=dict(device_map), max_memory=dict(memory), weight_bytes=weight_bytes,
                         cache_bytes=cache, layers=layers, cache_bytes_per_layer=per_layer,
                         workspace_bytes=workspace, offload_buffer_bytes=buffer,
                         draft_weight_bytes=quantized_per_layer * len(layer_names) + quantized_head,
                         notes=_notes(model, cfg, dtype, len(layer_names), offloaded, main))


def _tally(device_map: dict, sizes: dict, placed: dict, runners: list, per_layer: int) -> tuple[dict, dict, dict]:
    """Weight bytes per device, and the cache bytes and layers per device that runs them (an offloaded
    layer runs on the main device, the first runner)."""
    weight_bytes: dict[Any, int] = {}
    for name, device in device_map.items():
        weight_bytes[device] = weight_bytes.get(device, 0) + sizes[name]
    cache = {device: 0 for device in runners}
    layers = {device: 0 for device in runners}
    for device in placed.values():
        runner = device if device in runners else runners[0]
        cache[runner] += per_layer
        layers[runner] += 1
    return weight_bytes, cache, layers


def _notes(model, cfg: MagicDecConfig, dtype, layers: int, offloaded: int, main) -> tuple[str, ...]:
    """What the plan cannot know exactly, or where it places layers that make speculation gain little."""
    notes = []
    if cfg.draft_weights == AUTO:
        notes.append("draft_weights='auto' may add a quantized copy of the linear layers (about "
                     f"{_size(draft_weight_bytes(model, 'int8', dtype)[0] * layers)} as int8) on a model without "
                     "accelerate hooks; pass draft_weights='int8' or 'full' to plan for it exactly")
    if offloaded:
        notes.append(f"{offloaded} layers offloaded: their weights cross to {main!r} on every forward, draft "
                     "forwards included, so speculation gains little (docs/multi_gpu.md)")
    return tuple(notes)


def _place(model, memory, runners, workspace: int, per_layer: int, quantized_head: int, ratio: float, no_split, dtype,
           layer_names):
    """accelerate's placement with every runner's budget scaled so that each layer it gets also
    fits its cache; layers offloaded to ``"cpu"`` / ``"disk"`` run on the main device, whose budget
    then also holds their caches, so the plan is redone until that reservation is stable.
    ``no_split``: the module classes accelerate keeps whole (None: the model's ``_no_split_modules``).
    Returns ``(device_map, device of each decoder layer, layers offloaded)``."""
    no_split = list(no_split if no_split is not None else (getattr(model, "_no_split_modules", None) or []))
    main = runners[0]
    offloaded = 0
    for _ in range(len(layer_names) + 1):
        budget = {}
        for device, total in memory.items():
            if device in runners:
                room = total - workspace - (offloaded * per_layer + quantized_head if device == main else 0)
                budget[device] = max(int(room * ratio), 0)
            else:
                budget[device] = total
        device_map = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=no_split, dtype=dtype)
        placed = {name: _device_of(name, device_map) for name in layer_names}
        now = sum(1 for device in placed.values() if device not in runners)
        if now <= offloaded:
            break
        offloaded = now
    return device_map, placed, offloaded


def _check_fits(device, memory, weights: int, cache: int, layers: int, quantized: int, workspace: int, buffer: int,
                batch_size: int, context_length: int) -> None:
    need = weights + cache + quantized + workspace + buffer
    if device in memory and need > memory[device]:
        raise ValueError(
            f"device {device!r} needs {_size(need)} (weights {_size(weights)}, MagicDec cache {_size(cache)} for "
            f"{layers} layers, quantized draft weights {_size(quantized)}, workspace {_size(workspace)}) but "
            f"max_memory gives it {_size(memory[device])}: lower {batch_size=} or {context_length=}, or add devices."
        )


def draft_weight_bytes(model_or_config, draft_weights: str, dtype: Any = None) -> tuple[int, int]:
    """``(bytes per decoder layer, bytes of the LM head)`` of the quantized draft that
    ``draft_weights`` (``"int8"`` / ``"fp16"`` / ``"int4"``) keeps beside the model; ``(0, 0)`` otherwise
    (``"full"``, and ``"auto"``, which only picks a format for models without device-map hooks)."""
    if draft_weights not in QUANTIZED_FORMATS:
        return 0, 0
    spec = ModelSpec.from_config(getattr(model_or_config, "config", model_or_config),
                                 dtype=dtype if dtype is not None else _dtype_of(model_or_config))
    per_weight = spec.with_weights(draft_weights).linear_weight_bytes
    return int(spec.layer_params * per_weight), int(spec.vocab * spec.hidden * per_weight)


# ---------------------------------------------------------------------------- helpers
def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def _dtype_of(model_or_config):
    dtype = getattr(model_or_config, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    config = getattr(model_or_config, "config", model_or_config)
    for name in ("dtype", "torch_dtype"):
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return value
    return None


def _meta_model(model_or_config, dtype):
    """``(model, dtype)``: the model itself, or one built on the meta device from a config."""
    if isinstance(model_or_config, torch.nn.Module):
        return model_or_config, _torch_dtype(dtype if dtype is not None else model_or_config.dtype)
    config = model_or_config
    if isinstance(config, (str, os.PathLike)):
        config = AutoConfig.from_pretrained(config)
    if not isinstance(config, PretrainedConfig):
        raise ValueError(f"model_or_config must be a model, a PretrainedConfig or a name/path, got {type(config)!r}.")
    dtype = _torch_dtype(dtype if dtype is not None else (_dtype_of(config) or torch.bfloat16))
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
        model.tie_weights()  # from_config on meta leaves tied embeddings untied (counted twice)
    return model, dtype


def _torch_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"Unknown {dtype=!r}.")
    return value


def _decoder_layer_names(model) -> list[str]:
    """Names of the decoder layers: the ``ModuleList`` with ``num_hidden_layers`` entries."""
    config = model.config
    config = getattr(config, "text_config", None) or config
    count = getattr(config, "num_hidden_layers", None)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return [f"{name}.{i}" if name else str(i) for i in range(count)]
    raise ValueError(f"Cannot find the {count} decoder layers of {type(model).__name__}.")


def _device_of(name: str, device_map: dict) -> Any:
    """Device of module ``name`` under ``device_map`` (its longest listed prefix)."""
    best, device = -1, None
    for key, value in device_map.items():
        if key == "" or name == key or name.startswith(key + "."):
            if len(key) > best:
                best, device = len(key), value
    if device is None:
        raise ValueError(f"{name!r} is not covered by the device map {device_map}.")
    return device


def _workspace(model_config, batch: int, context: int, cfg: MagicDecConfig, dtype: torch.dtype,
               given: int | None = None) -> int:
    """Working memory of one forward: a prefill chunk's activations and mask, and the verify logits
    (``given``: the caller's figure)."""
    if given is not None:
        return int(given)
    config = getattr(model_config, "text_config", None) or model_config
    hidden = int(config.hidden_size)
    inter = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    vocab = int(config.vocab_size)
    act_bytes = torch.empty((), dtype=dtype).element_size()
    chunk = min(cfg.prefill_chunk_size, context)
    scratch = cfg.max_gamma if cfg.gamma == AUTO or cfg.adaptive else cfg.gamma
    activations = batch * chunk * (4 * hidden + 3 * inter) * act_bytes
    mask = batch * chunk * context  # bool
    logits = 3 * batch * (scratch + 1) * vocab * 4  # fp32 logits, processed scores, probabilities
    return int(activations + mask + logits)

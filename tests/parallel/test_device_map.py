"""accelerate device maps: hooked / offloaded models give the same tokens as the plain model, the
cache moves its per-row tensors once per device (not once per layer), and ``plan_device_map``
leaves room for MagicDec's cache."""

from __future__ import annotations

import pytest
import torch
from accelerate import cpu_offload, dispatch_model
from torch.overrides import TorchFunctionMode

from conftest import EOS, make_model, ragged_prompts

from hf_magicdec import MagicDecConfig
from hf_magicdec.engine.cache import MagicDecCache
from hf_magicdec.parallel.device_map import cache_bytes_per_layer, plan_device_map
from hf_magicdec.planner import ModelSpec

SPEC = MagicDecConfig.from_any(draft="streamingllm", draft_budget=16, gamma=3, sink_tokens=4, prefill_chunk_size=16)
LAYERS = 4


def _plain():
    return make_model("llama-gqa3", layers=LAYERS)


def _generate(model, do_sample: bool, speculative=SPEC):
    ids, mask = ragged_prompts(batch=3, length=40, seed=5)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=do_sample, eos_token_id=EOS)
    if do_sample:
        kwargs.update(top_k=20)
        torch.manual_seed(7)
    if speculative is not None:
        kwargs["speculative"] = speculative
    return model.generate(**kwargs)


@pytest.fixture(scope="module")
def references():
    model = _plain()
    return {"stock": _generate(model, False, speculative=None), "greedy": _generate(model, False),
            "sample": _generate(model, True)}


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sample"])
def test_cpu_offload_hooks_identical(references, do_sample):
    """Weights on the meta device, streamed in by accelerate's hooks at every forward."""
    model = cpu_offload(_plain(), execution_device="cpu")
    assert model.model.layers[0].self_attn.q_proj.weight.device.type == "meta"
    out = _generate(model, do_sample)
    assert torch.equal(out, references["sample" if do_sample else "greedy"])
    if not do_sample:
        assert torch.equal(out, references["stock"])


def test_planned_device_map_with_disk_offload_identical(references, tmp_path):
    """A map from ``plan_device_map`` that sends some layers to disk, dispatched by accelerate."""
    model = _plain()
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    per_layer = cache_bytes_per_layer(model, 3, 60, SPEC)
    # Room for the small modules, the caches of every layer, the workspace and about two layers.
    plan = plan_device_map(model, 3, 60, config=SPEC, workspace_bytes=0,
                           max_memory={"cpu": 2 * layer + LAYERS * per_layer + 200_000, "disk": 10**9})
    assert "disk" in plan.device_map.values() and "cpu" in plan.device_map.values()
    assert plan.layers == {"cpu": LAYERS}  # disk layers run on the CPU, so their caches live there
    dispatched = dispatch_model(model, device_map=plan.device_map, main_device="cpu", offload_dir=str(tmp_path))
    assert torch.equal(_generate(dispatched, False), references["greedy"])


# ---------------------------------------------------------------- per-device copies
class _CountCopiesTo(TorchFunctionMode):
    """Counts ``Tensor.to`` calls that copy onto the meta device (our stand-in second device)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and args[0].device.type != "meta":
            target = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, (str, torch.device))]
            if target and torch.device(target[0]).type == "meta":
                self.count += 1
        return func(*args, **kwargs)


def _copies_per_step(meta_layers: int) -> int:
    """Copies onto a second device during one draft step + verify + commit, for a cache whose
    layers alternate between the CPU and ``meta_layers`` layers on the meta device."""
    batch, heads, dim, prompt, q = 2, 2, 8, 12, 3
    devices = ["cpu", "meta"] * meta_layers
    cache = MagicDecCache(len(devices), batch, prompt + 16, torch.tensor([0, 3]))
    cache.begin_prefill(0, prompt)
    for layer, device in zip(cache.layers, devices):
        keys = torch.randn(batch, heads, prompt, dim, device=device)
        layer.update(keys, keys.clone())
    cache.end_prefill(prompt)
    config = MagicDecConfig.from_any(SPEC, draft_budget=8, sink_tokens=2)
    cache.build_draft_views(config.view, config.draft_budget, config.gamma, prompt, 16)
    with _CountCopiesTo() as counter:
        for begin, tokens in ((lambda: cache.begin_draft(0), 1), (lambda: cache.begin_verify(q), q)):
            forward = begin()
            for layer, device in zip(cache.layers, devices):
                forward.segments(torch.device(device))  # what the attention kernels read per layer
                keys = torch.randn(batch, heads, tokens, dim, device=device)
                layer.update(keys, keys.clone())
        cache.commit(torch.tensor([1, 3]))
        cache.drop_rows((True, False))
    return counter.count


def test_row_tensors_move_once_per_device_not_per_layer():
    few, many = _copies_per_step(1), _copies_per_step(4)
    assert few == many, f"copies grow with the layers on a device: {few} for 1 layer, {many} for 4"
    assert few > 0  # the meta layers really needed the row tensors


# ---------------------------------------------------------------- plan_device_map
def test_cache_bytes_per_layer_matches_the_engine(monkeypatch):
    model = _plain()
    allocated = []
    original = MagicDecCache.build_draft_views

    def recording(self, *args, **kwargs):  # right after allocation, before finished rows leave
        original(self, *args, **kwargs)
        layer = self.layers[0]
        tensors = (layer.keys, layer.values, layer.draft_keys, layer.draft_values)
        allocated.append(sum(t.numel() * t.element_size() for t in tensors))

    monkeypatch.setattr(MagicDecCache, "build_draft_views", recording)
    ids, _ = ragged_prompts(batch=3, length=40, seed=1)
    model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, eos_token_id=None, speculative=SPEC)
    assert allocated == [cache_bytes_per_layer(model, 3, 50, SPEC)]


def test_plan_device_map_reserves_cache_room():
    model = _plain()
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    memory = {0: 4 * layer, 1: 4 * layer, "cpu": 10**9}  # GPU ids need not exist to plan
    on_gpus = []
    for batch in (1, 2, 4):
        plan = plan_device_map(model, batch, 200, config=SPEC, max_memory=memory, workspace_bytes=0)
        for device in (0, 1):
            used = plan.weight_bytes.get(device, 0) + plan.cache_bytes[device]
            if device == 0:
                used += plan.offload_buffer_bytes
            assert used <= memory[device], plan.summary()
            assert plan.cache_bytes[device] == plan.layers[device] * plan.cache_bytes_per_layer
        assert sum(plan.layers.values()) == LAYERS
        resident = sum(1 for name, d in plan.device_map.items() if name.startswith("model.layers") and d in (0, 1))
        on_gpus.append(resident if "" not in plan.device_map else LAYERS)
        assert "MagicDec cache per layer" in plan.summary()
    # A bigger cache leaves less room for weights on the GPUs (layers go to the CPU, their caches
    # to GPU 0, which runs them) ...
    assert on_gpus[0] == LAYERS and on_gpus == sorted(on_gpus, reverse=True) and on_gpus[-1] < LAYERS
    # ... until the caches alone no longer fit.
    with pytest.raises(ValueError, match="MagicDec cache"):
        plan_device_map(model, 8, 200, config=SPEC, max_memory=memory, workspace_bytes=0)


def test_plan_device_map_from_config_and_errors():
    model = _plain()
    plan = plan_device_map(model.config, 1, 64, config=SPEC, max_memory={"cpu": 10**9}, dtype=torch.float32)
    assert set(plan.device_map.values()) == {"cpu"} and plan.layers == {"cpu": LAYERS}
    with pytest.raises(ValueError, match="MagicDec cache"):
        plan_device_map(model, 64, 4096, config=SPEC, max_memory={0: 10**6, "cpu": 10**9})
    with pytest.raises(ValueError, match="batch_size"):
        cache_bytes_per_layer(model, 0, 10)


def test_plan_device_map_counts_the_quantized_draft_weights():
    """draft_weights='int8' keeps an int8 copy of every linear layer (and the LM head): the plan
    charges it, so fewer layers fit where they did with full weights only."""
    from hf_magicdec.parallel.device_map import draft_weight_bytes

    model = _plain()
    spec = ModelSpec.from_config(model.config, dtype=torch.float32)
    per_layer, head = draft_weight_bytes(model, "int8", torch.float32)
    assert per_layer == spec.layer_params and head == spec.vocab * spec.hidden
    assert draft_weight_bytes(model, "full", torch.float32) == (0, 0)
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    memory = {0: 4 * layer, 1: 4 * layer, "cpu": 10**9}
    full = plan_device_map(model, 1, 200, config=SPEC.replace(draft_weights="full"), max_memory=memory,
                           workspace_bytes=0)
    int8 = plan_device_map(model, 1, 200, config=SPEC.replace(draft_weights="int8"), max_memory=memory,
                           workspace_bytes=0)
    assert int8.draft_weight_bytes == LAYERS * per_layer + head and full.draft_weight_bytes == 0
    assert "quantized draft weights" in int8.summary()
    on_gpus = [sum(1 for n, d in p.device_map.items() if n.startswith("model.layers") and d in (0, 1))
               if "" not in p.device_map else LAYERS for p in (full, int8)]
    assert on_gpus[1] <= on_gpus[0]

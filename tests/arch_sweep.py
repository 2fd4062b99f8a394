"""Architecture conformance sweep: every causal LM of the installed transformers, built tiny.

Importable helpers without a pytest dependency, shared by ``tests/test_architectures.py`` and
``scripts/architecture_table.py`` (which writes ``docs/architectures.md``):

- :func:`architectures` lists ``(model_type, class_name)`` from transformers'
  ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``;
- :func:`build_tiny` builds one from its own config class with random weights (about 2 layers,
  hidden 64, 4 heads / 2 KV heads, vocab 128) and makes its features bite: attention soft-capping
  small and actually reached, attention sinks of magnitude 1-3, sliding windows larger than the run
  (or, with ``sliding_window=``, smaller), MoE with a few small experts;
- :func:`run_case` compares ``generate(speculative="magicdec", ...)`` with stock greedy ``generate``
  on a left-padded ragged batch and classifies the outcome as ``identical``, ``refused`` (a
  ``ValueError`` / ``NotImplementedError`` before any forward ran), ``mismatch``, ``crash`` or
  ``skipped`` (stock ``generate`` itself fails);
- :func:`sweep` / :func:`sweep_one` run the cases for all architectures, optionally in a pool.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from typing import Any

import torch

import hf_magicdec  # noqa: F401  (installs the speculative= routing)

VOCAB = 128
PAD, BOS, EOS = 0, 1, 2
#: Prompt and generation sizes of every case; sliding windows / attention chunks are set above the run.
PROMPT_LEN, NEW_TOKENS = 24, 12
BIG_WINDOW = 256
SMALL_WINDOW = 16  # the refusal case: shorter than prompt + new tokens
STATUSES = ("identical", "refused", "mismatch", "crash", "skipped")

#: The cases each architecture runs: name -> run_case keyword arguments.
CASES: dict[str, dict[str, Any]] = {
    "streamingllm": dict(draft="streamingllm", budget=10, gamma=3, sink_tokens=2),
    "snapkv": dict(draft="snapkv", budget=10, gamma=2, window=4),
    # The verifier's attention mass chooses the view (prompt 24 + 12 new tokens outgrow its 10 slots).
    "attended": dict(draft="attended", budget=10, gamma=3, sink_tokens=1, page_size=2, recent_window=4, window=4),
}
#: Run for architectures with sliding-window layers, on a model built with ``SMALL_WINDOW``.
WINDOW_CASE = dict(draft="streamingllm", budget=10, gamma=3, sink_tokens=2)

# ----------------------------------------------------------------------------------------------
# Config shrinking
# ----------------------------------------------------------------------------------------------

#: Applied to every config (and nested sub-config) that has a field or attribute-map entry of that name.
GENERIC: dict[str, Any] = dict(
    vocab_size=VOCAB,
    # BERT-style models are causal LMs only as decoders; with is_decoder=False they attend
    # bidirectionally and MagicDec refuses them (tests/engine/test_attention_features.py).
    is_decoder=True,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    # mixture of experts: a few small experts
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    moe_topk=2,
    moe_intermediate_size=32,
    expert_intermediate_size=32,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    num_shared_experts=1,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    rotary_dim=8,
    # encoder-decoder families used as decoders (Bart, Marian, Whisper, ...)
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    # multi-latent attention
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    # windows larger than the run
    sliding_window=BIG_WINDOW,
    attention_chunk_size=BIG_WINDOW,
    # soft-capping small (made to bite by build_tiny, which scales q/k until logits exceed it)
    attn_logit_softcapping=1.0,
    # deterministic, no dropout
    attention_dropout=0.0,
    hidden_dropout=0.0,
    dropout=0.0,
    # tiny vision / audio towers of multimodal models
    num_channels=3,
)

TOKEN_IDS = dict(pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)

_MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16, mamba_n_groups=1)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

#: Per model_type overrides (applied after GENERIC, to the top-level config kwargs): the attribute
#: names and constraints GENERIC cannot guess. Hybrids get one layer of each kind.
OVERRIDES: dict[str, dict[str, Any]] = {
    "bamba": dict(_MAMBA, attn_layer_indices=[1]),
    "falcon_h1": dict(_MAMBA, mamba_d_ssm=128),
    "granitemoehybrid": dict(_MAMBA, shared_intermediate_size=32, layer_types=["mamba", "attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  mamba_dt_rank=8, use_mamba_kernels=False),
    "nemotron_h": dict(layer_types=["linear_attention", "full_attention"], layers_block_type=["linear_attention", "full_attention"], mamba_num_heads=8, mamba_head_dim=16,
                       ssm_state_size=16, n_groups=1, chunk_size=16, moe_shared_expert_intermediate_size=32,
                       use_mamba_kernels=False),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=64, head_dim=16),
    "zamba": dict(num_hidden_layers=4, layer_types=["linear_attention", "hybrid"] * 2, attn_layer_period=2, attn_layer_offset=1, attention_head_dim=16,
                  mamba_dt_rank=8, use_mamba_kernels=False),
    "zamba2": dict(num_hidden_layers=2, layers_block_type=["linear_attention", "hybrid"], hybrid_layer_ids=[1],
                   mamba_headdim=16, n_mamba_heads=8, mamba_d_state=16, chunk_size=16, attention_head_dim=16,
                   num_query_groups=2, use_mamba_kernels=False),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1, state_size=16, chunk_size=16),
    "xlstm": dict(num_heads=4, num_blocks=2),
    "musicgen": dict(num_codebooks=1),
    "musicgen_melody": dict(num_codebooks=1),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "cohere_compass_text": dict(rope_parameters={"full_attention": _ROPE, "sliding_attention": _ROPE}),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, linear_key_head_dim=16,
                           linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, ple_embed_dim=16,
                           indexer_budget=8, indexer_compress_ratio=2),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=BIG_WINDOW),
    "zaya": dict(num_experts_per_tok=1),
    "dots3_note_text": dict(num_key_value_heads=4),
    "blt": dict(encoder_hash_byte_group_vocab=64),
    "longcat_flash": dict(num_layers=1, zero_expert_num=2),
    "roc_bert": dict(shape_vocab_size=128, pronunciation_vocab_size=128, shape_embed_dim=16,
                     pronunciation_embed_dim=16),
    "reformer": dict(is_decoder=True, attn_layers=["local", "local"], axial_pos_shape=[16, 32],
                     axial_pos_embds_dim=[32, 32], attention_head_size=16, feed_forward_size=128,
                     max_position_embeddings=512, local_attn_chunk_length=16),
    "xlnet": dict(d_head=16),
    "kimi_linear": dict(linear_head_dim=16, linear_num_heads=4, num_experts_per_token=2),
    "prophetnet": dict(num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=4,
                       num_decoder_attention_heads=4, activation_dropout=0.0),
}
for _gemma in ("gemma3n_text", "gemma4_text", "gemma4_unified_text"):
    OVERRIDES[_gemma] = dict(num_kv_shared_layers=0, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
                             global_head_dim=16)
for _assistant in ("gemma4_assistant", "gemma4_unified_assistant"):
    OVERRIDES[_assistant] = dict(num_kv_shared_layers=0, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=0,
                                 global_head_dim=16)

#: Per model_type overrides of nested sub-configs: model_type -> {sub_config_name: {key: value}}.
SUB_OVERRIDES: dict[str, dict[str, dict[str, Any]]] = {
    "dbrx": {"attn_config": dict(rope_theta=10000.0, kv_n_heads=2, clip_qkv=8.0),
             "ffn_config": dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2)},
    "dots3_note": {"text_config": dict(num_key_value_heads=4)},
}
for _gemma in ("gemma3n", "gemma4", "gemma4_unified"):
    SUB_OVERRIDES[_gemma] = {"text_config": OVERRIDES[f"{_gemma}_text"]}

#: Run after building: model_type -> function(model).
POST_BUILD: dict[str, Any] = {
    "xmod": lambda model: model.set_default_language(next(iter(model.config.languages))),
}

#: model_type -> reason: not built at all (documented in the table as skipped).
NOT_BUILT: dict[str, str] = {}

#: model_type -> largest parameter count accepted (default MAX_PARAMS).
MAX_PARAMS_FOR: dict[str, int] = {"phi4_multimodal": 15_000_000}

MAX_PARAMS = 5_000_000


def architectures() -> list[tuple[str, str]]:
    """Sorted ``(model_type, class_name)`` of the installed transformers' causal LMs."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type, names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if isinstance(names, (list, tuple)):
            out.extend((model_type, n) for n in names)
        else:
            out.append((model_type, names))
    return sorted(set(out))


def _field_names(config_cls) -> set[str]:
    """Constructor keywords that set a real field: dataclass fields and attribute-map aliases of fields."""
    fields = {f.name for f in dataclasses.fields(config_cls)} if dataclasses.is_dataclass(config_cls) else set()
    amap = getattr(config_cls, "attribute_map", {}) or {}
    return fields | {alias for alias, target in amap.items() if target in fields}


def _get(obj, name: str, fallback=None):
    """``getattr`` that also survives configs raising other errors (per-layer attributes of heterogeneous configs)."""
    try:
        return getattr(obj, name, fallback)
    except Exception:  # noqa: BLE001
        return fallback


def _pick_layer_types(types: list, n: int) -> list:
    """``n`` layer types covering the distinct types in order of appearance (e.g. sliding + full)."""
    distinct = list(dict.fromkeys(types))
    return [distinct[i % len(distinct)] for i in range(n)]


def _tiny_kwargs(config_cls, default, extra: dict[str, Any] | None, sub_extra: dict[str, dict] | None,
                 sliding_window: int | None) -> dict[str, Any]:
    names = _field_names(config_cls)
    kw = {k: v for k, v in {**GENERIC, **TOKEN_IDS}.items() if k in names}
    if "kv_lora_rank" in names and "qk_rope_head_dim" in names:
        kw["head_dim"] = kw["qk_rope_head_dim"]  # multi-latent attention: head_dim is the rotary part
        kw["num_key_value_heads"] = kw["num_attention_heads"]  # and every head has its own key
        kw = {k: v for k, v in kw.items() if k in names}
    if sliding_window is not None and "sliding_window" in names:
        kw["sliding_window"] = sliding_window
    if "attn_logit_softcapping" in kw and _get(default, "attn_logit_softcapping") is None:
        del kw["attn_logit_softcapping"]  # a model without soft-capping keeps it off
    for key in ("sliding_window", "attention_chunk_size"):
        if key in kw and _get(default, key) is None and sliding_window is None:
            del kw[key]  # keep a feature off where the default has it off
    n_layers = kw.get("num_hidden_layers", 2)
    layer_types = _get(default, "layer_types")
    if "layer_types" in names and isinstance(layer_types, (list, tuple)) and layer_types:
        kw["layer_types"] = _pick_layer_types(list(layer_types), n_layers)
    # other per-layer lists (e.g. activation sparsity per layer) follow the layer count
    default_layers = _get(default, "num_hidden_layers")
    if isinstance(default_layers, int) and default_layers > n_layers:
        for f in dataclasses.fields(config_cls) if dataclasses.is_dataclass(config_cls) else ():
            value = _get(default, f.name)
            if f.name not in kw and isinstance(value, (list, tuple)) and len(value) == default_layers:
                kw[f.name] = _pick_layer_types(list(value), n_layers) if f.name.endswith("types") else \
                    list(value)[:n_layers]
    for name in getattr(config_cls, "sub_configs", {}) or {}:
        sub = _get(default, name)
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        sub_kw = _tiny_kwargs(type(sub), sub, (sub_extra or {}).get(name), None, sliding_window)
        kw[name] = type(sub)(**sub_kw)
    kw.update(extra or {})
    return kw


def tiny_config(model_type: str, sliding_window: int | None = None, model_cls=None):
    """The tiny config of ``model_type`` (a ``CONFIG_MAPPING`` class with GENERIC + OVERRIDES)."""
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    if model_cls is not None and getattr(model_cls, "config_class", None) not in (None, config_cls):
        config_cls = model_cls.config_class  # e.g. Llama4ForCausalLM takes the text config of "llama4"
    try:
        default = config_cls()
    except Exception:  # noqa: BLE001  (a default that does not validate; start from the overrides)
        default = config_cls(**OVERRIDES.get(model_type, {}))
    kw = _tiny_kwargs(config_cls, default, OVERRIDES.get(model_type), SUB_OVERRIDES.get(model_type), sliding_window)
    config = config_cls(**kw)
    for cfg in _configs(config):
        for key, value in (("pad_token_id", PAD), ("bos_token_id", BOS), ("eos_token_id", EOS)):
            try:
                setattr(cfg, key, value)
            except Exception:  # noqa: BLE001  (a strict config without that field)
                pass
    return config


def _configs(config) -> list:
    """The config and its nested sub-configs."""
    out = [config]
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            out.extend(_configs(sub))
    return out


def _model_class(class_name: str):
    import transformers

    return getattr(transformers, class_name)


def uses_sliding_window(config) -> bool:
    for cfg in _configs(config):
        types = list(getattr(cfg, "layer_types", None) or [])
        if "sliding_attention" in types:
            return True
        if getattr(cfg, "sliding_window", None) is not None and not types and getattr(cfg, "use_sliding_window", True):
            return True
    return False


def build_tiny(model_type: str, class_name: str, seed: int = 0, sliding_window: int | None = None):
    """A tiny random-weight ``class_name`` (eval, fp32) with soft-caps reached and sinks that matter.

    Raises whatever building raises (the sweep records it as "cannot build tiny").
    """
    if model_type in NOT_BUILT:
        raise RuntimeError(NOT_BUILT[model_type])
    model_cls = _model_class(class_name)
    config = tiny_config(model_type, sliding_window=sliding_window, model_cls=model_cls)
    with torch.device("meta"):
        try:
            n_params = sum(p.numel() for p in model_cls(config).parameters())
        except Exception:  # noqa: BLE001  (some models cannot be built on meta; build for real below)
            n_params = 0
    if n_params > MAX_PARAMS_FOR.get(model_type, MAX_PARAMS):
        raise RuntimeError(f"not tiny: {n_params / 1e6:.1f}M parameters with the overrides")
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        if out is not None and isinstance(getattr(out, "weight", None), torch.nn.Parameter):
            # argmax well separated; untied first, so that the input embeddings do not swamp what
            # attention adds to the residual stream (then the next token would hardly depend on it)
            if inp is not None and getattr(inp, "weight", None) is out.weight:
                out.weight = torch.nn.Parameter(out.weight.detach().clone())
            out.weight.mul_(8.0)
        for module in model.modules():
            sinks = getattr(module, "sinks", None)
            if isinstance(sinks, torch.nn.Parameter):
                magnitude = 1.0 + 2.0 * torch.rand(sinks.shape, generator=g)
                sign = torch.where(torch.rand(sinks.shape, generator=g) < 0.5, -1.0, 1.0)
                sinks.copy_(magnitude * sign)
    gc = model.generation_config
    gc.pad_token_id, gc.bos_token_id, gc.eos_token_id = PAD, BOS, EOS
    gc.do_sample = False
    for key in ("temperature", "top_p", "top_k"):
        if hasattr(gc, key):
            setattr(gc, key, None)
    if model_type in POST_BUILD:
        POST_BUILD[model_type](model)
    _make_softcap_bite(model)
    model._sweep_model_type = model_type
    return model


# ----------------------------------------------------------------------------------------------
# Probing the attention calls (which kwargs, soft-cap reached)
# ----------------------------------------------------------------------------------------------

_PROBE = "arch_sweep_probe"


class _Probe:
    def __init__(self):
        self.kwargs: set[str] = set()
        self.modules: list[torch.nn.Module] = []
        self.max_logit = 0.0
        self.softcap: float | None = None


_active_probe: _Probe | None = None


def _eager_for(module):
    mod = sys.modules.get(type(module).__module__)
    return getattr(mod, "eager_attention_forward", None)


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    probe = _active_probe
    if probe is not None:
        probe.kwargs.update(k for k, v in kwargs.items() if v is not None)
        if module not in probe.modules:
            probe.modules.append(module)
        if kwargs.get("softcap") is not None:
            probe.softcap = float(kwargs["softcap"])
            scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
            k = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1) if key.shape[1] != query.shape[1] else key
            if k.shape[-1] == query.shape[-1]:
                probe.max_logit = max(probe.max_logit, float((query @ k.transpose(-1, -2) * scaling).abs().max()))
    eager = _eager_for(module)
    if eager is not None:
        return eager(module, query, key, value, attention_mask, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextmanager
def attention_probe(model):
    """Route the model's attention through a recording wrapper of its own eager function."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    global _active_probe
    AttentionInterface.register(_PROBE, _probe_attention)
    if _PROBE not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(_PROBE, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    configs = _configs(model.config)
    saved = [c._attn_implementation for c in configs]
    probe = _active_probe = _Probe()
    try:
        for c in configs:
            c._attn_implementation = _PROBE
        yield probe
    finally:
        _active_probe = None
        for c, v in zip(configs, saved):
            c._attn_implementation = v


def _probe_forward(model) -> _Probe:
    ids = torch.randint(3, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(123))
    with attention_probe(model) as probe, torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    return probe


def _make_softcap_bite(model) -> None:
    """Scale q/k projections until attention logits exceed the soft-cap several times over."""
    try:
        probe = _probe_forward(model)
    except Exception:  # noqa: BLE001  (recorded by the stock run; nothing to calibrate)
        model._sweep_attn_kwargs = None
        return
    model._sweep_attn_kwargs = sorted(probe.kwargs)
    for _ in range(6):
        if probe.softcap is None or probe.max_logit >= 4 * probe.softcap:
            break
        with torch.no_grad():
            for module in probe.modules:
                for name in ("q_proj", "k_proj"):
                    proj = getattr(module, name, None)
                    if proj is not None and getattr(proj, "weight", None) is not None:
                        proj.weight.mul_(2.0)
        probe = _probe_forward(model)
    model._sweep_softcap = (probe.softcap, probe.max_logit) if probe.softcap is not None else None


# ----------------------------------------------------------------------------------------------
# One case
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    model_type: str
    class_name: str
    case: str
    status: str
    reason: str = ""
    seconds: float = 0.0
    attn_kwargs: list[str] | None = None
    notes: str = ""
    where: str = ""  # last traceback frames of a crash

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def ragged_batch(batch: int, length: int, seed: int = 0, vocab: int = VOCAB):
    """Left-padded prompts of different real lengths: ``(input_ids [B, length], attention_mask)``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for b in range(1, batch):
        real = int(torch.randint(max(1, length // 3), length, (1,), generator=g))
        mask[b, : length - real] = 0
    ids[mask == 0] = PAD
    return ids, mask


def _snapshot(model) -> dict[str, Any]:
    with torch.no_grad():
        checksum = sum(float(p.double().sum()) for p in model.parameters())
    return dict(
        attn=[c._attn_implementation for c in _configs(model.config)],
        checksum=checksum,
        hooks=sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()),
        training=model.training,
    )


@contextmanager
def count_forwards(model):
    """Count forward calls of the model and every submodule while inside the block."""
    counter = [0]

    def hook(module, args):
        counter[0] += 1

    handles = [m.register_forward_pre_hook(hook) for m in model.modules()]
    try:
        yield counter
    finally:
        for h in handles:
            h.remove()


def _short(exc: BaseException, limit: int = 300) -> str:
    msg = " ".join(str(exc).split())
    msg = msg if len(msg) <= limit else msg[: limit - 3] + "..."
    return f"{type(exc).__name__}: {msg}"


def _frames(exc: BaseException, n: int = 4) -> str:
    tb = traceback.extract_tb(exc.__traceback__)[-n:]
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(tb))


def run_case(model, draft: str = "streamingllm", budget: int = 10, gamma: int = 3, batch: int = 3,
             prompt_len: int = PROMPT_LEN, new_tokens: int = NEW_TOKENS, seed: int = 0, case: str | None = None,
             **extra) -> Result:
    """Stock greedy ``generate`` vs ``speculative="magicdec"`` on a left-padded ragged batch."""
    model_type = getattr(model, "_sweep_model_type", None) or getattr(model.config, "model_type", "?")
    result = Result(model_type, type(model).__name__, case or f"{draft}/{budget}/g{gamma}", "crash",
                    attn_kwargs=getattr(model, "_sweep_attn_kwargs", None))
    start = time.perf_counter()
    vocab = min(VOCAB, getattr(model.config, "vocab_size", None) or VOCAB)
    ids, mask = ragged_batch(batch, prompt_len, seed, vocab)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=PAD, eos_token_id=None)
    cache = model.__dict__.setdefault("_sweep_references", {})  # stock output per prompt set, reused across cases
    key = (batch, prompt_len, new_tokens, seed)
    try:
        if key not in cache:
            with torch.no_grad():
                cache[key] = model.generate(**kwargs)
        reference = cache[key]
    except Exception as exc:  # noqa: BLE001
        result.status, result.reason = "skipped", f"stock generate fails: {_short(exc)}"
        result.seconds = time.perf_counter() - start
        return result
    before = _snapshot(model)
    try:
        with count_forwards(model) as forwards, torch.no_grad():
            out = model.generate(**kwargs, speculative="magicdec", draft=draft, draft_budget=budget, gamma=gamma,
                                 **extra)
    except (ValueError, NotImplementedError) as exc:
        if forwards[0] == 0:
            result.status, result.reason = "refused", _short(exc, 400)
        else:
            result.status = "crash"
            result.reason = f"{_short(exc)} (raised after {forwards[0]} module forwards)"
            result.where = _frames(exc)
    except Exception as exc:  # noqa: BLE001
        result.status = "crash"
        result.reason = f"{_short(exc)} (after {forwards[0]} module forwards)"
        result.where = _frames(exc)
    else:
        if not isinstance(out, torch.Tensor):
            out = out.sequences
        if out.shape == reference.shape and torch.equal(out, reference):
            result.status = "identical"
        else:
            result.status = "mismatch"
            if out.shape != reference.shape:
                result.reason = f"shape {tuple(out.shape)} vs generate {tuple(reference.shape)}"
            else:
                diff = (out != reference).nonzero()
                row, col = diff[0].tolist()
                result.reason = (f"first difference at row {row}, position {col - prompt_len} of {new_tokens} new "
                                 f"tokens ({int(diff.shape[0])} tokens differ)")
    after = _snapshot(model)
    if after != before:
        changed = [k for k in before if before[k] != after[k]]
        result.notes = f"model not left as it was: {changed} ({before} -> {after})"
        if result.status in ("identical", "refused"):
            result.status, result.reason = "crash", result.notes
    softcap = getattr(model, "_sweep_softcap", None)
    if softcap is not None:
        result.notes = (result.notes + " " if result.notes else "") + \
            f"softcap {softcap[0]:g} reached (max |logit| {softcap[1]:.1f})"
    result.seconds = time.perf_counter() - start
    return result


# ----------------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------------


class _Timeout(Exception):
    pass


@contextmanager
def _time_limit(seconds: int):
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def handler(signum, frame):
        raise _Timeout(f"timed out after {seconds}s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def sweep_one(model_type: str, class_name: str, cases: dict[str, dict] | None = None, seed: int = 0,
              timeout: int = 120) -> list[dict[str, Any]]:
    """All cases of one architecture as result dicts (one "skipped" record when it cannot be built)."""
    cases = CASES if cases is None else cases
    records = []
    start = time.perf_counter()
    try:
        with _time_limit(timeout):
            try:
                model = build_tiny(model_type, class_name, seed=seed)
            except _Timeout:
                raise
            except Exception as exc:  # noqa: BLE001
                return [Result(model_type, class_name, "build", "skipped", f"cannot build tiny: {_short(exc)}",
                               time.perf_counter() - start).to_dict()]
            for name, kw in cases.items():
                records.append(run_case(model, case=name, seed=seed, **kw).to_dict())
                if records[-1]["status"] == "skipped":
                    break  # stock generate fails: the other cases would too
            if uses_sliding_window(model.config) and records[-1]["status"] != "skipped":
                try:
                    small = build_tiny(model_type, class_name, seed=seed, sliding_window=SMALL_WINDOW)
                except Exception as exc:  # noqa: BLE001
                    records.append(Result(model_type, class_name, "small-window", "skipped",
                                          f"cannot build with a small window: {_short(exc)}").to_dict())
                else:
                    records.append(run_case(small, case="small-window", seed=seed, **WINDOW_CASE).to_dict())
    except _Timeout as exc:
        records.append(Result(model_type, class_name, "timeout", "crash", str(exc),
                              time.perf_counter() - start).to_dict())
    return records


def _sweep_one_star(args):
    torch.set_num_threads(1)
    return sweep_one(*args)


def sweep(archs: list[tuple[str, str]] | None = None, processes: int = 1, cases: dict | None = None,
          progress=None) -> list[dict[str, Any]]:
    """Run :func:`sweep_one` over ``archs`` (default: all), in a spawn pool when ``processes > 1``."""
    archs = architectures() if archs is None else archs
    jobs = [(mt, cls, cases) for mt, cls in archs]
    out: list[dict[str, Any]] = []
    if processes <= 1:
        for job in jobs:
            recs = _sweep_one_star(job)
            out.extend(recs)
            if progress:
                progress(recs)
    else:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(processes) as pool:
            for recs in pool.imap_unordered(_sweep_one_star, jobs):
                out.extend(recs)
                if progress:
                    progress(recs)
    order = {a: i for i, a in enumerate(archs)}
    out.sort(key=lambda r: (order.get((r["model_type"], r["class_name"]), 0), r["case"]))
    return out


def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per architecture (model_type): the worst status over its cases and the reasons."""
    rank = {"crash": 0, "mismatch": 1, "refused": 2, "skipped": 3, "identical": 4}
    per: dict[str, dict[str, Any]] = {}
    for r in records:
        cur = per.setdefault(r["model_type"], dict(class_name=r["class_name"], status="identical", cases={},
                                                    attn_kwargs=r.get("attn_kwargs")))
        cur["cases"][r["case"]] = r
        if r.get("attn_kwargs") and not cur.get("attn_kwargs"):
            cur["attn_kwargs"] = r["attn_kwargs"]
    for mt, cur in per.items():
        main = [r for c, r in cur["cases"].items() if c != "small-window"]
        statuses = [r["status"] for r in main] or ["skipped"]
        worst = min(statuses, key=rank.__getitem__)
        # an architecture that is skipped (cannot build / stock generate fails) is skipped, not identical
        cur["status"] = worst
        window = cur["cases"].get("small-window")
        if window is not None and window["status"] in ("crash", "mismatch"):
            cur["status"] = window["status"]
    return per


# ----------------------------------------------------------------------------------------------
# The generated table (docs/architectures.md)
# ----------------------------------------------------------------------------------------------

DOC_COMMAND = "python scripts/architecture_table.py"
_COMMON_KWARGS = {"dropout", "scaling", "position_ids", "output_attentions", "cu_seq_lens_q", "cu_seq_lens_k",
                  "max_length_q", "max_length_k", "is_causal"}
_STATUS_TEXT = {"identical": "identical", "refused": "refused", "mismatch": "**MISMATCH**", "crash": "**CRASH**",
                "skipped": "skipped"}


def versions() -> dict[str, str]:
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}


def _cell(text: str, limit: int = 260) -> str:
    text = " ".join(str(text).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def render_markdown(records: list[dict[str, Any]], env: dict[str, str] | None = None) -> str:
    """``docs/architectures.md`` from sweep records (deterministic: no timings)."""
    env = env or versions()
    per = summarize(records)
    counts = {st: sum(1 for v in per.values() if v["status"] == st) for st in STATUSES}
    case_names = list(CASES) + ["small-window"]
    lines = [
        "# Supported architectures",
        "",
        "<!-- Generated by scripts/architecture_table.py from tests/arch_sweep.py; do not edit by hand. -->",
        "",
        f"Generated with `{DOC_COMMAND}` on transformers {env['transformers']} and torch {env['torch']}; "
        "`tests/test_architectures.py` runs the same sweep and checks this page is current when the installed "
        "transformers version is the one named here.",
        "",
        "Every causal LM in transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` is built tiny from its own config "
        "class (random weights, fp32, about 2 layers, hidden size 64, 4 query / 2 KV heads where the config "
        "allows, vocabulary 128; hybrid models get one layer of each kind, MoE models a few small experts) with "
        "its features made to bite: attention soft-capping set to 1 and query/key projections scaled until the "
        "logits exceed it several times over, attention sinks set to magnitudes 1-3, sliding windows and attention "
        f"chunks ({BIG_WINDOW}) larger than the run. Each case compares `generate(speculative=\"magicdec\", ...)` "
        f"with stock greedy `generate` on a left-padded ragged batch (3 rows, prompts up to {PROMPT_LEN} tokens, "
        f"{NEW_TOKENS} new tokens):",
        "",
    ]
    for name, kw in CASES.items():
        extra = ", ".join(f"{k}={v}" for k, v in kw.items() if k not in ("draft", "budget", "gamma"))
        lines.append(f"- `{name}`: draft `{kw['draft']}`, budget {kw['budget']}, γ={kw['gamma']}"
                     + (f" ({extra})" if extra else ""))
    lines += [
        f"- `small-window` (models with sliding-window layers only): the model rebuilt with a window of "
        f"{SMALL_WINDOW} tokens, shorter than the run; MagicDec must refuse it (or be identical).",
        "",
        "Statuses: **identical** (token-identical to `generate` in every case); **refused** (a `ValueError` / "
        "`NotImplementedError` before any forward pass, the model left as it was); **mismatch** (different "
        "tokens); **crash** (any other error, or one raised after forward passes ran); **skipped** (the tiny "
        "model cannot be built, or stock `generate` itself fails on it: not a MagicDec result).",
        "",
        "| status | architectures |",
        "|---|---:|",
    ]
    lines += [f"| {st} | {counts[st]} |" for st in STATUSES]
    lines += [f"| total | {len(per)} |", ""]
    header = "| model_type | class | status | " + " | ".join(f"`{c}`" for c in case_names) + " | reason / notes |"
    lines += [header, "|" + "---|" * (4 + len(case_names))]
    for mt in sorted(per):
        v = per[mt]
        cells = [v["cases"][c]["status"] if c in v["cases"] else "" for c in case_names]
        if "build" in v["cases"]:
            cells = ["–"] * len(case_names)
        reasons = []
        for c, r in v["cases"].items():
            if r["status"] != "identical" and r["reason"] and r["reason"] not in reasons:
                reasons.append(r["reason"])
        notes = [n for n in dict.fromkeys(r.get("notes", "") for r in v["cases"].values()) if n]
        kwargs = [k for k in (v.get("attn_kwargs") or []) if k not in _COMMON_KWARGS]
        if kwargs:
            notes.append("attention kwargs: " + ", ".join(kwargs))
        text = "; ".join(reasons + notes)
        lines.append(f"| `{mt}` | `{v['class_name']}` | {_STATUS_TEXT[v['status']]} | " + " | ".join(cells)
                     + f" | {_cell(text)} |")
    lines.append("")
    return "\n".join(lines)


def parse_markdown(text: str) -> dict[str, Any]:
    """The transformers version and ``{model_type: (status, case statuses...)}`` of a generated page."""
    import re

    m = re.search(r"on transformers (\S+) and torch (\S+?);", text)
    rows = {}
    for line in text.splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cols) >= 4 and cols[0].startswith("`") and cols[1].startswith("`"):
            rows[cols[0].strip("`")] = tuple(c.strip("*").lower() for c in cols[2:-1])
    return {"transformers": m.group(1) if m else None, "torch": m.group(2) if m else None, "rows": rows}


if __name__ == "__main__":  # quick manual run: python tests/arch_sweep.py [model_type ...]
    torch.set_num_threads(1)
    wanted = set(sys.argv[1:])
    archs = [a for a in architectures() if not wanted or a[0] in wanted]
    for rec in sweep(archs, progress=lambda recs: None):
        print(f"{rec['model_type']:28s} {rec['case']:12s} {rec['status']:9s} {rec['seconds']:5.1f}s {rec['reason']}"
              f" {rec['notes']}")

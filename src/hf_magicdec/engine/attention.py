"""The attention function the engine registers with transformers under the name ``"magicdec"``.

It never replaces HF's own ``sdpa``/``eager``: the engine switches the model to ``"magicdec"``
for the duration of one ``generate`` call (:func:`switched`) and restores the previous
implementation afterwards. While switched, a forward that does not come from the engine (a plain
``generate`` on the same model in another thread, a user's own call) is handed to the model's
original attention and mask functions, so it computes exactly what it would have unswitched.

Why a function of our own: HF's sdpa path calls ``repeat_kv`` for multi-token queries under GQA
with a mask, copying the whole KV cache g times per layer per verify step (3x the cost of a
1-token step at batch 8, context 2048 on CPU). Folding the g query heads that share a KV head
into the query axis reads each KV byte once, which is what makes verifying γ+1 tokens cost about
the same as decoding one.

Every keyword the models pass is honoured or refused (:data:`HONOURED_KWARGS`): logit
soft-capping (Gemma 2) and attention sinks (gpt-oss ``s_aux``) are implemented in both kernel
backends; a sliding window is checked against the generation's length; anything else that could
change the math raises ``NotImplementedError`` instead of being dropped.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import functools
import inspect
import sys
import textwrap
import threading

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .. import kernels
from ..kernels.reference import gqa_attention

ATTENTION_NAME = "magicdec"

#: Keywords of the attention interface that MagicDec honours. ``dropout`` only in eval mode;
#: ``is_causal`` and ``position_ids`` do not change the math once a mask / key ranges are given
#: (they serve flash-attention varlen paths); ``output_attentions`` is refused by ``generate``.
HONOURED_KWARGS = frozenset(
    {"dropout", "scaling", "softcap", "s_aux", "sliding_window", "is_causal", "position_ids", "output_attentions",
     "attention_mask", "magicdec_cache"}
)

#: Forward flags that models pass down with ``**kwargs`` and that attention never reads.
PLUMBING_KWARGS = frozenset({"use_cache", "return_dict", "output_hidden_states", "cache_position",
                             "past_key_values", "past_key_value", "logits_to_keep"})

# Why a keyword is refused, for the ones transformers' models are known to pass.
_REFUSED_WHY = {
    "indices": "sparse attention over indexer-selected keys (DeepSeek sparse attention)",
    "sinks": "per-position attention sinks",
    "cu_seq_lens_q": "packed variable-length sequences",
    "cu_seq_lens_k": "packed variable-length sequences",
    "max_length_q": "packed variable-length sequences",
    "max_length_k": "packed variable-length sequences",
    "head_mask": "head masking",
}


# The cache of the engine forward running in this thread (set by the engine around each forward):
# models that do not pass their forward kwargs down to attention still reach it, and a forward in
# another thread (or the user's own call) never sees it.
ACTIVE_CACHE: contextvars.ContextVar = contextvars.ContextVar("hf_magicdec_active_cache", default=None)


@contextlib.contextmanager
def engine_forward(cache):
    """Mark the forwards inside the block as the engine's, on ``cache``."""
    token = ACTIVE_CACHE.set(cache)
    try:
        yield
    finally:
        ACTIVE_CACHE.reset(token)


def _refuse_keywords(names, where: str) -> None:
    bad = sorted(set(names) - HONOURED_KWARGS)
    if bad:
        reasons = "; ".join(f"{n!r}: {_REFUSED_WHY.get(n, 'an attention feature MagicDec does not implement')}"
                            for n in bad)
        raise NotImplementedError(
            f"speculative='magicdec' cannot run {where}: its attention passes {bad} ({reasons}). MagicDec would "
            "have to drop these, which changes the output; use stock generate for this model."
        )


def magicdec_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    magicdec_cache=None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    sliding_window: int | None = None,
    **kwargs,
):
    """HF ``AttentionInterface`` function (see ``transformers-seams`` §4).

    ``magicdec_cache`` is the engine's :class:`~hf_magicdec.engine.cache.MagicDecCache`, passed down as a
    forward kwarg (or, for models that do not pass kwargs down, found in :data:`ACTIVE_CACHE`,
    which the engine sets around its forwards in its own thread); its open forward
    (:mod:`hf_magicdec.engine.cache.forwards`) records the observation-window queries SnapKV scores
    with during prefill, and during draft and verify describes each row's key ranges
    (:class:`~hf_magicdec.kernels.Segments`), which the kernels read instead of the 4-D mask (the
    model is handed a placeholder, :meth:`~hf_magicdec.engine.cache.Forward.model_mask`). Without it
    the call is not the engine's, and goes to the model's own attention implementation.

    ``softcap`` (logits become ``softcap·tanh(logits/softcap)``) and ``s_aux`` (``[H]`` sink logits
    in the softmax denominator) are honoured; ``sliding_window`` must cover the whole generation.
    """
    if magicdec_cache is None:
        magicdec_cache = ACTIVE_CACHE.get()
    if magicdec_cache is None:
        return _original_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                   softcap=softcap, s_aux=s_aux, sliding_window=sliding_window, **kwargs)
    extra = [k for k, v in kwargs.items() if v is not None and v is not False and k not in PLUMBING_KWARGS]
    _refuse_keywords(extra, type(module).__name__)
    if dropout and module.training:
        raise NotImplementedError(f"{type(module).__name__} is in training mode with attention dropout {dropout}; "
                                  "call model.eval() before generating.")
    if sliding_window is not None:
        limit = magicdec_cache.options.position_limit  # None: a timing cache, no output
        if limit is not None and limit > sliding_window:
            raise NotImplementedError(
                f"{type(module).__name__} attends through a sliding window of {sliding_window} tokens and this "
                f"generation reaches {limit} positions: the window would evict tokens, which MagicDec's cache "
                "does not model. Generate fewer tokens in total, or use stock generate."
            )
    sinks = s_aux
    forward = magicdec_cache.forward
    layer_idx = forward.layer_of(key, getattr(module, "layer_idx", None))
    segments = forward.segments(key.device)
    if segments is not None:
        forward.before_attention(layer_idx, query, scaling)  # dynamic view / refresh
        if attention_mask is not None and not forward.passed(attention_mask):
            # The model rewrote the mask it was given (Doge's dynamic mask adds per-key biases;
            # prefill noticed, so it was given the real mask, :meth:`Forward.model_mask`): honour
            # it as stock attention would, provided it still hides every slot the row's key
            # ranges hide (stale drafts, other rows' padding); anything else cannot be right.
            _check_rewritten_mask(module, attention_mask, segments.mask(query.shape[2], key.shape[2]))
            return gqa_attention(query, key, value, attention_mask[..., : key.shape[2]], scaling, softcap,
                                 sinks), None
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        page = forward.mass_page_size(layer_idx)
        if page:  # the verify's attention mass per page of keys, for a verification-guided view
            out, mass = kernels.segment_attention(query, key, value, segments, scale, softcap, sinks, page_size=page)
            forward.record_mass(layer_idx, mass)
            return out, None
        return kernels.segment_attention(query, key, value, segments, scale, softcap, sinks), None
    forward.observe(layer_idx, query, scaling)
    if attention_mask is not None and not forward.passed(attention_mask):
        magicdec_cache.mask_rewritten()  # its draft and verify forwards get real masks
    return gqa_attention(query, key, value, attention_mask, scaling, softcap, sinks), None


def _check_rewritten_mask(module, mask: torch.Tensor, engine: torch.Tensor) -> None:
    mask = mask[..., : engine.shape[-1]]
    if mask.dtype == torch.bool:
        leaks = mask & ~engine
    else:
        leaks = (mask > torch.finfo(mask.dtype).min / 2) & ~engine
    if mask.shape[-1] != engine.shape[-1] or bool(leaks.any()):
        raise NotImplementedError(
            f"{type(module).__name__} replaces the attention mask it is given with one that attends to slots the "
            "engine hides (stale draft tokens or padding); MagicDec's ragged cache cannot run it. Use stock "
            "generate for this model."
        )


# ---------------------------------------------------------------------- switching, thread-safely
# id(config) -> [original implementation, number of MagicDec calls holding the switch]. An entry
# lives exactly as long as its config is switched (so an id is never reused while present).
_SWITCHED: dict[int, list] = {}
_LOCK = threading.Lock()


def _model_configs(model) -> list:
    configs = [model.config]
    for name in getattr(model.config, "sub_configs", {}) or {}:
        sub = getattr(model.config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            configs.append(sub)
    return configs


@contextlib.contextmanager
def switched(model):
    """Run the block with ``model``'s attention switched to ``"magicdec"``; always restore it.

    Reference-counted per config, so overlapping MagicDec calls on one model (threads) restore the
    user's implementation only when the last one ends; forwards that are not the engine's go to
    that original implementation meanwhile (:func:`magicdec_attention_forward`)."""
    register()
    configs = _model_configs(model)
    with _LOCK:
        for cfg in configs:
            entry = _SWITCHED.get(id(cfg))
            if entry is None:
                _SWITCHED[id(cfg)] = [cfg._attn_implementation, 1]
                _set_implementation(cfg, ATTENTION_NAME)
            else:
                entry[1] += 1
    try:
        yield
    finally:
        with _LOCK:
            for cfg in configs:
                entry = _SWITCHED[id(cfg)]
                entry[1] -= 1
                if entry[1] == 0:
                    del _SWITCHED[id(cfg)]
                    _set_implementation(cfg, entry[0])


def _set_implementation(config, value) -> None:
    # The private field, not the property: the property's setter re-dispatches to sub-configs,
    # which `switched` handles itself (each one keeps its own original).
    if hasattr(config, "_attn_implementation_internal"):
        config._attn_implementation_internal = value
    else:
        config._attn_implementation = value


def original_implementation(config) -> str | None:
    """The implementation a switched config had before MagicDec switched it (None if not switched)."""
    entry = _SWITCHED.get(id(config))
    return entry[0] if entry is not None else None


def _original_attention(module, query, key, value, attention_mask, **kwargs):
    """A forward that is not the engine's, while the model is switched: run what the model would run."""
    original = original_implementation(module.config) if hasattr(module, "config") else None
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if original == "eager":
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is not None:
            return eager(module, query, key, value, attention_mask, **kwargs)
    elif original in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[original](module, query, key, value, attention_mask, **kwargs)
    # Set to "magicdec" by the user (not by the engine): plain causal attention with the mask given.
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    return gqa_attention(query, key, value, attention_mask, kwargs.get("scaling"), softcap, sinks), None


def _mask_function(*args, **kwargs):
    """Mask builder registered for ``"magicdec"``: the engine always passes its own 4-D masks, so
    this only serves forwards that are not the engine's; they get the original implementation's
    mask (an additive float mask for eager, a bool one for sdpa)."""
    config = kwargs.get("config")
    original = original_implementation(config) if config is not None else None
    # Not switched by the engine (the user selected "magicdec"): bool masks for gqa_attention.
    fn = ALL_MASK_ATTENTION_FUNCTIONS.get(original, sdpa_mask) if original is not None else sdpa_mask
    return fn(*args, **kwargs)


# ---------------------------------------------------------------------- static checks
@functools.lru_cache(maxsize=None)
def _attention_call_keywords(cls: type) -> frozenset[str]:
    """Keyword names that ``cls.forward`` passes to its attention function (read from its source)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls.forward))
        if "attention_interface" not in source and "ALL_ATTENTION_FUNCTIONS" not in source:
            return frozenset()
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):  # no source (built-ins, C extensions): the run-time check remains
        return frozenset()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func
            fn_name = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", "")
            if "attention_interface" in fn_name or "attention_function" in fn_name:
                names.update(kw.arg for kw in node.keywords if kw.arg is not None)
    return frozenset(names)


def check_attention_keywords(model) -> None:
    """Refuse, before any forward, a model whose attention modules pass keywords MagicDec would
    have to drop (read statically from their ``forward`` source; the attention function checks
    the values again at run time)."""
    for cls in {type(m) for m in model.modules()}:
        _refuse_keywords(_attention_call_keywords(cls), f"{type(model).__name__} ({cls.__name__})")


_registered = False


def register() -> None:
    """Register ``"magicdec"`` with transformers' attention and mask interfaces (idempotent)."""
    global _registered
    if _registered:
        return

    AttentionInterface.register(ATTENTION_NAME, magicdec_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _mask_function)
    _registered = True

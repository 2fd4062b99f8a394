"""``generate``: the ``custom_generate`` callable behind ``model.generate(speculative="magicdec")``.

config -> plan -> stock fallback or engine. Everything that can be refused is refused here, before
any forward; then either the planner's "no speedup" sends the call to stock decoding, or the
engine (:mod:`hf_magicdec.engine`) is assembled from the resolved configuration: who drafts, the
γ policy, and the observers (statistics, streamer, scores, acceptance memory).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

import torch
from transformers.generation.stopping_criteria import StopStringCriteria, StoppingCriteriaList

from . import kernels
from .compat import cache_kwarg_to_past_key_values
from .config import MagicDecConfig
from .engine import attention
from .engine.draft_weights import QUANTIZED_FORMATS, check_draft_weights, draft_twin
from .engine.continuation import Continuation, check_cache, hand_back, outlives_call
from .engine.drafters import ModelDrafter, SelfDrafter, check_draft_model, twin_call
from .engine.hooks import (AcceptanceRecorder, AdaptiveGamma, FixedGamma, Observers, ScoresRecorder, StatsRecorder,
                           StreamerHook)
from .engine.loop import Engine, left_padding
from .engine.outputs import MagicDecOutput, SpeculationStats
from .engine.steps import ModelCall, compile_config_for
from .engine.validation import check_generation_config, check_model, check_model_kwargs
from .parallel.lockstep import Lockstep, resolve_synced_gpus
from .planner.gamma import GammaController
from .resolve import draft_key, record_acceptance, resolve
from .views import DraftView, on_register, view_option_names

__all__ = ["generate"]


@torch.no_grad()
def generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    synced_gpus: bool | None = None,
    streamer=None,
    *,
    tokenizer=None,
    speculative: Any = None,
    draft: str | DraftView | None = None,
    draft_budget: int | str | None = None,
    gamma: int | str | None = None,
    adaptive_gamma: bool | None = None,
    max_gamma: int | None = None,
    hardware: str | None = None,
    refresh_every: int | None = None,
    refresh_below: float | None = None,
    compile: Any = None,
    draft_weights: str | None = None,
    magicdec_config: MagicDecConfig | None = None,
    magicdec_streamer=None,
    magicdec_synced_gpus: bool | None = None,
    magicdec_stop_strings: str | list[str] | None = None,
    magicdec_tokenizer=None,
    magicdec_draft_model=None,
    **model_kwargs,
):
    """Self-speculative (MagicDec) decoding, called by ``GenerationMixin.generate``.

    Use it through ``model.generate(..., speculative="magicdec")`` (after ``import hf_magicdec``)
    or without any patching as ``model.generate(..., custom_generate=hf_magicdec.generate)``.
    ``generate`` has already prepared everything HF's own ``_sample`` receives.

    Parameters
    ----------
    model : a decoder-only ``PreTrainedModel`` whose attention uses transformers'
        ``AttentionInterface``.
    input_ids : ``[B, P]`` left-padded prompts (already expanded for ``num_return_sequences``).
    logits_processor, stopping_criteria, generation_config : as prepared by ``generate``.
    tokenizer : enables ``stop_strings`` (``generate`` builds the criterion from it).
    speculative, draft, draft_budget, gamma, adaptive_gamma, max_gamma, hardware, refresh_every, refresh_below,
        compile, draft_weights, magicdec_config : MagicDec settings (see :class:`~hf_magicdec.MagicDecConfig`); explicit values win.
        ``draft`` may be a view instance (``SnapKV(window=16)``).
    magicdec_streamer, magicdec_synced_gpus, magicdec_stop_strings, magicdec_tokenizer :
        streamer, ``synced_gpus``, ``stop_strings`` and tokenizer forwarded by the ``speculative=``
        routing (``generate`` does not hand them to custom callables).
    magicdec_draft_model : a separate small draft model (``draft_model=`` in ``model.generate``;
        same tokenizer); ``draft`` then compresses *its* cache. See :mod:`hf_magicdec.engine.drafters`.
    **model_kwargs : ``attention_mask`` ``[B, P]`` or None, ``position_ids``, ``past_key_values`` …, and
        the registered draft views' options (``sink_tokens``, ``window``, ``recent_window``,
        ``pool_kernel``, ``page_size`` …), taken by name; they are listed in this function's
        runtime signature, which is what HF hands a ``custom_generate`` callable.

    Returns
    -------
    ``torch.LongTensor [B, P + T]`` right-padded with ``pad_token_id`` after each row's end, or
    :class:`~hf_magicdec.MagicDecOutput` when ``return_dict_in_generate`` is set; its
    ``past_key_values`` is a ``DynamicCache`` (or the ``StaticCache`` passed in) holding
    ``[B, Hkv, P + T - 1, D]`` per layer, laid out as stock ``generate`` returns it.

    Raises
    ------
    ValueError, NotImplementedError
        For unsupported models or settings, or a ``past_key_values`` that does not fit the call, before
        any forward pass.

    Notes
    -----
    ``past_key_values`` may hold the KV of the first ``n`` tokens of ``input_ids`` (a
    ``DynamicCache`` / ``StaticCache`` from a plain forward, a plain ``generate`` or an earlier
    MagicDec call, ``[B, Hkv, n, D]`` per layer, left padding included): only ``input_ids[:, n:]``
    is prefilled and the draft views cover the whole context. Like stock ``generate``, a cache
    passed in ends up holding the generation (every returned token but the last; its KV is moved
    into MagicDec's cache during the call, not copied): pass ``copy.deepcopy(cache)`` to reuse a
    prompt cache. See :mod:`hf_magicdec.engine.continuation`.
    """
    config = MagicDecConfig.from_any(
        magicdec_config if magicdec_config is not None else (speculative if speculative is not None else "magicdec"),
        draft=draft,
        draft_budget=draft_budget,
        gamma=gamma,
        adaptive_gamma=adaptive_gamma,
        max_gamma=max_gamma,
        hardware=hardware,
        refresh_every=refresh_every,
        refresh_below=refresh_below,
        compile=compile,
        draft_weights=draft_weights,
        **{name: model_kwargs.pop(name) for name in view_option_names() if name in model_kwargs},
    )
    streamer = magicdec_streamer if magicdec_streamer is not None else streamer
    # None: HF's default (on under ZeRO-3 / FSDP with several processes); see parallel/lockstep.py.
    synced = resolve_synced_gpus(model, magicdec_synced_gpus if magicdec_synced_gpus is not None else synced_gpus)
    stopping_criteria = _with_stop_strings(stopping_criteria, magicdec_stop_strings, magicdec_tokenizer)
    check_model(model, max_length=generation_config.max_length)
    check_generation_config(generation_config)
    kernels.check_backend(input_ids.device)  # a bad HF_MAGICDEC_KERNELS fails here, before prefill
    if magicdec_draft_model is not None:
        check_draft_model(model, magicdec_draft_model, config)
    check_draft_weights(model, config.draft_weights, input_ids.device, magicdec_draft_model)
    model_kwargs = check_model_kwargs(cache_kwarg_to_past_key_values(model_kwargs))  # transformers>=5.24: cache=
    batch, prompt = input_ids.shape
    left_padding(model_kwargs.get("attention_mask"), batch, input_ids.device)  # refuse right padding up front
    cache = model_kwargs.get("past_key_values")
    keep = outlives_call(cache, generation_config)
    past = Continuation(cache, check_cache(model, cache, input_ids, model_kwargs.get("attention_mask"),
                                           generation_config.max_length, keep), keep)
    lockstep = Lockstep.for_model(model, synced, input_ids.device, generation_config._pad_token_tensor)
    # Decided once: the planner prices the host time of eager steps, the engine compiles or not.
    compile_config = compile_config_for(config.compile, generation_config, input_ids.device)
    # Every rank of a TP group (every rank under synced_gpus) runs the first rank's plan. The steps read
    # the KV of the whole context (``prompt``: cached tokens included); prefill is not part of the plan.
    resolution = lockstep.agree(resolve(config, model, batch, prompt, max(generation_config.max_length - prompt, 0),
                                        draft_model=magicdec_draft_model, captured=compile_config is not None))
    if resolution.config is None:
        return _stock(model, input_ids, logits_processor, stopping_criteria, generation_config, synced, streamer,
                      resolution, model_kwargs)
    draft_model = magicdec_draft_model if resolution.use_draft_model else None
    draft_attention = attention.switched(draft_model) if draft_model is not None else contextlib.nullcontext()
    with attention.switched(model), draft_attention, lockstep.watching(model):
        return _speculate(model, draft_model, resolution, input_ids, generation_config, logits_processor,
                          stopping_criteria, streamer, lockstep, model_kwargs, compile_config, past)


def _with_stop_strings(stopping_criteria, stop_strings, tokenizer):
    """``generate`` does not build the stop-string criterion for custom callables: build it here."""
    if not stop_strings:
        return stopping_criteria
    if tokenizer is None:
        raise ValueError(
            "There are one or more stop strings, but no tokenizer: pass the model's tokenizer to `generate` as "
            "`tokenizer=`."
        )
    criteria = StoppingCriteriaList(list(stopping_criteria or []))
    criteria.append(StopStringCriteria(stop_strings=stop_strings, tokenizer=tokenizer))
    return criteria


def _stock(model, input_ids, logits_processor, stopping_criteria, generation_config, synced, streamer, resolution,
           model_kwargs):
    """The planner predicts no speedup: decode exactly as stock ``generate`` does (which would have
    streamed the prompt before decoding; the routing kept the streamer from it)."""
    if streamer is not None:
        streamer.put(input_ids.cpu())
    out = type(model)._sample(model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                              generation_config=generation_config, synced_gpus=synced, streamer=streamer,
                              **model_kwargs)
    if not generation_config.return_dict_in_generate:
        return out
    stats = SpeculationStats(accepted_lengths=[[] for _ in range(input_ids.shape[0])],
                             draft="none (planner: plain decoding)",
                             plan=resolution.plan.to_dict() if resolution.plan is not None else None)
    return MagicDecOutput(**{k: v for k, v in out.items()}, speculation=stats)


def _speculate(model, draft_model, resolution, input_ids, gen, logits_processor, stopping_criteria, streamer,
               lockstep, model_kwargs, compile_config, past: Continuation):
    """Assemble the engine for ``resolution.config`` and run it (``compile_config``: compiled
    steps, or None; ``past``: the cache to continue from and hand back)."""
    config = resolution.config
    view = config.view
    batch, prompt = input_ids.shape
    max_new = max(gen.max_length - prompt, 0)
    gamma, scratch = _gamma_policy(config, view, prompt, max_new, lockstep, resolution)
    chunk = gen.prefill_chunk_size or config.prefill_chunk_size
    call = ModelCall.of(model, compile_config)
    twin = draft_twin(model, config.draft_weights) if config.draft_weights in QUANTIZED_FORMATS else None
    drafter = (ModelDrafter(draft_model, view, config, chunk, gen.max_length, compile_config) if draft_model is not None
               else SelfDrafter(call, view, config, twin_call(twin, compile_config)))
    stats = SpeculationStats(
        accepted_lengths=[[] for _ in range(batch)], row_gammas=[[] for _ in range(batch)], gamma=config.gamma,
        draft=config.draft, draft_budget=config.draft_budget, draft_model=drafter.name,
        draft_weights=config.draft_weights, draft_weight_bytes=twin.nbytes if twin is not None else 0,
        adaptive_gamma=gamma.controller is not None,
        plan=resolution.plan.to_dict() if resolution.plan is not None else None,
    )
    want = gen.return_dict_in_generate and (gen.output_scores or gen.output_logits)
    scores = ScoresRecorder(batch, gen.output_scores, gen.output_logits) if want else None
    remember = None
    if config.gamma != 0:
        key = draft_key(config.draft, draft_model, config.draft_weights)
        remember = AcceptanceRecorder(stats, functools.partial(record_acceptance, model, key, config.draft_budget))
    observers = Observers(StatsRecorder(stats, input_ids.device), scores, remember,
                          StreamerHook(streamer) if streamer is not None else None)
    engine = Engine(call, drafter, gen, logits_processor, stopping_criteria, chunk, scratch, gamma, observers,
                    lockstep)
    sequences = engine.run(input_ids, model_kwargs.get("attention_mask"), model_kwargs.get("position_ids"), past)
    stats.refreshes = drafter.refreshes
    returned = past.cache
    if past.keep:  # as stock: the cache outlives the call (returned, or the user's, extended in place)
        kv = engine.returned_kv(sequences)
        returned = hand_back(past.cache, kv, past.length, model) if kv is not None else past.cache
    if not gen.return_dict_in_generate:
        return sequences
    steps = sequences.shape[1] - prompt
    return MagicDecOutput(
        sequences=sequences,
        scores=ScoresRecorder.assemble(scores.scores, steps) if gen.output_scores else None,
        logits=ScoresRecorder.assemble(scores.logits, steps) if gen.output_logits else None,
        past_key_values=returned,
        speculation=stats,
    )


def _gamma_policy(config, view, prompt: int, max_new: int, lockstep, resolution):
    """``(γ policy, draft scratch slots)``: fixed γ, or adaptive γ between 1 and the largest γ whose
    γ + 1 committed tokens fit in the view's rolling window (and ``max_gamma``)."""
    if not config.adaptive:
        return FixedGamma(config.gamma), config.gamma
    window = view.window_slots(config.draft_budget, config.gamma, prompt, max_new)
    scratch = lockstep.agree_min(max(1, min(config.max_gamma, window - 1)))
    plan = resolution.plan
    prior = plan.acceptance if plan is not None and plan.acceptance else 0.8
    controller = GammaController(config.gamma, scratch, prior, resolution.draft_ratio, resolution.verify_ratio)
    return AdaptiveGamma(controller, lockstep), scratch


def _list_view_options() -> None:
    """Show every registered view's options as keywords of ``generate``'s signature: HF hands a
    ``custom_generate`` callable the keywords its signature names (and refuses the others)."""
    base = inspect.signature(generate.__wrapped__)
    params = list(base.parameters.values())
    taken = {p.name for p in params}
    extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None)
             for n in view_option_names() if n not in taken]
    generate.__signature__ = base.replace(parameters=params[:-1] + extra + params[-1:])


on_register(_list_view_options)

"""``generate``: the ``custom_generate`` callable behind ``model.generate(speculative="magicdec")``.

config -> plan -> stock fallback or engine. Everything that can be refused is refused here, before
any forward; then either the planner's "no speedup" sends the call to stock decoding, or the
engine (:mod:`hf_magicdec.engine`) is assembled from the resolved configuration: who drafts, the
γ policy, and the observers (statistics, streamer, scores, acceptance memory).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.stopping_criteria import StopStringCriteria, StoppingCriteriaList

from . import kernels
from .compat import cache_kwarg_to_past_key_values, generate_cache_name, past_key_values_to_cache_kwarg
from .config import MagicDecConfig, carried_options
from .engine import attention
from .engine.continuation import Continuation, check_cache, hand_back, outlives_call
from .engine.draft_weights import QUANTIZED_FORMATS, check_draft_weights, has_quantized_draft, quantized_draft
from .engine.drafters import ModelDrafter, SelfDrafter, check_draft_model, quantized_draft_call
from .engine.gamma import AdaptiveGamma, FixedGamma, GammaController
from .engine.loop import Engine, left_padding
from .engine.observers import AcceptanceRecorder, Observers, ScoresRecorder, StatsRecorder, StreamerObserver
from .engine.outputs import MagicDecOutput, SpeculationStats
from .engine.compiled import StepGraphs
from .engine.steps import ModelCall, compile_config_for
from .engine.validation import check_generation_config, check_model, check_model_kwargs
from .parallel.lockstep import Lockstep, resolve_synced_gpus
from .planner.memory import draft_key, record_acceptance
from .notices import notice
from .resolve import Resolution, resolve

__all__ = ["Request", "generate"]


@dataclass(frozen=True)
class Request:
    """What the ``speculative=`` routing hands :func:`generate` besides transformers' own
    arguments: the validated config, and the objects ``generate`` does not pass to a custom callable
    (``streamer``, ``synced_gpus``, ``stop_strings`` with their ``tokenizer``) or that are not
    options (the separate ``draft_model``)."""

    config: MagicDecConfig
    streamer: Any = None
    synced_gpus: bool | None = None
    draft_model: Any = None
    stop_strings: str | list[str] | None = None
    tokenizer: Any = None


@dataclass
class _Call:
    """One ``generate`` call, checked and prepared."""

    model: Any
    input_ids: torch.Tensor
    request: Request
    gen: Any  # the per-call GenerationConfig
    logits_processor: Any
    stopping_criteria: Any
    synced: bool
    lockstep: Lockstep
    model_kwargs: dict
    past: Continuation
    compile_config: Any


@torch.no_grad()
def generate(model, input_ids: torch.LongTensor, logits_processor=None, stopping_criteria=None,
             generation_config=None, synced_gpus: bool | None = None, streamer=None, *, speculative: Any = None,
             magicdec_request: Request | None = None, **model_kwargs):
    """Self-speculative (MagicDec) decoding, called by ``GenerationMixin.generate``.

    Use it through ``model.generate(..., speculative="magicdec")`` (after ``import hf_magicdec``)
    or without any patching as ``model.generate(..., custom_generate=hf_magicdec.generate,
    speculative=...)``. ``generate`` has already prepared everything HF's own ``_sample`` receives.

    Parameters
    ----------
    model : a decoder-only ``PreTrainedModel`` whose attention uses transformers'
        ``AttentionInterface``.
    input_ids : ``[B, P]`` left-padded prompts (already expanded for ``num_return_sequences``).
    logits_processor, stopping_criteria, generation_config, synced_gpus, streamer : as prepared by
        ``generate``.
    speculative : ``"magicdec"``, a dict of :class:`~hf_magicdec.MagicDecConfig` fields and view
        options, or a ``MagicDecConfig`` (:meth:`~hf_magicdec.MagicDecConfig.from_any`): the
        settings of a call that comes through ``custom_generate=`` directly.
    magicdec_request : what the ``speculative=`` routing hands over (:class:`Request`); it wins
        over ``speculative``, ``streamer`` and ``synced_gpus``.
    **model_kwargs : ``attention_mask`` ``[B, P]`` or None, ``position_ids``, ``past_key_values`` …

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
    if magicdec_request is None:  # custom_generate=hf_magicdec.generate, not through the routing
        spec = speculative if speculative is not None else getattr(generation_config, "speculative", None)
        config = MagicDecConfig.from_any(spec if spec is not None else "magicdec", **carried_options(generation_config))
        magicdec_request = Request(config, streamer, synced_gpus)
    request = magicdec_request
    call = _prepare(model, input_ids, request, generation_config, logits_processor, stopping_criteria, model_kwargs)
    # Every rank of a TP group (every rank under synced_gpus) runs the first rank's plan. The steps read
    # the KV of the whole context (``prompt``: cached tokens included); prefill is not part of the plan.
    batch, prompt = input_ids.shape
    resolution = call.lockstep.agree(resolve(request.config, model, batch, prompt, _new_tokens(call),
                                             draft_model=request.draft_model,
                                             captured=call.compile_config is not None))
    if resolution.config is None:
        return _stock(call, resolution)
    draft_model = request.draft_model if resolution.use_draft_model else None
    draft_attention = attention.switched(draft_model) if draft_model is not None else contextlib.nullcontext()
    with attention.switched(model), draft_attention, call.lockstep.watching(model):
        return _speculate(call, resolution, draft_model)


def _prepare(model, input_ids, request: Request, gen, logits_processor, stopping_criteria, model_kwargs) -> _Call:
    """Check everything that can be refused before any forward, and gather what the call runs with."""
    config = request.config
    # None: HF's default (on under ZeRO-3 / FSDP with several processes); see parallel/lockstep.py.
    synced = resolve_synced_gpus(model, request.synced_gpus)
    stopping_criteria = _with_stop_strings(stopping_criteria, request.stop_strings, request.tokenizer)
    check_model(model, max_length=gen.max_length)
    check_generation_config(gen)
    kernels.check_backend(input_ids.device)  # a bad HF_MAGICDEC_KERNELS fails here, before prefill
    if request.draft_model is not None:
        check_draft_model(model, request.draft_model, config)
    check_draft_weights(model, config.draft_weights, input_ids.device, request.draft_model)
    model_kwargs = check_model_kwargs(cache_kwarg_to_past_key_values(model_kwargs))  # transformers>=5.24: cache=
    batch = input_ids.shape[0]
    mask = model_kwargs.get("attention_mask")
    left_padding(mask, batch, input_ids.device)  # refuse right padding up front
    cache = model_kwargs.get("past_key_values")
    outlives = outlives_call(cache, gen)
    past = Continuation(cache, check_cache(model, cache, input_ids, mask, gen.max_length, outlives), outlives)
    lockstep = Lockstep.for_model(model, synced, input_ids.device, gen._pad_token_tensor)
    # Decided once: the planner prices the host time of eager steps, the engine compiles or not.
    compile_config = compile_config_for(config.compile, gen, input_ids.device)
    return _Call(model, input_ids, request, gen, logits_processor, stopping_criteria, synced, lockstep, model_kwargs,
                 past, compile_config)


def _new_tokens(call: _Call) -> int:
    return max(call.gen.max_length - call.input_ids.shape[1], 0)


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


def _stock(call: _Call, resolution: Resolution):
    """The planner predicts no speedup: decode exactly as stock ``generate`` does (which would have
    streamed the prompt before decoding; the routing kept the streamer from it)."""
    model, input_ids, gen, streamer = call.model, call.input_ids, call.gen, call.request.streamer
    reason = resolution.plan.reason if resolution.plan is not None else "nothing fits the explicit settings"
    notice(f"speculative='magicdec' decodes this call with stock generate (the planner chose plain decoding: "
           f"{reason}); set draft_budget= and gamma= to speculate anyway.")
    if streamer is not None:
        streamer.put(input_ids.cpu())
    out = type(model)._sample(model, input_ids, logits_processor=call.logits_processor,
                              stopping_criteria=call.stopping_criteria, generation_config=gen,
                              synced_gpus=call.synced, streamer=streamer,
                              **past_key_values_to_cache_kwarg(call.model_kwargs))
    if not gen.return_dict_in_generate:
        return out
    stats = SpeculationStats(accepted_lengths=[[] for _ in range(input_ids.shape[0])],
                             draft="none (planner: plain decoding)", prefill_seconds=None, decode_seconds=None,
                             draft_seconds=None, verify_seconds=None,
                             plan=resolution.plan.to_dict() if resolution.plan is not None else None)
    return MagicDecOutput(**{k: v for k, v in out.items()}, speculation=stats)


def _speculate(call: _Call, resolution: Resolution, draft_model):
    """Assemble the engine for ``resolution.config`` and run it."""
    gen = call.gen
    batch, prompt = call.input_ids.shape
    config = _bounded(resolution.config, prompt, _new_tokens(call))
    gamma, scratch = _gamma_policy(config, prompt, _new_tokens(call), call.lockstep, resolution,
                                   sampling=bool(gen.do_sample))
    chunk = gen.prefill_chunk_size or config.prefill_chunk_size
    target = ModelCall.of(call.model, call.compile_config)
    quantized = _quantized_draft(call.model, config.draft_weights)
    drafter = (ModelDrafter(draft_model, config.view, config, chunk, gen.max_length, call.compile_config)
               if draft_model is not None else SelfDrafter(target, config.view, config,
                                                           quantized_draft_call(quantized, call.compile_config)))
    stats = SpeculationStats(
        accepted_lengths=[[] for _ in range(batch)], row_gammas=[[] for _ in range(batch)], gamma=config.gamma,
        draft=config.draft_name, draft_budget=config.draft_budget, draft_model=drafter.name,
        draft_weights=config.draft_weights, draft_weight_bytes=quantized.nbytes if quantized is not None else 0,
        adaptive_gamma=gamma.controller is not None,
        plan=resolution.plan.to_dict() if resolution.plan is not None else None,
    )
    scores = ScoresRecorder(batch, gen.output_scores, gen.output_logits) \
        if gen.return_dict_in_generate and (gen.output_scores or gen.output_logits) else None
    remember = None
    if config.gamma != 0:
        key = draft_key(config.draft_name, draft_model, config.draft_weights)
        remember = AcceptanceRecorder(stats, functools.partial(record_acceptance, call.model, key, config.draft_budget))
    streamer = call.request.streamer
    observers = Observers(StatsRecorder(stats, call.input_ids.device, gamma), scores, remember,
                          StreamerObserver(streamer) if streamer is not None else None)
    graphs = StepGraphs(call.compile_config) if call.compile_config is not None else None
    engine = Engine(target, drafter, gen, call.logits_processor, call.stopping_criteria, chunk, scratch, gamma,
                    observers, call.lockstep, graphs)
    sequences = engine.run(call.input_ids, call.model_kwargs.get("attention_mask"),
                           call.model_kwargs.get("position_ids"), call.past)
    stats.refreshes = drafter.refreshes
    return _outputs(call, engine, sequences, stats, scores)


def _bounded(config: MagicDecConfig, prompt: int, new_tokens: int) -> MagicDecConfig:
    """``config`` with a draft budget no larger than the call can fill (the views are sized by it);
    a budget that compresses nothing is said once."""
    view, context = config.view, prompt + new_tokens
    if config.gamma == 0 or view is None or view.name == "full" or config.draft_budget <= context:
        return config
    budget = view.bounded_budget(config.draft_budget, config.gamma, context)
    notice(f"draft_budget={config.draft_budget} holds the whole context ({prompt} prompt slots + {new_tokens} new "
           f"tokens per row): nothing is compressed, so the draft reads as much KV as the target and speculation "
           f"cannot pay; the views are sized to {budget} slots. Use a budget well below the context.")
    return config.replace(draft_budget=budget)


def _quantized_draft(model, fmt: str):
    """The model's quantized draft in ``fmt`` (None for full weights); building one is said once."""
    if fmt not in QUANTIZED_FORMATS:
        return None
    fresh = not has_quantized_draft(model, fmt)
    t0 = time.perf_counter()
    draft = quantized_draft(model, fmt)
    if fresh:
        notice(f"speculative='magicdec' built {fmt} draft weights for {type(model).__name__} in "
               f"{time.perf_counter() - t0:.1f} s ({draft.nbytes / 2**20:.0f} MiB beside the model; the target still "
               "verifies in full precision); later calls reuse them while the model's weights are unchanged.")
    return draft


def _outputs(call: _Call, engine: Engine, sequences, stats: SpeculationStats, scores: ScoresRecorder | None):
    """What stock ``generate`` returns: the sequences, or the output object (and the cache handed back)."""
    past, gen = call.past, call.gen
    returned = past.cache
    if past.outlives:  # as stock: the cache outlives the call (returned, or the user's, extended in place)
        kv = engine.returned_kv(sequences)
        returned = hand_back(past.cache, kv, past.length, call.model) if kv is not None else past.cache
    if not gen.return_dict_in_generate:
        return sequences
    steps = sequences.shape[1] - call.input_ids.shape[1]
    return MagicDecOutput(
        sequences=sequences,
        scores=ScoresRecorder.assemble(scores.scores, steps) if gen.output_scores else None,
        logits=ScoresRecorder.assemble(scores.logits, steps) if gen.output_logits else None,
        speculation=stats,
        **{generate_cache_name(): returned},  # `cache` from transformers 5.24
    )


def _gamma_policy(config: MagicDecConfig, prompt: int, max_new: int, lockstep, resolution: Resolution,
                  sampling: bool = False):
    """``(γ policy, draft scratch slots)``: fixed γ, or adaptive γ between 1 (0 for a schedule: plain
    decoding while speculation does not pay) and the largest γ whose γ + 1 committed tokens fit in
    the view's rolling window (and ``max_gamma``). A greedy schedule also checks the cost model
    against its steps' wall times; a sampled one does not, so that its γs, and with them the
    random draws, do not depend on timing: a seed reproduces the call."""
    if not config.adaptive:
        return FixedGamma(config.gamma), config.gamma
    window = config.view.window_slots(config.draft_budget, config.gamma, prompt, max_new)
    scratch = lockstep.agree_min(max(1, min(config.max_gamma, window - 1)))
    plan = resolution.plan
    prior = plan.acceptance if plan is not None and plan.acceptance else 0.8
    end = -lockstep.agree_min(-(prompt + max_new))  # the longest rank's: every rank takes the same γ
    controller = GammaController(config.gamma, scratch, prior, step_model=resolution.step_model,
                                 allow_off=resolution.schedule, measure_costs=not sampling, end=end)
    return AdaptiveGamma(controller, lockstep), scratch

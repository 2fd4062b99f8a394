"""The reversible ``speculative=`` routing around ``GenerationMixin.generate``.

Calls that do not ask for speculation go to the original ``generate`` untouched (same
arguments, same signature). Calls with ``speculative=...`` (or a generation config carrying a
``speculative`` attribute, e.g. from a model's ``generation_config.json`` or a ``GenerationConfig``
built by a trainer) go to the original ``generate`` with ``custom_generate=hf_magicdec.generate``.

This is the edge where MagicDec's options enter, once: the keywords of the call, and the options a
generation config carries as attributes beside ``speculative`` (the model's, then the call's; the
call's keywords win), are turned into one :class:`~hf_magicdec.MagicDecConfig` by
:meth:`~hf_magicdec.MagicDecConfig.from_any`. It travels to the engine in one
:class:`~hf_magicdec.api.Request`, together with what HF does not hand to custom callables
(streamer, synced_gpus, stop strings and their tokenizer) and the separate draft model.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
from typing import Any

from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

from .api import Request
from .api import generate as engine
from .compat import check_transformers
from .config import MagicDecConfig, carried_options, keyword_names
from .engine.validation import check_route_kwargs, take_assistant_model
from .notices import notice
from .views import DraftView, get_view, likely_names

_original_generate = None
_OFF = (None, False, "", "none", "off")


def is_enabled() -> bool:
    """Whether ``model.generate(speculative=...)`` is currently routed."""
    return getattr(GenerationMixin.generate, "_hf_magicdec_routing", False)


def enable() -> None:
    """Install the routing (idempotent). ``import hf_magicdec`` calls it unless the environment
    variable ``HF_MAGICDEC_NO_PATCH=1`` is set."""
    global _original_generate
    if is_enabled():
        return
    check_transformers()  # the internals the routing and the engine rely on, else the supported range
    original = GenerationMixin.generate
    _original_generate = original
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if isinstance(kwargs.get("custom_generate"), (str, os.PathLike)):
            # A Hub / local repository's custom_generate/generate.py (hf-magicdec export-hub) reads
            # speculative= itself; transformers loads and calls it.
            return original(self, *args, **kwargs)
        spec = _requested(self, args, kwargs, signature)
        if spec in _OFF and "speculative" not in kwargs and kwargs.get("custom_generate") is engine:
            spec = "magicdec"  # custom_generate=hf_magicdec.generate: its options enter here too
        if spec in _OFF:
            kwargs.pop("speculative", None)
            _refuse_unrequested_options(self, args, kwargs)
            return original(self, *args, **kwargs)
        return _route(self, original, signature, spec, args, kwargs)

    generate._hf_magicdec_routing = True
    GenerationMixin.generate = generate
    _guard_continuous_batching()


def disable() -> None:
    """Remove the routing and restore transformers' own ``generate`` (idempotent)."""
    if is_enabled() and _original_generate is not None:
        GenerationMixin.generate = _original_generate
        if "init_continuous_batching" in vars(GenerationMixin):
            del GenerationMixin.init_continuous_batching  # the inherited ContinuousMixin method again


def _guard_continuous_batching() -> None:
    """transformers' continuous batching (``generate_batch``, ``continuous_batching_context_manager``,
    ``init_continuous_batching``: all three build their manager in the last) decodes with its own
    paged loop and never calls ``generate``. A generation config asking for MagicDec there would be
    ignored without a word; say which path runs instead."""
    original = getattr(GenerationMixin, "init_continuous_batching", None)
    if original is None:  # a transformers without continuous batching
        return

    @functools.wraps(original)
    def init_continuous_batching(self, *args, **kwargs):
        config = kwargs.get("generation_config", args[0] if args else None)
        spec = _requested(self, (), {"generation_config": config}, None)
        options = carried_options(getattr(self, "generation_config", None), config)
        if spec not in _OFF or options:
            asked = f"speculative={spec!r}" if spec not in _OFF else f"MagicDec options {sorted(options)}"
            notice(f"{asked} does not apply to transformers' continuous batching (generate_batch, "
                   "init_continuous_batching, continuous_batching_context_manager): these requests decode with "
                   "transformers' continuous batching and no speculation. For MagicDec, call model.generate(input_ids, "
                   "attention_mask=..., speculative='magicdec') on a padded batch.")
        return original(self, *args, **kwargs)

    GenerationMixin.init_continuous_batching = init_continuous_batching


def _requested(model, args, kwargs, signature) -> Any:
    if "speculative" in kwargs:
        return kwargs["speculative"]
    generation_config = kwargs.get("generation_config")
    if generation_config is None and len(args) >= 2:
        generation_config = args[1]
    for cfg in (generation_config, getattr(model, "generation_config", None)):
        spec = getattr(cfg, "speculative", None) if cfg is not None else None
        if spec is not None:
            return spec
    return None


def _refuse_unrequested_options(model, args, kwargs) -> None:
    """MagicDec's options on a call that did not ask for MagicDec: keywords are refused (stock
    ``generate`` would refuse them too, as unused model kwargs, without saying why); options a
    generation config carries are ignored with a warning."""
    taken = set(inspect.signature(model.forward).parameters)
    stray = sorted(n for n in keyword_names() if n in kwargs and n not in taken)
    if stray:
        raise ValueError(f"{stray} are MagicDec options, and this call did not ask for MagicDec: add "
                         "speculative='magicdec' (or drop them).")
    config = kwargs.get("generation_config", args[1] if len(args) >= 2 else None)
    carried = carried_options(config)
    if carried:
        notice(f"The generation config carries MagicDec options {sorted(carried)} but no speculative= entry: they "
               "are ignored and this call decodes with stock generate. Add speculative='magicdec' to use them.")


@functools.cache
def _generation_config_fields() -> frozenset[str]:
    return frozenset(vars(GenerationConfig()))


def _refuse_near_misses(model, signature, config: MagicDecConfig, call: dict) -> None:
    """A leftover keyword close to a MagicDec option (``windw=16``) is a typo of it: name it with the
    likely option now, rather than let transformers refuse it as an unused model kwarg after
    preparing the call. A near-miss of the chosen view's option gets that view's own error."""
    taken = set(signature.parameters) | set(inspect.signature(model.forward).parameters)
    stray = [k for k in call if k not in taken and k not in _generation_config_fields()]
    names = keyword_names()
    for key in stray:
        hint = likely_names([key], names)
        if not hint:
            continue
        if isinstance(config.draft, DraftView) and likely_names([key], config.draft.option_names()):
            get_view(config.draft.name, **{key: call[key]})  # raises: the view's error names the option
        raise ValueError(f"Unknown MagicDec option {key!r}{hint}; the options are {sorted(names)}.")


def _route(model, original, signature, spec, args, kwargs):
    bound = signature.bind_partial(model, *args, **kwargs)
    call = dict(bound.arguments)
    call.pop("self", None)
    call.update(call.pop("kwargs", {}))
    call.pop("speculative", None)
    custom = call.get("custom_generate")
    if custom is not None and custom is not engine:
        raise ValueError(f"speculative={spec!r} cannot be combined with custom_generate={custom!r}.")
    take_assistant_model(call)  # assistant_model= is the draft model, as in assisted generation
    check_route_kwargs(call)
    options = carried_options(getattr(model, "generation_config", None), call.get("generation_config"))
    options.update({name: call.pop(name) for name in keyword_names() if name in call})
    # Validated here, once, before HF prepares anything or the model runs.
    config = MagicDecConfig.from_any(spec, **options)
    _refuse_near_misses(model, signature, config, call)
    # HF drops `tokenizer` before a custom callable sees it and then fails on stop strings;
    # take both over and let the engine build the criterion.
    stop_strings = call.pop("stop_strings", None)
    source = call.get("generation_config") or model.generation_config
    if getattr(source, "stop_strings", None):
        stop_strings = stop_strings or source.stop_strings
        call["generation_config"] = copy.deepcopy(source)
        call["generation_config"].stop_strings = None
    call["magicdec_request"] = Request(config, streamer=call.pop("streamer", None),
                                       synced_gpus=call.pop("synced_gpus", None),
                                       draft_model=call.pop("draft_model", None), stop_strings=stop_strings or None,
                                       tokenizer=call.pop("tokenizer", None) if stop_strings else None)
    call["custom_generate"] = engine
    return original(model, **call)


def _install_on_import() -> None:
    if os.environ.get("HF_MAGICDEC_NO_PATCH", "").lower() not in ("1", "true", "yes"):
        enable()


def set_default_speculation(model, speculative: Any = "magicdec", **options: Any) -> None:
    """Make ``model.generate()`` use MagicDec by default, in a way that survives ``save_pretrained``.

    Stores the configuration as a JSON-able dict in ``model.generation_config.speculative``. A
    generation config that transformers derived from the model config (``_from_model_config``)
    drops unknown attributes when it is loaded again, so the flag is cleared here: the saved
    ``generation_config.json`` then routes to MagicDec on ``from_pretrained`` (after
    ``import hf_magicdec``). Pass ``speculative=None`` to remove the default.

    Parameters
    ----------
    model : a ``PreTrainedModel``.
    speculative : ``"magicdec"``, a dict, a :class:`~hf_magicdec.MagicDecConfig` or None.
    **options : MagicDecConfig fields and view options (``gamma``, ``draft``, ``draft_budget``, ``window`` …).

    Examples
    --------
    >>> hf_magicdec.set_default_speculation(model, draft="snapkv", draft_budget=512, gamma=4)
    >>> model.save_pretrained("my-model")  # generation_config.json now carries "speculative"
    """
    gc = model.generation_config
    if speculative is None:
        if hasattr(gc, "speculative"):
            del gc.speculative
        return
    gc.speculative = MagicDecConfig.from_any(speculative, **options).to_dict()
    gc._from_model_config = False

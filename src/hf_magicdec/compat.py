"""Which transformers this library supports, and a check that its internals are where we use them.

hf-magicdec plugs into transformers at a handful of places that are public but not frozen between
minor releases: it wraps ``GenerationMixin.generate`` and hands it ``custom_generate=``, registers an
attention function and a mask function, subclasses ``Cache`` / ``CacheLayerMixin``, builds HF's
stopping criteria and output classes, and switches a config's ``_attn_implementation``.
:func:`check_transformers` looks all of them up once (routing calls it when it installs itself) and,
if one has moved, raises an :class:`ImportError` that names the supported range, instead of an
``AttributeError`` deep inside the first ``generate``.

Differences inside the range are bridged here too: :func:`cache_kwarg_to_past_key_values` (5.24
renamed generate's ``past_key_values`` to ``cache``). The two differences of Triton's CPU interpreter
between the oldest torch and Triton that ``pyproject.toml`` admits and the ones CI runs serve only the
tests and scripts that run the kernels interpreted: ``tests/triton_bridges.py`` bridges them.

The range is the one ``pyproject.toml`` declares; CI runs the suite on its floor (``make test``)
and on the newest 5.x release (``make test-newest``).
"""

from __future__ import annotations

import functools
import importlib
import inspect

import transformers
from transformers.generation import utils as generation_utils

__all__ = ["SUPPORTED_TRANSFORMERS", "REQUIRED", "cache_kwarg_to_past_key_values", "past_key_values_to_cache_kwarg",
           "generate_cache_name", "check_transformers", "missing_internals"]

#: The transformers versions this release supports (keep equal to ``pyproject.toml``).
SUPPORTED_TRANSFORMERS = ">=5.23,<6"

#: ``(module, attribute path)`` of every transformers internal the library relies on.
REQUIRED: tuple[tuple[str, str], ...] = (
    # routing.py: the speculative= routing around generate, through custom_generate=
    ("transformers.generation.utils", "GenerationMixin.generate"),
    # engine/attention.py: the "magicdec" attention and mask functions, the originals' fallbacks
    ("transformers", "AttentionInterface.register"),
    ("transformers.masking_utils", "AttentionMaskInterface.register"),
    ("transformers.masking_utils", "ALL_MASK_ATTENTION_FUNCTIONS"),
    ("transformers.masking_utils", "sdpa_mask"),
    ("transformers.modeling_utils", "ALL_ATTENTION_FUNCTIONS"),
    ("transformers.configuration_utils", "PreTrainedConfig._attn_implementation"),
    # engine/cache.py: MagicDecCache and its layers
    ("transformers.cache_utils", "Cache"),
    ("transformers.cache_utils", "CacheLayerMixin"),
    # api.py, engine/ragged.py, engine/outputs.py, config.py, engine/steps.py
    ("transformers.generation.stopping_criteria", "StopStringCriteria"),
    ("transformers.generation.stopping_criteria", "StoppingCriteriaList"),
    ("transformers.generation.stopping_criteria", "EosTokenCriteria"),
    ("transformers.generation.stopping_criteria", "MaxLengthCriteria"),
    ("transformers.generation.utils", "GenerateDecoderOnlyOutput"),
    ("transformers", "CompileConfig"),
)


def _resolve(module: str, path: str) -> object:
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def missing_internals() -> list[str]:
    """Return the dotted names from :data:`REQUIRED` that the installed transformers lacks (empty
    when everything is in place), plus ``generate(custom_generate=)`` if that keyword is gone."""
    missing = []
    for module, path in REQUIRED:
        try:
            _resolve(module, path)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{path}")
    try:
        generate = _resolve("transformers.generation.utils", "GenerationMixin.generate")
        # The routing may already wrap it (functools.wraps): look at what it wraps.
        params = inspect.signature(inspect.unwrap(generate)).parameters
        if "custom_generate" not in params:
            missing.append("GenerationMixin.generate(custom_generate=...)")
    except (ImportError, AttributeError, TypeError, ValueError):
        pass  # already reported above
    return missing


def _installed_version() -> str:
    return getattr(transformers, "__version__", "unknown")


@functools.lru_cache(maxsize=1)
def _checked() -> None:
    missing = missing_internals()
    if missing:
        raise ImportError(
            f"hf-magicdec supports transformers{SUPPORTED_TRANSFORMERS}, but the installed transformers "
            f"{_installed_version()} lacks what hf-magicdec builds on: {', '.join(missing)}. "
            f"Install a supported release: pip install 'transformers{SUPPORTED_TRANSFORMERS}'"
        )


def check_transformers() -> None:
    """Raise :class:`ImportError` naming :data:`SUPPORTED_TRANSFORMERS` if any internal in
    :data:`REQUIRED` is missing from the installed transformers. The look-up runs once per process;
    a successful result is cached (a failure is raised again on every call)."""
    _checked()


def cache_kwarg_to_past_key_values(model_kwargs: dict) -> dict:
    """transformers 5.24 renamed generate's ``past_key_values`` to ``cache`` (the old name stays a
    deprecated alias until 6.0) and hands decoding methods the cache under the new name; the engine
    reads ``past_key_values``. Move ``cache`` there (in place; a given ``past_key_values`` wins)."""
    if "cache" in model_kwargs:
        cache = model_kwargs.pop("cache")
        if model_kwargs.get("past_key_values") is None:
            model_kwargs["past_key_values"] = cache
    return model_kwargs


def generate_cache_name() -> str:
    """The name under which the installed transformers' ``generate`` passes and returns the cache:
    ``"cache"`` from 5.24 (``past_key_values`` is its deprecated alias until 6.0), else
    ``"past_key_values"``."""
    return getattr(generation_utils, "ALL_CACHE_NAMES", ["past_key_values"])[0]


def past_key_values_to_cache_kwarg(model_kwargs: dict) -> dict:
    """The inverse, for handing model kwargs back to stock decoding methods (``_sample``): on
    transformers >= 5.24 they read the cache from ``cache`` only (chunked prefill refuses to run
    without it; without chunking a fresh cache would be built and the prompt cache ignored).
    Returns a new dict; the installed release's own cache name is looked up, not its version."""
    name = generate_cache_name()
    out = dict(model_kwargs)
    if name != "past_key_values" and "past_key_values" in out:
        out[name] = out.pop("past_key_values")
    return out

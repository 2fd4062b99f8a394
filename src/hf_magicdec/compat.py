"""Which transformers this library supports, and a check that its internals are where we use them.

hf-magicdec plugs into transformers at a handful of places that are public but not frozen between
minor releases: it wraps ``GenerationMixin.generate`` and hands it ``custom_generate=``, registers an
attention function and a mask function, subclasses ``Cache`` / ``CacheLayerMixin``, builds HF's
stopping criteria and output classes, and switches a config's ``_attn_implementation``.
:func:`check_transformers` looks all of them up once (routing calls it when it installs itself) and,
if one has moved, raises an :class:`ImportError` that names the supported range, instead of an
``AttributeError`` deep inside the first ``generate``.

Differences inside the range are bridged here too: :func:`cache_kwarg_to_past_key_values` (5.24
renamed generate's ``past_key_values`` to ``cache``). So are the two differences between the oldest
torch and Triton that ``pyproject.toml`` admits (torch 2.11, Triton 3.6: the lent GPU machine's
stack) and the ones CI runs (torch 2.13, Triton 3.9), both in Triton's CPU interpreter
(``TRITON_INTERPRET=1``, the kernel tests): :func:`bridge_triton_interpreter`, applied when this
module is imported, which is before any kernel is (``import hf_magicdec`` imports it).

The range is the one ``pyproject.toml`` declares; CI runs the suite on its floor (``make test``)
and on the newest 5.x release (``make test-newest``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import sys

import torch
import torch.library
import transformers
from transformers.generation import utils as generation_utils

__all__ = ["SUPPORTED_TRANSFORMERS", "REQUIRED", "bridge_triton_interpreter", "cache_kwarg_to_past_key_values",
           "past_key_values_to_cache_kwarg", "generate_cache_name",
           "check_transformers", "missing_internals"]

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


# --- torch >= 2.11 and Triton >= 3.6 under Triton's interpreter ------------------------------------


def _release(version: str) -> tuple[int, int]:
    """``"2.11.0+cu130"`` -> ``(2, 11)``; ``(0, 0)`` for a version that does not start so."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def _bridge_wrap_triton() -> bool:
    """torch 2.11's ``torch.library.wrap_triton`` raises ("only works on functions annotated with
    triton.jit") for the ``InterpretedFunction`` that ``@triton.jit`` returns under
    ``TRITON_INTERPRET=1``; torch 2.13 returns such a kernel unchanged (launched eagerly, which is
    all the interpreter can do). Give torch < 2.13 the 2.13 behaviour for interpreted kernels only
    (everything else still goes to torch's own ``wrap_triton``; 2.12 was not checked, and the bridge
    changes nothing where torch already accepts such kernels). Must run before
    ``hf_magicdec.kernels.triton_kernels`` does ``from torch.library import wrap_triton``."""
    if _release(torch.__version__) >= (2, 13) or getattr(torch.library.wrap_triton, "_hf_magicdec_bridge", False):
        return False
    from triton.runtime import interpreter  # optional dependency: only under TRITON_INTERPRET

    original = torch.library.wrap_triton

    @functools.wraps(original)
    def wrap_triton(triton_kernel):
        if isinstance(triton_kernel, interpreter.InterpretedFunction):
            return triton_kernel
        return original(triton_kernel)

    wrap_triton._hf_magicdec_bridge = True
    torch.library.wrap_triton = wrap_triton
    return True


def _bridge_interpreter_index() -> bool:
    """Triton 3.6's interpreter turns a scalar tensor into a Python int (``__index__``, e.g. for
    ``range(start, stop, BLOCK)`` with loaded bounds) by ``int()`` of a 1-element array, which
    current NumPy refuses (2.4.6 here: "only 0-dimensional arrays can be converted to Python
    scalars"); Triton 3.9 squeezes the array first. Do the same on Triton < 3.9 (3.7 and 3.8 were not
    checked; the result is the same wherever ``int()`` worked)."""
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:  # a Triton installed under another name
        version = None
    if version is not None and _release(version) >= (3, 9):
        return False
    from triton.runtime import interpreter  # optional dependency: only under TRITON_INTERPRET

    if version is None and _release(sys.modules["triton"].__version__) >= (3, 9):
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_hf_magicdec_bridge", False):
        return False

    @functools.wraps(original)
    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor._hf_magicdec_bridge = True
    interpreter._patch_lang_tensor = _patch_lang_tensor
    return True


def bridge_triton_interpreter() -> list[str]:
    """Apply the torch 2.11 / Triton 3.6 interpreter bridges above when ``TRITON_INTERPRET`` is
    set and Triton is installed (idempotent; nothing is imported or changed otherwise, and nothing
    changes on torch >= 2.13 with Triton >= 3.9, nor for kernels compiled for a GPU). Returns the
    names of the bridges it installed."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") or importlib.util.find_spec("triton") is None:
        return []
    installed = []
    for bridge in (_bridge_wrap_triton, _bridge_interpreter_index):
        try:
            if bridge():
                installed.append(bridge.__name__)
        except (ImportError, AttributeError):  # a Triton or torch laid out otherwise: leave it alone
            pass
    return installed


bridge_triton_interpreter()

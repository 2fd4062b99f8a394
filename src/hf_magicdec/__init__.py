"""hf_magicdec: lossless self-speculative decoding (MagicDec) for Hugging Face transformers.

    import hf_magicdec
    out = model.generate(**inputs, speculative="magicdec", max_new_tokens=256)

Importing the package installs a reversible routing of ``generate``'s ``speculative=`` kwarg
(a strict no-op for every other call); set ``HF_MAGICDEC_NO_PATCH=1`` to skip it and use
``model.generate(..., custom_generate=hf_magicdec.generate)`` instead.
"""

from .api import generate
from .config import MagicDecConfig
from .engine.cache import MagicDecCache
from .engine.outputs import MagicDecOutput, SpeculationStats
from .engine.shared_prefill import shared_prefill
from .notices import MagicDecWarning
from .planning import device_model, plan
from .routing import disable, enable, is_enabled, set_default_speculation
from .views import (AttendedPages, DraftView, DynamicPages, FullKV, SnapKV, StreamingLLM, available_views, get_view,
                    register_view)

__version__ = "0.1.0"

__all__ = [
    "AttendedPages",
    "DraftView",
    "DynamicPages",
    "FullKV",
    "SnapKV",
    "StreamingLLM",
    "MagicDecCache",
    "MagicDecConfig",
    "MagicDecOutput",
    "MagicDecWarning",
    "SpeculationStats",
    "available_views",
    "disable",
    "device_model",
    "enable",
    "generate",
    "get_view",
    "is_enabled",
    "plan",
    "register_view",
    "set_default_speculation",
    "shared_prefill",
]

from .routing import _install_on_import

_install_on_import()
del _install_on_import

"""hf_magicdec: lossless self-speculative decoding (MagicDec) for Hugging Face transformers.

    import hf_magicdec
    out = model.generate(**inputs, speculative="magicdec", max_new_tokens=256)

Importing the package installs a reversible routing of ``generate``'s ``speculative=`` kwarg
(a strict no-op for every other call); set ``HF_MAGICDEC_NO_PATCH=1`` to skip it and use
``model.generate(..., custom_generate=hf_magicdec.generate)`` instead.
"""

from .auto import plan
from .cache import MagicDecCache
from .config import MagicDecConfig
from .generation import generate
from .outputs import MagicDecOutput, SpeculationStats
from .routing import disable, enable, is_enabled, set_default_speculation
from .views import DraftView, available_views, register_view

__version__ = "0.1.0"

__all__ = [
    "DraftView",
    "MagicDecCache",
    "MagicDecConfig",
    "MagicDecOutput",
    "SpeculationStats",
    "available_views",
    "disable",
    "enable",
    "generate",
    "is_enabled",
    "plan",
    "register_view",
    "set_default_speculation",
]

from .routing import _install_on_import

_install_on_import()
del _install_on_import

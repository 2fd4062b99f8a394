"""The engine's KV cache: :class:`MagicDecCache` (the transformers ``Cache``), its layers
(:mod:`.layers`: full KV and draft view), the per-forward values (:mod:`.forwards`), the draft
views' slot layout (:mod:`.geometry`), its options (:mod:`.options`) and slot buffers
(:mod:`.buffers`)."""

from .buffers import initial_capacity
from .cache import CacheHook, MagicDecCache, PromptSnapshot
from .forwards import DraftForward, Forward, PrefillForward, VerifyForward
from .geometry import DraftGeometry
from .layers import DraftKV, MagicDecLayer
from .options import CacheOptions

__all__ = ["CacheHook", "CacheOptions", "DraftForward", "DraftGeometry", "DraftKV", "Forward", "MagicDecCache",
           "MagicDecLayer", "PrefillForward", "PromptSnapshot", "VerifyForward", "initial_capacity"]

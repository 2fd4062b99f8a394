"""The engine's KV cache: :class:`MagicDecCache` (the transformers ``Cache``), its layers
(:mod:`.layers`: full KV and draft view), the per-forward values (:mod:`.forwards`), the draft
views' slot layout (:mod:`.geometry`), its options (:mod:`.options`), the stacked buffers
(:mod:`.store`) and the slot arithmetic (:mod:`.buffers`)."""

from .buffers import initial_capacity
from .cache import MagicDecCache, PromptSnapshot, RowState
from .forwards import DraftForward, Forward, PrefillForward, VerifyForward
from .geometry import DraftGeometry
from .layers import MagicDecLayer
from .store import LayerStack
from .options import CacheOptions

__all__ = ["CacheOptions", "DraftForward", "DraftGeometry", "Forward", "LayerStack", "MagicDecCache", "MagicDecLayer",
           "PrefillForward", "PromptSnapshot", "RowState", "VerifyForward", "initial_capacity"]

"""One prefill shared by several ``generate`` calls on the same prompts (acceptance sweeps)."""

from __future__ import annotations

import contextlib
import contextvars

import torch

from .buffers import widened
from .cache import MagicDecCache

__all__ = ["PrefillEntry", "shared_prefill", "stored_prefill", "store_prefill"]

_SHARED_PREFILL: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "hf_magicdec_shared_prefill", default=None
)


@contextlib.contextmanager
def shared_prefill():
    """Reuse one prefill across the MagicDec ``generate`` calls inside the block.

    For sweeps over draft views, budgets and gamma on the same prompts (acceptance studies), where
    prefill dominates: the first call's prefilled cache is kept, and a later call with the same
    prompts, positions, padding and prefill chunking gets a copy of it instead of recomputing it.
    Prefill does not depend on the draft configuration, so outputs are unchanged; only the
    reported ``prefill_seconds`` of reused calls is meaningless (it measures a copy).

    Examples
    --------
    >>> with shared_prefill():
    ...     for budget in (128, 256, 512):
    ...         model.generate(ids, speculative="magicdec", draft_budget=budget, max_new_tokens=64)
    """
    token = _SHARED_PREFILL.set([])
    try:
        yield
    finally:
        _SHARED_PREFILL.reset(token)


def stored_prefill(input_ids, position_ids, pad, chunk: int, capacity: int, observe: int):
    """``(cache, last logits)`` restored from a matching stored prefill, or None (none stored,
    or not inside :func:`shared_prefill`)."""
    entry = next((e for e in _SHARED_PREFILL.get() or ()
                  if e.matches(input_ids, position_ids, pad, chunk, capacity, observe)), None)
    return None if entry is None else (entry.restore(capacity, observe), entry.logits.clone())


def store_prefill(input_ids, position_ids, pad, chunk: int, observe: int, cache: MagicDecCache, logits) -> None:
    """Keep a copy of a fresh prefill for later calls (only inside :func:`shared_prefill`)."""
    store = _SHARED_PREFILL.get()
    if store is not None:
        store.append(PrefillEntry(input_ids, position_ids, pad, chunk, observe, cache, logits))


class PrefillEntry:
    """A prefilled cache kept by :func:`shared_prefill` (its prompt slots copied out, never handed
    out itself); restored into a cache of any capacity that holds the prompt."""

    def __init__(self, input_ids, position_ids, pad, chunk, observe, cache, logits):
        self.input_ids, self.position_ids, self.pad = input_ids.clone(), position_ids.clone(), pad.clone()
        self.chunk, self.observe = chunk, observe
        self.logits = logits.clone()
        self.prompt = cache.max_length()
        self.layers = [
            (layer.keys[:, :, : self.prompt].clone(), layer.values[:, :, : self.prompt].clone(),
             None if layer.observed_queries is None else layer.observed_queries.clone(), layer.scaling)
            for layer in cache.layers
        ]

    def matches(self, input_ids, position_ids, pad, chunk, capacity, observe) -> bool:
        return (
            chunk == self.chunk and capacity >= self.prompt and observe <= self.observe
            and input_ids.shape == self.input_ids.shape and torch.equal(input_ids, self.input_ids)
            and torch.equal(position_ids, self.position_ids) and torch.equal(pad, self.pad)
        )

    def restore(self, capacity: int, observe: int) -> MagicDecCache:
        cache = MagicDecCache(len(self.layers), self.input_ids.shape[0], capacity, self.pad.clone())
        cache.observation_window = observe
        for layer, (keys, values, queries, scaling) in zip(cache.layers, self.layers):
            layer.keys, layer.values = widened(keys, capacity, self.prompt), widened(values, capacity, self.prompt)
            layer.device, layer.dtype, layer.is_initialized = keys.device, keys.dtype, True
            layer.observed_queries = queries[:, :, queries.shape[2] - observe :].clone() if observe else None
            layer.scaling = scaling
        cache.end_prefill(self.prompt)
        return cache

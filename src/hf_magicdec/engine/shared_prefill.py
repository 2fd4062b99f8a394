"""One prefill shared by several ``generate`` calls on the same prompts (acceptance sweeps)."""

from __future__ import annotations

import contextlib
import contextvars

import torch

from .cache import CacheOptions, MagicDecCache

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


def stored_prefill(input_ids, position_ids, pad, chunk: int, capacity: int, options: CacheOptions):
    """``(cache, last logits)`` restored from a matching stored prefill into a cache of
    ``capacity`` slots with ``options``, or None (none stored, or not inside :func:`shared_prefill`)."""
    entry = next((e for e in _SHARED_PREFILL.get() or ()
                  if e.matches(input_ids, position_ids, pad, chunk, capacity, options.observation_window)), None)
    if entry is None:
        return None
    return MagicDecCache.from_snapshot(entry.snapshot, capacity, options), entry.logits.clone()


def store_prefill(input_ids, position_ids, pad, chunk: int, cache: MagicDecCache, logits) -> None:
    """Keep a copy of a fresh prefill for later calls (only inside :func:`shared_prefill`)."""
    store = _SHARED_PREFILL.get()
    if store is not None:
        store.append(PrefillEntry(input_ids, position_ids, pad, chunk, cache, logits))


class PrefillEntry:
    """A prefilled cache kept by :func:`shared_prefill` (its prompt copied out, never handed out
    itself); restored into a cache of any capacity that holds the prompt."""

    def __init__(self, input_ids, position_ids, pad, chunk, cache: MagicDecCache, logits):
        self.input_ids, self.position_ids, self.pad = input_ids.clone(), position_ids.clone(), pad.clone()
        self.chunk, self.observe = chunk, cache.options.observation_window
        self.logits = logits.clone()
        self.snapshot = cache.snapshot_prompt()

    def matches(self, input_ids, position_ids, pad, chunk, capacity, observe) -> bool:
        return (
            chunk == self.chunk and capacity >= self.snapshot.prompt and observe <= self.observe
            and input_ids.shape == self.input_ids.shape and torch.equal(input_ids, self.input_ids)
            and torch.equal(position_ids, self.position_ids) and torch.equal(pad, self.pad)
        )

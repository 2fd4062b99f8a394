"""What a :class:`~hf_magicdec.engine.cache.MagicDecCache` is told when it is made, and never after."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheOptions:
    """Options of one cache, fixed for its life.

    Attributes
    ----------
    observation_window : int
        Trailing prefill queries each layer records (SnapKV scores the prompt with them); 0: none.
    position_limit : int or None
        Largest position the generation reaches (prompt slots + new tokens), checked by the
        attention against sliding windows; None: unchecked (synthetic caches of step timing).
    max_capacity : int or None
        Slots per row :meth:`~hf_magicdec.engine.cache.MagicDecCache.reserve` grows to at most
        (prompt + new tokens + scratch + 1: all the call can write); None: the initial capacity.
    fixed_shapes : bool
        Compiled steps: draft and verify forwards read whole buffers (the draft views with all
        their scratch, the full cache up to its capacity), masked by their key ranges, so a
        captured graph sees the same shapes at every step (they change only when the cache grows
        or rows leave).
    static_addresses : bool
        Compiled on CUDA: the KV buffers are marked as static inputs each time they are made, so
        CUDA graphs read and write them in place instead of copying the cache into the graph's own
        input buffers at every step.
    """

    observation_window: int = 0
    position_limit: int | None = None
    max_capacity: int | None = None
    fixed_shapes: bool = False
    static_addresses: bool = False

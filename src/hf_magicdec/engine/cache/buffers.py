"""Slot buffers of the cache: how many slots to allocate, how to grow, and the copies between slots.

The growth policy is module-level so that tests can force many growths.
"""

from __future__ import annotations

import math

import torch

# Growth policy of the full cache (module-level so tests can force many growths).
INITIAL_HEADROOM = 256  # generated-token slots allocated with the prompt (fewer if max_new_tokens is smaller)
GROWTH_FACTOR = 1.5  # a growing cache becomes at least this many times larger …
MIN_GROWTH = 256  # … and at least this many slots larger


def initial_capacity(prompt: int, max_new_tokens: int, scratch: int) -> int:
    """Slots per row to allocate at prefill: the prompt, ``min(max_new_tokens, INITIAL_HEADROOM)``
    generated tokens and one verify's worth of scratch (``scratch + 1``)."""
    return prompt + min(max(max_new_tokens, 0), INITIAL_HEADROOM) + scratch + 1


def grown_capacity(capacity: int, needed: int, limit: int) -> int:
    """Next capacity of a cache of ``capacity`` slots that must hold ``needed``: geometric
    (``GROWTH_FACTOR``, at least ``MIN_GROWTH`` more), at most ``limit`` unless ``needed`` is more."""
    target = max(needed, math.ceil(capacity * GROWTH_FACTOR), capacity + MIN_GROWTH)
    return max(needed, min(target, limit))


def widened(buffer: torch.Tensor, capacity: int, filled: int) -> torch.Tensor:
    """``buffer [B, H, S, D]`` moved into a new ``[B, H, capacity, D]`` buffer on its device: the
    first ``filled`` slots copied, the rest zero (unwritten slots are read masked; zeros keep masked
    products finite)."""
    out = buffer.new_empty((*buffer.shape[:2], capacity, buffer.shape[-1]))
    out[:, :, :filled] = buffer[:, :, :filled]
    out[:, :, filled:].zero_()
    return out


def copy_slots(source: torch.Tensor, src: torch.Tensor, dest: torch.Tensor, dst: torch.Tensor) -> None:
    """``dest[b, :, dst[b, j]] = source[b, :, src[b, j]]`` for ``[B, H, S, D]`` buffers, ``[B, n]`` slots."""
    heads, dim = source.shape[1], source.shape[-1]
    s_idx = src[:, None, :, None].expand(-1, heads, -1, dim)
    d_idx = dst[:, None, :, None].expand(-1, heads, -1, dim)
    dest.scatter_(2, d_idx, torch.gather(source, 2, s_idx))


def per_device(*tensors: torch.Tensor):
    """``on(device)``: ``tensors`` on ``device``, copied once per device (device maps) rather than
    once per layer."""
    copies: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def on(device: torch.device) -> tuple[torch.Tensor, ...]:
        hit = copies.get(device)
        if hit is None:
            hit = copies[device] = tuple(t.to(device) for t in tensors)
        return hit

    return on

"""Slot buffers of the cache: how many slots to allocate, how to grow, and the copies between slots.

The growth policy is module-level so that tests can force many growths.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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


def row_moves(finished: Sequence[bool]) -> tuple[list[int], list[int], list[int]]:
    """How finished rows leave a batch of ``n`` rows in place: ``(order, holes, sources)``.

    The ``kept`` alive rows end up in positions ``[0, kept)``: each finished row there (a hole)
    takes the next alive row from ``[kept, n)`` (a source), so only as many rows move as finished
    early, not every row after the first one that finished. Swapping the pairs puts every finished
    row in ``[kept, n)``. ``order[i]`` is the row position ``i`` holds after the swaps; the first
    ``kept`` are the alive rows (not in increasing order once a row has moved)."""
    n = len(finished)
    kept = n - sum(bool(f) for f in finished)
    holes = [i for i in range(kept) if finished[i]]
    sources = [j for j in range(kept, n) if not finished[j]]
    order = list(range(n))
    for hole, source in zip(holes, sources):
        order[hole], order[source] = source, hole
    return order, holes, sources


def flat_slots(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Row indices into ``buffer.view(-1, D)`` of ``slots [B, H, n]`` in a ``[B, H, S, D]`` buffer."""
    batch, heads, length = buffer.shape[:3]
    slots = slots.expand(batch, heads, slots.shape[-1])
    rows = torch.arange(batch * heads, device=slots.device).view(batch, heads, 1) * length
    return (rows + slots).reshape(-1)

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


def widened(buffer: torch.Tensor, capacity: int, filled: int) -> torch.Tensor:
    """``buffer [B, H, S, D]`` moved into a new ``[B, H, capacity, D]`` buffer on its device: the
    first ``filled`` slots copied, the rest zero (unwritten slots are read masked; zeros keep masked
    products finite)."""
    out = buffer.new_empty((*buffer.shape[:2], capacity, buffer.shape[-1]))
    out[:, :, :filled] = buffer[:, :, :filled]
    out[:, :, filled:].zero_()
    return out


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


def move_rows(buffer: torch.Tensor, holes: torch.Tensor, sources: torch.Tensor, filled: int | None,
              swap: bool) -> None:
    """In place, for ``buffer [B, H, S, D]``: rows ``sources [k]`` go to rows ``holes [k]``
    (``swap``: and those rows' contents to ``sources``); slots ``[0, filled)`` only (None: all; the
    rest of a moved row keeps the finite values it held, read masked).

    Unlike a row selection with ``index_select`` (a second buffer of every kept row, beside the
    first), the temporaries are the ``k`` moved rows: on a CPU, where a large new buffer is fresh
    memory from the OS whose page faults cost more than the copy, 8 x 4K rows of SmolLM2 spent
    0.4-4.6 s of a 13-18 s call selecting and exporting rows that way (0.16-0.30 s moving them)."""
    region = buffer if filled is None else buffer[:, :, :filled]
    arrived = region.index_select(0, sources)
    if swap:
        region.index_copy_(0, sources, region.index_select(0, holes))
    region.index_copy_(0, holes, arrived)


def gather_slots(source: torch.Tensor, slots: torch.Tensor, flat: torch.Tensor | None = None) -> torch.Tensor:
    """``out[b, h, j] = source[b, h, slots[b, h, j]]``: ``[B, H, n, D]`` from a ``[B, H, S, D]``
    buffer and ``[B, H, n]`` slots (broadcast over ``H`` when ``[B, 1, n]``); ``flat``: their
    :func:`flat_slots` when the caller has them (the keys' serve the values).

    One ``index_select`` of whole ``D``-vectors on a contiguous buffer, not an element-wise
    ``gather`` with an index expanded over ``D`` (about 2x faster on a CPU, where the cache's
    copies are dominated by per-element index work)."""
    slots = slots.expand(*source.shape[:2], slots.shape[-1])
    if not source.is_contiguous():
        return torch.gather(source, 2, slots[..., None].expand(-1, -1, -1, source.shape[-1]))
    dim = source.shape[-1]
    picked = source.view(-1, dim).index_select(0, flat_slots(source, slots) if flat is None else flat)
    return picked.view(*slots.shape, dim)


def scatter_slots(dest: torch.Tensor, slots: torch.Tensor, values: torch.Tensor,
                  flat: torch.Tensor | None = None) -> None:
    """``dest[b, h, slots[b, h, j]] = values[b, h, j]`` in place, for ``[B, H, S, D]`` buffers and
    ``[B, H, n]`` slots (``flat`` as in :func:`gather_slots`). Slots written twice (the trash slot)
    get one of their values."""
    slots = slots.expand(*values.shape[:3])
    if not dest.is_contiguous():
        dest.scatter_(2, slots[..., None].expand(-1, -1, -1, dest.shape[-1]), values)
        return
    index = flat_slots(dest, slots) if flat is None else flat
    dest.view(-1, dest.shape[-1]).index_copy_(0, index, values.reshape(-1, dest.shape[-1]))


def flat_slots(buffer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Row indices into ``buffer.view(-1, D)`` of ``slots [B, H, n]`` in a ``[B, H, S, D]`` buffer."""
    batch, heads, length = buffer.shape[:3]
    slots = slots.expand(batch, heads, slots.shape[-1])
    rows = torch.arange(batch * heads, device=slots.device).view(batch, heads, 1) * length
    return (rows + slots).reshape(-1)


def copy_slots(source: torch.Tensor, src: torch.Tensor, dest: torch.Tensor, dst: torch.Tensor) -> None:
    """``dest[b, :, dst[b, j]] = source[b, :, src[b, j]]`` for ``[B, H, S, D]`` buffers, ``[B, n]`` slots."""
    scatter_slots(dest, dst[:, None, :], gather_slots(source, src[:, None, :]))


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

"""Stacked KV buffers: one tensor for every layer that shares a device and a head shape.

A :class:`LayerStack` holds the full KV and the draft views of a group of cache layers::

    full    keys / values  [L, B, Hkv, capacity, D]
    draft   keys / values  [L, B, Hkv, Ks + W + scratch + 1, D]     (:mod:`.geometry`)

Each layer's tensors are views ``stack[l]`` of it (``[B, Hkv, S, D]``, contiguous), which is what
the model's attention reads and writes. Everything the engine does *between* forwards (the commit
feeding the draft windows, a view re-choosing its static part, rows leaving, the cache growing) is
then one operation on the stack instead of one per layer: on a GPU, where every operation is a
kernel launch, the step's bookkeeping costs the same at 2 layers as at 80.

Rows are addressed through flat indices into the buffers viewed as ``[L * B0 * Hkv * S, D]``
(``B0``: the rows the buffers were allocated with; rows that leave keep their storage until the
next allocation), so a copy between any slots of any rows of every layer is one ``index_select``
and one ``index_copy_`` for keys and one of each for values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["LayerStack", "stack_key"]


def stack_key(keys: torch.Tensor, values: torch.Tensor) -> tuple:
    """What layers must share to be stacked: device, dtype, batch, KV heads and head dims."""
    return keys.device, keys.dtype, values.dtype, keys.shape[0], keys.shape[1], keys.shape[-1], values.shape[-1]


class LayerStack:
    """The KV buffers of the cache layers ``layers`` (cache indices, in order).

    Parameters
    ----------
    layers : list of int
        The cache layers stacked here; layer ``layers[j]`` is ``keys[j]``.
    keys, values : torch.Tensor
        ``[L, B, Hkv, capacity, D]`` contiguous full KV buffers (zeros past what is written).
    """

    def __init__(self, layers: list[int], keys: torch.Tensor, values: torch.Tensor):
        self.layers = list(layers)
        self.position = {layer: j for j, layer in enumerate(self.layers)}
        self.keys, self.values = keys, values
        self.draft_keys: torch.Tensor | None = None
        self.draft_values: torch.Tensor | None = None
        self.rows = keys.shape[1]  # rows in use: the first `rows` of the buffers' B0
        self._refresh()

    # ------------------------------------------------------------------ shapes
    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def full(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values) [L, B, Hkv, capacity, D]`` of the rows in use (views)."""
        return self.keys[:, : self.rows], self.values[:, : self.rows]

    def layer_full(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[j, : self.rows], self.values[j, : self.rows]

    def layer_draft(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.draft_keys[j, : self.rows], self.draft_values[j, : self.rows]

    def _refresh(self) -> None:
        """Remake what is derived from the buffers and the rows in use (after either changed): the
        flat row index of slot 0 of every (layer, row, head), ``[L, B, Hkv, 1]``, of the full and
        draft buffers viewed as ``[-1, D]``, and those flat views. Made here, between steps, so
        that a compiled step only adds slots to them."""
        self._full_base = _slot0(self.keys, self.rows)
        self._draft_base = _slot0(self.draft_keys, self.rows) if self.draft_keys is not None else None
        buffers = (self.keys, self.values) + ((self.draft_keys, self.draft_values) if self.draft_keys is not None
                                              else ())
        self._flat = tuple(b.view(-1, b.shape[-1]) for b in buffers)

    # ------------------------------------------------------------------ copies between slots
    def full_index(self, slots: torch.Tensor) -> torch.Tensor:
        """Flat indices of full-KV ``slots`` (``[B, n]``, or ``[L, B, Hkv, n]``) of every layer."""
        return (self._full_base + _as_lbhn(slots)).reshape(-1)

    def draft_index(self, slots: torch.Tensor) -> torch.Tensor:
        """Flat indices of draft-view ``slots`` (``[B, n]``, or ``[L, B, Hkv, n]``) of every layer."""
        return (self._draft_base + _as_lbhn(slots)).reshape(-1)

    def full_to_draft(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``draft[l, b, h, dst[.., j]] = full[l, b, h, src[.., j]]`` for every layer (``[B, n]``
        slots, the same in every layer and head, or ``[L, B, Hkv, n]``): two gathers, two scatters."""
        self.copy(self.full_index(src), self.draft_index(dst), from_full=True)

    def draft_to_draft(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """As :meth:`full_to_draft`, from the draft buffers' own slots (a draft model's scratch)."""
        self.copy(self.draft_index(src), self.draft_index(dst), from_full=False)

    def copy(self, src: torch.Tensor, dst: torch.Tensor, from_full: bool) -> None:
        """Flat rows ``src`` of the full (or draft) buffers into flat rows ``dst`` of the draft
        buffers; a destination written twice (the trash slot) gets one of its values."""
        flat = self._flat
        sources = flat[:2] if from_full else flat[2:]
        for source, dest in zip(sources, flat[2:]):
            dest.index_copy_(0, dst, source.index_select(0, src))

    # ------------------------------------------------------------------ allocation
    def build_draft(self, total: int, source: torch.Tensor | None) -> None:
        """Draft buffers of ``total`` slots whose first ``n`` slots hold the full KV at
        ``source [L, B, Hkv, n]`` (None: nothing yet); the rest zeros."""
        layers, _, heads = self.keys.shape[:3]
        shape = (layers, self.rows, heads, total)
        self.draft_keys = self.keys.new_zeros((*shape, self.keys.shape[-1]))
        self.draft_values = self.values.new_zeros((*shape, self.values.shape[-1]))
        self._refresh()
        if source is not None:
            n = source.shape[-1]
            self.copy(self.full_index(source), self.draft_index(torch.arange(n, device=source.device)[None, :]
                                                                .expand(self.rows, -1)), from_full=True)

    def widen(self, capacity: int, filled: int) -> None:
        """Full buffers of ``capacity`` slots holding the rows in use, slots ``[0, filled)`` copied,
        the rest zero (unwritten slots are read masked; zeros keep masked products finite)."""
        for name in ("keys", "values"):
            old = getattr(self, name)[:, : self.rows]
            new = old.new_empty((*old.shape[:3], capacity, old.shape[-1]))
            new[:, :, :, :filled] = old[:, :, :, :filled]
            new[:, :, :, filled:].zero_()
            setattr(self, name, new)
        self._refresh()

    def release_full(self) -> None:
        """Free the full KV (a separate draft model attends to its views only)."""
        self.keys = self.keys.new_empty((*self.keys.shape[:3], 0, self.keys.shape[-1]))
        self.values = self.values.new_empty((*self.values.shape[:3], 0, self.values.shape[-1]))
        self._refresh()

    def buffers(self) -> list[torch.Tensor]:
        out = [self.keys, self.values]
        return out + ([self.draft_keys, self.draft_values] if self.draft_keys is not None else [])

    # ------------------------------------------------------------------ rows
    def move_rows(self, holes: Sequence[int], sources: Sequence[int], kept: int, filled: int, swap: bool) -> None:
        """In place: rows ``sources`` into rows ``holes`` (host lists of disjoint rows, paired; full
        KV slots ``[0, filled)`` and the whole draft view; ``swap``: the holes' rows go to
        ``sources``), then the first ``kept`` rows are the ones in use.

        One slice copy per row pair and buffer: an ``index_select`` along the row dimension of a
        sliced ``[L, B, Hkv, S, D]`` stack gathers through the whole stack (on a CPU as slow as
        copying all of it), where a row's slice copies only that row."""
        if holes:
            regions = [b[:, : self.rows, :, :filled] for b in (self.keys, self.values) if b.shape[3]]
            if self.draft_keys is not None:
                regions += [self.draft_keys[:, : self.rows], self.draft_values[:, : self.rows]]
            for region in regions:
                for hole, source in zip(holes, sources):
                    leaving = region[:, hole].clone() if swap else None
                    region[:, hole].copy_(region[:, source])
                    if swap:
                        region[:, source].copy_(leaving)
        self.rows = kept
        self._refresh()


def _slot0(buffer: torch.Tensor, rows: int) -> torch.Tensor:
    """``[L, rows, Hkv, 1]`` flat index of slot 0 of each (layer, row, head) of ``buffer``."""
    layers, batch0, heads, slots = buffer.shape[:4]
    lbh = torch.arange(layers * batch0 * heads, device=buffer.device).view(layers, batch0, heads, 1)
    return lbh[:, :rows] * slots


def _as_lbhn(slots: torch.Tensor) -> torch.Tensor:
    """``[B, n]`` slots as ``[1, B, 1, n]``; ``[L, B, Hkv, n]`` (or broadcastable 4-D) as given."""
    return slots.view(1, slots.shape[0], 1, slots.shape[1]) if slots.dim() == 2 else slots

"""Which cached slots each query attends to, as two index ranges per row instead of a mask.

Every attention the engine runs after prefill has the same shape: row ``b``'s query ``i``
(of ``q``) attends to key slot ``j`` iff::

    lo1[b] <= j < hi1[b]                     or      lo2[b] <= j < hi2[b] - (q - 1 - i)

The second range is causal inside the query block, aligned bottom-right (the last query sees up
to ``hi2 - 1``). Two ranges describe both forwards of a speculation step:

* verify on the full cache: range 1 empty, range 2 = ``[pad, length + q)`` (left padding
  excluded, the ``q`` verified tokens causal);
* draft on a compact view ``[static | rolling window | draft scratch]``: range 1 = the filled
  prefix of the view, range 2 = the draft tokens written so far this step.

Kernels read these four ``[B]`` int32 vectors instead of a ``[B, q, L]`` mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Segments:
    """Per-row key ranges of one attention call (see the module docstring).

    Attributes
    ----------
    lo1, hi1, lo2, hi2 : torch.Tensor
        ``[B]`` int32, on the device of the keys they index.
    """

    lo1: torch.Tensor
    hi1: torch.Tensor
    lo2: torch.Tensor
    hi2: torch.Tensor
    # Masks built by the PyTorch twin, per (q, kv_len): every layer of one forward shares them.
    _masks: dict = field(default_factory=dict, compare=False, repr=False)
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def causal(cls, start: torch.Tensor, end: torch.Tensor) -> "Segments":
        """One causal range ``[start, end)`` per row (verify / decode on the full cache)."""
        end = end.int()
        zero = torch.zeros_like(end)
        return cls(zero, zero, start.int(), end)

    @classmethod
    def prefix_and_block(cls, filled: torch.Tensor, block_start: int, block_end: int,
                         skip: torch.Tensor | None = None) -> "Segments":
        """Slots ``[0, filled[b])`` plus the block ``[block_start + skip[b], block_end)`` (draft step;
        ``skip`` defaults to 0 for every row)."""
        filled = filled.int()
        zero = torch.zeros_like(filled)
        lo2 = torch.full_like(filled, block_start) if skip is None else (block_start + skip).to(filled)
        return cls(zero, filled, lo2, torch.full_like(filled, block_end))

    def to(self, device: torch.device) -> "Segments":
        if self.lo1.device == device:
            return self
        return Segments(*(t.to(device, non_blocking=True) for t in (self.lo1, self.hi1, self.lo2, self.hi2)))

    def built(self, mask: torch.Tensor) -> bool:
        """Whether ``mask`` is (a slice of) a mask :meth:`mask` built for this forward."""
        if torch.compiler.is_compiling():  # torch < 2.13 cannot trace data_ptr() comparisons
            return mask.dtype == torch.bool and any(mask is m for m in self._masks.values())
        return mask.dtype == torch.bool and any(mask.data_ptr() == m.data_ptr() for m in self._masks.values())

    def mask(self, q_len: int, kv_len: int) -> torch.Tensor:
        """The equivalent ``[B, 1, q, kv_len]`` bool mask (True = attend), built once per shape."""
        hit = self._masks.get((q_len, kv_len))
        if hit is not None:
            return hit
        j = torch.arange(kv_len, device=self.lo1.device)[None, None, :]
        shift = (q_len - 1 - torch.arange(q_len, device=self.lo1.device))[None, :, None]
        first = (j >= self.lo1[:, None, None]) & (j < self.hi1[:, None, None])
        second = (j >= self.lo2[:, None, None]) & (j < self.hi2[:, None, None] - shift)
        mask = self._masks[(q_len, kv_len)] = (first | second)[:, None]
        return mask

    def derived(self, key: tuple, build) -> torch.Tensor:
        """A tensor made from this forward's masks by ``build()`` (a twin's folded or additive form),
        built once per ``key`` and shared by every layer of the forward, like :meth:`mask`."""
        hit = self._derived.get(key)
        if hit is None:
            hit = self._derived[key] = build()
        return hit

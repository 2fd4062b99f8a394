"""Where each row's tokens sit in its draft view: the static part, the rolling window, the scratch.

Per row ``b`` (shared by every layer: the counts depend only on row lengths)::

    [ static part Ks | rolling window W | draft scratch | trash 1 ]
      static_count[b] slots used,  ring_size[b] = Ks + W - static_count[b] slots rolling

With ``n`` real prompt tokens the static part keeps ``sc = min(Ks, n)`` tokens and the rest,
``Wb = Ks + W - sc`` slots, is the rolling window, which starts with the last ``min(n - sc, Wb)``
prompt tokens; the static part is selected among the tokens before those
(:attr:`DraftGeometry.static_candidates`). So no token is ever in the view twice, a prompt shorter
than the budget is kept whole, and budget the prompt does not use goes to the window.

The cache owns its geometry and moves it (:meth:`DraftGeometry.advance`, row selection); views and
policies only read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftGeometry:
    """Slot layout of the draft views of one cache.

    Attributes
    ----------
    static_slots, window_slots, scratch : int
        ``Ks``, ``W`` and the draft slots per step (the largest γ when γ adapts).
    static_count : ``[B]`` static slots in use per row.
    ring_size : ``[B]`` rolling-window slots per row (``Ks + W - static_count``).
    ring_ptr : ``[B]`` tokens ever written to the window (the next one goes to
        ``static_count + ring_ptr % ring_size``).
    static_candidates : ``[B]`` real prompt tokens the static part was selected among (the ones
        before the window's initial tokens).
    """

    static_slots: int
    window_slots: int
    scratch: int
    static_count: torch.Tensor
    ring_size: torch.Tensor
    ring_ptr: torch.Tensor
    static_candidates: torch.Tensor
    _aranges: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def for_prompt(cls, static_slots: int, window_slots: int, scratch: int, prompt_slots: int,
                   pad: torch.Tensor) -> "DraftGeometry":
        """The layout right after prefill of ``prompt_slots`` slots left-padded by ``pad [B]``."""
        n_valid = prompt_slots - pad
        static_count = torch.clamp(n_valid, max=static_slots)
        ring_size = static_slots + window_slots - static_count
        ring_init = torch.minimum(n_valid - static_count, ring_size)
        return cls(static_slots, window_slots, scratch, static_count, ring_size, ring_init.clone(),
                   n_valid - ring_init)

    # ------------------------------------------------------------------ slots
    @property
    def view_slots(self) -> int:
        """``Ks + W``: the slots a draft attends to besides its scratch."""
        return self.static_slots + self.window_slots

    @property
    def trash_slot(self) -> int:
        """Where writes that must land nowhere go (the last slot)."""
        return self.view_slots + self.scratch

    @property
    def total_slots(self) -> int:
        """Slots per row of a draft buffer."""
        return self.view_slots + self.scratch + 1

    def window_filled(self) -> torch.Tensor:
        """``[B]`` tokens the rolling window holds."""
        return torch.minimum(self.ring_ptr, self.ring_size)

    def filled(self) -> torch.Tensor:
        """``[B]`` filled slots of each row's view: the static part, then the window as it fills."""
        return self.static_count + self.window_filled()

    def valid(self) -> torch.Tensor:
        """``[B, Ks + W]`` bool: which view slots hold a token (a prefix of each row)."""
        slot = torch.arange(self.view_slots, device=self.static_count.device)[None, :]
        return slot < self.filled()[:, None]

    def initial_sources(self, prompt_slots: int) -> torch.Tensor:
        """``[B, Ks + W]`` full-cache slot each view slot starts from: the window's prompt tail
        (clamped in range where unfilled: those slots are masked); the static slots are chosen by
        the view's scores instead."""
        ring_init = self.ring_ptr
        view_slot = torch.arange(self.view_slots, device=ring_init.device)[None, :]
        source = (prompt_slots - ring_init)[:, None] + (view_slot - self.static_count[:, None])
        return source.clamp(min=0, max=max(prompt_slots - 1, 0))

    def ring_targets(self, count: torch.Tensor, width: int) -> torch.Tensor:
        """``[B, width]`` view slots for the next ``count[b]`` tokens of each row's window (in order),
        the trash slot for the rest."""
        j = self._arange(width, count.device)  # [1, width]
        ring = (self.ring_ptr[:, None] + j).remainder_(self.ring_size[:, None]).add_(self.static_count[:, None])
        return ring.masked_fill_(j >= count[:, None], self.trash_slot)

    def _arange(self, width: int, device) -> torch.Tensor:
        if torch.compiler.is_compiling():  # free in a graph; a memo would specialise it
            return torch.arange(width, device=device)[None, :]
        hit = self._aranges.get(width)
        if hit is None:
            hit = self._aranges[width] = torch.arange(width, device=device)[None, :]
        return hit

    # ------------------------------------------------------------------ changes (the cache's)
    def advance(self, count: torch.Tensor) -> None:
        """``count [B]`` more tokens went into each window."""
        self.ring_ptr = self.ring_ptr + count

    def relayout(self, rows: torch.Tensor, window_start: torch.Tensor) -> None:
        """``rows`` (``[B]`` bool) now use every static slot and a window of ``window_slots`` holding
        their tokens from ``window_start [B]`` on (its first ``window_slots`` tokens)."""
        self.static_count = torch.where(rows, self.static_slots, self.static_count)
        self.ring_size = torch.where(rows, self.window_slots, self.ring_size)
        self.ring_ptr = torch.where(rows, self.window_slots, self.ring_ptr)
        self.static_candidates = torch.where(rows, window_start, self.static_candidates)

    def select_rows(self, rows: torch.Tensor) -> None:
        for name in ("static_count", "ring_size", "ring_ptr", "static_candidates"):
            setattr(self, name, getattr(self, name).index_select(0, rows))

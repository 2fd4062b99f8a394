"""Where each row stops: EOS, ``max_length`` and the generic stopping criteria, in token order,
with stock ``generate``'s semantics (including its behaviour without an EOS criterion)."""

from __future__ import annotations

import torch

from .ragged import RaggedBatch


class Stopper:
    """Stopping state of one generation, indexed by original row.

    Parameters
    ----------
    batch, prompt, max_new_tokens : the generation's shape.
    eos : ``[n]`` EOS token ids on the device, or None.
    device : where the rows live.
    """

    def __init__(self, batch: int, prompt: int, max_new_tokens: int, eos: torch.Tensor | None, device):
        self.eos = eos
        self.max_new_tokens = max_new_tokens
        self.cap = torch.full((batch,), prompt + max_new_tokens, device=device, dtype=torch.long)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)  # at max length (no EOS criterion)
        self.flagged_len = torch.full((batch,), -1, device=device, dtype=torch.long)
        self._aranges: dict[int, torch.Tensor] = {}

    def emit(self, rb: RaggedBatch, rows: torch.Tensor, seq_len: torch.Tensor, new_tokens: torch.Tensor,
             num_new: torch.Tensor, dead: torch.Tensor | None = None, ctx: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each working row's ``num_new [b]`` new tokens (``new_tokens [b, w]``) after its
        ``seq_len [B]`` tokens, apply the stopping criteria in token order and decide which rows
        are finished. Returns ``(emitted [b], finished [b])``; ``seq_len`` is advanced by ``emitted``.
        ``dead [b]``: rows that finished earlier but are still in the working batch (their
        ``num_new`` is 0); they stay finished and their length never changes. ``ctx``:
        ``seq_len[rows]`` when the caller has it."""
        if ctx is None:
            ctx = seq_len[rows]
        width = new_tokens.shape[1]
        j = self._offsets(width, new_tokens.device)
        # Write all candidates (slots past num_new are scratch and get overwritten later).
        rb.tokens[rows[:, None], ctx[:, None] + j] = new_tokens
        emitted = num_new
        eos = self.eos
        flag_eos = None
        if eos is not None:
            is_eos = torch.isin(new_tokens, eos) & (j < num_new[:, None])
            flag_eos = is_eos.any(dim=1)
            first = torch.where(flag_eos, is_eos.long().argmax(dim=1) + 1, emitted)
            emitted = torch.minimum(emitted, first)
        fired_generic = None
        if rb.generic_criteria:
            generic_emitted, generic_fired = rb.stopped(rows, ctx, emitted)
            fired_generic = generic_fired & (generic_emitted <= emitted)
            emitted = torch.where(fired_generic, generic_emitted, emitted)
            if flag_eos is not None:  # the EOS only counts if it is still within the kept tokens
                flag_eos = flag_eos & (~fired_generic | (first <= generic_emitted))
        room = self.cap[rows] - ctx
        flagged = flag_eos  # None: no row can be flagged this step
        if fired_generic is not None:
            flagged = fired_generic if flagged is None else flagged | fired_generic
        if rb.has_eos_criteria:
            finished = emitted >= room
            emitted = torch.minimum(emitted, room)
            finished = finished if flagged is None else flagged | finished
            new_len = ctx + emitted
        elif flagged is None:  # nothing can flag a row (no EOS, no criterion): each stops at its cap
            emitted = torch.minimum(num_new, room)
            new_len, finished = ctx + emitted, emitted >= room
        else:
            emitted, new_len, finished = self._stock_cut(rows, ctx, emitted, num_new, room, flagged)
        if dead is not None:
            new_len, finished = torch.where(dead, ctx, new_len), finished | dead
        seq_len[rows] = new_len
        return emitted, finished

    def _stock_cut(self, rows, ctx, emitted, num_new, room, flagged):
        """Stock ``generate`` without an EOS criterion keeps generating flagged rows (their tokens
        stay real) until every row is flagged, then cuts all rows to the longest flagged length.
        Returns ``(emitted, new lengths, finished)``, ``[b]`` each."""
        cap = self.cap
        new_flag = flagged & (self.flagged_len[rows] < 0)
        self.flagged_len[rows] = torch.where(new_flag, ctx + emitted, self.flagged_len[rows])
        emitted = torch.minimum(num_new, room)
        self.done[rows] |= emitted >= room
        # Once every row is flagged or done, every row is cut to the longest flagged length.
        # Computed on the device whether or not that happened (no host read): before it happens
        # the cut is a no-op, since no row is past its cap yet.
        all_over = ((self.flagged_len >= 0) | self.done).all()
        target = torch.where(self.flagged_len >= 0, self.flagged_len, cap).max()
        cap.copy_(torch.where(all_over, torch.minimum(cap, target), cap))
        room = cap[rows] - ctx
        emitted = torch.clamp(torch.minimum(emitted, room), min=0)
        # `cap` can shrink below a row's length (stock semantics without an EOS criterion).
        return emitted, torch.minimum(ctx + emitted, cap[rows]), emitted >= room

    def _offsets(self, width: int, device) -> torch.Tensor:
        """``[1, width]`` arange, made once per width (in a graph: each time, for free)."""
        if torch.compiler.is_compiling():
            return torch.arange(width, device=device)[None, :]
        hit = self._aranges.get(width)
        if hit is None:
            hit = self._aranges[width] = torch.arange(width, device=device)[None, :]
        return hit

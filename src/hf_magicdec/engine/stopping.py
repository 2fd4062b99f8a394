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

    def emit(self, rb: RaggedBatch, rows: torch.Tensor, seq_len: torch.Tensor, new_tokens: torch.Tensor,
             num_new: torch.Tensor, dead: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each working row's ``num_new [b]`` new tokens (``new_tokens [b, w]``) after its
        ``seq_len [B]`` tokens, apply the stopping criteria in token order and decide which rows
        are finished. Returns ``(emitted [b], finished [b])``; ``seq_len`` is advanced by ``emitted``.
        ``dead [b]``: rows that finished earlier but are still in the working batch (their
        ``num_new`` is 0); they stay finished and their length never changes."""
        ctx = seq_len[rows]
        width = new_tokens.shape[1]
        j = torch.arange(width, device=new_tokens.device)
        valid = j[None, :] < num_new[:, None]
        # Write all candidates (slots past num_new are scratch and get overwritten later).
        rb.tokens[rows[:, None], ctx[:, None] + j[None, :]] = new_tokens
        emitted = num_new.clone()
        eos = self.eos
        if eos is not None:
            is_eos = torch.isin(new_tokens, eos) & valid
            flag_eos = is_eos.any(dim=1)
            first = torch.where(flag_eos, is_eos.long().argmax(dim=1) + 1, emitted)
            emitted = torch.minimum(emitted, first)
        else:
            flag_eos = torch.zeros_like(valid[:, 0])
        generic_emitted, generic_fired = rb.stopped(rows, ctx, emitted)
        fired_generic = generic_fired & (generic_emitted <= emitted)
        emitted = torch.where(fired_generic, generic_emitted, emitted)
        # The EOS only counts if it is still within the kept tokens.
        flag_eos = flag_eos & (~fired_generic | (first <= generic_emitted)) if eos is not None else flag_eos
        cap = self.cap
        room = cap[rows] - ctx
        flagged = fired_generic | flag_eos
        if rb.has_eos_criteria:
            at_cap = emitted >= room
            emitted = torch.minimum(emitted, room)
            finished = flagged | at_cap
        else:
            # Stock `generate` without an EOS criterion keeps generating flagged rows (their
            # tokens stay real) until every row is flagged, then cuts all rows to the longest
            # flagged length.
            new_flag = flagged & (self.flagged_len[rows] < 0)
            self.flagged_len[rows] = torch.where(new_flag, ctx + emitted, self.flagged_len[rows])
            emitted = torch.minimum(num_new, room)
            self.done[rows] |= emitted >= room
            # Once every row is flagged or done, every row is cut to the longest flagged length.
            # Computed on the device whether or not that happened (no host read): before it
            # happens the cut is a no-op, since no row is past its cap yet.
            all_over = ((self.flagged_len >= 0) | self.done).all()
            target = torch.where(self.flagged_len >= 0, self.flagged_len, cap).max()
            cap.copy_(torch.where(all_over, torch.minimum(cap, target), cap))
            room = cap[rows] - ctx
            emitted = torch.clamp(torch.minimum(emitted, room), min=0)
            at_cap = emitted >= room
            finished = at_cap
        # `cap` can shrink below a row's length (stock semantics without an EOS criterion).
        new_len = torch.minimum(ctx + emitted, cap[rows])
        if dead is not None:
            new_len, finished = torch.where(dead, ctx, new_len), finished | dead
        seq_len[rows] = new_len
        return emitted, finished

"""Logits processors and stopping criteria on ragged rows, exactly as stock ``generate`` calls them.

HF's processors and criteria take a rectangular ``input_ids [batch, length]`` and may hold
batch-indexed or length-dependent state (prompt length of ``min_new_tokens``, the batch id of
``prefix_allowed_tokens_fn``, n-gram tables …). Rows here have different lengths, so for every
distinct context length ``L`` we call them once on the *full original batch* truncated to ``L``
and keep the rows whose context really has length ``L``. Rows not involved in a call see a
prefix of their own tokens; their outputs are discarded. With no processor at all (plain greedy)
nothing is called. Sampling warpers that read only the scores of their own row (temperature,
top-k, top-p, min-p, typical, epsilon, eta) need none of that, nor do the processors that depend
on a row's length alone (``min_length`` and ``min_new_tokens`` beside an EOS, which hide the EOS
below a length): when every processor is one of those, all positions are processed at once on
the device, each length-dependent one from every position's own length, without a host read.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (EpsilonLogitsWarper, EtaLogitsWarper, MinLengthLogitsProcessor,
                                                    MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
                                                    TypicalLogitsWarper)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

#: Processors whose output for a row depends on that row's scores alone (not on the tokens, the
#: position or the batch), exactly: safe to apply to every ragged position at once.
ROW_LOCAL_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper,
                        TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper)

#: Processors whose output for a row depends on its scores and its length alone: they hide the
#: EOS tokens while the row is shorter than a bound (``min_length``, or the prompt plus
#: ``min_new_tokens``), which every position can check against its own length on the device.
LENGTH_PROCESSORS = (MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor)


def _length_bound(processor) -> int:
    """The row length below which ``processor`` hides the EOS tokens."""
    if type(processor) is MinLengthLogitsProcessor:
        return processor.min_length
    return processor.prompt_length_to_skip + processor.min_new_tokens


class RaggedBatch:
    """Token history of every row of the original batch, and the processors/criteria to run.

    Parameters
    ----------
    input_ids : ``[B, P]`` the (left-padded) prompts.
    capacity : slots per row allocated now (at least the prompt); :meth:`reserve` grows it along
        with the KV cache.
    logits_processor, stopping_criteria : HF's prepared lists.
    pad_token_id : fill value of unused slots (any token id works; outputs re-pad).
    """

    def __init__(self, input_ids, capacity, logits_processor, stopping_criteria, pad_token_id):
        batch, prompt = input_ids.shape
        self.pad_token_id = pad_token_id
        self.tokens = input_ids.new_full((batch, max(capacity, prompt)), pad_token_id)  # [B, capacity]
        self.tokens[:, :prompt] = input_ids
        self.processors = logits_processor if logits_processor is not None else []
        criteria = list(stopping_criteria) if stopping_criteria is not None else []
        self.generic_criteria = [c for c in criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
        self.has_eos_criteria = any(hasattr(c, "eos_token_id") for c in criteria)
        # Exact types: a subclass may read more than its row's scores and length.
        self.per_row = all(type(p) in ROW_LOCAL_PROCESSORS + LENGTH_PROCESSORS for p in self.processors)
        self._eos_masks: dict = {}  # per length processor: [V] bool, its EOS tokens

    def reserve(self, capacity: int) -> None:
        """Make the token buffer hold at least ``capacity`` slots per row (copying what it holds)."""
        if capacity <= self.tokens.shape[1]:
            return
        grown = self.tokens.new_full((self.tokens.shape[0], capacity), self.pad_token_id)
        grown[:, : self.tokens.shape[1]] = self.tokens
        self.tokens = grown

    def process(self, rows: torch.Tensor, context_len: torch.Tensor, logits: torch.Tensor,
                offset: int | torch.Tensor = 0) -> torch.Tensor:
        """Apply the logits processors at ragged positions.

        Parameters
        ----------
        rows : ``[b]`` indices into the original batch.
        context_len : ``[b]`` tokens before position 0 of each row (``self.tokens[row, :len]``).
            Position ``j`` of a row sees the context ``tokens[row, :len + j]``, so draft tokens
            must already be written at ``tokens[row, len:len + j]``.
        logits : ``[b, n, V]`` float logits.
        offset : added to every ``context_len`` (a draft step's index).

        Returns
        -------
        ``[b, n, V]`` processed scores.
        """
        if len(self.processors) == 0:
            return logits
        if isinstance(offset, torch.Tensor) or offset:  # a tensor inside a compiled draft step
            context_len = context_len + offset
        b, n, vocab = logits.shape
        if self.per_row:
            return self._process_per_row(context_len, logits)
        out = torch.empty_like(logits)
        lengths = context_len[:, None] + torch.arange(n, device=context_len.device)  # [b, n]
        lengths_host = lengths.tolist()
        by_length: dict[int, list[tuple[int, int]]] = {}
        for r, per_row in enumerate(lengths_host):
            for j, length in enumerate(per_row):
                by_length.setdefault(length, []).append((r, j))
        full_batch = self.tokens.shape[0]
        for length, pairs in sorted(by_length.items()):
            local = torch.tensor([r for r, _ in pairs], device=logits.device)
            pos = torch.tensor([j for _, j in pairs], device=logits.device)
            global_rows = rows[local]
            scores = logits.new_zeros((full_batch, vocab))
            scores[global_rows] = logits[local, pos]
            processed = self.processors(self.tokens[:, :length], scores)
            out[local, pos] = processed[global_rows]
        return out

    def _process_per_row(self, context_len: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Every position at once, in the processors' order (see :data:`LENGTH_PROCESSORS`)."""
        b, n, vocab = logits.shape
        scores = logits.reshape(b * n, vocab)
        no_tokens = self.tokens.new_empty((b * n, 0))
        length = None
        for processor in self.processors:
            if type(processor) in ROW_LOCAL_PROCESSORS:
                scores = processor(no_tokens, scores)
                continue
            if length is None:  # [b * n] the context each position is scored after
                length = (context_len[:, None] + torch.arange(n, device=context_len.device)).reshape(-1, 1)
            eos = self._eos_mask(processor, vocab, scores.device)
            below = length.to(scores.device) < _length_bound(processor)
            scores = scores.masked_fill(below & eos, float("-inf"))
        return scores.reshape(b, n, vocab)

    def _eos_mask(self, processor, vocab: int, device) -> torch.Tensor:
        hit = self._eos_masks.get(id(processor))
        if hit is None:
            hit = torch.isin(torch.arange(vocab, device=device), processor.eos_token_id.to(device))[None, :]
            self._eos_masks[id(processor)] = hit
        return hit

    def stopped(
        self, rows: torch.Tensor, context_len: torch.Tensor, num_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the *generic* stopping criteria fire among each row's new tokens.

        The new tokens must already be written at ``tokens[row, len:len + num_new]``. EOS and
        max-length are handled by the engine directly; this runs the rest (stop strings, max
        time, user criteria), in token order, as stock ``generate`` would after each token.

        Returns
        -------
        keep : ``[b]`` long, new tokens up to and including the one after which a criterion
            fired (``num_new`` where none fired).
        fired : ``[b]`` bool.
        """
        keep = num_new.clone()
        fired_rows = torch.zeros_like(num_new, dtype=torch.bool)
        if not self.generic_criteria:
            return keep, fired_rows
        ctx = context_len.tolist()
        counts = num_new.tolist()
        rows_host = rows.tolist()
        by_length: dict[int, list[tuple[int, int]]] = {}
        for r, (c, k) in enumerate(zip(ctx, counts)):
            for j in range(k):
                by_length.setdefault(c + j + 1, []).append((r, j))
        first: list[int | None] = [None] * len(counts)
        for length, pairs in sorted(by_length.items()):
            pending = [(r, j) for r, j in pairs if first[r] is None]
            if not pending:
                continue
            fired = torch.zeros(self.tokens.shape[0], dtype=torch.bool, device=self.tokens.device)
            for criterion in self.generic_criteria:
                fired |= criterion(self.tokens[:, :length], None).to(fired.device)
            fired_host = fired.tolist()
            for r, j in pending:
                if fired_host[rows_host[r]]:
                    first[r] = j
        for r, j in enumerate(first):
            if j is not None:
                keep[r] = j + 1
                fired_rows[r] = True
        return keep, fired_rows

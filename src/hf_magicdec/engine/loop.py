"""The self-speculative decoding loop.

One generation::

    prefill (chunked)  ->  first token  ->  draft views  ->  repeat until every row is done:
        draft   γ single-token forwards on the draft view        (cheap: small KV)
        verify  one (γ+1)-token forward on the full cache         (≈ one decode step)
        accept  per row: greedy prefix match, or rejection sampling
        commit  per row: keep accepted + 1 tokens, roll the rest back, feed the draft view

Rows are ragged: each keeps its own length, offsets, positions and masks; finished rows leave
the working batch at once, so no row ever waits for another. What watches the loop (statistics,
streamer, scores, acceptance memory) is an :class:`~hf_magicdec.engine.hooks.Observer`; γ comes
from a policy; whoever drafts is a :class:`~hf_magicdec.engine.drafters.Drafter`; ranks in
lockstep agree through :class:`~hf_magicdec.parallel.lockstep.Lockstep`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..parallel.lockstep import LOCAL, Lockstep
from .buffers import initial_capacity
from .continuation import Continuation, LayerKV, committed_kv, fill_tails
from .drafters import Drafter, new_cache
from .hooks import FixedGamma, Observer, profile_sync
from .ragged import RaggedBatch
from .sampling import accept, pick
from .shared_prefill import store_prefill, stored_prefill
from .steps import ModelCall, prefill, verify_step
from .stopping import Stopper

__all__ = ["Engine", "left_padding"]


@dataclass
class _Rows:
    """The working batch: ``rows [b]`` original indices of unfinished rows; ``seq_len [B]`` tokens
    of every original row (the pending one included); ``tokens`` their history."""

    rows: torch.Tensor
    seq_len: torch.Tensor
    tokens: RaggedBatch
    dead: torch.Tensor  # [b] finished rows kept in a compiled batch until it halves (fixed shapes)


class Engine:
    """The machinery of one generation.

    Parameters
    ----------
    call : :class:`~hf_magicdec.engine.steps.ModelCall` of the target.
    drafter : who drafts (:class:`~hf_magicdec.engine.drafters.SelfDrafter` or ``ModelDrafter``).
    generation_config, logits_processor, stopping_criteria : as prepared by ``generate``.
    chunk : prompt tokens per prefill forward.
    scratch : draft slots per step the cache holds (the largest γ of the generation).
    gamma : a γ policy (``gamma``, ``after_step(accepted) -> γ``, ``controller``); default fixed 0.
    observers : what watches the loop.
    lockstep : agreement across ranks (a no-op in one process).
    """

    def __init__(self, call: ModelCall, drafter: Drafter, generation_config, logits_processor, stopping_criteria,
                 chunk: int, scratch: int, gamma=None, observers: Observer | None = None, lockstep: Lockstep = LOCAL):
        self.call, self.drafter, self.gen = call, drafter, generation_config
        self.processors, self.criteria = logits_processor, stopping_criteria
        self.chunk, self.scratch = chunk, scratch
        self.gamma = gamma if gamma is not None else FixedGamma(0)
        self.observers = observers if observers is not None else Observer()
        self.lockstep = lockstep
        self.do_sample = bool(generation_config.do_sample)
        pad = generation_config._pad_token_tensor
        self.pad_id = int(pad.item()) if pad is not None else 0  # fill of unused slots and of rows' ends
        self.cache = None
        self.past = Continuation(None)
        self._final: _Rows | None = None
        self._pad: torch.Tensor | None = None  # [B] left padding of every original row
        self._finished_kv: list = []  # (rows, lengths, kv) of rows that left the batch, kept for the hand-back

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            position_ids: torch.Tensor | None, past: Continuation | None = None) -> torch.Tensor:
        """Generate from left-padded ``input_ids [B, P]``; returns ``[B, P + T]`` right-padded with
        the pad token after each row's end.

        ``past``: the cache ``generate`` received: its first ``past.length`` slots are the KV of
        ``input_ids[:, :past.length]`` (only the rest is prefilled), and with ``past.keep`` the
        committed KV of every row is kept for :meth:`returned_kv`."""
        self.past = past if past is not None else Continuation(None)
        batch, prompt = input_ids.shape
        max_new = max(self.gen.max_length - prompt, 0)
        pad = self._pad = left_padding(attention_mask, batch, input_ids.device)
        if position_ids is None:
            position_ids = (torch.arange(prompt, device=input_ids.device)[None, :] - pad[:, None]).clamp(min=0)
        eos = self.gen._eos_token_tensor
        stopper = Stopper(batch, prompt, max_new, eos.to(input_ids.device) if eos is not None else None,
                          input_ids.device)
        capacity = initial_capacity(prompt, max_new, self.scratch)
        b = _Rows(torch.arange(batch, device=input_ids.device),
                  torch.full((batch,), prompt, device=input_ids.device, dtype=torch.long),
                  RaggedBatch(input_ids, capacity, self.processors, self.criteria, self.pad_id),
                  torch.zeros(batch, dtype=torch.bool, device=input_ids.device))
        self.observers.on_prompt(input_ids)
        self._final = b
        if max_new == 0:
            self.lockstep.sit_out(self.gamma.gamma, self.gamma.controller, self.drafter.on_target)
            self.observers.on_end()
            return self._sequences(b)

        logits = self._prefill(input_ids, position_ids, pad, capacity, prompt + max_new + self.scratch + 1)
        logits = logits[:, -1:].float()
        first, scores = self._choose(b, logits)
        self.lockstep.match_forwards()
        self.drafter.prepare(self.cache, input_ids, position_ids, max_new, self.scratch)
        self.observers.on_prefilled()
        new_tokens, num_new, step_scores, step_logits = first[:, None], torch.ones_like(first), scores, logits
        accepted, gamma = None, self.gamma.gamma
        while True:
            keep, finished = stopper.emit(b.tokens, b.rows, b.seq_len, new_tokens, num_new, b.dead)
            self.observers.on_tokens(b.rows, new_tokens, keep, step_scores, step_logits)
            alive, longest, longest_alive = self._read_step(finished, keep if accepted is not None else None)
            if accepted is not None:  # verified KV of the pending + accepted tokens: one slot per kept token
                self.cache.commit(keep, longest)
                self.drafter.commit(keep, accepted, gamma)
            if not self.lockstep.keep_going(alive > 0, gamma, self.gamma.controller, self.drafter.on_target):
                break
            self._drop_finished(b, finished, alive, longest_alive)
            pending = self._make_room(b, gamma)
            t0 = time.perf_counter()
            drafts, draft_probs = self._draft(b, pending, gamma)
            t1 = _synced(pending.device)
            step_logits = verify_step(self.call, self.cache, pending, drafts)
            step_scores = b.tokens.process(b.rows, b.seq_len[b.rows], step_logits)
            accepted, nxt = self.lockstep.share(*accept(drafts, draft_probs, step_scores, self.do_sample))
            accepted = accepted.masked_fill(b.dead, 0)  # kept finished rows emit and count nothing
            self.observers.on_step(b.rows.masked_fill(b.dead, -1), accepted, gamma, t1 - t0,
                                   _synced(pending.device) - t1)
            new_tokens = torch.cat([drafts, nxt[:, None]], dim=1)
            new_tokens.scatter_(1, accepted[:, None], nxt[:, None])  # [b, γ+1]; the first accepted + 1 are real
            num_new, gamma = (accepted + 1).masked_fill(b.dead, 0), self.gamma.after_step(accepted, alive)
        self.observers.on_end()
        return self._sequences(b)

    # ------------------------------------------------------------------ the loop's parts
    def _prefill(self, input_ids, position_ids, pad, capacity: int, max_capacity: int) -> torch.Tensor:
        """Build ``self.cache`` (``capacity`` slots per row, growing up to ``max_capacity``) and
        fill it with the prompts; returns the last logits ``[B, 1, V]``."""
        observe = self.drafter.observation_window()
        if self.past.length:
            return self._continue(input_ids, position_ids, pad, capacity, max_capacity, observe)
        self.lockstep.plan_forwards(-(-input_ids.shape[1] // self.chunk))
        found = stored_prefill(input_ids, position_ids, pad, self.chunk, capacity, observe)
        if found is not None:
            self.cache, logits = found
            self.cache.position_limit = self.gen.max_length
        else:
            self.cache = new_cache(self.call.model, pad, capacity, observe, self.gen.max_length)
            logits = prefill(self.call, self.cache, input_ids, position_ids, self.chunk)
            store_prefill(input_ids, position_ids, pad, self.chunk, observe, self.cache, logits)
        self._finish_cache(max_capacity)
        return logits

    def _continue(self, input_ids, position_ids, pad, capacity: int, max_capacity: int, observe: int):
        """:meth:`_prefill` from a cache holding the first ``past.length`` tokens: its KV moves into
        the new cache and only the suffix is prefilled, from a few cached tokens earlier when
        SnapKV needs the last ``observe`` prompt queries (their cached KV is kept as given)."""
        cached = self.past.length
        self.cache = new_cache(self.call.model, pad, capacity, observe, self.gen.max_length)
        self.past.adopt(self.cache)
        first = min(cached, max(input_ids.shape[1] - observe, 0)) if observe else cached
        self.lockstep.plan_forwards(-(-(input_ids.shape[1] - first) // self.chunk))
        logits = prefill(self.call, self.cache, input_ids, position_ids, self.chunk, first=first)
        self._finish_cache(max_capacity)
        return logits

    def _finish_cache(self, max_capacity: int) -> None:
        self.cache.max_capacity = max(self.cache.capacity, max_capacity)
        self.cache.fixed_shapes = self.call.compiled is not None  # compiled steps: same shapes every step
        # CUDA graphs read and write the KV buffers in place (no per-step copy into graph inputs).
        self.cache.static_addresses = self.call.compiled is not None and self.cache.lengths.device.type == "cuda"
        self.cache._buffers_replaced()

    def _choose(self, b: _Rows, logits: torch.Tensor):
        """The first token of every row from its last prompt logits ``[B, 1, V]``."""
        scores = b.tokens.process(b.rows, b.seq_len, logits)
        token, _ = pick(scores[:, 0], self.do_sample)
        return self.lockstep.share(token), scores

    def _read_step(self, finished: torch.Tensor, keep: torch.Tensor | None) -> list[int]:
        """The step's one device→host read: ``[rows still alive, longest row, longest alive row]``,
        lengths counted after committing ``keep`` (None: nothing to commit)."""
        lengths = self.cache.lengths + keep.to(self.cache.lengths.device) if keep is not None else self.cache.lengths
        alive = (~finished).to(lengths.device)
        return torch.stack([alive.sum(), lengths.max(), torch.where(alive, lengths, 0).max()]).tolist()

    def _drop_finished(self, b: _Rows, finished: torch.Tensor, alive: int, longest_alive: int) -> None:
        """Finished rows leave the working batch at once, except under compiled steps: there they
        stay as dead rows until at most half the batch is alive, so batch sizes (graph shapes) at
        least halve from one to the next."""
        if alive == b.rows.shape[0] or (self.call.compiled is not None and 2 * alive > b.rows.shape[0]):
            b.dead = finished
            return
        if self.past.keep:  # their KV leaves the working cache now: keep it for the hand-back
            gone = finished.nonzero().squeeze(1)
            self._finished_kv.append((b.rows[gone], *self.cache.export_rows(gone)))
        keep_idx = torch.argsort(finished.to(torch.int8), stable=True)[:alive]  # alive rows, in order; no sync
        b.rows, b.dead = b.rows[keep_idx], b.dead.new_zeros(alive)
        self.cache.select_rows(keep_idx, longest_alive)
        self.drafter.select_rows(keep_idx)

    def _make_room(self, b: _Rows, gamma: int) -> torch.Tensor:
        """Grow the cache for this step (verify writes slots ``[C, C + γ + 1)`` and the next emission
        tokens up to ``C + γ + 1``; ``C`` mirrored on the host); returns the pending tokens ``[b]``."""
        if self.cache.reserve(self.cache.max_length() + gamma + 2):
            b.tokens.reserve(self.cache.capacity)
        return b.tokens.tokens[b.rows, b.seq_len[b.rows] - 1]

    def _draft(self, b: _Rows, pending: torch.Tensor, gamma: int):
        """γ draft tokens per row, each chosen as the target would choose (processors, sampling).
        Returns ``drafts [b, γ]`` and, when sampling, the draft distributions ``[b, γ, V]``."""
        if gamma == 0:
            return pending.new_empty((pending.shape[0], 0)), None
        seq_len = b.seq_len[b.rows]
        step = self.drafter.round(self.cache, b.tokens.tokens, b.rows, seq_len, gamma)
        tok, drafts, probs = pending[:, None], [], []
        for i in range(gamma):
            scores = b.tokens.process(b.rows, seq_len + i, step(i, tok)[:, None])[:, 0]
            d, p = pick(scores, self.do_sample)
            d = self.lockstep.share(d)
            b.tokens.tokens[b.rows, seq_len + i] = d  # later draft steps' processors see it
            drafts.append(d)
            probs.append(p)
            tok = d[:, None]
        return torch.stack(drafts, dim=1), (torch.stack(probs, dim=1) if self.do_sample else None)

    def returned_kv(self, sequences: torch.Tensor) -> LayerKV | None:
        """The KV stock ``generate`` would hold after returning ``sequences [B, S + 1]``: per layer
        ``(keys, values) [B, Hkv, S, D]``, every token but the last of each row, rows that ended
        early continued with the KV of their pad tokens as stock computes it. None when nothing
        was prefilled (no new token). Spends the working cache; only with ``past.keep``."""
        if self.cache is None:
            return None
        kv, filled = committed_kv(self.cache, self._final.rows, self._finished_kv, sequences.shape[0],
                                  sequences.shape[1] - 1)
        self._finished_kv = []
        fill_tails(self.call.model, kv, filled, sequences, self._pad, self.lockstep)
        return kv

    def _sequences(self, b: _Rows) -> torch.Tensor:
        total = int(b.seq_len.max())
        sequences = b.tokens.tokens[:, :total].clone()
        cols = torch.arange(total, device=sequences.device)
        sequences[cols[None, :] >= b.seq_len[:, None]] = self.pad_id
        return sequences


def _synced(device: torch.device) -> float:
    profile_sync(device)
    return time.perf_counter()


def left_padding(attention_mask, batch: int, device) -> torch.Tensor:
    """``[B]`` left-padding lengths; refuses right padding and holes (they would be silently wrong)."""
    if attention_mask is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    mask = attention_mask.to(device).long()
    if mask.shape[1] > 1 and bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError(
            "speculative='magicdec' needs left padding (attention_mask rows of the form 0…0 1…1); got right "
            "padding or holes. Use tokenizer.padding_side = 'left'."
        )
    return (mask == 0).sum(dim=1)

"""The self-speculative decoding loop.

One generation::

    prefill (chunked)  ->  first token  ->  draft views  ->  repeat while a row is unfinished:
        grow     make room in the cache for this step
        draft    γ single-token forwards on the draft view        (cheap: small KV)
        verify   one (γ+1)-token forward on the full cache         (≈ one decode step)
        accept   per row: greedy prefix match, or rejection sampling
        emit     per row: accepted + 1 tokens, cut at EOS / stopping criteria
        read     the step's one device→host read (rows alive, longest rows, accepted drafts)
        commit   per row: keep the emitted tokens' KV, roll the rest back, feed the draft view
        observe  statistics, scores, streamer
        γ        the γ policy picks the next step's γ from the counts just read

Rows are ragged: each keeps its own length, offsets, positions and masks; finished rows leave
the working batch at once, so no row ever waits for another. What watches the loop is an
:class:`~hf_magicdec.engine.observers.Observer`; γ comes from a policy
(:mod:`hf_magicdec.engine.gamma`); whoever drafts is a :class:`~hf_magicdec.engine.drafters.Drafter`;
ranks in lockstep agree through :class:`~hf_magicdec.parallel.lockstep.Lockstep` (a rank with
nothing left under ``synced_gpus`` runs the same iterations on nothing: :meth:`Engine._idle_step`).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from ..notices import notice
from ..parallel.lockstep import LOCAL, Lockstep
from .cache import CacheOptions, initial_capacity
from .compiled import StepGraphs, compiled_forwards, read_counts, watch_recompile_limit, why_not_captured
from .continuation import Continuation, LayerKV, fill_tails
from .drafters import Drafter, new_cache
from .gamma import FixedGamma
from .observers import Observer, profile_sync
from .ragged import RaggedBatch
from .sampling import accept, pick
from .shared_prefill import store_prefill, stored_prefill
from .steps import ModelCall, prefill, verify_step
from .stopping import Stopper

__all__ = ["Engine", "left_padding"]

#: Compiled steps allocate the call's capacity in multiples of this many slots per row.
CAPACITY_BUCKET = 256


@dataclass
class _Rows:
    """The working batch: ``rows [b]`` original indices of unfinished rows; ``seq_len [B]`` tokens
    of every original row (the pending one included); ``tokens`` their history."""

    rows: torch.Tensor
    seq_len: torch.Tensor
    tokens: RaggedBatch
    dead: torch.Tensor | None  # [b] finished rows kept in a compiled batch until it halves (fixed shapes)


@dataclass
class StepCounts:
    """What one step read on the host (all in one transfer), and the step's ``finished [b]``."""

    alive: int  # rows still unfinished
    longest: int  # longest row of the cache once the step is committed
    longest_alive: int  # longest unfinished row
    accepted: int  # draft tokens accepted this step, all rows
    context: int  # tokens of the unfinished rows, in all (a schedule chooses γ for their mean)
    drafted: int  # draft tokens drafted this step, all rows
    finished: torch.Tensor | None = None
    finished_rows: tuple[bool, ...] = ()  # ``finished`` on the host

    @classmethod
    def unpack(cls, values: list[int], drafted: int, finished: torch.Tensor) -> "StepCounts":
        """From :func:`~hf_magicdec.engine.compiled.read_counts`, read on the host."""
        alive, longest, longest_alive, accepted, context = values[:5]
        return cls(alive=alive, longest=longest, longest_alive=longest_alive, accepted=accepted, context=context,
                   drafted=drafted, finished=finished, finished_rows=tuple(map(bool, values[5:])))

    @classmethod
    def none(cls) -> "StepCounts":
        """A step that ran nothing: no row alive, nothing drafted or accepted."""
        return cls(alive=0, longest=0, longest_alive=0, accepted=0, context=0, drafted=0)


class Engine:
    """The machinery of one generation.

    Parameters
    ----------
    call : :class:`~hf_magicdec.engine.steps.ModelCall` of the target.
    drafter : who drafts (:class:`~hf_magicdec.engine.drafters.SelfDrafter` or ``ModelDrafter``).
    generation_config, logits_processor, stopping_criteria : as prepared by ``generate``.
    chunk : prompt tokens per prefill forward.
    scratch : draft slots per step the cache holds (the largest γ of the generation).
    gamma : a γ policy (:mod:`hf_magicdec.engine.gamma`); default fixed 0.
    observers : what watches the loop.
    lockstep : agreement across ranks (a no-op in one process).
    graphs : the speculation step in compiled regions (:mod:`hf_magicdec.engine.compiled`), or None
        (eager, or the model forwards alone compiled: ``call.compiled``).
    """

    def __init__(self, call: ModelCall, drafter: Drafter, generation_config, logits_processor, stopping_criteria,
                 chunk: int, scratch: int, gamma=None, observers: Observer | None = None, lockstep: Lockstep = LOCAL,
                 graphs: StepGraphs | None = None):
        self.call, self.drafter, self.gen = call, drafter, generation_config
        self.processors, self.criteria = logits_processor, stopping_criteria
        self.chunk, self.scratch = chunk, scratch
        self.gamma = gamma if gamma is not None else FixedGamma(0)
        self.observers = observers if observers is not None else Observer()
        self.lockstep = lockstep
        self.graphs = graphs
        #: Whether the steps are compiled (regions or forwards): fixed shapes, capacity for the call.
        self.captured = graphs is not None or call.compiled is not None
        self.do_sample = bool(generation_config.do_sample)
        pad = generation_config._pad_token_tensor
        self.pad_id = int(pad.item()) if pad is not None else 0  # fill of unused slots and of rows' ends
        self.cache = None
        self.past = Continuation(None)
        self._final: _Rows | None = None
        self._pad: torch.Tensor | None = None  # [B] left padding of every original row

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            position_ids: torch.Tensor | None, past: Continuation | None = None) -> torch.Tensor:
        """Generate from left-padded ``input_ids [B, P]``; returns ``[B, P + T]`` right-padded with
        the pad token after each row's end.

        ``past``: the cache ``generate`` received: its first ``past.length`` slots are the KV of
        ``input_ids[:, :past.length]`` (only the rest is prefilled), and with ``past.outlives`` the
        committed KV of every row is kept for :meth:`returned_kv`."""
        self.past = past if past is not None else Continuation(None)
        b, stopper, position_ids = self._start(input_ids, attention_mask, position_ids)
        if self.graphs is not None:
            why = why_not_captured(b.tokens, self.lockstep, self.drafter, LOCAL)
            if why is not None:
                notice(f"compile=: the speculation step cannot run in compiled graphs with {why}; only the model "
                       "forwards are compiled (the step's bookkeeping runs eagerly).")
                self.graphs = None
        if self.captured:
            watch_recompile_limit()
        counts = self._begin(b, stopper, input_ids, position_ids)
        self.gamma.after_step(0, 0, counts.alive, counts.context)  # the first γ, for the prompt's context
        with compiled_forwards() if self.captured else contextlib.nullcontext():
            while self.lockstep.any_alive(counts.alive > 0):
                gamma, start = self.gamma.gamma, time.perf_counter()
                counts = self._step(b, stopper, gamma, counts) if counts.alive else self._idle_step(gamma)
                # The step's wall time (its one host read has waited for the device): a schedule
                # checks the cost model against it.
                self.gamma.after_step(counts.accepted, counts.drafted, counts.alive, counts.context,
                                      time.perf_counter() - start)
        self.observers.on_end()
        return self._sequences(b)

    def _begin(self, b: _Rows, stopper: Stopper, input_ids, position_ids) -> StepCounts:
        """Prefill, the first token of every row and the draft views; what the first read says."""
        max_new = stopper.max_new_tokens
        if max_new == 0:  # nothing to generate; under synced_gpus the others' prefill forwards are matched
            self.lockstep.plan_forwards(0)
            self.lockstep.match_forwards()
            return StepCounts.none()
        logits = self._prefill(input_ids, position_ids, max_new)[:, -1:].float()
        first, scores = self._choose(b, logits)
        self.lockstep.match_forwards()
        self.drafter.prepare(self.cache, input_ids, position_ids, max_new, self.scratch)
        self.observers.on_prefilled()
        _, finished = self._emit(b, stopper, first[:, None], torch.ones_like(first), scores, logits)
        return self._count(finished, None, None, 0)

    def _step(self, b: _Rows, stopper: Stopper, gamma: int, last: StepCounts) -> StepCounts:
        """One speculation step of the working batch, in the order of the module docstring."""
        if self.graphs is not None:
            return self._captured_step(b, stopper, gamma, last)
        self._drop_finished(b, last)
        ctx, pending = self._make_room(b, gamma)
        positions = self.cache.positions(gamma + 1)  # [b, γ + 1] the pending token's, then the drafts'
        t0 = time.perf_counter()
        drafts, draft_probs = self._draft(b, ctx, pending, positions, gamma)
        t1 = _synced(pending.device)
        logits = verify_step(self.call, self.cache, pending, drafts, positions)
        scores = b.tokens.process(b.rows, ctx, logits)
        # [b], [b, γ + 1]: each row emits its first accepted + 1 tokens
        accepted, tokens = self.lockstep.share(*accept(drafts, draft_probs, scores, self.do_sample))
        if b.dead is not None:
            accepted = accepted.masked_fill(b.dead, 0)  # kept finished rows emit and count nothing
        t2 = _synced(pending.device)
        num_new = accepted + 1 if b.dead is None else (accepted + 1).masked_fill(b.dead, 0)
        emitted, finished = self._emit(b, stopper, tokens, num_new, scores, logits, ctx)
        counts = self._count(finished, emitted, accepted, gamma * last.alive)
        # The verified KV of the emitted tokens; the draft views' windows only when they are read soon.
        self.cache.commit(emitted, counts.longest, feed_views=self.drafter.feeds_views(gamma))
        self.drafter.commit(emitted, accepted, gamma)
        rows = b.rows if b.dead is None else b.rows.masked_fill(b.dead, -1)
        self.observers.on_step(rows, accepted, gamma, t1 - t0, t2 - t1)
        return counts

    def _captured_step(self, b: _Rows, stopper: Stopper, gamma: int, last: StepCounts) -> StepCounts:
        """:meth:`_step` in compiled regions (:mod:`hf_magicdec.engine.compiled`): the drafts, then
        verify-to-commit, then the step's one host read."""
        self._drop_finished(b, last)
        ctx, pending = self._make_room(b, gamma)
        cache, graphs = self.cache, self.graphs
        positions = cache.positions(gamma + 1)
        t0 = time.perf_counter()
        if gamma:  # γ = 0 verifies the pending token alone: plain decoding in the verify region
            self.drafter.round(cache, b.tokens.tokens, b.rows, ctx, gamma, positions)  # brings stale windows up to date
            drafts, draft_probs = graphs.draft(self.drafter.draft_call, cache, b.rows, ctx, pending, positions,
                                               b.tokens, gamma, self.do_sample)
        else:
            drafts, draft_probs = pending.new_empty((pending.shape[0], 0)), None
        t1 = _synced(pending.device)
        accepted, tokens, emitted, finished, packed, scores, logits = graphs.verify(
            self.call, cache, stopper, b.tokens, b.seq_len, b.rows, ctx, pending, drafts, draft_probs, positions,
            b.dead, self.do_sample, self.drafter.feeds_views(gamma))
        t2 = _synced(pending.device)
        self.observers.on_tokens(b.rows, tokens, emitted, scores, logits)
        counts = StepCounts.unpack(packed.tolist(), gamma * last.alive, finished)
        cache.end_step(counts.longest)
        self.drafter.commit(emitted, accepted, gamma)
        rows = b.rows if b.dead is None else b.rows.masked_fill(b.dead, -1)
        self.observers.on_step(rows, accepted, gamma, t1 - t0, t2 - t1)
        return counts

    def _idle_step(self, gamma: int) -> StepCounts:
        """A rank with nothing left under ``synced_gpus`` while others still decode: the target
        forwards of a real step (γ draft forwards when the model drafts on its own views, one
        verify), on nothing, and nothing accepted."""
        self.lockstep.idle_forwards((gamma if self.drafter.on_target else 0) + 1)
        return StepCounts.none()

    # ------------------------------------------------------------------ the step's parts
    def _start(self, input_ids, attention_mask, position_ids):
        """The working batch, the stopping state and the prompts' positions."""
        batch, prompt = input_ids.shape
        device = input_ids.device
        max_new = max(self.gen.max_length - prompt, 0)
        pad = self._pad = left_padding(attention_mask, batch, device)
        if position_ids is None:
            position_ids = (torch.arange(prompt, device=device)[None, :] - pad[:, None]).clamp(min=0)
        eos = self.gen._eos_token_tensor
        stopper = Stopper(batch, prompt, max_new, eos.to(device) if eos is not None else None, device)
        tokens = RaggedBatch(input_ids, self._capacity(prompt, max_new), self.processors,
                             self.criteria, self.pad_id)
        b = self._final = _Rows(torch.arange(batch, device=device),
                                torch.full((batch,), prompt, device=device, dtype=torch.long), tokens,
                                self._no_dead(batch, device))
        self.observers.on_prompt(input_ids)
        return b, stopper, position_ids

    def _prefill(self, input_ids, position_ids, max_new: int) -> torch.Tensor:
        """Build ``self.cache`` and fill it with the prompts (only their uncached suffix when
        continuing from ``past``, from a few cached tokens earlier when SnapKV needs the last
        prompt queries; their cached KV is kept); returns the last logits ``[B, 1, V]``."""
        prompt = input_ids.shape[1]
        capacity = self._capacity(prompt, max_new)
        compiled = self.captured
        options = CacheOptions(observation_window=self.drafter.observation_window(),
                               position_limit=self.gen.max_length,
                               max_capacity=max(capacity, prompt + max_new + self.scratch + 1),
                               fixed_shapes=compiled,
                               # CUDA graphs of the model forwards write the KV in place. The step's
                               # regions keep their shapes dynamic instead (static inputs are not).
                               static_addresses=self.call.compiled is not None and self.graphs is None
                               and input_ids.device.type == "cuda")
        first = 0
        if not self.past.length:
            self.lockstep.plan_forwards(-(-prompt // self.chunk))
            found = stored_prefill(input_ids, position_ids, self._pad, self.chunk, capacity, options)
            if found is not None:
                self.cache, logits = found
                return logits
        self.cache = new_cache(self.call.model, self._pad, capacity, options)
        if self.past.length:
            self.past.adopt(self.cache)
            observe = options.observation_window
            first = min(self.past.length, max(prompt - observe, 0)) if observe else self.past.length
            self.lockstep.plan_forwards(-(-(prompt - first) // self.chunk))
        logits = prefill(self.call, self.cache, input_ids, position_ids, self.chunk, first=first)
        if not self.past.length:
            store_prefill(input_ids, position_ids, self._pad, self.chunk, self.cache, logits)
        return logits

    def _no_dead(self, rows: int, device) -> torch.Tensor | None:
        """No row dead yet: None for eager steps, a tensor for compiled ones (one graph either way)."""
        return torch.zeros(rows, dtype=torch.bool, device=device) if self.captured else None

    def _capacity(self, prompt: int, max_new: int) -> int:
        """Slots per row to allocate at prefill: what the call can write when the steps are
        compiled (their graphs never see the cache grow), else a headroom grown on demand."""
        if self.captured:  # rounded up, so that calls of nearby lengths share their graphs
            return -(-(prompt + max_new + self.scratch + 1) // CAPACITY_BUCKET) * CAPACITY_BUCKET
        return initial_capacity(prompt, max_new, self.scratch)

    def _choose(self, b: _Rows, logits: torch.Tensor):
        """The first token of every row from its last prompt logits ``[B, 1, V]``."""
        scores = b.tokens.process(b.rows, b.seq_len, logits)
        token, _ = pick(scores[:, 0], self.do_sample)
        return self.lockstep.share(token), scores

    def _emit(self, b: _Rows, stopper: Stopper, tokens, num_new, scores, logits, ctx=None):
        """Each working row emits ``tokens[r, :num_new[r]]`` up to where it stops (``ctx [b]``: the
        rows' lengths when the caller has them); returns ``(emitted [b], finished [b])``."""
        emitted, finished = stopper.emit(b.tokens, b.rows, b.seq_len, tokens, num_new, b.dead, ctx)
        self.observers.on_tokens(b.rows, tokens, emitted, scores, logits)
        return emitted, finished

    def _count(self, finished: torch.Tensor, emitted: torch.Tensor | None, accepted: torch.Tensor | None,
               drafted: int) -> StepCounts:
        """The step's one device→host read: rows alive, the longest row and the longest alive row
        once ``emitted`` is committed (None: nothing to commit), the accepted drafts, the alive
        rows' tokens and which rows finished."""
        lengths = self.cache.lengths
        if emitted is not None:
            lengths = lengths + emitted.to(lengths.device)
        return StepCounts.unpack(read_counts(lengths, self.cache.pad, finished, accepted).tolist(), drafted, finished)

    def _drop_finished(self, b: _Rows, last: StepCounts) -> None:
        """Finished rows leave the working batch at once, except under compiled steps: there they
        stay as dead rows until at most half the batch is alive, so batch sizes (graph shapes) at
        least halve from one to the next."""
        finished, alive = last.finished, last.alive
        if alive == b.rows.shape[0]:
            return
        if self.captured and 2 * alive > b.rows.shape[0]:
            b.dead = finished
            return
        # In place: finished rows among the first `alive` take alive rows from the end. Handed
        # back, their KV stays where it is (swapped to the end) until the hand-back reads it.
        order = self.cache.drop_rows(last.finished_rows, last.longest_alive, keep_finished=self.past.outlives)
        order = order.to(b.rows.device)
        b.rows, b.dead = b.rows[order[:alive]], self._no_dead(alive, b.rows.device)
        self.drafter.drop_rows(last.finished_rows, order[:alive])

    def _make_room(self, b: _Rows, gamma: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Grow the cache for this step (verify writes slots ``[C, C + γ + 1)`` and the next emission
        tokens up to ``C + γ + 1``; ``C`` mirrored on the host); returns the working rows' lengths
        (the pending token included) and their pending tokens, ``[b]`` each."""
        if self.cache.reserve(self.cache.max_length() + gamma + 2):
            b.tokens.reserve(self.cache.capacity)
        ctx = b.seq_len[b.rows]
        return ctx, b.tokens.tokens[b.rows, ctx - 1]

    def _draft(self, b: _Rows, ctx: torch.Tensor, pending: torch.Tensor, positions: torch.Tensor, gamma: int):
        """γ draft tokens per row, each chosen as the target would choose (processors, sampling).
        Returns ``drafts [b, γ]`` and, when sampling, the draft distributions ``[b, γ, V]``."""
        if gamma == 0:
            return pending.new_empty((pending.shape[0], 0)), None
        step = self.drafter.round(self.cache, b.tokens.tokens, b.rows, ctx, gamma, positions)
        # Processors that read the tokens see each draft in the history before the next step.
        history = not b.tokens.per_row
        tok, drafts, probs = pending[:, None], [], []
        for i in range(gamma):
            scores = b.tokens.process(b.rows, ctx, step(i, tok), offset=i)  # [b, 1, V]
            if self.do_sample:
                d, p = pick(scores[:, 0], True)
                tok = d[:, None]
                probs.append(p)
            else:
                tok = scores.argmax(dim=-1)  # [b, 1]
            tok = self.lockstep.share(tok)
            if history:
                b.tokens.tokens[b.rows, ctx + i] = tok[:, 0]
            drafts.append(tok)
        return torch.cat(drafts, dim=1), (torch.stack(probs, dim=1) if self.do_sample else None)

    # ------------------------------------------------------------------ results
    def returned_kv(self, sequences: torch.Tensor) -> LayerKV | None:
        """The KV stock ``generate`` would hold after returning ``sequences [B, S + 1]``: per layer
        ``(keys, values) [B, Hkv, S, D]``, every token but the last of each row, rows that ended
        early continued with the KV of their pad tokens as stock computes it. None when nothing
        was prefilled (no new token). Spends the working cache; only with ``past.outlives``."""
        if self.cache is None:
            return None
        kv, filled = self.cache.committed_kv(sequences.shape[0], sequences.shape[1] - 1)
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

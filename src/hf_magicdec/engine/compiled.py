"""The speculation step in compiled graphs.

With ``compile=`` on, a step is γ + 1 compiled regions and a handful of operations between them::

    draft region   × γ   open the draft forward, the model on its views, the processors, the token
    verify region  × 1   the verify forward, the processors, the acceptance, the emit, the commit
                         of the verified KV into the windows, and the step's counts packed in one
                         tensor
    then           the step's one host read of that tensor, after every launch of the step

The draft region takes its step index as a 0-d tensor, so one graph serves every draft step; the
verify region is one graph per γ. Both are module-level functions compiled once per compile
configuration, so calls of any shape in one process share their graphs; shapes that change (the
batch as rows leave, the prompt, the capacity) become dynamic after their first change, as dynamo
does. Should dynamo still reach its recompile limit it would run the regions eagerly for the rest
of the process; :func:`watch_recompile_limit` turns its log line into a
:class:`~hf_magicdec.MagicDecWarning`.

What the regions cannot hold falls back to compiling the model forwards alone
(:func:`why_not_captured` says why): logits processors that read the token history or stopping
criteria of the user's (both read the device on the host per distinct row length), a separate
draft model, a refresh policy, and tensor parallelism (its ranks agree on tokens through
collectives between the steps' parts).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading

import torch

from ..notices import notice
from . import attention
from .sampling import accept, pick

__all__ = ["StepGraphs", "read_counts", "watch_recompile_limit", "why_not_captured"]


def read_counts(lengths: torch.Tensor, pad: torch.Tensor, finished: torch.Tensor,
                accepted: torch.Tensor | None) -> torch.Tensor:
    """What a step reads on the host, packed: ``[rows alive, longest row, longest alive row,
    accepted drafts, tokens of the alive rows, finished[0], …, finished[b-1]]`` (long) from the
    rows' ``lengths [b]`` once the step is committed, their ``pad [b]`` and ``finished [b]``."""
    finished = finished.to(lengths.device)
    alive = ~finished
    total = accepted.sum().to(lengths.device) if accepted is not None else lengths.new_zeros(())
    tokens = ((lengths - pad) * alive).sum()
    counts = torch.stack([alive.sum(), lengths.max(), (lengths * alive).max(), total, tokens])
    return torch.cat([counts, finished.long()])


def _draft_region(call, cache, rows, ctx, tok, positions, step, ragged, do_sample: bool):
    """Draft step ``step`` (0-d long tensor) of the working rows: ``tok [b, 1]`` in, the next draft
    ``[b, 1]`` and, when sampling, its distribution ``[b, V]`` out."""
    forward = cache.begin_draft(step)
    logits = call.forward(cache, tok, positions.index_select(1, step.view(1)), forward.model_mask(), 1)
    scores = ragged.process(rows, ctx, logits.float(), offset=step)  # [b, 1, V]
    if do_sample:
        token, probs = pick(scores[:, 0], True)
        return token[:, None], probs
    return scores.argmax(dim=-1), None


def _verify_region(call, cache, stopper, ragged, seq_len, rows, ctx, pending, drafts, draft_probs, positions,
                   dead, do_sample: bool, feed_views: bool):
    """Verify ``drafts [b, γ]`` after ``pending [b]``, accept, emit and commit; returns
    ``(accepted [b], tokens [b, γ + 1], emitted [b], finished [b], counts, scores, logits)``
    (``counts``: :func:`read_counts`)."""
    forward = cache.begin_verify(drafts.shape[1] + 1)
    ids = torch.cat([pending[:, None], drafts], dim=1)
    logits = call.forward(cache, ids, positions, forward.model_mask(), 0).float()
    scores = ragged.process(rows, ctx, logits)
    accepted, tokens = accept(drafts, draft_probs, scores, do_sample)
    num_new = accepted + 1
    if dead is not None:  # kept finished rows emit and count nothing
        accepted, num_new = accepted.masked_fill(dead, 0), num_new.masked_fill(dead, 0)
    emitted, finished = stopper.emit(ragged, rows, seq_len, tokens, num_new, dead, ctx)
    counts = read_counts(cache.lengths + emitted, cache.pad, finished, accepted)
    cache.commit_tokens(emitted, feed_views)
    return accepted, tokens, emitted, finished, counts, scores, logits


#: Compiled regions, one pair per compile configuration, shared by every engine of the process.
_REGIONS: dict[tuple, tuple] = {}
_LOCK = threading.Lock()


class StepGraphs:
    """The compiled regions of one compile configuration (a ``transformers.CompileConfig``)."""

    #: Recompiles allowed per region: dynamic shapes after the first change leave a few graphs
    #: per γ and per batch regime; above dynamo's default of 8 so that γ adapting stays compiled.
    RECOMPILE_LIMIT = 64

    def __init__(self, compile_config):
        options = compile_config.to_dict()
        key = tuple(sorted((k, repr(v)) for k, v in options.items()))
        with _LOCK:
            if key not in _REGIONS:
                _REGIONS[key] = (_compile(_draft_region, options), _compile(_verify_region, options))
        self.draft_region, self.verify_region = _REGIONS[key]
        self._steps: dict = {}

    def step_index(self, i: int, device) -> torch.Tensor:
        """Draft step ``i`` as a 0-d tensor (made once)."""
        hit = self._steps.get((i, device))
        if hit is None:
            hit = self._steps[(i, device)] = torch.tensor(i, device=device)
        return hit

    def draft(self, call, cache, rows, ctx, pending, positions, ragged, gamma: int, do_sample: bool):
        """γ draft tokens ``[b, γ]`` (and, when sampling, their distributions ``[b, γ, V]``)."""
        tok, drafts, probs = pending[:, None], [], []
        with attention.engine_forward(cache), _engine_compiling():
            for i in range(gamma):
                tok, p = self.draft_region(call, cache, rows, ctx, tok, positions, self.step_index(i, tok.device),
                                           ragged, do_sample)
                drafts.append(tok)
                probs.append(p)
        return torch.cat(drafts, dim=1), (torch.stack(probs, dim=1) if do_sample else None)

    def verify(self, call, cache, stopper, ragged, seq_len, rows, ctx, pending, drafts, draft_probs, positions,
               dead, do_sample: bool, feed_views: bool):
        """See :func:`_verify_region`."""
        with attention.engine_forward(cache), _engine_compiling():
            return self.verify_region(call, cache, stopper, ragged, seq_len, rows, ctx, pending, drafts,
                                      draft_probs, positions, dead, do_sample, feed_views)


def _compile(fn, options: dict):
    kwargs = dict(options)
    try:
        return torch.compile(fn, recompile_limit=StepGraphs.RECOMPILE_LIMIT, **kwargs)
    except TypeError:  # torch < 2.13: no per-region limit; dynamo's global one applies
        return torch.compile(fn, **kwargs)


def why_not_captured(ragged, lockstep, drafter, local) -> str | None:
    """Why the step cannot run in compiled regions (the model forwards alone are compiled then),
    or None. ``ragged``: the call's :class:`~hf_magicdec.engine.ragged.RaggedBatch`."""
    if lockstep is not local:
        return "tensor parallelism (its ranks agree on tokens between the step's parts)"
    if not ragged.per_row:
        names = sorted({type(p).__name__ for p in ragged.processors})
        return f"logits processors that read the token history ({', '.join(names)})"
    if ragged.generic_criteria:
        names = sorted({type(c).__name__ for c in ragged.generic_criteria})
        return f"stopping criteria ({', '.join(names)})"
    if not drafter.on_target:
        return "a separate draft model"
    config = getattr(drafter, "config", None)
    if config is not None and (config.refresh_every is not None or config.refresh_below is not None):
        return "refresh_every / refresh_below"
    return None


# ---------------------------------------------------------------------- dynamo's recompile limit
_COMPILING: contextvars.ContextVar = contextvars.ContextVar("hf_magicdec_compiling", default=False)


@contextlib.contextmanager
def _engine_compiling():
    token = _COMPILING.set(True)
    try:
        yield
    finally:
        _COMPILING.reset(token)


class _RecompileLimitWatch(logging.Filter):
    """Says as a MagicDecWarning when dynamo gives up compiling one of the engine's regions or
    forwards (it runs them eagerly for the rest of the process, saying so only in a log line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _COMPILING.get() and "recompile_limit" in str(record.msg):
            notice("torch.compile reached its recompile limit on a speculative='magicdec' step "
                   f"({record.getMessage().splitlines()[0]}); that part now runs eagerly for the rest of the "
                   "process, slower. Raise torch._dynamo.config.recompile_limit, or keep the batch size and "
                   "lengths of calls in fewer distinct values.")
        return True


_WATCH = _RecompileLimitWatch()


def watch_recompile_limit() -> None:
    """Install the watch on dynamo's logger (idempotent)."""
    logger = logging.getLogger("torch._dynamo.convert_frame")
    if _WATCH not in logger.filters:
        logger.addFilter(_WATCH)


@contextlib.contextmanager
def compiled_forwards():
    """Mark the block as the engine's compiled forwards (for :func:`watch_recompile_limit`)."""
    with _engine_compiling():
        yield

"""The self-speculative decoding loop: the ``custom_generate`` callable behind
``model.generate(speculative="magicdec")``.

One generation::

    prefill (chunked)  ->  build draft views  ->  repeat until every row is done:
        draft   gamma single-token forwards on the draft view      (cheap: small KV)
        verify  one (gamma+1)-token forward on the full cache       (≈ one decode step)
        accept  per row: greedy prefix match, or rejection sampling
        commit  per row: keep accepted + 1 tokens, roll the rest back, feed the draft view

Rows are ragged: each keeps its own length, offsets, positions and masks; finished rows leave
the working batch at once, so no row ever waits for another.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import os
import time
from typing import Any

import torch
from transformers.generation.stopping_criteria import StopStringCriteria, StoppingCriteriaList

from . import attention, auto, kernels
from .cache import MagicDecCache, initial_capacity, widened
from .config import MagicDecConfig
from .draft_model import DraftModelDrafter, check_draft_model
from .distributed import LOCAL, Lockstep, resolve_synced_gpus
from .outputs import MagicDecOutput, SpeculationStats
from .ragged import RaggedBatch
from .sampling import greedy_verify, rejection_sample
from .validation import check_generation_config, check_model, check_model_kwargs
from .views import DraftView, on_register, view_option_names


@torch.no_grad()
def generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor=None,
    stopping_criteria=None,
    generation_config=None,
    synced_gpus: bool | None = None,
    streamer=None,
    *,
    tokenizer=None,
    speculative: Any = None,
    draft: str | DraftView | None = None,
    draft_budget: int | str | None = None,
    gamma: int | str | None = None,
    adaptive_gamma: bool | None = None,
    max_gamma: int | None = None,
    hardware: str | None = None,
    refresh_every: int | None = None,
    refresh_below: float | None = None,
    magicdec_config: MagicDecConfig | None = None,
    magicdec_streamer=None,
    magicdec_synced_gpus: bool | None = None,
    magicdec_stop_strings: str | list[str] | None = None,
    magicdec_tokenizer=None,
    magicdec_draft_model=None,
    **model_kwargs,
):
    """Self-speculative (MagicDec) decoding, called by ``GenerationMixin.generate``.

    Use it through ``model.generate(..., speculative="magicdec")`` (after ``import hf_magicdec``)
    or without any patching as ``model.generate(..., custom_generate=hf_magicdec.generate)``.
    ``generate`` has already prepared everything HF's own ``_sample`` receives.

    Parameters
    ----------
    model : a decoder-only ``PreTrainedModel`` whose attention uses transformers'
        ``AttentionInterface``.
    input_ids : ``[B, P]`` left-padded prompts (already expanded for ``num_return_sequences``).
    logits_processor, stopping_criteria, generation_config : as prepared by ``generate``.
    tokenizer : enables ``stop_strings`` (``generate`` builds the criterion from it).
    speculative, draft, draft_budget, gamma, adaptive_gamma, max_gamma, hardware, refresh_every, refresh_below,
        magicdec_config : MagicDec settings (see :class:`~hf_magicdec.MagicDecConfig`); explicit values win.
        ``draft`` may be a view instance (``SnapKV(window=16)``).
    magicdec_streamer, magicdec_synced_gpus, magicdec_stop_strings, magicdec_tokenizer :
        streamer, ``synced_gpus``, ``stop_strings`` and tokenizer forwarded by the ``speculative=``
        routing (``generate`` does not hand them to custom callables).
    magicdec_draft_model : a separate small draft model (``draft_model=`` in ``model.generate``;
        same tokenizer); ``draft`` then compresses *its* cache. See :mod:`hf_magicdec.draft_model`.
    **model_kwargs : ``attention_mask`` ``[B, P]`` or None, ``position_ids``, the empty cache …, and
        the registered draft views' options (``sink_tokens``, ``window``, ``recent_window``,
        ``pool_kernel``, ``page_size`` …), taken by name; they are listed in this function's
        runtime signature, which is what HF hands a ``custom_generate`` callable.

    Returns
    -------
    ``torch.LongTensor [B, P + T]`` right-padded with ``pad_token_id`` after each row's end, or
    :class:`~hf_magicdec.MagicDecOutput` when ``return_dict_in_generate`` is set.

    Raises
    ------
    ValueError, NotImplementedError
        For unsupported models or settings, before any forward pass.
    """
    config = MagicDecConfig.from_any(
        magicdec_config if magicdec_config is not None else (speculative if speculative is not None else "magicdec"),
        draft=draft,
        draft_budget=draft_budget,
        gamma=gamma,
        adaptive_gamma=adaptive_gamma,
        max_gamma=max_gamma,
        hardware=hardware,
        refresh_every=refresh_every,
        refresh_below=refresh_below,
        **{name: model_kwargs.pop(name) for name in view_option_names() if name in model_kwargs},
    )
    streamer = magicdec_streamer if magicdec_streamer is not None else streamer
    # None: HF's default (on under ZeRO-3 / FSDP with several processes); see distributed.py.
    synced = resolve_synced_gpus(model, magicdec_synced_gpus if magicdec_synced_gpus is not None else synced_gpus)
    if magicdec_stop_strings:
        if magicdec_tokenizer is None:
            raise ValueError(
                "There are one or more stop strings, but no tokenizer: pass the model's tokenizer to `generate` "
                "as `tokenizer=`."
            )
        stopping_criteria = StoppingCriteriaList(list(stopping_criteria or []))
        stopping_criteria.append(StopStringCriteria(stop_strings=magicdec_stop_strings, tokenizer=magicdec_tokenizer))
    check_model(model, max_length=generation_config.max_length)
    check_generation_config(generation_config)
    kernels.check_backend(input_ids.device)  # a bad HF_MAGICDEC_KERNELS fails here, before prefill
    if magicdec_draft_model is not None:
        check_draft_model(model, magicdec_draft_model, config)
    model_kwargs = check_model_kwargs(model_kwargs)
    chunk = generation_config.prefill_chunk_size or config.prefill_chunk_size
    batch, prompt = input_ids.shape
    _left_padding(model_kwargs.get("attention_mask"), batch, input_ids.device)  # refuse right padding up front
    lockstep = Lockstep.for_model(model, synced, input_ids.device, generation_config._pad_token_tensor)
    # Every rank of a TP group (every rank under synced_gpus) runs the first rank's plan.
    resolution = auto.resolve(config, model, batch, prompt, max(generation_config.max_length - prompt, 0),
                              draft_model=magicdec_draft_model)
    resolution = lockstep.agree(resolution)
    draft_model = magicdec_draft_model if resolution.use_draft_model else None
    if resolution.config is None:
        # The planner predicts no speedup: decode exactly as stock `generate` does (which would
        # have streamed the prompt before decoding; the routing kept the streamer from it).
        if streamer is not None:
            streamer.put(input_ids.cpu())
        out = type(model)._sample(
            model, input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
            generation_config=generation_config, synced_gpus=synced, streamer=streamer, **model_kwargs
        )
        if not generation_config.return_dict_in_generate:
            return out
        stats = SpeculationStats(accepted_lengths=[[] for _ in range(batch)], draft="none (planner: plain decoding)",
                                 plan=resolution.plan.to_dict() if resolution.plan is not None else None)
        return MagicDecOutput(**{k: v for k, v in out.items()}, speculation=stats)

    draft_attention = _magicdec_attention(draft_model) if draft_model is not None else contextlib.nullcontext()
    with _magicdec_attention(model), draft_attention, lockstep.watching(model):
        engine = _Engine(model, resolution.config, generation_config, logits_processor, stopping_criteria, streamer,
                         chunk, resolution, draft_model=draft_model)
        engine.lockstep = lockstep
        return engine.run(input_ids, model_kwargs.get("attention_mask"), model_kwargs.get("position_ids"))


def _list_view_options() -> None:
    """Show every registered view's options as keywords of ``generate``'s signature: HF hands a
    ``custom_generate`` callable the keywords its signature names (and refuses the others)."""
    base = inspect.signature(generate.__wrapped__)
    params = list(base.parameters.values())
    taken = {p.name for p in params}
    extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None)
             for n in view_option_names() if n not in taken]
    generate.__signature__ = base.replace(parameters=params[:-1] + extra + params[-1:])


on_register(_list_view_options)


# Switch the model to the ``magicdec`` attention for one call; always restore it (thread-safe).
_magicdec_attention = attention.switched


_SHARED_PREFILL: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "hf_magicdec_shared_prefill", default=None
)


@contextlib.contextmanager
def shared_prefill():
    """Reuse one prefill across the MagicDec ``generate`` calls inside the block.

    For sweeps over draft views, budgets and gamma on the same prompts (acceptance studies), where
    prefill dominates: the first call's prefilled cache is kept, and a later call with the same
    prompts, positions, padding and prefill chunking gets a copy of it instead of recomputing it.
    Prefill does not depend on the draft configuration, so outputs are unchanged; only the
    reported ``prefill_seconds`` of reused calls is meaningless (it measures a copy).

    Examples
    --------
    >>> with shared_prefill():
    ...     for budget in (128, 256, 512):
    ...         model.generate(ids, speculative="magicdec", draft_budget=budget, max_new_tokens=64)
    """
    token = _SHARED_PREFILL.set([])
    try:
        yield
    finally:
        _SHARED_PREFILL.reset(token)


def _profile_sync(device: torch.device) -> None:
    if device.type == "cuda" and os.environ.get("HF_MAGICDEC_PROFILE") == "1":
        torch.cuda.synchronize(device)


class _Engine:
    """State of one generation. Tensors named ``*_all`` are indexed by original row; the others by
    position in the working (unfinished) batch, whose original indices are ``self.rows``."""

    lockstep: Lockstep = LOCAL  # multi-process agreement (tensor parallel, synced_gpus); see distributed.py

    def __init__(self, model, config, generation_config, logits_processor, stopping_criteria, streamer, chunk,
                 resolution=None, draft_model=None):
        self.model = model
        self.resolution = resolution if resolution is not None else auto.Resolution(config)
        self.config = config
        self.gen = generation_config
        self.logits_processor = logits_processor
        self.stopping_criteria = stopping_criteria
        self.streamer = streamer
        self.chunk = chunk
        self.do_sample = bool(generation_config.do_sample)
        self.view = config.view
        # A separate draft model, or None: the model drafts on its own views (self-speculation).
        self.drafter = DraftModelDrafter(self, draft_model, self.view, config) if draft_model is not None else None
        self.keep_logits = model._supports_logits_to_keep()
        self.sliding_dict = _needs_mask_dict(model.config.get_text_config(decoder=True))

    # -------------------------------------------------------------- forward helpers
    def _forward(self, ids, positions, mask, logits_to_keep: int | None, model=None, cache=None):
        # The attention function reads the cache's per-row key ranges (draft / verify) or records
        # SnapKV's observation queries (prefill); `mask` serves any layer that does not use it.
        model = self.model if model is None else model
        cache = self.cache if cache is None else cache
        kwargs = {"magicdec_cache": cache}
        if self.keep_logits and logits_to_keep is not None:
            kwargs["logits_to_keep"] = logits_to_keep
        if self.sliding_dict:
            mask = {"full_attention": mask, "sliding_attention": mask}
        with attention.engine_forward(cache):
            out = model(
                input_ids=ids,
                position_ids=positions,
                attention_mask=mask,
                past_key_values=cache,
                use_cache=True,
                return_dict=True,
                **kwargs,
            )
        logits = out.logits
        if logits_to_keep == 1 and logits.shape[1] != 1:
            logits = logits[:, -1:]
        return logits

    def _prefill(self, input_ids, position_ids, pad, capacity: int, max_capacity: int | None = None) -> torch.Tensor:
        """Build ``self.cache`` with ``capacity`` slots per row (growing up to ``max_capacity``, see
        :meth:`MagicDecCache.reserve`) and fill it with the prompt in chunks; returns the last
        logits ``[B, 1, V]``."""
        # No view on the target when gamma is 0 or a separate draft model drafts.
        observe = self.view.observation_window() if self.config.gamma > 0 and self.drafter is None else 0
        store = _SHARED_PREFILL.get()
        entry = next((e for e in store or () if e.matches(input_ids, position_ids, pad, self.chunk, capacity, observe)),
                     None)
        if entry is not None:
            self.cache = entry.restore(capacity, observe)
            self.cache.position_limit = self.gen.max_length
            logits = entry.logits.clone()
        else:
            logits = self._compute_prefill(input_ids, position_ids, pad, capacity, observe)
            if store is not None:
                store.append(_PrefillEntry(input_ids, position_ids, pad, self.chunk, observe, self.cache, logits))
        if max_capacity is not None:
            self.cache.max_capacity = max(self.cache.capacity, max_capacity)
        return logits

    def _compute_prefill(self, input_ids, position_ids, pad, capacity: int, observe: int) -> torch.Tensor:
        self.cache, logits = self.prefill_model(self.model, input_ids, position_ids, pad, capacity, observe)
        return logits

    def prefill_model(self, model, input_ids, position_ids, pad, capacity: int, observe: int):
        """Fill a new :class:`MagicDecCache` of ``model`` with the prompt in chunks.
        Returns ``(cache, last logits [B, 1, V])``."""
        batch, prompt = input_ids.shape
        cache = MagicDecCache(num_layers(model), batch, capacity, pad)
        cache.observation_window = observe
        cache.position_limit = self.gen.max_length  # sliding-window layers must cover every position
        slot = torch.arange(prompt, device=input_ids.device)
        for start in range(0, prompt, self.chunk):
            end = min(prompt, start + self.chunk)
            cache.begin_prefill(start, end - start)
            q_slot = slot[start:end]
            mask = (slot[None, None, :end] >= pad[:, None, None]) & (slot[None, None, :end] <= q_slot[None, :, None])
            mask |= slot[None, None, :end] == q_slot[None, :, None]  # padding queries see themselves: no NaN
            logits = self._forward(
                input_ids[:, start:end], position_ids[:, start:end], mask[:, None], logits_to_keep=1,
                model=model, cache=cache,
            )
        cache.end_prefill(prompt)
        return cache, logits

    # -------------------------------------------------------------- main loop
    def run(self, input_ids, attention_mask, position_ids):
        gen, config = self.gen, self.config
        device = input_ids.device
        batch, prompt = input_ids.shape
        max_new = max(gen.max_length - prompt, 0)
        gamma, controller = config.gamma, None
        scratch = gamma  # draft slots per step the cache holds
        if config.adaptive:
            # gamma + 1 committed tokens must fit in the rolling window without overwriting it;
            # the controller never goes above max_gamma (a larger starting gamma is clamped).
            window = self.view.window_slots(config.draft_budget, config.gamma, prompt, max_new)
            scratch = self.lockstep.agree_min(max(1, min(config.max_gamma, window - 1)))
            res = self.resolution
            prior = res.plan.acceptance if res.plan is not None and res.plan.acceptance else 0.8
            controller = auto.GammaController(gamma, scratch, prior, res.draft_ratio, res.verify_ratio)
            gamma = controller.gamma
        pad_id = int(gen._pad_token_tensor.item()) if gen._pad_token_tensor is not None else 0
        eos = gen._eos_token_tensor
        eos = eos.to(device) if eos is not None else None
        pad = _left_padding(attention_mask, batch, device)
        if position_ids is None:
            position_ids = (torch.arange(prompt, device=device)[None, :] - pad[:, None]).clamp(min=0)
        # The KV cache and the token buffer start at the prompt plus a headroom and grow in chunks,
        # up to all this call can write (`max_capacity`), as tokens are generated (cache.reserve).
        max_capacity = prompt + max_new + scratch + 1
        capacity = initial_capacity(prompt, max_new, scratch)
        rb = RaggedBatch(input_ids, capacity, self.logits_processor, self.stopping_criteria, pad_id)
        stats = SpeculationStats(
            accepted_lengths=[[] for _ in range(batch)],
            gamma=config.gamma,
            draft=config.draft,
            draft_budget=config.draft_budget,
            draft_model=self.drafter.name if self.drafter is not None else None,
            adaptive_gamma=controller is not None,
            row_gammas=[[] for _ in range(batch)],
            plan=self.resolution.plan.to_dict() if self.resolution.plan is not None else None,
        )
        want_scores = gen.return_dict_in_generate and gen.output_scores
        want_logits = gen.return_dict_in_generate and gen.output_logits
        row_scores: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        row_logits: list[list[torch.Tensor]] = [[] for _ in range(batch)]

        if self.streamer is not None:
            self.streamer.put(input_ids.cpu())
        if max_new == 0:
            self.lockstep.sit_out(gamma, controller, self.drafter is None)
            if self.streamer is not None:
                self.streamer.end()
            return self._finish(rb, torch.full((batch,), prompt, device=device), prompt, pad_id, stats, [], [])

        # ---------------- prefill
        t0 = time.perf_counter()
        self.lockstep.plan_forwards(-(-prompt // self.chunk))
        logits = self._prefill(input_ids, position_ids, pad, capacity, max_capacity)
        first_logits = logits[:, -1].float()
        rows = torch.arange(batch, device=device)
        seq_len = torch.full((batch,), prompt, device=device, dtype=torch.long)  # [B] tokens incl. pending
        scores = rb.process(rows, seq_len, first_logits[:, None])[:, 0]
        first = torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1) if self.do_sample else scores.argmax(-1)
        first = self.lockstep.share(first)
        self.lockstep.match_forwards()
        if gamma > 0 and self.drafter is not None:
            self.drafter.prefill(input_ids, position_ids, pad, max_new, scratch)
        elif gamma > 0:
            self.cache.build_draft_views(self.view, config, prompt, max_new, scratch=scratch)
        _profile_sync(device)
        stats.prefill_seconds = time.perf_counter() - t0

        # ---------------- decode
        t_decode = time.perf_counter()
        cap = torch.full((batch,), prompt + max_new, device=device, dtype=torch.long)
        done_all = torch.zeros(batch, dtype=torch.bool, device=device)
        flagged_len = torch.full((batch,), -1, device=device, dtype=torch.long)
        new_tokens = first[:, None]
        step_scores, step_logits = scores[:, None], first_logits[:, None]
        num_new = torch.ones(batch, device=device, dtype=torch.long)
        accepted = None  # [b] accepted drafts of the last verification (set once a step has run)
        while True:
            # Emit this step's tokens (first token, or a verification's accepted + 1), stop rows.
            keep, finished = self._emit(rb, rows, seq_len, new_tokens, num_new, cap, eos, flagged_len, done_all)
            for r, (orig, k) in enumerate(zip(rows.tolist(), keep.tolist())):
                if want_scores:
                    row_scores[orig].extend(step_scores[r, :k].unbind(0))
                if want_logits:
                    row_logits[orig].extend(step_logits[r, :k].unbind(0))
            if self.streamer is not None and keep.numel():
                self.streamer.put(new_tokens[0, : int(keep[0])].cpu())
            # `cap` can shrink below a row's length (stock semantics without an EOS criterion).
            seq_len[rows] = torch.minimum(seq_len[rows] + keep, cap[rows])
            if stats.steps > 0:  # verified KV of pending + accepted tokens: one slot per kept token
                self.cache.commit(keep)
                if self.cache.refresher is not None:  # re-select a static view (hf_magicdec.refresh)
                    stats.refreshes += self.cache.refresher.after_commit(self.cache, keep, accepted,
                                                                         stats.gamma_trace[-1])
                if self.drafter is not None:
                    self.drafter.commit(keep)
            alive = ~finished
            if not self.lockstep.keep_going(bool(alive.any()), gamma, controller, self.drafter is None):
                break
            if not bool(alive.all()):
                keep_idx = alive.nonzero().squeeze(1)
                rows = rows[keep_idx]
                self.cache.select_rows(keep_idx)
                if self.drafter is not None:
                    self.drafter.select_rows(keep_idx)
            # Room for this step: verify writes KV slots [C, C + gamma + 1) and the next _emit tokens
            # up to C + gamma + 1 (C: committed length; host-side mirror, no device sync).
            if self.cache.reserve(self.cache.max_length() + gamma + 2):
                rb.reserve(self.cache.capacity)
            pending = rb.tokens[rows, seq_len[rows] - 1]

            # Draft gamma tokens on the draft view.
            t_step = time.perf_counter()
            drafts, draft_probs = self._draft(rb, rows, seq_len[rows], pending, gamma)
            _profile_sync(device)
            t_mid = time.perf_counter()
            # Verify gamma + 1 tokens on the full cache.
            target_logits = self._verify(pending, drafts)
            target_scores = rb.process(rows, seq_len[rows], target_logits)
            if gamma == 0:  # plain decoding: the same draw as stock `generate`
                accepted = torch.zeros_like(pending)
                nxt = (
                    torch.multinomial(torch.softmax(target_scores[:, 0], -1), 1).squeeze(1)
                    if self.do_sample
                    else target_scores[:, 0].argmax(-1)
                )
            elif self.do_sample:
                accepted, nxt = rejection_sample(drafts, draft_probs, torch.softmax(target_scores, dim=-1))
            else:
                accepted, nxt = greedy_verify(drafts, target_scores)
            accepted, nxt = self.lockstep.share(accepted, nxt)
            _profile_sync(device)
            stats.draft_seconds += t_mid - t_step
            stats.verify_seconds += time.perf_counter() - t_mid
            stats.steps += 1
            stats.gamma_trace.append(gamma)
            for orig, n in zip(rows.tolist(), accepted.tolist()):
                stats.accepted_lengths[orig].append(n)
                stats.row_gammas[orig].append(gamma)
            if controller is not None:
                gamma = controller.update(*self.lockstep.pool(int(accepted.sum()), gamma * int(accepted.numel())))
            new_tokens = torch.cat([drafts, nxt[:, None]], dim=1)
            new_tokens.scatter_(1, accepted[:, None], nxt[:, None])  # [b, gamma+1]; first n+1 are real
            num_new = accepted + 1
            step_scores, step_logits = target_scores, target_logits
        _profile_sync(device)
        stats.decode_seconds = time.perf_counter() - t_decode
        if config.gamma != 0:
            drafted = sum(sum(g) for g in stats.row_gammas)
            drafter = self.drafter.model if self.drafter is not None else None
            auto.record_acceptance(self.model, auto.draft_key(config.draft, drafter), config.draft_budget,
                                   sum(sum(a) for a in stats.accepted_lengths), drafted)
        if self.streamer is not None:
            self.streamer.end()
        return self._finish(rb, seq_len, prompt, pad_id, stats, row_scores, row_logits)

    def _emit(self, rb, rows, seq_len, new_tokens, num_new, cap, eos, flagged_len, done_all):
        """Write each row's new tokens, apply stopping criteria in token order, and decide which
        rows are finished. Returns ``(keep [b], finished [b])``."""
        ctx = seq_len[rows]
        width = new_tokens.shape[1]
        j = torch.arange(width, device=new_tokens.device)
        valid = j[None, :] < num_new[:, None]
        # Write all candidates (slots past num_new are scratch and get overwritten later).
        cols = ctx[:, None] + j[None, :]
        rb.tokens[rows[:, None], cols] = new_tokens
        keep = num_new.clone()
        if eos is not None:
            is_eos = torch.isin(new_tokens, eos) & valid
            flag_eos = is_eos.any(dim=1)
            first = torch.where(flag_eos, is_eos.long().argmax(dim=1) + 1, keep)
            keep = torch.minimum(keep, first)
        else:
            flag_eos = torch.zeros_like(valid[:, 0])
        generic_keep, generic_fired = rb.stopped(rows, ctx, keep)
        fired_generic = generic_fired & (generic_keep <= keep)
        keep = torch.where(fired_generic, generic_keep, keep)
        # The EOS only counts if it is still within the kept tokens.
        flag_eos = flag_eos & (~fired_generic | (first <= generic_keep)) if eos is not None else flag_eos
        room = cap[rows] - ctx
        flagged = fired_generic | flag_eos
        if rb.has_eos_criteria:
            at_cap = keep >= room
            keep = torch.minimum(keep, room)
            finished = flagged | at_cap
        else:
            # Stock `generate` without an EOS criterion keeps generating flagged rows (their
            # tokens stay real) until every row is flagged, then cuts all rows to the longest
            # flagged length.
            new_flag = flagged & (flagged_len[rows] < 0)
            flagged_len[rows] = torch.where(new_flag, ctx + keep, flagged_len[rows])
            keep = torch.minimum(num_new, room)
            at_cap = keep >= room
            done_all[rows] |= at_cap
            if bool(((flagged_len >= 0) | done_all).all()):
                target = int(torch.where(flagged_len >= 0, flagged_len, cap).max())
                cap.clamp_(max=target)
                room = cap[rows] - ctx
                keep = torch.clamp(torch.minimum(keep, room), min=0)
                at_cap = keep >= room
            finished = at_cap
        return keep, finished

    def _draft(self, rb, rows, seq_len_rows, pending, gamma: int):
        """gamma single-token forwards on the draft view. Returns ``drafts [b, gamma]`` and, when
        sampling, ``draft_probs [b, gamma, V]``."""
        if gamma == 0:
            return pending.new_empty((pending.shape[0], 0)), None
        if self.drafter is None:
            step = self._self_draft_step()
        else:
            step = self.drafter.start_round(rb, rows, seq_len_rows, gamma)
        tok = pending[:, None]
        drafts, probs = [], []
        for i in range(gamma):
            logits = step(i, tok)
            scores = rb.process(rows, seq_len_rows + i, logits[:, None])[:, 0]
            if self.do_sample:
                p = torch.softmax(scores, dim=-1)
                d = torch.multinomial(p, 1).squeeze(1)
                probs.append(p)
            else:
                d = scores.argmax(dim=-1)
            d = self.lockstep.share(d)
            rb.tokens[rows, seq_len_rows + i] = d  # later draft steps' processors see it
            drafts.append(d)
            tok = d[:, None]
        return torch.stack(drafts, dim=1), (torch.stack(probs, dim=1) if probs else None)

    def _self_draft_step(self):
        """Draft step ``i`` of the model itself on its draft views: ``step(i, tok [b, 1]) -> [b, V]``."""
        cache = self.cache
        view_end = cache.static_slots + cache.window_slots

        def step(i: int, tok: torch.Tensor) -> torch.Tensor:
            cache.begin_draft(i)
            mask = cache.forward_mask(1, view_end + i + 1)
            positions = (cache.lengths - cache.pad + i)[:, None]
            return self._forward(tok, positions, mask, logits_to_keep=1)[:, -1].float()

        return step

    def _verify(self, pending, drafts):
        """One forward of ``[pending, d_1 … d_gamma]`` per row at its own offset; ``[b, gamma+1, V]``."""
        cache = self.cache
        q = drafts.shape[1] + 1
        cache.begin_verify(q)
        mask = cache.forward_mask(q, cache.verify_kv_length(q))
        positions = cache.lengths[:, None] - cache.pad[:, None] + torch.arange(q, device=pending.device)
        ids = torch.cat([pending[:, None], drafts], dim=1)
        return self._forward(ids, positions, mask, logits_to_keep=0).float()

    def _finish(self, rb, seq_len, prompt, pad_id, stats, row_scores, row_logits):
        total = int(seq_len.max())
        sequences = rb.tokens[:, :total].clone()
        cols = torch.arange(total, device=sequences.device)
        sequences[cols[None, :] >= seq_len[:, None]] = pad_id
        if not self.gen.return_dict_in_generate:
            return sequences
        steps = total - prompt

        def assemble(per_row):
            if not any(per_row) or steps == 0:
                return None
            vocab = next(t for r in per_row for t in r).shape[-1]
            ref = next(t for r in per_row for t in r)
            out = []
            for k in range(steps):
                col = ref.new_full((len(per_row), vocab), float("-inf"))
                for b, r in enumerate(per_row):
                    if k < len(r):
                        col[b] = r[k]
                out.append(col)
            return tuple(out)

        return MagicDecOutput(
            sequences=sequences,
            scores=assemble(row_scores) if self.gen.output_scores else None,
            logits=assemble(row_logits) if self.gen.output_logits else None,
            past_key_values=None,
            speculation=stats,
        )


class _PrefillEntry:
    """A prefilled cache kept by :func:`shared_prefill` (its prompt slots copied out, never handed
    out itself); restored into a cache of any capacity that holds the prompt."""

    def __init__(self, input_ids, position_ids, pad, chunk, observe, cache, logits):
        self.input_ids, self.position_ids, self.pad = input_ids.clone(), position_ids.clone(), pad.clone()
        self.chunk, self.observe = chunk, observe
        self.logits = logits.clone()
        self.prompt = cache.max_length()
        self.layers = [
            (layer.keys[:, :, : self.prompt].clone(), layer.values[:, :, : self.prompt].clone(),
             None if layer.observed_queries is None else layer.observed_queries.clone(), layer.scaling)
            for layer in cache.layers
        ]

    def matches(self, input_ids, position_ids, pad, chunk, capacity, observe) -> bool:
        return (
            chunk == self.chunk and capacity >= self.prompt and observe <= self.observe
            and input_ids.shape == self.input_ids.shape and torch.equal(input_ids, self.input_ids)
            and torch.equal(position_ids, self.position_ids) and torch.equal(pad, self.pad)
        )

    def restore(self, capacity: int, observe: int) -> MagicDecCache:
        cache = MagicDecCache(len(self.layers), self.input_ids.shape[0], capacity, self.pad.clone())
        cache.observation_window = observe
        for layer, (keys, values, queries, scaling) in zip(cache.layers, self.layers):
            layer.keys, layer.values = widened(keys, capacity, self.prompt), widened(values, capacity, self.prompt)
            layer.device, layer.dtype, layer.is_initialized = keys.device, keys.dtype, True
            layer.observed_queries = queries[:, :, queries.shape[2] - observe :].clone() if observe else None
            layer.scaling = scaling
        cache.end_prefill(self.prompt)
        return cache


def _left_padding(attention_mask, batch: int, device) -> torch.Tensor:
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


def num_layers(model) -> int:
    """Decoder layers of ``model`` (composite models keep them in their text config)."""
    return model.config.get_text_config(decoder=True).num_hidden_layers


def _needs_mask_dict(config) -> bool:
    """Hybrid models index their mask by layer type."""
    return "sliding_attention" in (getattr(config, "layer_types", None) or [])

"""``hf-magicdec bench --rounds N``: the timing protocol for a machine that may be busy.

The sequential protocol (:func:`.runner.run`) prefills and decodes each method once, one after
another, so whatever else runs on the machine during one method's decode lands on that row alone
and the ratios flip. Here, per (batch, context) point:

1. **One prefill per engine, shared by every round.** Stock ``generate`` runs once from scratch
   (the *reference*: its tokens are what every method must reproduce, its prefill is the one stock
   prefill reported); its cache, cut back to the prompt minus its last token, is then copied
   (``copy.deepcopy``, outside the clock) into every stock call of the rounds, and into a
   ``StaticCache`` of the size ``cache_implementation="static"`` allocates for the static-cache
   baseline, so both continue with one prompt token and then decode exactly as stock does. Own AR
   and every MagicDec configuration run inside one :func:`hf_magicdec.shared_prefill` block primed
   by a single chunked MagicDec prefill (recording the largest observation window any of them
   needs): each call restores a copy of it and builds its draft view. Two prefills per point in
   all, however many rounds and methods.
2. **Rounds.** Each round decodes every method once on the same prompts; the order is rotated by
   one place per round, so no method always runs first (after the prefill) or last.
3. **Per method**: the median decode time over the rounds (decode = first generated token to the
   end of ``generate``, the streamer clock of :mod:`.harness`), its spread ``(max - min) /
   median``, and speedups from the medians against stock ``generate``, its static cache and own
   AR; the per-round ratios are kept in the JSONL (``speedup_vs_stock_rounds``). When any
   method's spread exceeds :data:`BUSY_SPREAD` the report says, in a WARNING line, that the
   machine was probably busy and the ratios are unreliable.

The default plan (``speculative="magicdec"`` with every field ``"auto"``) may decline and decode
as stock ``generate`` does, which cannot use the shared MagicDec prefill: after a call that
declined, the next one is handed a copy of stock's cache instead (as the stock row is), so a
declined plan costs one prefill, not one per round. Which plan each round ran is recorded.

With ``temperature > 0`` every call samples; each round's calls start from one seed
(:data:`SAMPLING_SEED` + round), so a round compares methods on equal terms, and no tokens are
compared (the suite's chi-square tests hold the distribution); with EOS ignored every method
still writes the same number of tokens.

Uses the library's public API only (``generate``, ``hf_magicdec.shared_prefill``, ``MagicDecConfig``).
"""

from __future__ import annotations

import copy
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, StaticCache

from hf_magicdec import MagicDecConfig, shared_prefill
from hf_magicdec.defaults import AUTO, DEFAULT_WINDOW

from .. import data
from .harness import Measurement, environment, measure, quiet_warm_up
from .report import POSITION_WINDOWS
from .runner import (
    OWN_AR_BUDGET,
    OWN_AR_DRAFT,
    BenchSpec,
    ModelInfo,
    Result,
    _bytes_read,
    _predict,
    draft_model_label,
    load_model,
    magicdec_label,
    plan_label,
    plan_ran,
    resolve_device,
)

__all__ = ["BUSY_SPREAD", "Method", "busy_warning", "prompt_cache", "rotation", "run_rounds", "sample_trace",
           "spread", "static_copy"]

log = logging.getLogger("hf_magicdec")

#: A method whose decode time varied across rounds by more than this fraction of its median
#: makes the report warn that the machine was probably busy.
BUSY_SPREAD = 0.15

#: Seed of round 0's sampled calls (round r: + r).
SAMPLING_SEED = 1234


def rotation(n_methods: int, round_index: int) -> list[int]:
    """The order (indices into the method list) in which round ``round_index`` runs ``n_methods``
    methods: the list rotated left by one place per round."""
    if n_methods < 1:
        return []
    k = round_index % n_methods
    return [(i + k) % n_methods for i in range(n_methods)]


def spread(values: list[float]) -> float:
    """``(max - min) / median`` of ``values``; 0 for fewer than two values."""
    if len(values) < 2:
        return 0.0
    mid = statistics.median(values)
    return (max(values) - min(values)) / mid if mid > 0 else 0.0


def _median_index(values: list[float]) -> int:
    """Index of the median value (the lower middle one for an even count)."""
    order = sorted(range(len(values)), key=values.__getitem__)
    return order[(len(values) - 1) // 2]


def busy_warning(results: list[Result], threshold: float = BUSY_SPREAD, load: tuple | None = None) -> str | None:
    """The WARNING line when any row's decode spread over the rounds exceeds ``threshold``, else None."""
    noisy = sorted((r for r in results if r.extra.get("decode_spread", 0.0) > threshold),
                   key=lambda r: -r.extra["decode_spread"])
    if not noisy:
        return None
    worst = ", ".join(f"{r.label} {100 * r.extra['decode_spread']:.0f}%" for r in noisy[:4])
    more = f" and {len(noisy) - 4} more" if len(noisy) > 4 else ""
    machine = ""
    if load is not None:
        machine = f"; load average {load[0]:.2f} over the last minute on {os.cpu_count()} CPUs"
    return (f"WARNING: decode times varied across rounds by more than {100 * threshold:.0f}% of their median "
            f"({worst}{more}{machine}). The machine was probably busy: these times and speedups are unreliable. "
            "Re-run on an idle machine, or with more --rounds.")


def prompt_cache(cache, length: int, config) -> DynamicCache:
    """A ``DynamicCache`` holding the first ``length`` tokens of ``cache`` (copies)."""
    out = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys[:, :, :length].clone(), layer.values[:, :, :length].clone(), i)
    return out


def static_copy(cache, max_cache_len: int, config) -> StaticCache:
    """A ``StaticCache`` of ``max_cache_len`` slots holding ``cache``'s tokens: what
    ``generate(cache_implementation="static")`` allocates, already prefilled."""
    out = StaticCache(config=config, max_cache_len=max_cache_len)
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys, layer.values, i)
    return out


@dataclass
class Method:
    """One row of the rounds: ``run(clock, ids, new_tokens)`` calls ``generate`` the way the rounds
    time it; ``warm(ids, new_tokens)`` the same method on other (short) prompts, untimed."""

    method: str  # "stock", "stock-static", "own-ar", "magicdec"
    label: str
    run: Callable[[Any, torch.Tensor, int], Any]
    warm: Callable[[torch.Tensor, int], Any]
    config: MagicDecConfig | None = None
    estimate: bool = True  # bytes-read estimate and cost-model prediction (not for a separate draft model)
    shares_prefill: bool = False
    rounds: list = field(default_factory=list)  # per round: (round, position, Measurement, notes)


def priming_config(configs: list[MagicDecConfig], context: int) -> MagicDecConfig | None:
    """A MagicDec configuration whose prefill serves every one of ``configs`` from the shared store:
    one recording the largest observation window any of them needs (``"auto"`` views: SnapKV's
    default window). None when no configuration is given."""
    if not configs:
        return None
    windows = [0]
    for cfg in configs:
        if cfg.draft == AUTO:
            windows.append(DEFAULT_WINDOW)
        elif cfg.view is not None:
            windows.append(cfg.view.observation_window())
    window = max(windows)
    if window == 0:
        return MagicDecConfig.from_any("magicdec", draft=OWN_AR_DRAFT, draft_budget=OWN_AR_BUDGET, gamma=0)
    for budget in (256, 128, 64, 32, 16, 8):
        if budget >= context:
            continue
        try:
            return MagicDecConfig.from_any("magicdec", draft="snapkv", draft_budget=budget, gamma=1, window=window)
        except ValueError:
            continue
    # A prompt too short for any SnapKV budget: the configuration with the largest window itself.
    return max((c for c in configs if c.draft != AUTO and c.view is not None),
               key=lambda c: c.view.observation_window(), default=configs[0])


def run_rounds(spec: BenchSpec, progress: bool = True, on_result: Callable[[Result], None] | None = None,
               env: dict | None = None):
    """Run ``spec`` with the rounds protocol (module docstring). Returns ``(results, environment,
    model_info)`` as :func:`.runner.run` does; ``on_result`` is called for every row once its
    point's rounds are done."""
    device = resolve_device(spec.device)
    log.warning("loading %s (%s) on %s …", spec.model, spec.dtype, device)
    model, tokenizer = load_model(spec.model, spec.dtype, device)
    small = load_model(spec.draft_model, spec.dtype, device)[0] if spec.draft_model else None
    info = ModelInfo.of(model)
    env = env if env is not None else environment(device)
    extra = {} if spec.stop_at_eos else {"eos_token_id": None}
    if spec.prefill_chunk is not None:
        extra["prefill_chunk_size"] = spec.prefill_chunk
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def generate(ids, new_tokens, clock=None, **kwargs):
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=None, streamer=clock, pad_token_id=pad_id, **spec.decoding(),
                              **extra, **kwargs)

    points = [(b, c) for c in spec.contexts for b in spec.batches]
    methods_per_point = {c: (1 + int(spec.static_baseline) + int(spec.own_ar) + len(spec.configs(c))
                             + len(spec.draft_model_configs(c))) for c in spec.contexts}
    total = sum(2 + spec.rounds * methods_per_point[c] for _, c in points)
    outer = tqdm(total=total, desc="bench", unit="run", disable=not progress)

    def token_bar(label, n):
        if not progress:
            return None
        return lambda: tqdm(total=n, desc=f"  {label}", unit="tok", leave=False)

    results: list[Result] = []
    with torch.inference_mode():
        for batch, context in points:
            ids = data.prompt_batch(tokenizer, batch, context, source=spec.text).to(device)
            rows = _run_point(spec, model, small, info, generate, ids, outer, token_bar, device)
            results.extend(rows)
            if on_result is not None:
                for r in rows:
                    on_result(r)
    outer.close()
    return results, env, info


def _run_point(spec, model, small, info, generate, ids, outer, token_bar, device) -> list[Result]:
    batch, context = ids.shape
    n = spec.new_tokens
    state: dict[str, Any] = {"cache": None, "declined": {}}

    def stock_run(clock, x, k):
        return generate(x, k, clock, past_key_values=copy.deepcopy(state["cache"]))

    def static_run(clock, x, k):
        return generate(x, k, clock, past_key_values=static_copy(state["cache"], x.shape[1] + k, model.config))

    def magicdec(cfg, **kwargs):
        def run(clock, x, k):
            return generate(x, k, clock, speculative=cfg, return_dict_in_generate=True, **kwargs)

        return run

    def planned(cfg, label):
        """A configuration the planner may decline: after a declined call, continue from stock's cache."""
        def run(clock, x, k):
            passed = bool(state["declined"].get(label))
            cache = {"past_key_values": copy.deepcopy(state["cache"])} if passed else {}
            out = generate(x, k, clock, speculative=cfg, return_dict_in_generate=True, **cache)
            state["declined"][label] = plan_ran(out.speculation)["declined"]
            state["passed"] = passed
            return out

        return run

    methods = [Method("stock", "stock generate", stock_run, lambda x, k: generate(x, k))]
    if spec.static_baseline:
        methods.append(Method("stock-static", "stock generate, static cache", static_run,
                              lambda x, k: generate(x, k, cache_implementation="static")))
    configs = spec.configs(context)
    if spec.own_ar:
        own = MagicDecConfig.from_any("magicdec", draft=OWN_AR_DRAFT, draft_budget=OWN_AR_BUDGET, gamma=0)
        methods.append(Method("own-ar", "own AR (gamma=0)", magicdec(own), lambda x, k, c=own: magicdec(c)(None, x, k),
                              own, shares_prefill=True))
    for cfg in configs:
        label = magicdec_label(cfg)
        run = planned(cfg, label) if cfg.planner_may_decline else magicdec(cfg)
        methods.append(Method("magicdec", label, run, lambda x, k, c=cfg: magicdec(c)(None, x, k), cfg,
                              shares_prefill=True))
    for cfg in spec.draft_model_configs(context):
        run = magicdec(cfg, draft_model=small)
        methods.append(Method("magicdec", draft_model_label(spec, cfg), run, lambda x, k, r=run: r(None, x, k), cfg,
                              estimate=False, shares_prefill=True))

    if spec.warmup:  # discarded: first-call allocations, thread pools, a quantized draft's weights
        warm = ids[:, -min(64, context):].clone()
        warm[:, 0] = ids[:, 0]
        for m in methods:
            outer.set_postfix_str(f"B={batch} S={context} warm-up {m.label}")
            with quiet_warm_up():
                m.warm(warm, 4)

    # The reference: stock generate from scratch. Its tokens are every method's target, its
    # prefill the stock prefill, and its cache (cut to the prompt minus its last token) what every
    # stock and static-cache call of the rounds continues from. Sampled, there are no target
    # tokens: two are enough for the prefill and the cache.
    outer.set_postfix_str(f"B={batch} S={context} stock generate (reference, from scratch)")
    kept = {}
    ref_tokens = 2 if spec.sampled else n

    def reference(clock):
        kept["out"] = generate(ids, ref_tokens, clock, return_dict_in_generate=True)
        return kept["out"]

    ref = measure(reference, 1, device, token_bar("stock generate (reference)", ref_tokens))
    state["cache"] = prompt_cache(kept.pop("out").past_key_values, context - 1, model.config)
    base = ref.sequences
    outer.update(1)

    shared = [m.config for m in methods if m.shares_prefill]
    prime = priming_config(shared, context)
    shared_s = None
    with shared_prefill():
        if prime is not None:  # one chunked prefill for own AR and every MagicDec row, all rounds
            outer.set_postfix_str(f"B={batch} S={context} MagicDec prefill (shared)")
            t0 = time.perf_counter()
            generate(ids, 1, speculative=prime)
            shared_s = time.perf_counter() - t0
        outer.update(1)
        for r in range(spec.rounds):
            for position, i in enumerate(rotation(len(methods), r)):
                m = methods[i]
                outer.set_postfix_str(f"B={batch} S={context} round {r + 1}/{spec.rounds} {m.label}")
                state["passed"] = False
                torch.manual_seed(SAMPLING_SEED + r)  # sampled: every method of a round from one seed
                meas = measure(lambda clock, m=m: m.run(clock, ids, n), 1, device, token_bar(m.label, n))
                m.rounds.append((r, position, meas, {"cache_passed": state["passed"]}))
                outer.update(1)

    eos = model.generation_config.eos_token_id if spec.stop_at_eos else None
    eos = [eos] if isinstance(eos, int) else eos
    rows = [_aggregate(m, batch, context, n, None if spec.sampled else base, eos) for m in methods]
    stock = rows[0]
    stock.extra.update(reference_prefill_s=ref.prefill_s, reference_decode_s=ref.decode_s)
    static = next((r for r in rows if r.method == "stock-static"), None)
    ar = next((r for r in rows if r.method == "own-ar"), None)
    for m, res in zip(methods, rows):
        res.speedup_vs_stock = stock.m.decode_s / res.m.decode_s
        res.extra["speedup_vs_stock_rounds"] = [s / d for s, d in zip(stock.m.decode_all, res.m.decode_all)]
        if static is not None and res.method != "stock":
            res.speedup_vs_static = static.m.decode_s / res.m.decode_s
        if ar is not None and res.method in ("own-ar", "magicdec"):
            res.speedup_vs_ar = ar.m.decode_s / res.m.decode_s
        if res.method in ("own-ar", "magicdec"):
            res.extra.update(prefill_shared=True, shared_prefill_s=shared_s)
        else:
            res.extra["cache_reused"] = True
        if m.estimate:
            res.bytes_read = _bytes_read(info, res)
        if res.method == "magicdec" and m.estimate:
            try:
                _predict(model, res)
            except Exception as exc:  # noqa: BLE001  (a prediction must never cost a measurement)
                log.info("no cost-model prediction for %s: %s", res.label, exc)
    return rows


#: Points of a decode's position trace kept in the JSONL.
TRACE_POINTS = 64


def sample_trace(trace: list[tuple[int, float]], new_tokens: int, points: int = TRACE_POINTS) -> list[list[float]]:
    """``[[position, seconds since the first new token], ...]`` at about ``points`` positions
    spread over the generation (the first step at or past each), from a :class:`.harness.Clock`
    trace."""
    if not trace:
        return []
    every = max(1, new_tokens // points)
    out, mark = [], every
    for position, seconds in trace:
        if position >= mark or position == trace[-1][0]:
            out.append([position, round(seconds, 4)])
            mark = (position // every + 1) * every
    return out


def step_positions(stats: Any, new_tokens: int) -> list[float] | None:
    """Mean new tokens per row after the first token and after each speculative step (``steps + 1``
    values), from the statistics' accepted lengths; None without them. A row that stopped (EOS)
    keeps its count; counts are capped at ``new_tokens``."""
    accepted = getattr(stats, "accepted_lengths", None)
    if not accepted:
        return None
    totals = [1] * len(accepted)  # the first new token, from the prefill
    out = [1.0]
    for step in range(getattr(stats, "steps", 0)):
        for r, row in enumerate(accepted):
            if step < len(row):
                totals[r] = min(new_tokens, totals[r] + row[step] + 1)
        out.append(round(sum(totals) / len(totals), 2))
    return out


def batch_trace(trace: list[tuple[int, float]], stats: Any, new_tokens: int) -> list[tuple[float, float]]:
    """``trace`` (streamed new tokens, seconds) with each step's position as the mean new tokens
    per row: a speculative step commits a different number of tokens in each row, and the streamed
    row's count alone would show that row's acceptance, not the batch's throughput. Stock steps
    commit one token per row, and their trace is returned as it is (as is any trace that is not
    one entry per step: MagicDec streams the first token, then once per step)."""
    positions = step_positions(stats, new_tokens)
    if positions is None or len(trace) != len(positions):
        return trace
    return [(p, seconds) for p, (_, seconds) in zip(positions, trace)]


def window_schedule(stats: Any, new_tokens: int, windows: int = POSITION_WINDOWS) -> list[list]:
    """``[[window mid-position, mean γ, acceptance or None], ...]`` over the speedup plot's
    ``windows`` equal windows of the generation (by mean new tokens per row): the mean γ of the
    steps that started in the window, and the fraction of their drafted tokens the target accepted
    (None where every step was plain). The long-generation plot draws them under the speedup."""
    positions = step_positions(stats, new_tokens)
    gammas = getattr(stats, "gamma_trace", None)
    if positions is None or not gammas or len(gammas) != len(positions) - 1:
        return []
    accepted, row_gammas = stats.accepted_lengths, stats.row_gammas
    width = new_tokens / windows
    sums = [[0, 0, 0, 0] for _ in range(windows)]  # steps, sum of γ, accepted, drafted
    for step, gamma in enumerate(gammas):
        w = sums[min(windows - 1, int(positions[step] // width))]
        w[0] += 1
        w[1] += gamma
        for row, gs in zip(accepted, row_gammas):
            if step < len(row):
                w[2] += row[step]
                w[3] += gs[step]
    return [[round((i + 0.5) * width, 1), round(g / n, 3), round(a / d, 4) if d else None]
            for i, (n, g, a, d) in enumerate(sums) if n]


def stock_trace(trace: list, ends: list[int] | None) -> list:
    """A stock trace (one entry per step: every live row's next token) with each step's position as
    the mean new tokens per row, as :func:`batch_trace` places MagicDec's: once a row has stopped
    (``ends``: each row's new tokens up to its EOS, :func:`row_tokens`) its count stays. Unchanged
    when EOS was ignored (``ends`` None)."""
    if not ends or not trace:
        return trace
    return [(round(sum(min(k, e) for e in ends) / len(ends), 2), seconds) for k, seconds in trace]


def row_tokens(sequences: torch.Tensor, context: int, eos: list[int]) -> list[int]:
    """New tokens of each row up to and including its first EOS (all of them where none):
    ``sequences [B, context + T]`` -> B counts."""
    generated = sequences[:, context:]
    stopped = torch.isin(generated, torch.tensor(eos, device=generated.device))
    return torch.where(stopped.any(1), stopped.int().argmax(1) + 1, generated.shape[1]).tolist()


def _positions(run: Measurement, new_tokens: int, ends: list[int] | None) -> list:
    """The run's trace placed by the mean new tokens per row (:func:`batch_trace` for MagicDec,
    :func:`stock_trace` for stock)."""
    trace = run.extra.get("trace", [])
    if run.speculation is not None:
        return batch_trace(trace, run.speculation, new_tokens)
    return stock_trace(trace, ends)


def _aggregate(m: Method, batch: int, context: int, new_tokens: int, base: torch.Tensor | None,
               eos: list[int] | None = None) -> Result:
    """One :class:`Result` from a method's rounds: medians, spread, the median round's statistics.
    ``base``: the reference tokens every round must equal (None: sampled, nothing to compare)."""
    m.rounds.sort(key=lambda t: t[0])
    runs = [meas for _, _, meas, _ in m.rounds]
    decode = [x.decode_s for x in runs]
    prefill = [x.prefill_s for x in runs]
    mid = _median_index(decode)
    peaks = [x.peak_bytes for x in runs if x.peak_bytes is not None]
    meas = Measurement(prefill_s=statistics.median(prefill), decode_s=statistics.median(decode),
                       prefill_all=prefill, decode_all=decode, sequences=runs[mid].sequences,
                       speculation=runs[mid].speculation, peak_bytes=max(peaks, default=None),
                       extra=runs[mid].extra)
    ends = row_tokens(meas.sequences, context, eos) if eos else None  # None: every row ran to new_tokens
    res = Result(m.method, m.label, batch, context, new_tokens, meas, m.config, row_tokens=ends)
    # Sampled (no base): same distribution is the suite's business (chi-square tests).
    same = None if base is None else all(torch.equal(x.sequences, base) for x in runs)
    res.extra["sampled"] = base is None
    if same is None:
        res.identical = None
    elif m.method == "stock":  # the baseline: continuing from its cache must give the reference's tokens
        res.identical = None if same else False
        res.extra["identical_to_reference"] = same
    else:
        res.identical = same
    if same is False:
        log.error("%s output differs from stock generate at B=%d S=%d", m.label, batch, context)
    res.extra.update(
        position_trace=sample_trace(_positions(runs[mid], new_tokens, ends), new_tokens),
        position_schedule=window_schedule(runs[mid].speculation, new_tokens),
        rounds=len(runs),
        round_position=[p for _, p, _, _ in m.rounds],
        decode_spread=spread(decode),
        decode_min_s=min(decode),
        decode_max_s=max(decode),
    )
    if m.method in ("own-ar", "magicdec"):
        res.extra["round_plans"] = [plan_label(x.speculation) for x in runs]
        if any(notes["cache_passed"] for _, _, _, notes in m.rounds):
            res.extra["round_cache_passed"] = [notes["cache_passed"] for _, _, _, notes in m.rounds]
    return res

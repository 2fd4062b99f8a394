"""The benchmark grid: stock ``generate``, our own autoregressive path and MagicDec, on the same
prompts, in one process.

For every (batch, context) point the runner cuts one batch of real long-text prompts and runs,
in this order: stock greedy ``model.generate`` (the baseline), ``speculative="magicdec"`` with
``gamma=0`` (plain decoding on our cache: "own AR"), then every (draft view, budget, gamma)
configuration; optionally HF assisted generation with a small draft model at batch 1. Every
output is compared token for token with the baseline.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Callable

import hf_magicdec
import torch
from hf_magicdec import MagicDecConfig, get_view, shared_prefill
from hf_magicdec.defaults import AUTO, DEFAULT_BUDGET, DEFAULT_DRAFT
from hf_magicdec.planner import ModelSpec, SearchSpace, Workload, search_plan
from tqdm.auto import tqdm

from .. import data, models
from .harness import Measurement, environment, measure, quiet_warm_up

log = logging.getLogger("hf_magicdec")

#: Own AR (``gamma=0``): plain decoding on MagicDec's cache, pinned to the library's documented
#: fallback view and budget (``hf_magicdec.defaults``: public default values).
OWN_AR_DRAFT, OWN_AR_BUDGET = DEFAULT_DRAFT, DEFAULT_BUDGET

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: HF methods the bench runs at batch 1 only, compared with stock generate at batch 1.
BATCH1_METHODS = ("assisted", "prompt-lookup")


@dataclass(frozen=True)
class BenchSpec:
    """What to run. Sizes are validated before any model is loaded."""

    model: str = "smollm2-135m"
    dtype: str = "float32"
    device: str = "auto"
    batches: tuple[int, ...] = (8,)
    contexts: tuple[int, ...] = (2048,)
    new_tokens: int = 64
    drafts: tuple[str, ...] = ("streamingllm", "snapkv")
    budgets: tuple[int | str, ...] = (256,)  # "auto": the planner picks
    gammas: tuple[int | str, ...] = (3,)  # "auto": the planner picks, then adapts per step
    # The self-draft's weights: "full", "int8" (quantized copies of the linear layers), "auto".
    draft_weights: tuple[str, ...] = ("full",)
    text: str = "auto"
    repeats: int = 1
    warmup: bool = True
    own_ar: bool = True
    static_baseline: bool = False  # also stock generate with cache_implementation="static"
    stop_at_eos: bool = False
    assistant: str | None = None
    # HF prompt lookup decoding (``prompt_lookup_num_tokens``) at batch 1, beside stock at batch 1.
    prompt_lookup: int | None = None
    # A separate small draft model (same tokenizer) and the views compressing its cache; its runs
    # sit beside the self-speculative ones as method "magicdec", labelled "draft-model …".
    draft_model: str | None = None
    draft_model_views: tuple[str, ...] = ("full",)
    # Prefill the target once per point for all MagicDec runs (generation.shared_prefill): decode
    # times are unchanged, their prefill times are then not measured (long contexts on CPU).
    share_prefill: bool = False
    prefill_chunk: int | None = None  # passed to every method as generation_config.prefill_chunk_size
    # Also run ``speculative="magicdec"`` with nothing else set (the planner chooses everything).
    default_plan: bool = False
    # The rounds protocol (:mod:`.rounds`): every method decodes once per round on the same
    # prompts, the order rotated each round, from one prefill per point; None: the sequential one.
    rounds: int | None = None
    # > 0: every method samples at this temperature (the model's other sampling defaults kept),
    # each round's calls from one seed (rounds protocol only); tokens are then not compared.
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype=!r}")
        for name in ("batches", "contexts", "budgets"):
            values = getattr(self, name)
            allowed = (AUTO,) if name == "budgets" else ()
            if not values or any(v not in allowed and (not isinstance(v, int) or v < 1) for v in values):
                raise ValueError(f"{name} must be positive ints{' or auto' if allowed else ''}, got {values!r}")
        if self.new_tokens < 2:
            raise ValueError(f"new_tokens must be >= 2 (decode starts after the first token), got {self.new_tokens=}")
        if self.prompt_lookup is not None and (not isinstance(self.prompt_lookup, int) or self.prompt_lookup < 1):
            raise ValueError(f"prompt_lookup must be an int >= 1 (tokens per lookup draft), "
                             f"got {self.prompt_lookup=!r}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {self.prefill_chunk=}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats=}")
        if self.rounds is not None:
            if self.rounds < 1:
                raise ValueError(f"rounds must be >= 1, got {self.rounds=}")
            if self.repeats != 1:
                raise ValueError("rounds and repeats are two timing protocols: use one of them "
                                 f"(got {self.rounds=} and {self.repeats=})")
            if self.assistant or self.prompt_lookup:
                raise ValueError("rounds does not run HF's batch-1 methods (assistant, prompt_lookup): "
                                 "drop one of them")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature=}")
        if self.temperature > 0 and self.rounds is None:
            raise ValueError("sampling (temperature > 0) is timed with the rounds protocol: add rounds "
                             f"(--rounds N), got {self.temperature=} and {self.rounds=}")
        if self.drafts == ("none",):  # no explicit view: only the default plan or a draft model
            if not (self.default_plan or self.draft_model):
                raise ValueError("drafts=('none',) runs no MagicDec configuration: add default_plan "
                                 "(--default-plan) or a draft model")
            object.__setattr__(self, "drafts", ())
        for draft in (*self.drafts, *(self.draft_model_views if self.draft_model else ())):
            for budget in self.budgets:
                for gamma in self.gammas:
                    for weights in self.draft_weights:  # names the bad value
                        MagicDecConfig.from_any(draft=draft, draft_budget=budget, gamma=gamma, draft_weights=weights)

    def draft_model_configs(self, context: int) -> list[MagicDecConfig]:
        """Configurations run with the separate draft model (its full view: one budget suffices)."""
        if not self.draft_model:
            return []
        out = []
        for view in self.draft_model_views:
            budgets = self.budgets[:1] if view == "full" else [k for k in self.budgets if k == AUTO or k < context]
            out.extend(MagicDecConfig.from_any(draft=view, draft_budget=k, gamma=g, draft_weights="full")
                       for k in budgets for g in self.gammas)
        return out

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    def decoding(self) -> dict:
        """``generate``'s decoding arguments: greedy, or sampling at ``temperature``."""
        return {"do_sample": True, "temperature": self.temperature} if self.sampled else {"do_sample": False}

    def configs(self, context: int) -> list[MagicDecConfig]:
        """MagicDec configurations worth running at ``context`` (a budget that holds the prompt and
        every new token compresses nothing; one that holds only the prompt does once the generation
        outgrows it: long generations)."""
        out = []
        for draft in self.drafts:
            for budget in self.budgets:
                if draft != "full" and budget != AUTO and budget >= context + self.new_tokens:
                    log.warning("skipping %s budget %d at context %d + %d new tokens: the view would hold all of it",
                                draft, budget, context, self.new_tokens)
                    continue
                out.extend(MagicDecConfig.from_any(draft=draft, draft_budget=budget, gamma=g, draft_weights=w)
                           for w in self.draft_weights for g in self.gammas)
        if self.default_plan:
            out.append(MagicDecConfig())  # every field "auto": what speculative="magicdec" alone runs
        return out


def magicdec_label(cfg: MagicDecConfig) -> str:
    """The table's name of a self-speculative configuration (what was asked, not what the planner chose)."""
    if cfg == MagicDecConfig():
        return "magicdec default plan"
    label = f"magicdec {draft_name(cfg)}/{cfg.draft_budget} γ={cfg.gamma}".replace("auto/auto", "auto")
    return label + (f" {cfg.draft_weights}" if cfg.draft_weights != "full" else "")


def draft_name(cfg: MagicDecConfig) -> str:
    """The draft view's name, or ``"auto"`` (``draft`` may hold the name or the view instance)."""
    return getattr(cfg, "draft_name", None) or getattr(cfg.draft, "name", cfg.draft)


def draft_model_label(spec: BenchSpec, cfg: MagicDecConfig) -> str:
    name = draft_name(cfg)
    budget = "" if name == "full" else f"/{cfg.draft_budget}"
    return f"draft-model {spec.draft_model} {name}{budget} γ={cfg.gamma}"


def plan_ran(stats) -> dict | None:
    """What a MagicDec call ran (the planner's choice where fields were "auto"), from its
    ``SpeculationStats``: view, budget, γ (mean γ when adaptive) and draft weights; ``declined``
    when the planner chose plain decoding."""
    if stats is None:
        return None
    declined = stats.draft.startswith("none")
    return {"draft": None if declined else stats.draft, "draft_budget": None if declined else stats.draft_budget,
            "gamma": stats.gamma, "mean_gamma": round(stats.mean_gamma, 3), "adaptive_gamma": stats.adaptive_gamma,
            "draft_weights": None if declined else stats.draft_weights, "declined": declined}


def plan_label(stats) -> str:
    """:func:`plan_ran` in a few characters: ``snapkv/256 γ=3 full``, ``snapkv/256 γ≈1.8 int8``
    (adaptive: the mean γ), ``γ=0`` (own AR), ``plain (declined)``."""
    p = plan_ran(stats)
    if p is None:
        return "-"
    if p["declined"]:
        return "plain (declined)"
    if p["gamma"] == 0 and not p["adaptive_gamma"]:
        return "γ=0"
    gamma = f"γ≈{p['mean_gamma']:.1f}" if p["adaptive_gamma"] else f"γ={p['gamma']}"
    return f"{p['draft']}/{p['draft_budget']} {gamma} {p['draft_weights']}"


@dataclass
class ModelInfo:
    """Byte counts behind the achieved-bandwidth estimate."""

    weight_bytes: int  # every parameter once (a tied LM head is read from the embedding)
    kv_bytes_per_token: int  # K and V, all layers, per row

    @classmethod
    def of(cls, model) -> "ModelInfo":
        weights = sum(p.numel() * p.element_size() for p in model.parameters())  # real, not modelled
        spec = ModelSpec.from_config(model.config, dtype=model.dtype)
        return cls(weights, spec.kv_bytes_per_token)


@dataclass
class Result:
    """One row of the benchmark output (see :func:`Result.to_dict` for the JSONL schema)."""

    method: str  # "stock", "stock-static", "own-ar", "magicdec", "stock-b1", "assisted", "prompt-lookup"
    label: str
    batch: int
    context: int
    new_tokens: int
    m: Measurement
    config: MagicDecConfig | None = None
    identical: bool | None = None
    bytes_read: float | None = None
    speedup_vs_stock: float | None = None
    speedup_vs_static: float | None = None  # vs stock generate with cache_implementation="static"
    speedup_vs_ar: float | None = None
    predicted_speedup: float | None = None
    extra: dict = field(default_factory=dict)
    # New tokens of each row up to and including its EOS, when EOS was honoured (None: every row
    # generated ``new_tokens``): rows that stopped early must not count the padding after it.
    row_tokens: list[int] | None = None

    @property
    def decode_tokens(self) -> int:
        """Tokens committed during decode, all rows (the first token of each row is prefill's)."""
        if self.row_tokens is not None:
            return sum(n - 1 for n in self.row_tokens)
        return self.batch * (self.new_tokens - 1)

    @property
    def decode_tok_per_s(self) -> float:
        return self.decode_tokens / self.m.decode_s

    @property
    def ms_per_token(self) -> float:
        """Per-token latency of a row: decode time / tokens a row generated after the first (their
        mean over the rows when EOS stopped some early)."""
        return 1000 * self.m.decode_s * self.batch / max(1, self.decode_tokens)

    @property
    def gb_per_s(self) -> float | None:
        return self.bytes_read / self.m.decode_s / 1e9 if self.bytes_read else None

    def breakdown(self) -> dict | None:
        """Seconds per verification step: draft, verify and everything else (emit, commit, processors)."""
        s = self.m.speculation
        if s is None or not s.steps:
            return None
        other = max(self.m.decode_s - s.draft_seconds - s.verify_seconds, 0.0)
        return {
            "steps": s.steps,
            "draft_ms_per_step": 1000 * s.draft_seconds / s.steps,
            "verify_ms_per_step": 1000 * s.verify_seconds / s.steps,
            "other_ms_per_step": 1000 * other / s.steps,
        }

    def to_dict(self) -> dict:
        s = self.m.speculation
        row = {
            "method": self.method,
            "label": self.label,
            "batch": self.batch,
            "context": self.context,
            "new_tokens": self.new_tokens,
            "prefill_s": self.m.prefill_s,
            "decode_s": self.m.decode_s,
            "prefill_s_all": self.m.prefill_all,
            "decode_s_all": self.m.decode_all,
            "decode_tokens": self.decode_tokens,
            "row_tokens": self.row_tokens,
            "decode_tok_per_s": self.decode_tok_per_s,
            "ms_per_token": self.ms_per_token,
            "speedup_vs_stock": self.speedup_vs_stock,
            "speedup_vs_static": self.speedup_vs_static,
            "speedup_vs_own_ar": self.speedup_vs_ar,
            "predicted_speedup": self.predicted_speedup,
            "identical_to_generate": self.identical,
            "peak_memory_mb": None if self.m.peak_bytes is None else self.m.peak_bytes / 2**20,
            "est_bytes_read": self.bytes_read,
            "est_gb_per_s": self.gb_per_s,
            "config": None if self.config is None else self.config.to_dict(),
            "plan_ran": plan_ran(s) if self.method == "magicdec" or self.method == "own-ar" else None,
            "plan_label": plan_label(s) if self.method == "magicdec" or self.method == "own-ar" else None,
        }
        if s is not None and self.config is not None and self.config.gamma != 0 and s.steps:
            lengths = [n for r in s.accepted_lengths for n in r]
            row.update(
                acceptance_rate=s.acceptance_rate,
                mean_accepted=sum(lengths) / len(lengths) if lengths else 0.0,
                accepted_histogram=s.histogram(),
                tokens_per_step=s.tokens_per_step,
                mean_gamma=s.mean_gamma,
                gamma_schedule=s.schedule(),  # (first step, last step, γ) runs: where it speculated
                resolved={"draft": s.draft, "draft_budget": s.draft_budget, "adaptive_gamma": s.adaptive_gamma},
                plan=s.plan,
                breakdown=self.breakdown(),
            )
        if s is not None and "plan" not in row and getattr(s, "plan", None) is not None:
            row["plan"] = s.plan  # the planner's decision (and its reason) also when it declined
        row.update(self.extra)
        return row


def _bytes_read(info: ModelInfo, result: Result) -> float:
    """Estimated bytes the decode phase reads: weights once per forward plus the KV each attends to."""
    b, p, n = result.batch, result.context, result.new_tokens
    s = result.m.speculation
    if result.config is None or result.config.gamma == 0 or s is None or not s.steps:
        # Plain decoding (or the planner chose it): one forward per step until the longest row
        # stops; each live row reads its own context.
        rows = result.row_tokens or [n] * b
        kv_tokens = sum(p * (r - 1) + r * (r - 1) // 2 for r in rows)
        return (max(rows) - 1) * info.weight_bytes + kv_tokens * info.kv_bytes_per_token
    row_steps = sum(len(r) for r in s.accepted_lengths) - b  # the first token is prefill's, not a step
    row_steps = max(row_steps, s.steps)
    mean_ctx = p + n / 2
    view = min(s.draft_budget, p) if s.draft != "full" else mean_ctx
    g = s.mean_gamma
    verify = s.steps * info.weight_bytes + row_steps * mean_ctx * info.kv_bytes_per_token
    # A quantized draft reads its int8 copy of the linear layers instead (the embedding is not read).
    draft_weight_bytes = s.draft_weight_bytes or info.weight_bytes
    draft = s.steps * g * draft_weight_bytes + row_steps * g * (view + (g + 1) / 2) * info.kv_bytes_per_token
    return verify + draft


def _predict(model, result: Result) -> None:
    """The cost model's speedup over plain decoding on the same engine (own AR) for this run,
    with the acceptance the run measured: next to the measurement, the gap shows what the model
    misses. Uses the device model ``generate`` plans with (:func:`hf_magicdec.plan`: the config's
    ``hardware``, else the cached calibration of this model on this device, else a preset), over a
    search space of the run's one (view, budget, γ); a run of the default plan is priced by the
    schedule adaptive γ ran, over its γ range, as ``generate`` priced the call."""
    s = result.m.speculation
    if s is None or not s.steps or s.draft == "full":
        return
    gamma = max(1, round(s.mean_gamma))
    # The view with the run's options: a query-aware view's selection cost depends on them.
    # (an "auto" view: the planner's choice with default options, as the planner priced it)
    explicit = result.config.view if result.config is not None else None
    view = explicit if explicit is not None and getattr(explicit, "name", s.draft) == s.draft else get_view(s.draft)
    hardware = hf_magicdec.device_model(model, result.config.hardware if result.config is not None else None)
    # A run whose γ followed the context (the default plan) is priced by that schedule, as generate
    # priced it, over its γ range; a fixed γ at the run's mean γ.
    scheduled = result.config is not None and result.config.adaptive and result.config.planner_may_decline
    gammas = tuple(range(1, result.config.max_gamma + 1)) if scheduled else (gamma,)
    space = SearchSpace(drafts=[view], budgets=(s.draft_budget,), gammas=gammas, draft_weights=(s.draft_weights,),
                        schedule=scheduled)
    p = search_plan(model, Workload(result.batch, result.context, result.new_tokens), hardware, space,
                    acceptance=min(s.acceptance_rate, 0.999))
    if p.draft is None:
        raise ValueError(p.reason)
    result.predicted_speedup = p.predicted_speedup
    result.extra["prediction"] = {"hardware": p.hardware, "gamma": p.gamma, "acceptance": s.acceptance_rate,
                                  "T_T_s": p.t_target, "T_D_s": p.t_draft, "T_V_s": p.t_verify}


def resolve_device(name: str) -> torch.device:
    """``"auto"``: the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_model(name: str, dtype: str, device: torch.device):
    """``(model, tokenizer)`` of ``name`` (offline name, directory or Hub id) on ``device``, in eval mode."""
    model, tokenizer = models.load(name, dtype=DTYPES[dtype], device_map=None if device.type == "cpu" else str(device))
    return model.eval(), tokenizer


def run(spec: BenchSpec, progress: bool = True, on_result: Callable[[Result], None] | None = None,
        env: dict | None = None):
    """Run the grid. Returns ``(results, environment, model_info)``.

    ``on_result`` is called after every finished row (e.g. to append it to a JSONL file at once,
    so an interrupted run keeps what it measured). ``env``: the environment already collected by
    the caller (default: collected here).
    """
    if spec.rounds is not None:
        from .rounds import run_rounds  # the rounds protocol builds on this module

        return run_rounds(spec, progress=progress, on_result=on_result, env=env)
    device = resolve_device(spec.device)
    log.warning("loading %s (%s) on %s …", spec.model, spec.dtype, device)
    model, tokenizer = load_model(spec.model, spec.dtype, device)
    assistant = load_model(spec.assistant, spec.dtype, device)[0] if spec.assistant else None
    small = load_model(spec.draft_model, spec.dtype, device)[0] if spec.draft_model else None
    info = ModelInfo.of(model)
    env = env if env is not None else environment(device)
    extra = {} if spec.stop_at_eos else {"eos_token_id": None}
    if spec.prefill_chunk is not None:
        extra["prefill_chunk_size"] = spec.prefill_chunk
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def generate(ids, new_tokens, clock=None, **kwargs):
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=None, do_sample=False, streamer=clock, pad_token_id=pad_id,
                              **extra, **kwargs)

    points = [(b, c) for c in spec.contexts for b in spec.batches]
    configs = {c: spec.configs(c) for c in spec.contexts}
    if spec.share_prefill:
        # One target prefill per point serves every run when the first one records the largest
        # observation window (SnapKV's); own AR then runs last.
        for c in configs:
            configs[c].sort(key=lambda cfg: -cfg.view.observation_window() if cfg.draft != AUTO else 0)
    small_configs = {c: spec.draft_model_configs(c) for c in spec.contexts}
    batch1 = int(assistant is not None) + int(spec.prompt_lookup is not None)
    per_point = 1 + int(spec.own_ar) + int(spec.static_baseline) + (batch1 + 1 if batch1 else 0)
    n_runs = sum(per_point + len(configs[c]) + len(small_configs[c]) for _, c in points)
    outer = tqdm(total=n_runs, desc="bench", unit="run", disable=not progress)
    results: list[Result] = []
    warmed: set[tuple] = set()
    held: list[Result] | None = None  # rows waiting for own AR (shared prefill: it runs last)

    def token_bar(label, total):
        if not progress:
            return None
        return lambda: tqdm(total=total, desc=f"  {label}", unit="tok", leave=False)

    def one(method, label, ids, run_fn, config=None, baseline=None, estimate=True):
        outer.set_postfix_str(f"B={ids.shape[0]} S={ids.shape[1]} {label}")
        key = (method, label, ids.shape[0])
        if spec.warmup and key not in warmed:  # discarded: first-call allocations and thread pools
            warm = ids[:, -min(64, ids.shape[1]):].clone()
            warm[:, 0] = ids[:, 0]
            with quiet_warm_up():
                run_fn(None, warm, 4)
            warmed.add(key)
        m = measure(lambda clock: run_fn(clock, ids, spec.new_tokens), spec.repeats, device,
                    token_bar(label, spec.new_tokens))
        res = Result(method, label, ids.shape[0], ids.shape[1], spec.new_tokens, m, config)
        if spec.share_prefill and method in ("own-ar", "magicdec"):
            res.extra["prefill_shared"] = True  # its prefill_s timed a copy of the shared cache
        if baseline is not None:
            res.identical = bool(torch.equal(m.sequences, baseline))
            if not res.identical:
                log.error("%s output differs from stock generate at B=%d S=%d", label, res.batch, res.context)
        if method not in BATCH1_METHODS and estimate:  # a separate draft model's reads are not in this estimate
            res.bytes_read = _bytes_read(info, res)
        if method == "magicdec" and estimate:
            try:
                _predict(model, res)
            except Exception as exc:  # a prediction must never cost a measurement
                log.info("no cost-model prediction for %s: %s", label, exc)
        # Baselines of the same point ran first: speedups are known now, so the row can be
        # written at once and an interrupted run keeps everything it measured.
        same = [r for r in results if (r.batch, r.context) == (res.batch, res.context)]
        stock = next((r for r in same if r.method == ("stock-b1" if method in BATCH1_METHODS else "stock")), None)
        ar = next((r for r in same if r.method == "own-ar"), None)
        static = next((r for r in same if r.method == "stock-static"), None)
        if method == "stock-static":
            res.speedup_vs_static = 1.0
        elif static is not None and method not in ("stock", "stock-b1", *BATCH1_METHODS):
            res.speedup_vs_static = static.m.decode_s / res.m.decode_s
        if method in ("stock", "stock-b1"):
            res.speedup_vs_stock = 1.0
        elif stock is not None:
            res.speedup_vs_stock = stock.m.decode_s / res.m.decode_s
        if ar is not None and method not in BATCH1_METHODS:
            res.speedup_vs_ar = ar.m.decode_s / res.m.decode_s
        elif method == "own-ar":
            res.speedup_vs_ar = 1.0
            for r in same:  # with a shared prefill own AR runs last: fill in the rows held back
                if r.method == "magicdec":
                    r.speedup_vs_ar = res.m.decode_s / r.m.decode_s
        results.append(res)
        if held is not None and method != "own-ar":
            held.append(res)  # written once own AR has run
        elif on_result is not None:
            for r in (held or []) + [res]:
                on_result(r)
            if held:
                held.clear()
        outer.update(1)
        return res

    with torch.inference_mode():
        for batch, context in points:
            ids = data.prompt_batch(tokenizer, batch, context, source=spec.text).to(device)
            stock = one("stock", "stock generate", ids, lambda clock, x, n: generate(x, n, clock))
            base = stock.m.sequences
            if spec.static_baseline:
                one("stock-static", "stock generate, static cache", ids,
                    lambda clock, x, n: generate(x, n, clock, cache_implementation="static"), None, base)
            own_ar = MagicDecConfig.from_any(draft=OWN_AR_DRAFT, draft_budget=OWN_AR_BUDGET, gamma=0)

            def run_own_ar():
                one("own-ar", "own AR (gamma=0)", ids,
                    lambda clock, x, n, c=own_ar: generate(x, n, clock, speculative=c, return_dict_in_generate=True),
                    own_ar, base)

            held = [] if spec.share_prefill and spec.own_ar else None
            with shared_prefill() if spec.share_prefill else contextlib.nullcontext():
                if spec.own_ar and not spec.share_prefill:
                    run_own_ar()
                for cfg in configs[context]:
                    one("magicdec", magicdec_label(cfg), ids,
                        lambda clock, x, n, c=cfg: generate(x, n, clock, speculative=c, return_dict_in_generate=True),
                        cfg, base)
                for cfg in small_configs[context]:
                    one("magicdec", draft_model_label(spec, cfg), ids,
                        lambda clock, x, n, c=cfg: generate(x, n, clock, speculative=c, draft_model=small,
                                                            return_dict_in_generate=True),
                        cfg, base, estimate=False)
                if spec.own_ar and spec.share_prefill:
                    run_own_ar()
            held = None
            if batch1:
                ids1 = ids[:1]
                s1 = one("stock-b1", "stock generate (batch 1)", ids1, lambda clock, x, n: generate(x, n, clock))
            if assistant is not None:
                one("assisted", f"HF assisted ({spec.assistant})", ids1,
                    lambda clock, x, n: generate(x, n, clock, assistant_model=assistant), None, s1.m.sequences)
            if spec.prompt_lookup is not None:
                one("prompt-lookup", f"HF prompt lookup ({spec.prompt_lookup})", ids1,
                    lambda clock, x, n: generate(x, n, clock, prompt_lookup_num_tokens=spec.prompt_lookup), None,
                    s1.m.sequences)
    outer.close()
    return results, env, info

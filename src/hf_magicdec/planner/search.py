"""The search: the draft view, budget K and γ with the best predicted speedup, or plain decoding.

Candidates are every (view, budget, γ, weights) the view accepts (``view.fits(budget, gamma)``) with
``budget < prompt_len`` (``< prompt_len + new_tokens`` with ``schedule=True``), priced at the mean
context ``prompt_len + new_tokens / 2`` on the roofline of ``hardware`` (or of ``calibration``).
Torch-free: views are read duck-typed (``name``, ``fits``, ``query_aware``, ``page_size``, fields).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple, Protocol

from ..checks import check_int
from .acceptance import WEIGHTS_SEPARATOR, AcceptanceLike, resolve_acceptance
from .hardware import HardwareSpec, get_hardware
from .modelspec import ModelSpec
from .roofline import target_step
from .schedule import PLAIN_PROBE_STEPS, SWITCH_MARGIN, StepModel, context_points, scheduled_speedup
from .speculation import Estimate, estimate

__all__ = ["Plan", "search_plan", "Workload", "SearchSpace", "Candidate", "DraftLike", "DEFAULT_BUDGETS",
           "DEFAULT_DRAFTS", "DEFAULT_DRAFT_MODEL_DRAFTS", "DEFAULT_GAMMAS"]

#: View names the callers resolve (``hf_magicdec.plan``, ``generate`` with ``draft="auto"``).
DEFAULT_DRAFTS = ("streamingllm", "snapkv", "attended")
#: Views considered for a separate draft model's cache (``"full"`` keeps all of it).
DEFAULT_DRAFT_MODEL_DRAFTS = ("full", "streamingllm", "snapkv")
DEFAULT_BUDGETS = (128, 256, 512, 1024, 2048)
DEFAULT_GAMMAS = tuple(range(1, 9))
_RUNNER_UPS = 5
#: Scheduled candidates within this fraction of the best speedup are a tie
#: (docs/cost_model.md, "Where the constants come from") ...
NEAR_TIE = 0.02
#: ... broken by the speedup each would reach at this much more acceptance than its prior.
UPSIDE = 0.10


class DraftLike(Protocol):
    """What the planner reads of a draft view (:class:`hf_magicdec.views.DraftView`)."""

    name: str
    query_aware: bool

    def fits(self, budget: int, gamma: int) -> bool: ...


def _views(what: str, values: Iterable[Any] | None) -> tuple[Any, ...]:
    values = () if values is None else tuple(values)
    for v in values:
        if isinstance(v, str) or not callable(getattr(v, "fits", None)) \
                or not isinstance(getattr(v, "name", None), str):
            raise TypeError(f"{what} must be draft view objects (hf_magicdec.views.get_view(name, **options)), got "
                            f"{v!r}; hf_magicdec.plan takes names.")
    return values


def _options(view: Any) -> dict[str, Any]:
    """The dataclass fields of ``view`` that differ from their defaults (its explicit options)."""
    if not dataclasses.is_dataclass(view):
        return {}
    out = {}
    for f in dataclasses.fields(view):
        value = getattr(view, f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if f.init and value != default:
            out[f.name] = value
    return out


@dataclass(frozen=True)
class Plan:
    """The planner's decision for one workload: ``speculate`` (in the plan of a call, whether it
    speculates) and the best candidate (``draft``, ``draft_budget``, ``gamma``, ``draft_weights``,
    ``draft_options`` away from the view's defaults, ``draft_model`` or None; None where there is no
    candidate) with its figures: ``predicted_speedup`` (1.0 without one), ``acceptance`` α,
    ``tokens_per_step`` Ω, ``t_target``, ``t_draft`` (mean over the γ steps), ``t_verify`` seconds.
    ``runner_ups``: the best γ of each other (draft, budget), best first, at most 5; ``context``: the
    mean context priced; ``reason``: one line. ``gamma_by_context``: priced by the schedule
    (``SearchSpace.schedule``), ``(context, γ)`` at each point of the generation at the prior α.
    ``setup_seconds``: the one-time build of each quantized draft-weights format priced into its
    candidates (``search_plan(..., setup_seconds=)``); ``predicted_decode_speedup``: the best
    candidate's speedup over the decode steps alone, without that build (what a benchmark of decode
    time measures; equal to ``predicted_speedup`` where nothing is built); ``unpriced_builds``: the
    quantized formats searched whose build the hardware has no rate for (``HardwareSpec.format_build``).
    """

    speculate: bool
    draft: str | None
    draft_budget: int | None
    gamma: int | None
    predicted_speedup: float
    acceptance: float | None
    tokens_per_step: float | None
    t_target: float
    t_draft: float | None
    t_verify: float | None
    runner_ups: tuple[Estimate, ...]
    batch_size: int
    prompt_len: int
    new_tokens: int
    context: float
    model: str
    hardware: str
    reason: str
    draft_model: str | None = None
    draft_options: dict[str, Any] = field(default_factory=dict)
    draft_weights: str = "full"
    gamma_by_context: tuple[tuple[int, int], ...] = ()
    setup_seconds: dict[str, float] = field(default_factory=dict)
    unpriced_builds: tuple[str, ...] = ()
    predicted_decode_speedup: float = 1.0

    def config_kwargs(self) -> dict[str, Any]:
        """``MagicDecConfig`` keyword arguments of the best candidate (ValueError if there is none)."""
        if self.draft is None:
            raise ValueError(f"No speculative candidate for this workload: {self.reason}")
        return {"draft": self.draft, "draft_budget": self.draft_budget, "gamma": self.gamma,
                "draft_weights": self.draft_weights, **self.draft_options}

    def summary(self) -> str:
        """Human-readable multi-line description."""
        lines = [f"model {self.model} on {self.hardware}: batch {self.batch_size}, prompt {self.prompt_len}, "
                 f"{self.new_tokens} new tokens (mean context {self.context:g})"]
        if "(calibrated)" not in self.hardware:
            lines.append(f"note: step times from the {self.hardware} preset, placeholder rates not measured on this "
                         "device; `hf-magicdec plan --model <model> --calibrate` measures them")
        if self.draft is None:
            lines.append(f"plain decoding: {self.reason}")
            return "\n".join(lines)
        if self.setup_seconds:
            builds = ", ".join(f"{fmt} {sec:.1f} s" for fmt, sec in sorted(self.setup_seconds.items()))
            lines.append(f"one-time: building the quantized draft weights ({builds}) is priced into their candidates; "
                         "a model that has them pays nothing")
        elif self.speculate and self.draft_weights in self.unpriced_builds and "(calibrated)" not in self.hardware:
            lines.append(f"one-time: a model without {self.draft_weights} draft weights builds them in its first "
                         "speculating call, which this preset does not price (a calibration measures it)")
        verdict = "speculate" if self.speculate else "plain decoding"
        lines.append(f"{verdict}: {self.reason}")
        drafter = f" on draft model {self.draft_model}" if self.draft_model else ""
        drafter += f" with {self.draft_weights} weights" if self.draft_weights != "full" else ""
        if self.acceptance is None:  # chosen without an estimate (the view holds the whole prompt)
            lines.append(f"runs: draft={self.draft}{drafter} budget={self.draft_budget} gamma={self.gamma}")
            return "\n".join(lines)
        lines.append(f"best: draft={self.draft}{drafter} budget={self.draft_budget} gamma={self.gamma}  "
                     f"alpha={self.acceptance:.3f}  tokens/step={self.tokens_per_step:.2f}  "
                     f"predicted speedup {self.predicted_speedup:.2f}x")
        if self.speculate and self.setup_seconds.get(self.draft_weights):
            lines.append(f"  {self.predicted_decode_speedup:.2f}x over the decode steps alone; the one-time build of "
                         f"the {self.draft_weights} draft weights takes the rest")
        lines.append(f"steps: T_T={self.t_target * 1e3:.3f} ms  T_D={self.t_draft * 1e3:.3f} ms "
                     f"(T_D/T_T={self.t_draft / self.t_target:.3f})  T_V={self.t_verify * 1e3:.3f} ms "
                     f"(T_V/T_T={self.t_verify / self.t_target:.3f})")
        if self.gamma_by_context and self.speculate:
            expected = ", ".join(f"{c}: {g}" for c, g in self.gamma_by_context)
            lines.append(f"run: under greedy decoding the first {PLAIN_PROBE_STEPS} steps are plain, timing the cost "
                         "model; then γ is re-chosen every step from the acceptance observed (probed early) and the "
                         "context reached, 0 where speculating does not pay")
            lines.append(f"  γ the model expects by context, at the prior acceptance: {expected}")
        if self.runner_ups:
            lines.append("runner-ups:")
            for e in self.runner_ups:
                name = e.draft if e.draft_model is None else f"{e.draft} ({e.draft_model})"
                name += f"@{e.draft_weights}" if e.draft_weights != "full" else ""
                lines.append(f"  {name:<13} budget {e.draft_budget:<5} gamma {e.gamma}  alpha {e.acceptance:.3f}  "
                             f"speedup {e.speedup:.2f}x")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        out = dataclasses.asdict(self)
        out["runner_ups"] = [dataclasses.asdict(e) for e in self.runner_ups]
        return out


def _model_spec(model_or_config: Any, dtype: Any) -> ModelSpec:
    if isinstance(model_or_config, ModelSpec):
        return model_or_config if dtype is None else model_or_config.with_dtype(dtype)
    config = getattr(model_or_config, "config", model_or_config)  # a model or a config object/dict
    if dtype is None and hasattr(model_or_config, "config"):
        # A loaded model's parameters may have been cast after its config was written.
        dtype = getattr(model_or_config, "dtype", None)
    return ModelSpec.from_config(config, dtype=dtype)


@dataclass(frozen=True)
class Workload:
    """``batch_size`` rows of ``prompt_len`` prompt tokens, ``new_tokens`` generated per row;
    :attr:`context` is the mean context over the generation, where candidates are priced."""

    batch_size: int
    prompt_len: int
    new_tokens: int

    def __post_init__(self) -> None:
        check_int("batch_size", self.batch_size)
        check_int("prompt_len", self.prompt_len)
        check_int("new_tokens", self.new_tokens, 0)

    @property
    def context(self) -> float:
        return self.prompt_len + self.new_tokens / 2


@dataclass(frozen=True)
class SearchSpace:
    """What :func:`search_plan` considers, checked and held as tuples: ``drafts`` (view objects,
    required for self-speculation), ``budgets`` K, ``gammas``, ``draft_weights`` (``"full"``, ``"int8"``,
    ``"fp16"``, ``"int4"``, each with its own α ``"<view>@<format>"``); a separate ``draft_model`` (model,
    config or ModelSpec) with ``draft_model_drafts`` on its own cache, competing with self-speculation
    where ``self_speculation``. ``schedule``: price self-speculation as adaptive γ runs it, γ per
    context (0 where it does not pay); the plan's ``gamma`` is then the best γ at the mean context.
    """

    drafts: Iterable[DraftLike] | None = None
    budgets: Iterable[int] = DEFAULT_BUDGETS
    gammas: Iterable[int] = DEFAULT_GAMMAS
    draft_weights: Iterable[str] = ("full",)
    draft_model: Any = None
    draft_model_drafts: Iterable[DraftLike] | None = None
    self_speculation: bool = True
    schedule: bool = False

    def __post_init__(self) -> None:
        if self.drafts is None and self.self_speculation:
            raise ValueError("drafts: pass the draft views to consider (view objects, e.g. "
                             "hf_magicdec.views.get_view('snapkv')); hf_magicdec.plan takes names.")
        if self.draft_model_drafts is None and self.draft_model is not None:
            raise ValueError("draft_model_drafts: pass the draft views to consider for the draft model's cache.")
        tuples = dict(drafts=_views("drafts", self.drafts),
                      draft_model_drafts=_views("draft_model_drafts", self.draft_model_drafts),
                      budgets=tuple(self.budgets), gammas=tuple(self.gammas), draft_weights=tuple(self.draft_weights))
        for name, value in tuples.items():
            object.__setattr__(self, name, value)
        for name, values in (("drafts", self.drafts if self.self_speculation else (None,)), ("budgets", self.budgets),
                             ("gammas", self.gammas), ("draft_weights", self.draft_weights)):
            if not values:
                raise ValueError(f"{name} must not be empty.")
        for b in self.budgets:
            check_int("budget", b)
        for g in self.gammas:
            check_int("gamma", g)


class Candidate(NamedTuple):
    """One priced candidate: its estimate (whose speedup includes any one-time setup), the view
    object it runs (the plan's options), priced by the schedule ``(context, γ)`` at each point of the
    generation, and the speedup of its decode steps without the setup (None: no setup priced)."""

    estimate: Estimate
    view: Any
    schedule: tuple[tuple[int, int], ...] = ()
    decode_speedup: float | None = None


def search_plan(model_or_config: Any, workload: Workload, hardware: str | HardwareSpec = "h100",
                space: SearchSpace | None = None, *, acceptance: AcceptanceLike = None, calibration: Any = None,
                min_speedup: float = 1.0, dtype: Any = None, tp: int = 1,
                setup_seconds: Mapping[str, float] | None = None) -> Plan:
    """Choose draft view, budget and γ for ``workload``, or plain decoding; returns a :class:`Plan`.

    ``model_or_config``: a model, config (object or dict) or :class:`ModelSpec` (shapes and dtype only;
    ``dtype`` overrides). ``hardware``: a preset name or :class:`HardwareSpec`, ``tp`` of them in tensor
    parallel, its rates replaced by a ``calibration``. ``acceptance``: α per candidate
    (:func:`~.acceptance.resolve_acceptance`; None: the prior). Speculate where the best predicted
    speedup reaches ``min_speedup``. ``setup_seconds``: one-time seconds per draft-weights format
    (building a quantized draft), spread over the new tokens. ValueError for bad sizes, an empty
    space, unknown hardware or dtype; TypeError for drafts given by name.
    """
    space = SearchSpace() if space is None else space  # raises: the drafts are required
    spec = _model_spec(model_or_config, dtype)
    hw = get_hardware(hardware, tp)
    if calibration is not None:
        hw = calibration.hardware(hw)
    s = int(round(workload.context))  # step functions take whole tokens
    tt = target_step(spec, hw, workload.batch_size, s).seconds
    setup = {fmt: sec for fmt, sec in (setup_seconds or {}).items() if sec}  # per weights format; none: 0
    common = dict(batch_size=workload.batch_size, prompt_len=workload.prompt_len, new_tokens=workload.new_tokens,
                  context=workload.context, model=spec.name, hardware=hw.name + (f" x{hw.tp}" if hw.tp > 1 else ""),
                  t_target=tt, setup_seconds=setup,
                  unpriced_builds=tuple(w for w in space.draft_weights if w != "full" and w not in hw.format_build))
    price = dict(batch=workload.batch_size, context=s, acceptance=acceptance, t_target=tt,
                 prompt_len=workload.prompt_len)
    # A budget must compress something: below the prompt, or, when γ follows the context, below
    # where the generation ends (the view holds everything until the context outgrows it).
    limit = workload.prompt_len + workload.new_tokens if space.schedule else workload.prompt_len
    candidates = [Candidate(estimate(spec, hw, draft=d, budget=k, gamma=g, draft_weights=w, **price), d)
                  for d in space.drafts if space.self_speculation and d.name != "full"
                  for k in space.budgets if k < limit for g in space.gammas if d.fits(k, g)
                  for w in space.draft_weights]
    upside: dict[tuple, float] = {}
    if space.schedule:
        candidates, upside = _scheduled(candidates, spec, hw, workload, acceptance, setup)
    elif setup:
        candidates = [_with_setup(c, setup.get(c.estimate.draft_weights, 0.0), workload.new_tokens) for c in candidates]
    if space.draft_model is not None:
        candidates += _draft_model_candidates(spec, hw, _model_spec(space.draft_model, dtype), space,
                                              workload.prompt_len, price)
    if candidates:
        return _decide(candidates, min_speedup, common, upside)
    reason = (f"no candidate: every budget in {space.budgets} is >= "
              f"{'prompt + new tokens' if space.schedule else 'prompt_len'}={limit} "
              "(nothing to compress) or invalid for the given gammas")
    return Plan(speculate=False, draft=None, draft_budget=None, gamma=None, predicted_speedup=1.0, acceptance=None,
                tokens_per_step=None, t_draft=None, t_verify=None, runner_ups=(), reason=reason,
                predicted_decode_speedup=1.0, **common)


def _draft_model_candidates(spec: ModelSpec, hw: HardwareSpec, dspec: ModelSpec, space: SearchSpace,
                            prompt_len: int, price: dict) -> list[Candidate]:
    """Each view on the draft model's cache at every budget below the prompt (``full``: the context)."""
    out = []
    for d in space.draft_model_drafts:
        view_budgets = (price["context"],) if d.name == "full" else tuple(k for k in space.budgets if k < prompt_len)
        out += [Candidate(estimate(spec, hw, draft=d, budget=k, gamma=g, draft_model=dspec, **price), d)
                for k in view_budgets for g in space.gammas if d.name == "full" or d.fits(k, g)]
    return out


def _with_setup(c: Candidate, seconds: float, new_tokens: int) -> Candidate:
    """``c`` with ``seconds`` of one-time work spread over ``new_tokens`` plain steps' worth of decoding."""
    if not seconds:
        return c
    e = c.estimate
    plain = new_tokens * e.t_target
    return c._replace(estimate=dataclasses.replace(e, speedup=plain / (plain / e.speedup + seconds)),
                      decode_speedup=e.speedup)


def _scheduled(candidates: list[Candidate], spec: ModelSpec, hw: HardwareSpec, workload: Workload,
               acceptance: AcceptanceLike, setup: dict[str, float]) -> tuple[list[Candidate], dict[tuple, float]]:
    """Per (view, budget, weights): the best γ's estimate with the schedule's speedup over the
    generation, and (the tie-break) the schedule's speedup at :data:`UPSIDE` more acceptance."""
    groups: dict[tuple, list[Candidate]] = {}
    for c in candidates:
        groups.setdefault((c.estimate.draft, c.estimate.draft_budget, c.estimate.draft_weights), []).append(c)
    prompt_len, batch = workload.prompt_len, workload.batch_size
    points = context_points(prompt_len, workload.new_tokens)
    out, upside = [], {}
    for (name, budget, weights), group in groups.items():
        est, view = max(group, key=lambda c: c.estimate.speedup)[:2]
        drafter = spec if weights == "full" else spec.with_weights(weights)
        model = StepModel(spec, hw, drafter, budget, view, tuple(c.estimate.gamma for c in group))
        alpha_name = name if weights == "full" else f"{name}{WEIGHTS_SEPARATOR}{weights}"

        def alpha(context, more=0.0):
            return min(resolve_acceptance(acceptance, alpha_name, budget, context, prompt_len) + more, 0.99)

        call = dict(new_tokens=workload.new_tokens, setup_seconds=setup.get(weights, 0.0))
        speedup, gammas = scheduled_speedup(model, batch, points, alpha, True, **call)
        decode = None
        if call["setup_seconds"] and any(gammas):  # the same schedule without the build (memoised steps)
            decode = scheduled_speedup(model, batch, points, alpha, True, new_tokens=workload.new_tokens)[0]
        upside[(name, budget, weights)] = scheduled_speedup(model, batch, points, lambda c: alpha(c, UPSIDE), True,
                                                            **call)[0]
        # Never on: plain decoding on MagicDec's cache, not worth a speculative call (the estimate,
        # below where the schedule would switch on).
        out.append(Candidate(dataclasses.replace(est, speedup=speedup) if any(gammas)
                             else dataclasses.replace(est, speedup=min(est.speedup, 1.0 - SWITCH_MARGIN)), view,
                             tuple(zip(points, gammas)), decode))
    return out, upside


def _decide(candidates: list[Candidate], min_speedup: float, common: dict, upside: dict[tuple, float]) -> Plan:
    """The best candidate's plan, the best γ of each other (draft, budget) as runner-ups; scheduled
    candidates within :data:`NEAR_TIE` of the best are ranked by their ``upside``."""
    candidates.sort(key=lambda c: c.estimate.speedup, reverse=True)
    top = candidates[0].estimate.speedup

    def tied_upside(c: Candidate) -> float:
        e = c.estimate
        key = (e.draft, e.draft_budget, e.draft_weights)
        return upside[key] if e.draft_model is None and key in upside and e.speedup >= top * (1 - NEAR_TIE) else 0.0

    if upside:
        candidates.sort(key=tied_upside, reverse=True)  # stable: the rest keep their order
    best, runner_ups = candidates[0].estimate, {}
    decode = candidates[0].decode_speedup
    for e in (c.estimate for c in candidates[1:]):
        runner_ups.setdefault((e.draft, e.draft_budget, e.draft_model, e.draft_weights), e)
    runner_ups.pop((best.draft, best.draft_budget, best.draft_model, best.draft_weights), None)
    speculate = best.speedup >= min_speedup
    if speculate:
        reason = f"predicted {best.speedup:.2f}x >= {min_speedup:g}x"
    else:
        reason = (f"best predicted speedup {best.speedup:.2f}x < {min_speedup:g}x: verification or drafting "
                  "costs more than the accepted tokens save at this batch and context")
    return Plan(speculate=speculate, draft=best.draft, draft_budget=best.draft_budget, gamma=best.gamma,
                predicted_speedup=best.speedup, acceptance=best.acceptance, tokens_per_step=best.omega,
                t_draft=best.t_draft, t_verify=best.t_verify, runner_ups=tuple(runner_ups.values())[:_RUNNER_UPS],
                reason=reason, draft_model=best.draft_model, draft_options=_options(candidates[0].view),
                draft_weights=best.draft_weights, gamma_by_context=candidates[0].schedule,
                predicted_decode_speedup=best.speedup if decode is None else decode, **common)

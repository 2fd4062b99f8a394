"""The planner: pick the draft view, budget K and γ with the best predicted speedup, or decide
that plain decoding is faster.

Search: every (draft, budget, γ) with ``budget < prompt_len`` (a larger view holds the whole
prompt: nothing is compressed; with ``schedule=True``, where γ follows the context, ``budget <
prompt_len + new_tokens``: the view holds everything until the generation outgrows it) that the
view accepts (``view.fits(budget, gamma)``, the same check as :class:`~hf_magicdec.MagicDecConfig`),
evaluated at the mean context over the generation, ``prompt_len + new_tokens / 2``. Step times
come from the roofline on ``hardware`` (or on the calibrated device when ``calibration`` is given).

The planner stays torch-free: it never imports the views. Its callers hand it view objects
(``hf_magicdec.views.get_view(name, **options)``; :func:`hf_magicdec.plan` takes names), read
duck-typed: ``name``, ``fits(budget, gamma)``, ``query_aware`` and ``page_size`` (selection cost,
:mod:`.selection`), and their dataclass fields (the options :meth:`Plan.to_config` carries).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple, Protocol

from ._checks import check_int
from .acceptance import WEIGHTS_SEPARATOR, AcceptanceLike, resolve_acceptance
from .hardware import HardwareSpec, get_hardware
from .modelspec import ModelSpec
from .roofline import target_step
from .schedule import SWITCH_MARGIN, StepModel, context_points, scheduled_speedup
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


def _views(what: str, values: Iterable[Any]) -> tuple[Any, ...]:
    values = tuple(values)
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
    """The planner's decision for one workload.

    Attributes
    ----------
    speculate : bool
        False when no candidate beats plain decoding (predicted speedup below
        ``min_speedup``): use plain ``generate``. In the plan of a call
        (:func:`hf_magicdec.plan`, ``out.speculation.plan``): whether the call speculates.
    draft, draft_budget, gamma :
        Best candidate (``None`` when there was no candidate at all, e.g. a prompt shorter than
        every budget).
    predicted_speedup : float
        Of the best candidate (1.0 when there is none).
    acceptance : float or None
        α assumed for the best candidate.
    tokens_per_step : float or None
        Ω(γ, α) of the best candidate.
    t_target, t_draft, t_verify : float or None
        Step times used, seconds: T_T, mean T_D over the γ draft steps, T_V.
    runner_ups : tuple[Estimate, ...]
        The best γ of each other (draft, budget), best first (at most 5).
    batch_size, prompt_len, new_tokens, context :
        The workload; ``context`` is the mean context used, tokens.
    draft_model : str or None
        Name of the separate draft model the best candidate drafts with (None: self-speculation).
    draft_options : dict
        The best candidate's view options away from their defaults (``{"window": 16}``).
    draft_weights : str
        The best candidate's draft weights: ``"full"``, ``"int8"``, ``"fp16"`` or ``"int4"``.
    model, hardware : str
        Names of the model spec and the device (``"... (calibrated)"`` when calibrated, ``" xN"`` with
        N-way tensor parallelism).
    reason : str
        One line explaining the decision.
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

    def config_kwargs(self) -> dict[str, Any]:
        """``MagicDecConfig`` keyword arguments of the best candidate.

        Raises
        ------
        ValueError
            If there is no candidate at all.
        """
        if self.draft is None:
            raise ValueError(f"No speculative candidate for this workload: {self.reason}")
        return {"draft": self.draft, "draft_budget": self.draft_budget, "gamma": self.gamma,
                "draft_weights": self.draft_weights, **self.draft_options}

    def summary(self) -> str:
        """Human-readable multi-line description."""
        lines = [f"model {self.model} on {self.hardware}: batch {self.batch_size}, prompt {self.prompt_len}, "
                 f"{self.new_tokens} new tokens (mean context {self.context:g})"]
        if self.draft is None:
            lines.append(f"plain decoding: {self.reason}")
            return "\n".join(lines)
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
        lines.append(f"steps: T_T={self.t_target * 1e3:.3f} ms  T_D={self.t_draft * 1e3:.3f} ms "
                     f"(T_D/T_T={self.t_draft / self.t_target:.3f})  T_V={self.t_verify * 1e3:.3f} ms "
                     f"(T_V/T_T={self.t_verify / self.t_target:.3f})")
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
    # A model (has .config) or a config object/dict.
    config = getattr(model_or_config, "config", model_or_config)
    if dtype is None:
        # A loaded model's parameters may have been cast after its config was written.
        param_dtype = getattr(model_or_config, "dtype", None) if hasattr(model_or_config, "config") else None
        dtype = param_dtype
    return ModelSpec.from_config(config, dtype=dtype)


@dataclass(frozen=True)
class Workload:
    """One generation's shape: ``batch_size`` rows of ``prompt_len`` prompt tokens, ``new_tokens``
    generated per row. :attr:`context` is the mean context over the generation, where the search
    evaluates its candidates."""

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
    """What :func:`search_plan` considers, checked and held as tuples.

    Attributes
    ----------
    drafts : iterable of draft views
        The views to consider (objects, e.g. ``[get_view("snapkv", window=16)]`` from
        :mod:`hf_magicdec.views`; :func:`hf_magicdec.plan` takes names). Required for
        self-speculation.
    budgets, gammas : iterable of int
        Draft budgets K and γ values.
    draft_weights : iterable of str
        Weights the self-draft may read: ``"full"`` and/or quantized formats (``"int8"``,
        ``"fp16"``, ``"int4"``), each priced by its weight bytes (and the device's rate for the
        format) with its own α (``"<view>@<format>"``).
    draft_model : PreTrainedModel, config, dict or ModelSpec, optional
        A separate small draft model: its candidates (each view in ``draft_model_drafts``
        compressing *its* cache; ``"full"`` keeps all of it) compete with self-speculation.
    draft_model_drafts : iterable of draft views
        Views considered for the draft model's cache (required with ``draft_model``).
    self_speculation : bool
        Whether self-speculation candidates compete too.
    schedule : bool
        Price self-speculation candidates as adaptive γ runs them: γ chosen per step from the
        context the generation has reached, γ = 0 (plain decoding) where speculation does not pay
        (:mod:`.schedule`), the speedup integrated over the generation from ``prompt_len`` to
        ``prompt_len + new_tokens``; a plan's ``gamma`` is then the best γ at the mean context.
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
        tuples = dict(drafts=_views("drafts", () if self.drafts is None else self.drafts),
                      draft_model_drafts=_views("draft_model_drafts",
                                                () if self.draft_model_drafts is None else self.draft_model_drafts),
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
    """One priced candidate: its estimate and the view object it runs (the plan's options)."""

    estimate: Estimate
    view: Any


_WORKLOAD_FIELDS = frozenset(f.name for f in dataclasses.fields(Workload))
_SPACE_FIELDS = frozenset(f.name for f in dataclasses.fields(SearchSpace))


def _parts(workload: Workload | None, space: SearchSpace | None, fields: dict) -> tuple[Workload, SearchSpace]:
    """``workload`` and ``space``, or those built from their fields given as keywords."""
    unknown = sorted(set(fields) - _WORKLOAD_FIELDS - _SPACE_FIELDS)
    if unknown:
        raise TypeError(f"search_plan() got unexpected keyword arguments {unknown}.")
    for given, names, what in ((workload, _WORKLOAD_FIELDS, "workload"), (space, _SPACE_FIELDS, "space")):
        if given is not None and names & set(fields):
            raise TypeError(f"search_plan() takes {what}= or its fields {sorted(names & set(fields))}, not both.")
    workload = workload or Workload(**{k: v for k, v in fields.items() if k in _WORKLOAD_FIELDS})
    space = space or SearchSpace(**{k: v for k, v in fields.items() if k in _SPACE_FIELDS})
    return workload, space


def search_plan(model_or_config: Any, workload: Workload | None = None, hardware: str | HardwareSpec = "h100",
                space: SearchSpace | None = None, *, acceptance: AcceptanceLike = None, calibration: Any = None,
                min_speedup: float = 1.0, dtype: Any = None, tp: int = 1, **fields: Any) -> Plan:
    """Choose draft view, budget and γ for a workload, or plain decoding.

    Parameters
    ----------
    model_or_config : PreTrainedModel, PretrainedConfig, dict or ModelSpec
        What to model (only the shapes and dtype are read; no weights are touched).
    workload : Workload
        Rows, prompt tokens and new tokens per row.
    hardware : str or HardwareSpec
        Preset name (``"a100"``, ``"h100"``, ``"h200"``, ``"l40s"``, ``"cpu"``) or a spec.
    space : SearchSpace
        The views, budgets, γ values, draft weights and draft model to consider.
    acceptance : None, float, Mapping or callable
        α per candidate, see :func:`~hf_magicdec.planner.acceptance.resolve_acceptance`
        (``None``: :func:`~hf_magicdec.planner.acceptance.default_acceptance`).
    calibration : Calibration, optional
        Fitted device (:func:`hf_magicdec.calibration.calibrate`); replaces ``hardware``'s rates
        and overhead.
    min_speedup : float
        Speculate only when the best predicted speedup reaches this (1.0: any gain).
    dtype : str or torch.dtype, optional
        Overrides the config's dtype.
    tp : int
        Tensor-parallel degree.
    **fields :
        Instead of ``workload`` and ``space``: their fields as keywords (``batch_size=``,
        ``prompt_len=``, ``new_tokens=``, ``drafts=``, ``budgets=``, ``gammas=``, ...).

    Returns
    -------
    Plan

    Raises
    ------
    ValueError
        For non-positive sizes, an empty search space, unknown hardware or dtype.
    TypeError
        For drafts that are not view objects (names: use :func:`hf_magicdec.plan`).

    Examples
    --------
    >>> views = [get_view("streamingllm"), get_view("snapkv")]                                     # doctest: +SKIP
    >>> p = search_plan(llama_config, Workload(64, 32768, 256), "h100", SearchSpace(drafts=views))  # doctest: +SKIP
    >>> p.speculate, MagicDecConfig.from_any(p)                                                     # doctest: +SKIP
    """
    workload, space = _parts(workload, space, fields)
    spec = _model_spec(model_or_config, dtype)
    hw = get_hardware(hardware, tp)
    if calibration is not None:
        hw = calibration.hardware(hw)
    batch, prompt_len, new_tokens = workload.batch_size, workload.prompt_len, workload.new_tokens
    s = int(round(workload.context))  # step functions take whole tokens
    tt = target_step(spec, hw, batch, s).seconds
    common = dict(batch_size=batch, prompt_len=prompt_len, new_tokens=new_tokens, context=workload.context,
                  model=spec.name, hardware=hw.name + (f" x{hw.tp}" if hw.tp > 1 else ""), t_target=tt)
    price = dict(batch=batch, context=s, acceptance=acceptance, t_target=tt, prompt_len=prompt_len)
    # A budget must compress something: below the prompt, or, when γ follows the context, below
    # where the generation ends (the view holds everything until the context outgrows it).
    limit = prompt_len + new_tokens if space.schedule else prompt_len
    candidates = [Candidate(estimate(spec, hw, draft=d, budget=k, gamma=g, draft_weights=w, **price), d)
                  for d in space.drafts if space.self_speculation and d.name != "full"
                  for k in space.budgets if k < limit for g in space.gammas if d.fits(k, g)
                  for w in space.draft_weights]
    upside: dict[tuple, float] = {}
    if space.schedule:
        candidates, upside = _scheduled(candidates, spec, hw, workload, acceptance)
    if space.draft_model is not None:
        candidates += _draft_model_candidates(spec, hw, _model_spec(space.draft_model, dtype), space, prompt_len,
                                              price)
    if not candidates:
        reason = (f"no candidate: every budget in {space.budgets} is >= "
                  f"{'prompt + new tokens' if space.schedule else 'prompt_len'}={limit} "
                  "(nothing to compress) or invalid for the given gammas")
        return Plan(speculate=False, draft=None, draft_budget=None, gamma=None, predicted_speedup=1.0,
                    acceptance=None, tokens_per_step=None, t_draft=None, t_verify=None, runner_ups=(), reason=reason,
                    **common)
    return _decide(candidates, min_speedup, common, upside)


def _draft_model_candidates(spec: ModelSpec, hw: HardwareSpec, dspec: ModelSpec, space: SearchSpace,
                            prompt_len: int, price: dict) -> list[Candidate]:
    """Every draft-model candidate: each view compressing the draft model's cache at every budget
    below the prompt (``full`` keeps all of it: its "budget" is the context)."""
    out = []
    for d in space.draft_model_drafts:
        view_budgets = (price["context"],) if d.name == "full" else tuple(k for k in space.budgets if k < prompt_len)
        out += [Candidate(estimate(spec, hw, draft=d, budget=k, gamma=g, draft_model=dspec, **price), d)
                for k in view_budgets for g in space.gammas if d.name == "full" or d.fits(k, g)]
    return out


def _scheduled(candidates: list[Candidate], spec: ModelSpec, hw: HardwareSpec, workload: Workload,
               acceptance: AcceptanceLike) -> tuple[list[Candidate], dict[tuple, float]]:
    """Per (view, budget, weights), the best γ's estimate at the mean context, its speedup replaced
    by the schedule's over the whole generation (:func:`.schedule.scheduled_speedup`); and per
    (view, budget, weights) the schedule's speedup at :data:`UPSIDE` more acceptance (the tie-break)."""
    groups: dict[tuple, list[Candidate]] = {}
    for c in candidates:
        groups.setdefault((c.estimate.draft, c.estimate.draft_budget, c.estimate.draft_weights), []).append(c)
    prompt_len, batch = workload.prompt_len, workload.batch_size
    points = context_points(prompt_len, workload.new_tokens)
    out, upside = [], {}
    for (name, budget, weights), group in groups.items():
        est, view = max(group, key=lambda c: c.estimate.speedup)
        drafter = spec if weights == "full" else spec.with_weights(weights)
        model = StepModel(spec, hw, drafter, budget, view, tuple(c.estimate.gamma for c in group))
        alpha_name = name if weights == "full" else f"{name}{WEIGHTS_SEPARATOR}{weights}"

        def alpha(context, more=0.0):
            return min(resolve_acceptance(acceptance, alpha_name, budget, context, prompt_len) + more, 0.99)

        speedup, gammas = scheduled_speedup(model, batch, points, alpha, True)
        upside[(name, budget, weights)] = scheduled_speedup(model, batch, points, lambda c: alpha(c, UPSIDE), True)[0]
        # Never on: plain decoding on MagicDec's cache, not worth a speculative call (the estimate,
        # below where the schedule would switch on).
        out.append(Candidate(dataclasses.replace(est, speedup=speedup) if any(gammas)
                             else dataclasses.replace(est, speedup=min(est.speedup, 1.0 - SWITCH_MARGIN)), view))
    return out, upside


def _decide(candidates: list[Candidate], min_speedup: float, common: dict, upside: dict[tuple, float]) -> Plan:
    """The plan of the best candidate, with the best γ of each other (draft, budget) as runner-ups
    (alternatives rather than the winner's neighbouring γs). Scheduled candidates within
    :data:`NEAR_TIE` of the best are ranked by their ``upside`` (keyed by view, budget, weights)."""
    candidates.sort(key=lambda c: c.estimate.speedup, reverse=True)
    top = candidates[0].estimate.speedup

    def tied_upside(c: Candidate) -> float:
        e = c.estimate
        key = (e.draft, e.draft_budget, e.draft_weights)
        return upside[key] if e.draft_model is None and key in upside and e.speedup >= top * (1 - NEAR_TIE) else 0.0

    if upside:
        candidates.sort(key=tied_upside, reverse=True)  # stable: the rest keep their order
    best = candidates[0].estimate
    seen = {(best.draft, best.draft_budget, best.draft_model, best.draft_weights)}
    runner_ups = []
    for e in (c.estimate for c in candidates[1:]):
        if (e.draft, e.draft_budget, e.draft_model, e.draft_weights) not in seen:
            seen.add((e.draft, e.draft_budget, e.draft_model, e.draft_weights))
            runner_ups.append(e)
    speculate = best.speedup >= min_speedup
    if speculate:
        reason = f"predicted {best.speedup:.2f}x >= {min_speedup:g}x"
    else:
        reason = (f"best predicted speedup {best.speedup:.2f}x < {min_speedup:g}x: verification or drafting "
                  "costs more than the accepted tokens save at this batch and context")
    return Plan(speculate=speculate, draft=best.draft, draft_budget=best.draft_budget, gamma=best.gamma,
                predicted_speedup=best.speedup, acceptance=best.acceptance, tokens_per_step=best.omega,
                t_draft=best.t_draft, t_verify=best.t_verify, runner_ups=tuple(runner_ups[:_RUNNER_UPS]),
                reason=reason, draft_model=best.draft_model, draft_options=_options(candidates[0].view),
                draft_weights=best.draft_weights, **common)

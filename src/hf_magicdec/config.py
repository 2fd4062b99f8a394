"""`MagicDecConfig`: the validated knobs of self-speculative decoding.

Glossary (follows the MagicDec paper): ``gamma`` (γ) is the number of draft tokens per
verification step; the *draft view* is the compressed part of the KV cache the draft attends to;
its *budget* is the number of cached tokens in it (static selection + rolling recent window).

One representation: a frozen dataclass whose ``draft`` is a view instance (a view owns its
options) or ``"auto"``. Names and flat options (``draft="snapkv", window=16``, a dict, a saved
``generation_config.speculative``, a planner's ``Plan``) are turned into one config by
:meth:`MagicDecConfig.from_any`, the only place that parses them; ``generate``'s routing calls it
once per call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers import CompileConfig

from .checks import is_int
from .defaults import (  # noqa: F401  (re-exported: part of this module's public names)
    AUTO,
    DEFAULT_BUDGET,
    DEFAULT_DRAFT,
    DEFAULT_GAMMA,
    DEFAULT_MAX_GAMMA,
    DEFAULT_PAGE_SIZE,
    DEFAULT_POOL_KERNEL,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_SINK_TOKENS,
    DEFAULT_WINDOW,
    DRAFT_WEIGHT_FORMATS,
    MAX_GAMMA,
)
from .planner.hardware import get_hardware
from .planner.search import DEFAULT_DRAFTS
from .views import DraftView, available_views, get_view, likely_names, view_option_names

#: Method names accepted by ``generate(speculative=...)``.
SPECULATIVE_METHODS = ("magicdec",)


def _check_registered(view: DraftView) -> None:
    """Refuse a view instance that is not what its registered name builds (an unregistered class,
    or a subclass answering to a registered name)."""
    kind = type(view).__name__
    if view.name not in available_views():
        raise ValueError(f"Draft view {kind} (name {view.name!r}) is not registered: call "
                         f"hf_magicdec.register_view({kind}) first.")
    if get_view(view.name, **_own_options(view)) != view:
        raise ValueError(f"{view!r} is not the registered {view.name!r} view ({type(get_view(view.name)).__name__}): "
                         "register it under a name of its own.")


def _own_options(view: DraftView) -> dict[str, Any]:
    """The options ``view`` sets away from its registered defaults."""
    default = get_view(view.name)
    return {k: v for k, v in view.options().items() if v != getattr(default, k, dataclasses.MISSING)}


def default_candidates() -> tuple[DraftView, ...]:
    """The views ``draft="auto"`` chooses among when nothing else is said: each default view
    (``streamingllm``, ``snapkv``) with its default options."""
    return tuple(get_view(name) for name in DEFAULT_DRAFTS)


@dataclass(frozen=True)
class MagicDecConfig:
    """Configuration of one ``speculative="magicdec"`` generation.

    ``draft``, ``draft_budget`` and ``gamma`` default to ``"auto"``: the planner
    (:func:`hf_magicdec.plan`, see ``docs/cost_model.md``) picks them per call from the batch size,
    prompt length, new tokens, the model's shapes and the device (its cached calibration when
    there is one). When both ``draft_budget`` and ``gamma`` are ``"auto"`` and the planner predicts
    no speedup (short contexts, small batches), ``generate`` decodes exactly as stock ``generate``
    does. Fields set explicitly are always honoured.

    A draft view owns its options: ``MagicDecConfig(draft=SnapKV(window=16))``. Names and flat
    options (``draft="snapkv", window=16``, as ``generate`` takes them) go through
    :meth:`from_any`, which builds the same config.

    Parameters
    ----------
    draft : DraftView or "auto"
        The draft view, an instance of a registered view: :class:`~hf_magicdec.StreamingLLM`
        (sink tokens + recent window), :class:`~hf_magicdec.SnapKV` (per-KV-head selection scored
        by the last ``window`` prompt queries + recent window), :class:`~hf_magicdec.DynamicPages` (pages
        re-selected from each draft query, Quest-style; see ``docs/draft_views.md``),
        :class:`~hf_magicdec.FullKV` (the whole cache; every draft token is accepted, a sanity
        mode), or your own; ``"auto"``: the planner picks one of ``candidates``.
    draft_budget : int or "auto"
        Tokens of KV per layer, per row and per KV head that the draft attends to (static
        selection plus rolling recent window). Ignored by ``FullKV``.
    gamma : int or "auto"
        Draft tokens per verification step (γ). Each step verifies γ+1 tokens. ``0`` turns
        drafting off: plain autoregressive decoding on the MagicDec cache (the benchmark's
        "own AR" baseline; no draft view is built).
    adaptive_gamma : bool or None
        Re-choose γ at every step from the acceptance observed so far (the same γ for every row,
        so every rank of a tensor-parallel group decides alike), between 1 and ``max_gamma``.
        Default (None): on when ``gamma="auto"``, off when γ is set.
    max_gamma : int
        Largest γ the planner and adaptive γ consider.
    hardware : str or None
        Device model the planner uses: a preset (``"a100"``, ``"h100"``, ``"h200"``, ``"l40s"``,
        ``"cpu"``). Default: the cached calibration of this model on this device
        (``hf-magicdec plan --calibrate``), else the preset matching the device.
    prefill_chunk_size : int
        Prompt tokens per prefill forward, so that long prompts never allocate full-length
        scratch. ``generation_config.prefill_chunk_size``, when set, takes precedence.
    refresh_every : int or None
        Static views (``snapkv``, ``streamingllm``): re-select the static part of a row every
        this many committed tokens, scored by the row's last ``window`` committed queries.
        Default None: never.
    refresh_below : float or None
        Static views: re-select every row's static part when the acceptance pooled over rows over
        the last 8 verification steps falls below this, in (0, 1]. Default None: never.
    compile : "auto", bool or transformers.CompileConfig
        Run the draft and verify forwards through ``torch.compile`` (prefill stays eager):
        ``"auto"`` (default) compiles on CUDA and not elsewhere (on CPUs compiling does not pay),
        ``True`` / ``False`` force it, a ``CompileConfig`` chooses backend, mode and ``fullgraph``.
        ``True`` and ``"auto"`` use ``generation_config.compile_config`` when set, else
        ``CompileConfig()`` (inductor, ``mode="reduce-overhead"``: CUDA graphs on CUDA);
        ``generation_config.disable_compile=True`` turns ``"auto"`` off, as in stock ``generate``.
    draft_weights : "auto", "full", "int8", "fp16" or "int4"
        Weights of the self-draft's forwards (``docs/configuration.md``, "Quantized draft
        weights"): ``"full"`` (the model's own), ``"int8"`` / ``"fp16"`` / ``"int4"`` (compressed
        copies of its linear layers, LM head included, made once per model and cached beside it;
        the model and every verification stay in full precision, so only the acceptance can
        change), or ``"auto"`` (default): when the planner chooses the view, budget or γ, it also
        picks the weights among the formats this device has a kernel for (CPU: int8, and fp16
        where fbgemm runs; CUDA with torchao: int8, int4); with all three explicit, or with
        ``draft_model=``, the ``full`` sanity view or γ = 0, ``"auto"`` means ``"full"``.
    candidates : tuple of DraftView
        With ``draft="auto"``: the views the planner chooses among, with their options (default:
        ``StreamingLLM()`` and ``SnapKV()``; flat options given with an ``"auto"`` draft go to the
        candidates that have them). Empty once a view is chosen.
    acceptance_memory : bool
        Plan with the acceptance that earlier calls on this model measured, where there is one,
        instead of the documented prior. Off by default, so that the same inputs get the same plan
        on every call of a process (and, when sampling with a seed, the same tokens: the drawn
        tokens depend on γ); with it on, a plan depends on the calls before it. Every call records
        what it measured either way.

    Raises
    ------
    ValueError
        If a value is out of range, ``draft`` is not a registered view instance or ``"auto"``, or
        the view cannot hold the budget with γ.

    Examples
    --------
    >>> MagicDecConfig(draft=SnapKV(window=16), draft_budget=512, gamma=4)
    MagicDecConfig(draft=SnapKV(window=16, recent_window=None, pool_kernel=5), draft_budget=512, gamma=4, ...)
    >>> MagicDecConfig.from_any("magicdec", draft="snapkv", window=16, draft_budget=512, gamma=4).view
    SnapKV(window=16, recent_window=None, pool_kernel=5)
    >>> MagicDecConfig().is_resolved      # everything left to the planner
    False
    """

    draft: DraftView | str = AUTO
    draft_budget: int | str = AUTO
    gamma: int | str = AUTO
    adaptive_gamma: bool | None = None
    max_gamma: int = DEFAULT_MAX_GAMMA
    hardware: str | None = None
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK
    refresh_every: int | None = None
    refresh_below: float | None = None
    compile: Any = AUTO
    draft_weights: str = AUTO
    candidates: tuple[DraftView, ...] = ()
    acceptance_memory: bool = False

    def __post_init__(self) -> None:
        self._check_draft()
        for name in ("prefill_chunk_size", "max_gamma"):
            value = getattr(self, name)
            if not is_int(value):
                raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
        for name in ("draft_budget", "gamma"):
            value = getattr(self, name)
            if value != AUTO and not is_int(value):
                raise ValueError(f"{name} must be an int or 'auto', got {value!r} ({type(value).__name__}).")
        if self.draft_budget != AUTO and self.draft_budget < 1:
            raise ValueError(f"draft_budget must be >= 1, got draft_budget={self.draft_budget}.")
        if self.gamma != AUTO and not 0 <= self.gamma <= MAX_GAMMA:
            raise ValueError(f"gamma must be in [0, {MAX_GAMMA}], got gamma={self.gamma}.")
        if not 1 <= self.max_gamma <= MAX_GAMMA:
            raise ValueError(f"max_gamma must be in [1, {MAX_GAMMA}], got max_gamma={self.max_gamma}.")
        if self.adaptive_gamma is not None and not isinstance(self.adaptive_gamma, bool):
            raise ValueError(f"adaptive_gamma must be True, False or None, got adaptive_gamma={self.adaptive_gamma!r}.")
        if self.hardware is not None:
            get_hardware(self.hardware)  # names the bad value
        if self.prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got prefill_chunk_size={self.prefill_chunk_size}.")
        if self.refresh_every is not None and (not is_int(self.refresh_every) or self.refresh_every < 1):
            raise ValueError(f"refresh_every must be a positive int or None, got refresh_every={self.refresh_every!r}.")
        below = self.refresh_below
        if below is not None and (isinstance(below, bool) or not isinstance(below, (int, float)) or not 0 < below <= 1):
            raise ValueError(f"refresh_below must be a number in (0, 1] or None, got refresh_below={below!r}.")
        if isinstance(self.compile, Mapping):  # from to_dict() / a saved generation config
            object.__setattr__(self, "compile", CompileConfig(**self.compile))
        if not (isinstance(self.compile, CompileConfig) or self.compile in (AUTO, True, False)):
            raise ValueError(f"compile must be 'auto', True, False or a transformers.CompileConfig, got {self.compile!r}.")
        if not isinstance(self.acceptance_memory, bool):
            raise ValueError(f"acceptance_memory must be True or False, got acceptance_memory={self.acceptance_memory!r}.")
        if self.draft_weights not in DRAFT_WEIGHT_FORMATS:
            raise ValueError(f"draft_weights must be one of {list(DRAFT_WEIGHT_FORMATS)}, got {self.draft_weights!r}.")
        view = self.view
        if view is not None and view.reselects and (self.refresh_every is not None or self.refresh_below is not None):
            raise ValueError(
                f"draft={view.name!r} re-selects its view itself; refresh_every / refresh_below apply to static views "
                f"(snapkv), got refresh_every={self.refresh_every}, refresh_below={self.refresh_below}."
            )
        if self.is_resolved:
            # The rolling window takes up to gamma+1 committed tokens per step without overwriting
            # itself, so it must hold at least that many.
            view.check(self.draft_budget, self.gamma)

    def _check_draft(self) -> None:
        draft, candidates = self.draft, self.candidates
        if isinstance(draft, str) and draft != AUTO:
            hint = f"MagicDecConfig.from_any(draft={draft!r}, ...)" if draft in available_views() else (
                f"one of {sorted(available_views())}")
            raise ValueError(f"MagicDecConfig(draft=...) takes a view instance (e.g. hf_magicdec.SnapKV()) or 'auto', "
                             f"got the name {draft!r}; names and flat options go through {hint}.")
        if not isinstance(draft, (DraftView, str)):
            raise ValueError(f"draft must be a registered DraftView instance or 'auto', got {draft!r}.")
        if not isinstance(candidates, tuple) or not all(isinstance(c, DraftView) for c in candidates):
            raise ValueError(f"candidates must be a tuple of DraftView instances, got {candidates!r}.")
        for view in (draft,) * isinstance(draft, DraftView) + candidates:
            _check_registered(view)
        if isinstance(draft, DraftView):
            if candidates:
                raise ValueError(f"candidates are what draft='auto' chooses among; draft is {draft!r}.")
        elif not candidates:
            object.__setattr__(self, "candidates", default_candidates())
        elif len({c.name for c in candidates}) != len(candidates):
            raise ValueError(f"candidates must be different views, got {[c.name for c in candidates]}.")

    # ------------------------------------------------------------------ what it says
    @property
    def view(self) -> DraftView | None:
        """The draft view (None while ``draft`` is ``"auto"``)."""
        return self.draft if isinstance(self.draft, DraftView) else None

    @property
    def draft_name(self) -> str:
        """The view's name, or ``"auto"``."""
        return self.draft.name if isinstance(self.draft, DraftView) else AUTO

    @property
    def is_resolved(self) -> bool:
        """True when no field is left to the planner."""
        return AUTO not in (self.draft_name, self.draft_budget, self.gamma)

    @property
    def planner_may_decline(self) -> bool:
        """Whether the planner may choose plain decoding (both budget and γ were left to it)."""
        return self.draft_budget == AUTO and self.gamma == AUTO

    @property
    def adaptive(self) -> bool:
        """Whether γ is re-chosen during generation."""
        if self.gamma == 0:
            return False
        return self.gamma == AUTO if self.adaptive_gamma is None else self.adaptive_gamma

    def replace(self, **changes: Any) -> "MagicDecConfig":
        """A copy with ``changes`` to its fields (validated again). Choosing a view clears the
        candidates."""
        if isinstance(changes.get("draft"), DraftView) and "candidates" not in changes:
            changes["candidates"] = ()
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable flat form (view options as keys), which :meth:`from_any` reads back;
        suitable for ``GenerationConfig(speculative=...)``."""
        out: dict[str, Any] = {"method": "magicdec", "draft": self.draft_name}
        out.update({name: getattr(self, name) for name in _FIELDS if name not in ("draft", "candidates")})
        if isinstance(self.compile, CompileConfig):
            out["compile"] = self.compile.to_dict()
        views = (self.view,) if self.view is not None else self.candidates
        if self.view is None and tuple(c.name for c in views) != DEFAULT_DRAFTS:
            out["candidates"] = [c.name for c in views]
        for view in views:
            out.update(_own_options(view))
        return out

    # ------------------------------------------------------------------ the one parser
    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """Every flat keyword :meth:`from_any` takes: the fields and the registered views' options."""
        return tuple(dict.fromkeys([*_FIELDS, *view_option_names()]))

    @classmethod
    def from_any(cls, spec: Any = "magicdec", **options: Any) -> "MagicDecConfig":
        """Build a config from what users pass as ``speculative=`` and flat options.

        Parameters
        ----------
        spec : str | dict | MagicDecConfig | Plan | bool
            ``"magicdec"`` / ``True`` (defaults), a dict of fields and view options (an optional
            ``"method"`` key must be ``"magicdec"``), a ready config, or a planner's
            :class:`~hf_magicdec.planner.Plan` (its best candidate, even when ``speculate`` is False).
        **options
            Fields (``draft`` as a view name or instance, ``draft_budget``, ``gamma`` …) and view
            options (``window``, ``sink_tokens`` …) that take precedence over ``spec``'s; ``None``
            values are ignored. A new ``draft`` keeps the options of ``spec``'s view it has.

        Raises
        ------
        ValueError
            An unknown method or option, an option the chosen view does not have (or, for
            ``draft="auto"``, none of its candidates has), or a bad value (named).
        """
        options = {k: v for k, v in options.items() if v is not None}
        if isinstance(spec, cls):
            if not options:
                return spec
            spec = spec.to_dict()
        elif spec is True or (isinstance(spec, str) and spec.lower() in SPECULATIVE_METHODS):
            spec = {}
        elif callable(getattr(spec, "config_kwargs", None)):  # a Plan (the torch-free planner cannot build configs)
            spec = spec.config_kwargs()
        if not isinstance(spec, Mapping):
            raise ValueError(f"Unsupported speculative={spec!r}: pass 'magicdec', a dict of MagicDecConfig fields or "
                             "a hf_magicdec.MagicDecConfig.")
        flat = dict(spec)
        method = flat.pop("method", "magicdec")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"Unknown speculative method {method=!r}; supported: {SPECULATIVE_METHODS}.")
        if "draft" in options or "candidates" in options:  # a new view keeps only the options it has
            keep = _option_owner(options.get("draft", AUTO), options.get("candidates"))
            flat = {k: v for k, v in flat.items() if k in _FIELDS or k == "candidates" or k in keep}
            flat.pop("candidates", None)
        return cls._from_flat({**flat, **options})

    @classmethod
    def _from_flat(cls, flat: dict[str, Any]) -> "MagicDecConfig":
        fields = {k: flat.pop(k) for k in list(flat) if k in _FIELDS and k != "candidates"}
        names = flat.pop("candidates", None)
        known = view_option_names()
        unknown = sorted(k for k in flat if k not in known)
        if unknown:
            everything = sorted(set(_FIELDS) | set(known))
            raise ValueError(f"Unknown MagicDec option(s) {unknown}{likely_names(unknown, everything)}; known: "
                             f"{everything}.")
        draft = fields.get("draft", AUTO)
        if isinstance(draft, DraftView):
            fields["draft"] = _with_options(draft, flat)
        elif draft == AUTO:
            fields["candidates"] = _candidates(names, flat)
        elif isinstance(draft, str):
            if draft not in available_views():
                raise ValueError(f"Unknown draft view draft={draft!r}; choose one of {sorted(available_views())} or "
                                 "'auto'.")
            fields["draft"] = get_view(draft, **flat)
        return cls(**fields)


_FIELDS = tuple(f.name for f in dataclasses.fields(MagicDecConfig))
#: Fields that are also ``GenerationConfig`` fields: transformers reads those itself (and they take
#: precedence), so they are not MagicDec keywords of ``generate``.
GENERATION_CONFIG_FIELDS = ("prefill_chunk_size",)


def keyword_names() -> tuple[str, ...]:
    """The keywords of ``generate`` (and attributes of a ``GenerationConfig``) that configure
    MagicDec: :meth:`MagicDecConfig.option_names` but the generation config's own fields."""
    return tuple(n for n in MagicDecConfig.option_names() if n not in GENERATION_CONFIG_FIELDS)


def carried_options(*generation_configs: Any) -> dict[str, Any]:
    """MagicDec options set as attributes of ``generation_configs`` (later ones win, None skipped):
    a ``GenerationConfig(speculative="magicdec", draft="snapkv", gamma=3)`` built by a trainer
    carries its settings that way. A ``speculative`` dict carries its own."""
    names = keyword_names()
    options: dict[str, Any] = {}
    for config in generation_configs:
        if config is not None:
            options.update({k: v for k, v in vars(config).items() if k in names and v is not None})
    return options


def _option_owner(draft: Any, candidates: Any) -> tuple[str, ...]:
    """The option names of the view(s) a new ``draft`` / ``candidates`` stands for."""
    if isinstance(draft, DraftView):
        return ()
    if draft != AUTO:
        return view_option_names(draft) if draft in available_views() else ()
    names = candidates if candidates is not None else DEFAULT_DRAFTS
    return tuple(o for n in names if n in available_views() for o in view_option_names(n))


def _with_options(view: DraftView, options: dict[str, Any]) -> DraftView:
    """``view`` with flat ``options`` too (they must not contradict the ones it sets itself)."""
    _check_registered(view)
    own = _own_options(view)
    clash = sorted(k for k in options if k in own and options[k] != own[k])
    if clash:
        raise ValueError(f"Option(s) {clash} set both on draft={view!r} and as keywords, with different values.")
    return get_view(view.name, **{**own, **options}) if options else view


def _candidates(names: Any, options: dict[str, Any]) -> tuple[DraftView, ...]:
    """The views ``draft="auto"`` chooses among (``names``, default ``DEFAULT_DRAFTS``), each with
    the options it has; an option none of them has is refused (validated by its own view first)."""
    names = tuple(names) if names is not None else DEFAULT_DRAFTS
    for name in names:
        if name not in available_views():
            raise ValueError(f"Unknown draft view {name!r} in candidates; choose among {sorted(available_views())}.")
    views = tuple(get_view(n, **{k: v for k, v in options.items() if k in view_option_names(n)}) for n in names)
    orphans = sorted(k for k in options if not any(k in view_option_names(n) for n in names))
    for name in available_views():  # a bad value is named by the view that owns the option
        mine = {k: options[k] for k in orphans if k in view_option_names(name)}
        if mine:
            get_view(name, **mine)
            raise ValueError(f"Option(s) {sorted(mine)} belong to the {name!r} draft view, which draft='auto' does not "
                             f"consider (it chooses among {list(names)}); pass draft={name!r}.")
    return views

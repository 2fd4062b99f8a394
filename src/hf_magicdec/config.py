"""`MagicDecConfig`: the validated knobs of self-speculative decoding.

Glossary (follows the MagicDec paper): ``gamma`` (γ) is the number of draft tokens per
verification step; the *draft view* is the compressed part of the KV cache the draft attends to;
its *budget* is the number of cached tokens in it (static selection + rolling recent window).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator

from transformers import CompileConfig

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
from .views import DraftView, available_views, get_view, view_option_names

#: Method names accepted by ``generate(speculative=...)``.
SPECULATIVE_METHODS = ("magicdec",)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ViewOptions(Mapping):
    """An immutable, hashable ``{option: value}`` mapping (the draft views' options of a config)."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | None = None):
        self._items = dict(sorted(dict(items or {}).items()))

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(self._items.items()))

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Mapping) and dict(self._items) == dict(other)

    def __repr__(self) -> str:
        return repr(self._items)

    def __reduce__(self):
        return (ViewOptions, (self._items,))


@dataclass(frozen=True)
class MagicDecConfig:
    """Configuration of one ``speculative="magicdec"`` generation.

    ``draft``, ``draft_budget`` and ``gamma`` default to ``"auto"``: the planner
    (:func:`hf_magicdec.plan`, see ``docs/cost_model.md``) picks them per call from the batch size,
    prompt length, new tokens, the model's shapes and the device (its cached calibration when
    there is one). When both ``draft_budget`` and ``gamma`` are ``"auto"`` and the planner predicts
    no speedup (short contexts, small batches), ``generate`` decodes exactly as stock ``generate``
    does. Fields set explicitly are always honoured.

    The draft views' own options (``sink_tokens``, ``window``, ``recent_window``, ``pool_kernel``,
    ``page_size``, and those of views you register) are passed as keywords next to the fields,
    ``MagicDecConfig(draft="snapkv", window=16)``, or on a view instance,
    ``MagicDecConfig(draft=SnapKV(window=16))`` (the same config); they are kept in
    ``view_options``. An option the chosen view does not have is refused; with ``draft="auto"``
    each option applies to whichever candidate view has it.

    Parameters
    ----------
    draft : str, DraftView or "auto"
        Draft view: ``"streamingllm"`` (sink tokens + recent window), ``"snapkv"`` (per-KV-head
        selection scored by the last ``window`` prompt queries + recent window), ``"dynamic"``
        (pages re-selected from each draft query, Quest-style; see ``docs/draft_views.md``), ``"full"``
        (the whole cache; every draft token is accepted, a sanity mode), any registered view, a
        view instance (of a registered view; stored as its name and options) or ``"auto"``.
    draft_budget : int or "auto"
        Tokens of KV per layer, per row and per KV head that the draft attends to (static
        selection plus rolling recent window). Ignored by ``"full"``.
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
    view_options : Mapping[str, Any]
        The draft views' options (see above; keywords are merged into it). Stored immutably.

    Raises
    ------
    ValueError
        If a value is out of range, the draft name is unknown, or an option belongs to no view /
        not to the chosen view.

    Examples
    --------
    >>> MagicDecConfig(draft="snapkv", draft_budget=512, gamma=4, window=16)
    MagicDecConfig(draft='snapkv', draft_budget=512, gamma=4, ..., view_options={'window': 16})
    >>> MagicDecConfig(draft=SnapKV(window=16), draft_budget=512, gamma=4).view
    SnapKV(window=16, recent_window=None, pool_kernel=5)
    >>> MagicDecConfig().is_resolved      # everything left to the planner
    False
    """

    draft: str | DraftView = AUTO
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
    view_options: Mapping[str, Any] = field(default_factory=ViewOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.view_options, Mapping):
            raise ValueError(f"view_options must be a mapping of view options, got {self.view_options!r}.")
        options = dict(self.view_options)
        draft = self.draft
        if isinstance(draft, DraftView):
            draft, options = _from_instance(draft, options)
        names = available_views()
        if not isinstance(draft, str) or (draft != AUTO and draft not in names):
            raise ValueError(f"Unknown draft view draft={draft!r}; choose one of {sorted(names)} or 'auto'.")
        known = view_option_names()
        unknown = sorted(k for k in options if k not in known)
        if unknown:
            raise ValueError(f"Unknown MagicDec option(s) {unknown}; known: {sorted(set(_FIELDS) | set(known))}.")
        if draft != AUTO:
            own = view_option_names(draft)
            wrong = sorted(k for k in options if k not in own)
            if wrong:
                raise ValueError(f"The {draft!r} draft view has no option(s) {wrong}; its options: {sorted(own)}.")
        object.__setattr__(self, "draft", draft)
        object.__setattr__(self, "view_options", ViewOptions(options))
        for name in ("prefill_chunk_size", "max_gamma"):
            value = getattr(self, name)
            if not _is_int(value):
                raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
        for name in ("draft_budget", "gamma"):
            value = getattr(self, name)
            if value != AUTO and not _is_int(value):
                raise ValueError(f"{name} must be an int or 'auto', got {value!r} ({type(value).__name__}).")
        if self.draft_budget != AUTO and self.draft_budget < 1:
            raise ValueError(f"draft_budget must be >= 1, got {self.draft_budget=}.")
        if self.gamma != AUTO and not 0 <= self.gamma <= MAX_GAMMA:
            raise ValueError(f"gamma must be in [0, {MAX_GAMMA}], got {self.gamma=}.")
        if not 1 <= self.max_gamma <= MAX_GAMMA:
            raise ValueError(f"max_gamma must be in [1, {MAX_GAMMA}], got {self.max_gamma=}.")
        if self.adaptive_gamma is not None and not isinstance(self.adaptive_gamma, bool):
            raise ValueError(f"adaptive_gamma must be True, False or None, got {self.adaptive_gamma=!r}.")
        if self.hardware is not None:
            get_hardware(self.hardware)  # names the bad value
        if self.prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {self.prefill_chunk_size=}.")
        if self.refresh_every is not None and (not _is_int(self.refresh_every) or self.refresh_every < 1):
            raise ValueError(f"refresh_every must be a positive int or None, got {self.refresh_every=!r}.")
        below = self.refresh_below
        if below is not None and (isinstance(below, bool) or not isinstance(below, (int, float)) or not 0 < below <= 1):
            raise ValueError(f"refresh_below must be a number in (0, 1] or None, got {self.refresh_below=!r}.")
        if isinstance(self.compile, Mapping):  # from to_dict() / a saved generation config
            object.__setattr__(self, "compile", CompileConfig(**self.compile))
        if not (isinstance(self.compile, CompileConfig) or self.compile in (AUTO, True, False)):
            raise ValueError(f"compile must be 'auto', True, False or a transformers.CompileConfig, got {self.compile!r}.")
        if self.draft_weights not in DRAFT_WEIGHT_FORMATS:
            raise ValueError(f"draft_weights must be one of {list(DRAFT_WEIGHT_FORMATS)}, got {self.draft_weights!r}.")
        # The views validate their options (an "auto" draft: every view that has some of them).
        if draft == AUTO:
            for name in names:
                if any(k in view_option_names(name) for k in options):
                    self.view_for(name)
            return
        view = self.view_for(draft)
        if view.query_aware and (self.refresh_every is not None or self.refresh_below is not None):
            raise ValueError(
                f"draft={draft!r} re-selects its view at every draft step; refresh_every / refresh_below apply to "
                f"static views (snapkv), got {self.refresh_every=}, {self.refresh_below=}."
            )
        if self.is_resolved:
            # The rolling window takes up to gamma+1 committed tokens per step without overwriting
            # itself, so it must hold at least that many.
            view.check(self.draft_budget, self.gamma)

    @property
    def view(self) -> "DraftView | None":
        """The draft view with this config's options (None while ``draft`` is ``"auto"``)."""
        return None if self.draft == AUTO else self.view_for(self.draft)

    def view_for(self, name: str) -> "DraftView":
        """The registered view ``name`` with the options of this config that it has (an
        ``"auto"`` draft's options apply to whichever view has them)."""
        own = view_option_names(name)
        return get_view(name, **{k: v for k, v in self.view_options.items() if k in own})

    @property
    def is_resolved(self) -> bool:
        """True when no field is left to the planner."""
        return AUTO not in (self.draft, self.draft_budget, self.gamma)

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
        """Return a copy with ``changes`` applied (fields or view options; validated again).

        Changing ``draft`` keeps the options the new view has (all of them for ``"auto"``) and
        drops the others; a view instance brings its own options.
        """
        if "draft" in changes and "view_options" not in changes:
            new = changes["draft"]
            if isinstance(new, DraftView):
                keep: dict[str, Any] = {}
            elif new == AUTO or new == self.draft:
                keep = dict(self.view_options)
            else:
                own = view_option_names(new) if isinstance(new, str) and new in available_views() else ()
                keep = {k: v for k, v in self.view_options.items() if k in own}
            changes["view_options"] = keep
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (view options flattened), suitable for ``GenerationConfig(speculative=...)``."""
        out: dict[str, Any] = {"method": "magicdec"}
        out.update({name: getattr(self, name) for name in _FIELDS if name != "view_options"})
        if isinstance(self.compile, CompileConfig):
            out["compile"] = self.compile.to_dict()
        out.update(self.view_options)
        return out

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """Every keyword a config takes: its fields (but ``view_options``) and the registered
        views' options."""
        return tuple(dict.fromkeys([*(n for n in _FIELDS if n != "view_options"), *view_option_names()]))

    @classmethod
    def from_any(cls, spec: Any, **overrides: Any) -> "MagicDecConfig":
        """Build a config from what users pass as ``speculative=``.

        Parameters
        ----------
        spec : str | dict | MagicDecConfig | Plan | bool
            ``"magicdec"`` / ``True`` (defaults), a dict of fields and view options (an optional
            ``"method"`` key must be ``"magicdec"``), a ready config, or a planner's
            :class:`~hf_magicdec.planner.Plan` (its best candidate, even when ``speculate`` is False).
        **overrides
            Field and view-option values that take precedence (``None`` values are ignored).
        """
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if isinstance(spec, cls):
            return spec.replace(**overrides) if overrides else spec
        if spec is True or (isinstance(spec, str) and spec.lower() in SPECULATIVE_METHODS):
            return cls(**overrides)
        if callable(getattr(spec, "config_kwargs", None)):  # a Plan (the torch-free planner cannot build configs)
            spec = spec.config_kwargs()
        if isinstance(spec, Mapping):
            fields = dict(spec)
            method = fields.pop("method", "magicdec")
            if method not in SPECULATIVE_METHODS:
                raise ValueError(f"Unknown speculative method {method=!r}; supported: {SPECULATIVE_METHODS}.")
            fields.update(overrides)
            return cls(**fields)
        raise ValueError(
            f"Unsupported speculative={spec!r}: pass 'magicdec', a dict of MagicDecConfig fields or a "
            "hf_magicdec.MagicDecConfig."
        )


_FIELDS = tuple(f.name for f in dataclasses.fields(MagicDecConfig))


def _from_instance(view: "DraftView", options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(name, options)`` of a view instance: the options it sets away from the registered
    view's defaults, plus ``options`` (which must not contradict them)."""
    kind = type(view).__name__
    if view.name not in available_views():
        raise ValueError(f"Draft view {kind} (name {view.name!r}) is not registered: call "
                         f"hf_magicdec.register_view({kind}) first.")
    default = get_view(view.name)
    own = {k: v for k, v in view.options().items() if v != getattr(default, k, dataclasses.MISSING)}
    if get_view(view.name, **own) != view:
        raise ValueError(f"{view!r} is not the registered {view.name!r} view ({type(default).__name__}): register "
                         "it under a name of its own.")
    clash = sorted(k for k in options if k in own and options[k] != own[k])
    if clash:
        raise ValueError(f"Option(s) {clash} set both on draft={view!r} and as keywords, with different values.")
    return view.name, {**own, **options}


_dataclass_init = MagicDecConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self, *args: Any, view_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
    # Keywords that are no field are view options: ``MagicDecConfig(draft="snapkv", window=16)``.
    options = dict(view_options) if view_options is not None else {}
    options.update({k: kwargs.pop(k) for k in [k for k in kwargs if k not in _FIELDS]})
    _dataclass_init(self, *args, view_options=options, **kwargs)


_signature = inspect.signature(_dataclass_init)
_init.__signature__ = _signature.replace(parameters=[
    *_signature.parameters.values(), inspect.Parameter("options", inspect.Parameter.VAR_KEYWORD, annotation=Any)])
MagicDecConfig.__init__ = _init

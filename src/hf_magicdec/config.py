"""`MagicDecConfig`: the validated knobs of self-speculative decoding.

Glossary (follows the MagicDec paper): ``gamma`` (γ) is the number of draft tokens per
verification step; the *draft view* is the compressed part of the KV cache the draft attends to;
its *budget* is the number of cached tokens in it (static selection + rolling recent window).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

#: Method names accepted by ``generate(speculative=...)``.
SPECULATIVE_METHODS = ("magicdec",)

from .defaults import (  # noqa: F401  (re-exported: part of this module's public names)
    AUTO,
    DEFAULT_BUDGET,
    DEFAULT_DRAFT,
    DEFAULT_GAMMA,
    DEFAULT_MAX_GAMMA,
    DEFAULT_PAGE_SIZE,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_SINK_TOKENS,
    DEFAULT_WINDOW,
    MAX_GAMMA,
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class MagicDecConfig:
    """Configuration of one ``speculative="magicdec"`` generation.

    ``draft``, ``draft_budget`` and ``gamma`` default to ``"auto"``: the planner
    (:func:`hf_magicdec.plan`, see ``docs/cost_model.md``) picks them per call from the batch size,
    prompt length, new tokens, the model's shapes and the device (its cached calibration when
    there is one). When both ``draft_budget`` and ``gamma`` are ``"auto"`` and the planner predicts
    no speedup (short contexts, small batches), ``generate`` decodes exactly as stock ``generate``
    does. Fields set explicitly are always honoured.

    Parameters
    ----------
    draft : str
        Draft view: ``"streamingllm"`` (sink tokens + recent window), ``"snapkv"`` (per-KV-head
        selection scored by the last ``window`` prompt queries + recent window), ``"dynamic"``
        (pages re-selected from each draft query, Quest-style; see ``docs/draft_views.md``), ``"full"``
        (the whole cache; every draft token is accepted, a sanity mode) or ``"auto"``.
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
    sink_tokens : int
        ``streamingllm`` and ``dynamic``: the first tokens of the prompt that always stay in the view.
    window : int
        ``snapkv`` only: observation window (last prompt queries used for scoring). It is also
        the smallest size of SnapKV's rolling recent window.
    recent_window : int | None
        ``snapkv`` and ``dynamic``: size of the rolling window of recent tokens (prompt tail, then
        committed tokens). Default ``max(window, draft_budget // 4)`` (``dynamic``: ``draft_budget // 4``).
    pool_kernel : int
        ``snapkv`` only: width of the 1-D average pooling over key scores (odd).
    prefill_chunk_size : int
        Prompt tokens per prefill forward, so that long prompts never allocate full-length
        scratch. ``generation_config.prefill_chunk_size``, when set, takes precedence.
    page_size : int
        ``dynamic`` only: prompt tokens per page ``P`` (per-page key min / max summaries, 2/P of
        the prompt's keys, are scored against every draft query).
    refresh_every : int or None
        Static views (``snapkv``, ``streamingllm``): re-select the static part of a row every
        this many committed tokens, scored by the row's last ``window`` committed queries.
        Default None: never.
    refresh_below : float or None
        Static views: re-select every row's static part when the acceptance pooled over rows over
        the last 8 verification steps falls below this, in (0, 1]. Default None: never.

    Raises
    ------
    ValueError
        If a value is out of range or the draft name is unknown.

    Examples
    --------
    >>> MagicDecConfig(draft="snapkv", draft_budget=512, gamma=4)
    MagicDecConfig(draft='snapkv', draft_budget=512, gamma=4, ...)
    >>> MagicDecConfig().is_resolved      # everything left to the planner
    False
    """

    draft: str = AUTO
    draft_budget: int | str = AUTO
    gamma: int | str = AUTO
    adaptive_gamma: bool | None = None
    max_gamma: int = DEFAULT_MAX_GAMMA
    hardware: str | None = None
    sink_tokens: int = DEFAULT_SINK_TOKENS
    window: int = DEFAULT_WINDOW
    recent_window: int | None = None
    pool_kernel: int = 5
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK
    page_size: int = DEFAULT_PAGE_SIZE
    refresh_every: int | None = None
    refresh_below: float | None = None

    def __post_init__(self) -> None:
        from .views import available_views

        names = available_views()
        if not isinstance(self.draft, str) or (self.draft != AUTO and self.draft not in names):
            raise ValueError(f"Unknown draft view {self.draft=!r}; choose one of {sorted(names)} or 'auto'.")
        for name in ("sink_tokens", "window", "pool_kernel", "prefill_chunk_size", "max_gamma"):
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
            from .costmodel.hardware import get_hardware

            get_hardware(self.hardware)  # names the bad value
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens=}.")
        if self.recent_window is not None and (not _is_int(self.recent_window) or self.recent_window < 1):
            raise ValueError(f"recent_window must be a positive int or None, got {self.recent_window=!r}.")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window=}.")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel must be a positive odd int, got {self.pool_kernel=}.")
        if self.prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {self.prefill_chunk_size=}.")
        if not _is_int(self.page_size) or self.page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {self.page_size=!r}.")
        if self.refresh_every is not None and (not _is_int(self.refresh_every) or self.refresh_every < 1):
            raise ValueError(f"refresh_every must be a positive int or None, got {self.refresh_every=!r}.")
        below = self.refresh_below
        if below is not None and (isinstance(below, bool) or not isinstance(below, (int, float)) or not 0 < below <= 1):
            raise ValueError(f"refresh_below must be a number in (0, 1] or None, got {self.refresh_below=!r}.")
        if self.is_resolved:
            # The rolling window takes up to gamma+1 committed tokens per step without overwriting
            # itself, so it must hold at least that many.
            from .views import get_view

            get_view(self.draft).check_config(self)

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
        """Return a copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form, suitable for ``GenerationConfig(speculative=...)``."""
        return {"method": "magicdec", **dataclasses.asdict(self)}

    @classmethod
    def from_any(cls, spec: Any, **overrides: Any) -> "MagicDecConfig":
        """Build a config from what users pass as ``speculative=``.

        Parameters
        ----------
        spec : str | dict | MagicDecConfig | bool
            ``"magicdec"`` / ``True`` (defaults), a dict of fields (an optional ``"method"`` key
            must be ``"magicdec"``), or a ready config.
        **overrides
            Field values that take precedence (``None`` values are ignored).
        """
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if isinstance(spec, cls):
            return spec.replace(**overrides) if overrides else spec
        if spec is True or (isinstance(spec, str) and spec.lower() in SPECULATIVE_METHODS):
            return cls(**overrides)
        if isinstance(spec, dict):
            fields = dict(spec)
            method = fields.pop("method", "magicdec")
            if method not in SPECULATIVE_METHODS:
                raise ValueError(f"Unknown speculative method {method=!r}; supported: {SPECULATIVE_METHODS}.")
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(fields) - known)
            if unknown:
                raise ValueError(f"Unknown MagicDec option(s) {unknown}; known: {sorted(known)}.")
            fields.update(overrides)
            return cls(**fields)
        raise ValueError(
            f"Unsupported speculative={spec!r}: pass 'magicdec', a dict of MagicDecConfig fields or a "
            "hf_magicdec.MagicDecConfig."
        )

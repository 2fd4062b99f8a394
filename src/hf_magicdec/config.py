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

DEFAULT_DRAFT = "streamingllm"
DEFAULT_BUDGET = 256
DEFAULT_GAMMA = 3
DEFAULT_SINK_TOKENS = 16
DEFAULT_WINDOW = 32
DEFAULT_PREFILL_CHUNK = 1024
MAX_GAMMA = 32


@dataclass(frozen=True)
class MagicDecConfig:
    """Configuration of one ``speculative="magicdec"`` generation.

    Parameters
    ----------
    draft : str
        Draft view: ``"streamingllm"`` (sink tokens + recent window), ``"snapkv"`` (per-KV-head
        selection scored by the last ``window`` prompt queries + recent window) or ``"full"``
        (the whole cache; every draft token is accepted, a sanity mode).
    draft_budget : int
        Tokens of KV per layer, per row and per KV head that the draft attends to (static
        selection plus rolling recent window). Ignored by ``"full"``.
    gamma : int
        Draft tokens per verification step (γ). Each step verifies γ+1 tokens. ``0`` turns
        drafting off: plain autoregressive decoding on the MagicDec cache (the benchmark's
        "own AR" baseline; no draft view is built).
    sink_tokens : int
        ``streamingllm`` only: the first tokens of the prompt that always stay in the view.
    window : int
        ``snapkv`` only: observation window (last prompt queries used for scoring). It is also
        the smallest size of SnapKV's rolling recent window.
    recent_window : int | None
        ``snapkv`` only: size of the rolling window of recent tokens (prompt tail, then committed
        tokens). Default ``max(window, draft_budget // 4)``.
    pool_kernel : int
        ``snapkv`` only: width of the 1-D average pooling over key scores (odd).
    prefill_chunk_size : int
        Prompt tokens per prefill forward, so that long prompts never allocate full-length
        scratch. ``generation_config.prefill_chunk_size``, when set, takes precedence.

    Raises
    ------
    ValueError
        If a value is out of range or the draft name is unknown.

    Examples
    --------
    >>> MagicDecConfig(draft="snapkv", draft_budget=512, gamma=4)
    MagicDecConfig(draft='snapkv', draft_budget=512, gamma=4, ...)
    """

    draft: str = DEFAULT_DRAFT
    draft_budget: int = DEFAULT_BUDGET
    gamma: int = DEFAULT_GAMMA
    sink_tokens: int = DEFAULT_SINK_TOKENS
    window: int = DEFAULT_WINDOW
    recent_window: int | None = None
    pool_kernel: int = 5
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK

    def __post_init__(self) -> None:
        from .views import available_views

        names = available_views()
        if not isinstance(self.draft, str) or self.draft not in names:
            raise ValueError(f"Unknown draft view {self.draft=!r}; choose one of {sorted(names)}.")
        for name in ("draft_budget", "gamma", "sink_tokens", "window", "pool_kernel", "prefill_chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
        if not 0 <= self.gamma <= MAX_GAMMA:
            raise ValueError(f"gamma must be in [0, {MAX_GAMMA}], got {self.gamma=}.")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens=}.")
        if self.recent_window is not None and (
            isinstance(self.recent_window, bool) or not isinstance(self.recent_window, int) or self.recent_window < 1
        ):
            raise ValueError(f"recent_window must be a positive int or None, got {self.recent_window=!r}.")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window=}.")
        if self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel must be a positive odd int, got {self.pool_kernel=}.")
        if self.prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {self.prefill_chunk_size=}.")
        # The rolling window takes up to gamma+1 committed tokens per step without overwriting
        # itself, so it must hold at least that many.
        from .views import get_view

        view = get_view(self.draft)
        view.check_config(self)

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

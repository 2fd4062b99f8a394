"""RULER's scoring: substring recall, and the same as an offline ``evaluate`` metric.

:func:`string_match_all` (niah, vt, cwe, fwe) and :func:`string_match_part` (qa);
:func:`score` picks the right one per task; :func:`load_metric` loads the bundled
``evaluate`` module (``hf_magicdec_bench/metrics/ruler_string_match``), which must agree
with these functions (a test checks it).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from .tasks import _TASKS, TASKS

__all__ = ["string_match_all", "string_match_part", "score", "metric_path", "load_metric"]


def _postprocess(prediction: str | None) -> str:
    """RULER's postprocess_pred: strip, control characters -> newlines."""
    if prediction is None:
        return ""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def _check(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> list[list[str]]:
    if isinstance(predictions, str):
        raise ValueError("predictions must be a sequence of strings, not one string")
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    if not predictions:
        raise ValueError("no predictions to score")
    refs = [[r] if isinstance(r, str) else list(r) for r in references]
    for i, r in enumerate(refs):
        if not r:
            raise ValueError(f"sample {i} has no references")
    return refs


def _hits(prediction: str, refs: Sequence[str]) -> list[float]:
    pred = _postprocess(prediction).lower()
    return [1.0 if r.lower() in pred else 0.0 for r in refs]


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's ``string_match_all``: mean recall of the references, in percent.

    For each sample, the fraction of its references that occur (case-insensitively)
    in the prediction; the mean over samples, times 100, rounded to 2 decimals.

    Parameters
    ----------
    predictions : sequence of str
        Model outputs (RULER's post-processing is applied: strip, control
        characters to newlines).
    references : sequence of sequence of str
        Reference strings per sample (a bare string counts as one reference).

    Returns
    -------
    float
        Score in ``[0, 100]``.

    Raises
    ------
    ValueError
        Lengths differ, nothing to score, or a sample without references.
    """
    refs = _check(predictions, references)
    total = sum(sum(h) / len(h) for h in (_hits(p, r) for p, r in zip(predictions, refs)))
    return round(total / len(refs) * 100, 2)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's ``string_match_part``: a sample scores 1 if *any* reference occurs.

    Same as :func:`string_match_all` with the per-sample mean replaced by the max
    (used for QA, where the references are alternative answers).
    """
    refs = _check(predictions, references)
    total = sum(max(_hits(p, r)) for p, r in zip(predictions, refs))
    return round(total / len(refs) * 100, 2)


def score(task: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Score predictions for ``task`` with RULER's metric for it (``part`` for qa, else ``all``)."""
    if task not in _TASKS:
        raise ValueError(f"unknown {task=!r}; expected one of {TASKS}")
    fn = string_match_part if _TASKS[task][0] == "qa" else string_match_all
    return fn(predictions, references)


def metric_path() -> Path:
    """Directory of the bundled ``evaluate`` metric ``ruler_string_match``."""
    return Path(__file__).resolve().parent.parent / "metrics" / "ruler_string_match"


def load_metric(mode: str = "all", **kwargs: Any) -> Any:
    """Load RULER's string-match metric as an ``evaluate`` metric, offline.

    Parameters
    ----------
    mode : {"all", "part"}, default "all"
        ``config_name`` of the metric: :func:`string_match_all` or
        :func:`string_match_part`.
    **kwargs
        Passed to :func:`evaluate.load`.

    Returns
    -------
    evaluate.EvaluationModule
        ``compute(predictions=[...], references=[[...], ...])`` returns
        ``{"score": float}``.

    Raises
    ------
    ValueError
        ``mode`` is not ``"all"`` or ``"part"``.
    ModuleNotFoundError
        ``evaluate`` is not installed.
    """
    if mode not in ("all", "part"):
        raise ValueError(f"unknown {mode=!r}; expected 'all' or 'part'")
    try:
        import evaluate  # optional dependency
    except ImportError as exc:
        raise ModuleNotFoundError("load_metric needs 'evaluate': pip install 'evaluate>=0.4,<1'") from exc
    return evaluate.load(str(metric_path()), config_name=mode, **kwargs)

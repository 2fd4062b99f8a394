"""RULER's scoring: substring recall, computed by an offline ``evaluate`` metric.

:func:`score` is the one scoring path (the bench's RULER mode uses it): it picks RULER's metric
for the task (:func:`metric_mode`: ``string_match_part`` for qa, ``string_match_all`` for the
rest) and computes it with the bundled ``evaluate`` module
(``hf_magicdec_bench/metrics/ruler_string_match``, loaded by path with :func:`load_metric`,
which needs no network). :func:`string_match_all` and :func:`string_match_part` are the same
metrics in plain Python, for use without ``evaluate``; a test checks that both agree.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Sequence

from .tasks import resolve_task

__all__ = ["string_match_all", "string_match_part", "score", "metric_mode", "metric_path", "load_metric"]


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


def metric_mode(task: str) -> str:
    """RULER's metric for ``task`` (any name :func:`~hf_magicdec_bench.ruler.resolve_task` accepts):
    ``"part"`` (:func:`string_match_part`) for qa, ``"all"`` (:func:`string_match_all`) otherwise."""
    return "part" if resolve_task(task)[0] == "qa" else "all"


@functools.lru_cache(maxsize=None)
def _metric(mode: str) -> Any:
    return load_metric(mode)


def score(task: str, predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Score predictions for ``task`` with RULER's metric for it, through the ``evaluate`` metric.

    Parameters
    ----------
    task : str
        Any name :func:`~hf_magicdec_bench.ruler.resolve_task` accepts (``niah_single_1``,
        ``qa_2``, ``niah_single`` ...); it picks the metric (:func:`metric_mode`).
    predictions, references :
        As for :func:`string_match_all` (a bare string counts as one reference).

    Returns
    -------
    float
        ``load_metric(metric_mode(task)).compute(...)["score"]``, in ``[0, 100]``; equal to
        :func:`string_match_part` (qa) or :func:`string_match_all` (the rest).

    Raises
    ------
    ValueError
        Unknown task, lengths differ, nothing to score, or a sample without references.
    ModuleNotFoundError
        ``evaluate`` is not installed (``pip install 'evaluate>=0.4,<1'``).
    """
    mode = metric_mode(task)
    refs = _check(predictions, references)
    return float(_metric(mode).compute(predictions=list(predictions), references=refs)["score"])


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

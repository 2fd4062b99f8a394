"""RULER-style synthetic long-context tasks (:mod:`.tasks`) and their scoring (:mod:`.scoring`,
through the bundled ``evaluate`` metric). RULER's own task names (``niah_single_1`` ... ``qa_2``)
and our task families (``niah_single`` ...) are both accepted.

>>> from hf_magicdec_bench import ruler
>>> samples = ruler.generate_samples("niah_single_1", tokenizer, context_len=4096)  # doctest: +SKIP
>>> ruler.score("niah_single_1", predictions, [s["outputs"] for s in samples])     # doctest: +SKIP
"""

from .scoring import load_metric, metric_mode, metric_path, score, string_match_all, string_match_part
from .tasks import ALIASES, HAYSTACKS, RULER_TASKS, TASKS, generate_samples, resolve_task, task_names

__all__ = [
    "TASKS",
    "RULER_TASKS",
    "ALIASES",
    "HAYSTACKS",
    "generate_samples",
    "resolve_task",
    "task_names",
    "metric_mode",
    "string_match_all",
    "string_match_part",
    "score",
    "metric_path",
    "load_metric",
]

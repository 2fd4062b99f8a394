"""RULER-style synthetic long-context tasks (:mod:`.tasks`) and their scoring (:mod:`.scoring`).

>>> from hf_magicdec_bench import ruler
>>> samples = ruler.generate_samples("niah_single", tokenizer, context_len=4096)  # doctest: +SKIP
>>> ruler.score("niah_single", predictions, [s["outputs"] for s in samples])     # doctest: +SKIP
"""

from .scoring import load_metric, metric_path, score, string_match_all, string_match_part
from .tasks import HAYSTACKS, TASKS, generate_samples

__all__ = [
    "TASKS",
    "HAYSTACKS",
    "generate_samples",
    "string_match_all",
    "string_match_part",
    "score",
    "metric_path",
    "load_metric",
]

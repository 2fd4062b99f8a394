"""RULER's string-match metrics as an ``evaluate`` metric that loads offline.

Load it by path (Hub metric names need the network)::

    import evaluate
    metric = evaluate.load("<site-packages>/hf_magicdec_bench/metrics/ruler_string_match", config_name="all")
    metric.compute(predictions=["The number is 42."], references=[["42"]])   # {'score': 100.0}

or with :func:`hf_magicdec_bench.ruler.load_metric`.  This file is self-contained (it is
copied into evaluate's module cache and imported on its own) and must agree with
:func:`hf_magicdec_bench.ruler.string_match_all` / ``string_match_part`` (a test checks it).
"""

import re

import datasets
import evaluate

_CITATION = """\
@article{hsieh2024ruler,
  title={RULER: What's the Real Context Size of Your Long-Context Language Models?},
  author={Hsieh, Cheng-Ping and Sun, Simeng and Kriman, Samuel and Acharya, Shantanu and
          Rekesh, Dima and Jia, Fei and Zhang, Yang and Ginsburg, Boris},
  journal={arXiv preprint arXiv:2404.06654},
  year={2024}
}
"""

_DESCRIPTION = """\
RULER's substring-recall metrics.  Config "all" (string_match_all, used for needle
retrieval, variable tracking and word extraction): per sample, the fraction of the
references that occur case-insensitively in the prediction.  Config "part"
(string_match_part, used for QA): 1 if any reference occurs.  The score is the mean
over samples times 100, rounded to 2 decimals.  Predictions are stripped and control
characters replaced by newlines first, as in RULER.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): model outputs.
    references (list of list of str): the reference strings of each sample.
Returns:
    score (float): in [0, 100].
Examples:
    >>> metric = evaluate.load("path/to/ruler_string_match", config_name="all")
    >>> metric.compute(predictions=["A and B"], references=[["a", "c"]])
    {'score': 50.0}
"""

_MODES = ("all", "part")


def _hits(prediction, refs):
    pred = re.sub(r"[\x00-\x1f]", "\n", (prediction or "").strip()).strip().lower()
    return [1.0 if r.lower() in pred else 0.0 for r in refs]


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class RulerStringMatch(evaluate.Metric):
    """RULER's ``string_match_all`` (config ``"all"``) and ``string_match_part`` (``"part"``)."""

    def _info(self):
        if self.config_name not in _MODES + ("default",):
            raise ValueError(f"unknown config_name={self.config_name!r}; expected 'all' or 'part'")
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Value("string"),
                    "references": datasets.Sequence(datasets.Value("string")),
                }
            ),
            reference_urls=["https://github.com/NVIDIA/RULER"],
        )

    def _compute(self, predictions, references):
        if not predictions:
            raise ValueError("no predictions to score")
        reduce = max if self.config_name == "part" else (lambda h: sum(h) / len(h))
        per_sample = []
        for i, (pred, refs) in enumerate(zip(predictions, references)):
            if not refs:
                raise ValueError(f"sample {i} has no references")
            per_sample.append(reduce(_hits(pred, refs)))
        return {"score": round(sum(per_sample) / len(per_sample) * 100, 2)}

"""hf_magicdec_bench: the tooling around :mod:`hf_magicdec`, kept out of the library.

It uses only the library's public API; the library never imports it.

* :mod:`.bench`   ``hf-magicdec bench`` / ``hf-magicdec acceptance``: harness, runner, report, RULER mode
* :mod:`.plan`    ``hf-magicdec plan``: the planner's choice and a predicted-speedup grid
* :mod:`.models`  offline-first model loader (GGUF from PyPI -> cached safetensors)
* :mod:`.data`    real long text for prompts (Shakespeare offline, PG-19 online, essays, your files)
* :mod:`.ruler`   RULER's tasks, by RULER's names or ours (:mod:`.ruler.tasks`), scored through the local
  ``evaluate`` module in ``metrics/`` (:mod:`.ruler.scoring`)
* :mod:`.hub`     ``hf-magicdec export-hub``: a transformers ``custom_generate`` repository running MagicDec
* :mod:`.demo`    ``make demo`` / ``hf-magicdec demo`` (a preset of ``bench``)
* :mod:`.cli`     the ``hf-magicdec`` entry point (``--help``, ``--version``, ``--quiet``)
"""

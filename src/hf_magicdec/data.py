"""Deprecated alias of :mod:`hf_magicdec_bench.data`, which the tooling moved to; removed in 0.3.

Import ``from hf_magicdec_bench import data`` instead.
"""

import warnings

from hf_magicdec_bench import data as _moved
from hf_magicdec_bench.data import *  # noqa: F401,F403
from hf_magicdec_bench.data import __all__  # noqa: F401

warnings.warn("hf_magicdec.data moved to hf_magicdec_bench.data; this alias will be removed in 0.3",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(_moved, name)  # the private names too, for one release

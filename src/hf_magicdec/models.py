"""Deprecated alias of :mod:`hf_magicdec_bench.models`, which the tooling moved to; removed in 0.3.

Import ``from hf_magicdec_bench import models`` instead.
"""

import warnings

from hf_magicdec_bench import models as _moved
from hf_magicdec_bench.models import *  # noqa: F401,F403
from hf_magicdec_bench.models import __all__  # noqa: F401

warnings.warn("hf_magicdec.models moved to hf_magicdec_bench.models; this alias will be removed in 0.3",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(_moved, name)  # the private names too, for one release

"""Deprecated: the cost model is :mod:`hf_magicdec.planner` now (``costmodel.planner`` is
``planner.search``). This alias, including its submodules, goes away in the next release."""

import sys
import warnings

from .. import planner as _planner
from ..planner import *  # noqa: F401,F403
from ..planner import __all__  # noqa: F401
from ..planner import (acceptance, calibrate, calibration_store, dtypes, gamma, hardware, modelspec, roofline, search,
                       selection, speculation)

warnings.warn("hf_magicdec.costmodel is deprecated; import hf_magicdec.planner instead.", DeprecationWarning,
              stacklevel=2)

for _module in (acceptance, calibrate, calibration_store, dtypes, gamma, hardware, modelspec, roofline, selection,
                speculation):
    sys.modules[f"{__name__}.{_module.__name__.rsplit('.', 1)[1]}"] = _module
sys.modules[f"{__name__}.planner"] = search
del _module, _planner

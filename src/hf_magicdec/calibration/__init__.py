"""Calibration: time the engine's own steps (:func:`measure_steps`), fit the torch-free cost model to
them (:mod:`.fit`; on a CPU with the row curve of :func:`measure_linear_rows`), keep the result
(:mod:`.store`); :func:`calibrate` does all three, :func:`probe_acceptance` measures α. The planner
never imports it: a :class:`Calibration` reaches it as ``search_plan(..., calibration=)`` or as the
device model ``generate`` plans with.
"""

from .acceptance import probe_acceptance
from .fit import fit_quantized
from .measure import calibrate
from .rows import measure_linear_rows
from .steps import measure_steps
from .store import (Calibration, Fit, Measurement, StepTimes, cache_root, calibration_path, cpu_name, device_key,
                    load_calibration, other_thread_counts)

__all__ = ["Calibration", "Fit", "Measurement", "StepTimes", "cache_root", "calibrate", "calibration_path",
           "cpu_name", "device_key", "fit_quantized", "load_calibration", "measure_linear_rows",
           "measure_steps", "other_thread_counts", "probe_acceptance"]

"""Calibration: time the engine's own steps, fit the torch-free cost model to them, keep the result.

* :mod:`.steps`  :func:`measure_steps`: T_T, T_V(γ), T_D(budget) on one prefilled (or synthetic) cache;
* :mod:`.fit`  the torch-free fit of the roofline's effective rates to timed forwards (:func:`.fit.fit`,
  :func:`fit_quantized`);
* :mod:`.store`  the records (:class:`Measurement`, :class:`StepTimes`, :class:`Fit`,
  :class:`Calibration`) and their JSON cache per model, device and dtype (:func:`load_calibration`,
  :func:`calibration_path`, :func:`device_key`, :func:`cache_root`, :func:`cpu_name`);
* :mod:`.measure`  :func:`calibrate`: measure a few operating points and fit (cached as JSON);
* :mod:`.acceptance`  :func:`probe_acceptance`: one short generation's acceptance rate.

The planner (:mod:`hf_magicdec.planner`) never imports this package: a :class:`Calibration` reaches
it as ``search_plan(..., calibration=)`` or as the device model ``generate`` plans with.
``hf-magicdec plan --calibrate`` and ``scripts/`` use it.
"""

from .acceptance import probe_acceptance
from .fit import fit_quantized
from .measure import calibrate
from .steps import measure_steps
from .store import (
    Calibration,
    Fit,
    Measurement,
    StepTimes,
    cache_root,
    calibration_path,
    cpu_name,
    device_key,
    load_calibration,
)

__all__ = ["Calibration", "Fit", "Measurement", "StepTimes", "cache_root", "calibrate", "calibration_path",
           "cpu_name", "device_key", "fit_quantized", "load_calibration", "measure_steps", "probe_acceptance"]

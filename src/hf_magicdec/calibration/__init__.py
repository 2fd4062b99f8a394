"""Calibration: time the engine's own steps and fit the planner to them.

* :func:`measure_steps`: T_T, T_V(γ), T_D(budget) on one prefilled (or synthetic) cache;
* :func:`calibrate`: measure a few operating points and fit the roofline (cached as JSON);
* :func:`probe_acceptance`: one short generation's acceptance rate.

It drives the engine through its step functions and hands the torch-free planner
(:mod:`hf_magicdec.planner.calibrate`) the numbers; ``hf-magicdec plan --calibrate`` and
``scripts/`` use it.
"""

from .acceptance import probe_acceptance
from .fit import calibrate
from .steps import measure_steps

__all__ = ["calibrate", "measure_steps", "probe_acceptance"]

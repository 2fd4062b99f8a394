"""Two differences of Triton's CPU interpreter (``TRITON_INTERPRET=1``) between the oldest torch and
Triton that ``pyproject.toml`` admits (torch 2.11, Triton 3.6: the lent GPU machine's stack) and the
ones CI runs (torch 2.13, Triton 3.9), bridged for what runs the kernels interpreted: the tests
(``tests/conftest.py`` applies them before any kernel is imported) and the scripts that run them on a
CPU (``scripts/gpu_check.py --smoke``, ``scripts/fuzz.py``). The library never imports this module:
on a GPU the kernels are compiled, and nothing here changes on torch >= 2.13 with Triton >= 3.9.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
import sys

import torch
import torch.library

__all__ = ["bridge_triton_interpreter"]


def _release(version: str) -> tuple[int, int]:
    """``"2.11.0+cu130"`` -> ``(2, 11)``; ``(0, 0)`` for a version that does not start so."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def _bridge_wrap_triton() -> bool:
    """torch 2.11's ``torch.library.wrap_triton`` raises ("only works on functions annotated with
    triton.jit") for the ``InterpretedFunction`` that ``@triton.jit`` returns under
    ``TRITON_INTERPRET=1``; torch 2.13 returns such a kernel unchanged (launched eagerly, which is
    all the interpreter can do). Give torch < 2.13 the 2.13 behaviour for interpreted kernels only
    (everything else still goes to torch's own ``wrap_triton``; 2.12 was not checked, and the bridge
    changes nothing where torch already accepts such kernels). Must run before
    ``hf_magicdec.kernels.triton_kernels`` does ``from torch.library import wrap_triton``."""
    if _release(torch.__version__) >= (2, 13) or getattr(torch.library.wrap_triton, "_hf_magicdec_bridge", False):
        return False
    from triton.runtime import interpreter  # optional dependency: only under TRITON_INTERPRET

    original = torch.library.wrap_triton

    @functools.wraps(original)
    def wrap_triton(triton_kernel):
        if isinstance(triton_kernel, interpreter.InterpretedFunction):
            return triton_kernel
        return original(triton_kernel)

    wrap_triton._hf_magicdec_bridge = True
    torch.library.wrap_triton = wrap_triton
    return True


def _bridge_interpreter_index() -> bool:
    """Triton 3.6's interpreter turns a scalar tensor into a Python int (``__index__``, e.g. for
    ``range(start, stop, BLOCK)`` with loaded bounds) by ``int()`` of a 1-element array, which
    current NumPy refuses (2.4.6 here: "only 0-dimensional arrays can be converted to Python
    scalars"); Triton 3.9 squeezes the array first. Do the same on Triton < 3.9 (3.7 and 3.8 were not
    checked; the result is the same wherever ``int()`` worked)."""
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:  # a Triton installed under another name
        version = None
    if version is not None and _release(version) >= (3, 9):
        return False
    from triton.runtime import interpreter  # optional dependency: only under TRITON_INTERPRET

    if version is None and _release(sys.modules["triton"].__version__) >= (3, 9):
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_hf_magicdec_bridge", False):
        return False

    @functools.wraps(original)
    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor._hf_magicdec_bridge = True
    interpreter._patch_lang_tensor = _patch_lang_tensor
    return True


def bridge_triton_interpreter() -> list[str]:
    """Apply the torch 2.11 / Triton 3.6 interpreter bridges above when ``TRITON_INTERPRET`` is
    set and Triton is installed (idempotent; nothing is imported or changed otherwise, and nothing
    changes on torch >= 2.13 with Triton >= 3.9, nor for kernels compiled for a GPU). Returns the
    names of the bridges it installed."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") or importlib.util.find_spec("triton") is None:
        return []
    installed = []
    for bridge in (_bridge_wrap_triton, _bridge_interpreter_index):
        try:
            if bridge():
                installed.append(bridge.__name__)
        except (ImportError, AttributeError):  # a Triton or torch laid out otherwise: leave it alone
            pass
    return installed


"""Measuring one ``generate`` call: prefill and decode clocks, peak memory, environment.

Prefill and decode are split by a streamer timestamp, identically for every method: ``generate``
hands the prompt to the streamer before any forward, and the first generated token right after
prefill (for MagicDec, after the draft views are built too). *Decode* is everything after that
first token until ``generate`` returns.

With a progress bar, the same bar first shows the prefill (prompt tokens through the model's decoder
layers, counted by forward hooks that live only until the first token, so decode is timed without
them), then the decode (tokens of row 0). Stock ``generate`` and MagicDec's chunked prefill alike:
the hooks sit on the model, not in either decoding loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from hf_magicdec import MagicDecWarning, __version__
from hf_magicdec.calibration import cpu_name
from torch.nn.modules.module import register_module_forward_pre_hook
from transformers import PreTrainedModel
from transformers.generation.streamers import BaseStreamer
from transformers.modeling_layers import GradientCheckpointingLayer


class PrefillProgress:
    """Moves a tqdm ``bar`` through the prompt while a ``generate`` call prefills it.

    Until the first model forward it watches every module call (a global forward pre-hook) for the
    outermost ``PreTrainedModel``, then counts that model's decoder layers finishing: each one adds
    ``rows x chunk tokens / layers`` to the bar (whose total is all rows' prompt tokens), so a prompt
    prefilled at once (stock ``generate``) and one prefilled in chunks (MagicDec) both move it layer by
    layer. :meth:`close` removes every hook and hands the bar back as it was (description, total,
    unit) for the decode.
    """

    def __init__(self, bar, prompt_tokens: int):
        self.bar = bar
        self.total = max(int(prompt_tokens), 1)
        self._saved = (bar.desc, bar.total, bar.unit)
        self._done = 0.0
        self._layers = 1
        self._handles = []
        bar.unit = "tok"
        bar.set_description_str(f"{bar.desc} prefill", refresh=False)
        bar.reset(total=self.total)
        self._finder = register_module_forward_pre_hook(self._find)

    def _find(self, module, args):
        if self._finder is None or not isinstance(module, PreTrainedModel):
            return None
        self._finder.remove()
        self._finder = None
        layers = [m for m in module.modules() if isinstance(m, GradientCheckpointingLayer)]
        if layers:
            self._layers = len(layers)
            self._handles = [m.register_forward_hook(self._count, with_kwargs=True) for m in layers]
        else:  # no recognisable decoder layers: count whole forwards of the model
            self._handles = [module.register_forward_hook(self._count, with_kwargs=True)]
        return None

    def _count(self, module, args, kwargs, output):
        x = args[0] if args else kwargs.get("hidden_states", kwargs.get("input_ids"))
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            self._done += x.shape[0] * x.shape[1] / self._layers
            n = min(int(self._done + 1e-6), self.total)
            if n > self.bar.n:
                self.bar.update(n - self.bar.n)
        return None

    def close(self) -> None:
        """Remove the hooks; restore the bar for the decode (idempotent)."""
        if self._finder is not None:
            self._finder.remove()
            self._finder = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._saved is not None:
            desc, total, unit = self._saved
            self._saved = None
            self.bar.unit = unit
            self.bar.set_description_str(desc, refresh=False)
            self.bar.reset(total=total)


class Clock(BaseStreamer):
    """A streamer that only timestamps: prompt in, first new token out, end; optional token bar.

    Parameters
    ----------
    progress : tqdm bar or None
        Shows the prefill (:class:`PrefillProgress`, prompt tokens) until the first new token, then
        advances by the tokens of row 0 (stock ``generate`` streams one per step; MagicDec streams
        a step's accepted tokens at once).
    """

    def __init__(self, progress=None):
        self.start: float | None = None
        self.first: float | None = None
        self.stop: float | None = None
        self.progress = progress
        self.prefill: PrefillProgress | None = None
        self._rows = None
        #: ``(new tokens of the streamed row, perf_counter)`` after every step from the first new
        #: token: where the generation was when (the speedup-vs-position plot of long generations).
        self.trace: list[tuple[int, float]] = []

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if self.start is None:
            self.start = now
            self._rows = value.shape[0] if value.dim() == 2 else 1
            if self.progress is not None and not getattr(self.progress, "disable", False):
                # the bar shows the prefill until the first token
                self.prefill = PrefillProgress(self.progress, value.numel())  # all rows' prompt tokens
            return
        if self.first is None:
            self.first = now
            self.close()
        # Stock puts [B] (one token per row); MagicDec puts a row's [k] new tokens (after row 0
        # finishes, the next live row's).
        step = 1 if (self._rows > 1 and value.numel() == self._rows) else value.numel()
        self.trace.append(((self.trace[-1][0] if self.trace else 0) + step, now))
        if self.progress is not None:
            # capped at the bar's total
            total = getattr(self.progress, "total", None)
            if total is not None:
                step = max(0, min(step, int(total) - int(self.progress.n)))
            if step:
                self.progress.update(step)

    def end(self) -> None:
        self.stop = time.perf_counter()
        self.close()

    def close(self) -> None:
        """Remove the prefill hooks, if any (also after a failed ``generate``)."""
        if self.prefill is not None:
            self.prefill.close()
            self.prefill = None


def _release_freed_memory() -> None:
    """Return freed heap memory to the OS (glibc ``malloc_trim``), so RSS deltas mean something."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory of the work inside ``with``, in bytes above the level at entry.

    On CUDA it is ``torch.cuda.max_memory_allocated`` (tensors only); on the CPU the growth of the
    process's resident set size, sampled every 5 ms from ``/proc/self/statm`` after freed heap
    memory was handed back to the OS (everything, tensors included; ``None`` where ``/proc`` does
    not exist).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.peak: int | None = None
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def _rss(self) -> int | None:
        try:
            with open("/proc/self/statm") as fh:
                return int(fh.read().split()[1]) * self._page
        except OSError:
            return None

    def _sample(self, base: int) -> None:
        peak = base
        while not self._stop.wait(0.005):
            peak = max(peak, self._rss() or base)
        self.peak = max(peak, self._rss() or base) - base

    def __enter__(self):
        gc.collect()
        _release_freed_memory()  # else the allocator's free lists hide this run's growth
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            base = self._rss()
            self._thread = threading.Thread(target=self._sample, args=(base,), daemon=True) if base else None
            if self._thread:
                self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
        elif self._thread:
            self._stop.set()
            self._thread.join()
        return False


@dataclass
class Measurement:
    """One method on one batch of prompts: medians over repeats and the last run's output."""

    prefill_s: float
    decode_s: float
    prefill_all: list[float]
    decode_all: list[float]
    sequences: torch.Tensor  # [B, P + T]
    speculation: Any = None  # SpeculationStats of the last run (MagicDec only)
    peak_bytes: int | None = None
    extra: dict = field(default_factory=dict)


@contextlib.contextmanager
def quiet_warm_up():
    """Around a discarded warm-up call: its plan (for a tiny prompt, usually plain decoding) is not
    the measured call's, so the :class:`~hf_magicdec.MagicDecWarning` it raises is not shown."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MagicDecWarning)
        yield


def measure(run: Callable[[Clock], Any], repeats: int, device: torch.device, progress_factory=None) -> Measurement:
    """Call ``run(clock)`` ``repeats`` times; return median prefill and decode seconds.

    ``run`` must call ``generate(..., streamer=clock)`` and return its output (a tensor or a
    ``GenerateOutput``). Outputs of every repeat must be identical (greedy), else ``RuntimeError``.
    """
    prefill, decode, peaks = [], [], []
    sequences = stats = None
    for _ in range(repeats):
        bar = progress_factory() if progress_factory else None
        clock = Clock(bar)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        try:
            with PeakMemory(device) as mem:
                out = run(clock)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        finally:
            clock.close()
        end = time.perf_counter()
        if bar is not None:
            bar.close()
        seqs = out if isinstance(out, torch.Tensor) else out.sequences
        if clock.start is None or clock.first is None:
            raise RuntimeError("the streamer saw no generated token; is max_new_tokens >= 2?")
        prefill.append(clock.first - clock.start)
        decode.append((clock.stop or end) - clock.first)
        peaks.append(mem.peak)
        if sequences is not None and not torch.equal(sequences, seqs):
            raise RuntimeError("greedy outputs differ between repeats of the same method")
        sequences, stats = seqs, getattr(out, "speculation", None)
        trace = [(n, t - clock.first) for n, t in clock.trace]
    return Measurement(
        prefill_s=statistics.median(prefill),
        decode_s=statistics.median(decode),
        prefill_all=prefill,
        decode_all=decode,
        sequences=sequences,
        speculation=stats,
        peak_bytes=max((p for p in peaks if p is not None), default=None),
        extra={"trace": trace},
    )


def _git_revision() -> str | None:
    root = Path(__file__).resolve().parents[3]
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if rev.returncode != 0:
        return None
    return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()} ({torch.get_num_threads()} threads)"


def environment(device: torch.device) -> dict:
    """What a reader needs to reproduce or judge a number."""
    return {
        "device": device_name(device),
        "device_type": device.type,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "hf_magicdec": __version__,
        "git": _git_revision(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        # 1, 5 and 15-minute load averages when the run started: a busy machine shows here
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }

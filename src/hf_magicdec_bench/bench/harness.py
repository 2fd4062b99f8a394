"""Measuring one ``generate`` call: prefill and decode clocks, peak memory, environment.

Prefill and decode are split by a streamer timestamp, identically for every method: ``generate``
hands the prompt to the streamer before any forward, and the first generated token right after
prefill (for MagicDec, after the draft views are built too). *Decode* is everything after that
first token until ``generate`` returns.
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from hf_magicdec import __version__
from hf_magicdec.planner.calibrate import cpu_name
from transformers.generation.streamers import BaseStreamer


class Clock(BaseStreamer):
    """A streamer that only timestamps: prompt in, first new token out, end; optional token bar.

    Parameters
    ----------
    progress : tqdm bar or None
        Advanced by the tokens of row 0 (stock ``generate`` streams one per step; MagicDec streams
        a step's accepted tokens at once).
    """

    def __init__(self, progress=None):
        self.start: float | None = None
        self.first: float | None = None
        self.stop: float | None = None
        self.progress = progress
        self._rows = None

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if self.start is None:
            self.start = now
            self._rows = value.shape[0] if value.dim() == 2 else 1
            return
        if self.first is None:
            self.first = now
        if self.progress is not None:
            # Stock puts [B] (one token per row); MagicDec puts row 0's [k] new tokens.
            self.progress.update(1 if (self._rows > 1 and value.numel() == self._rows) else value.numel())

    def end(self) -> None:
        self.stop = time.perf_counter()


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
        with PeakMemory(device) as mem:
            out = run(clock)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
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
    return Measurement(
        prefill_s=statistics.median(prefill),
        decode_s=statistics.median(decode),
        prefill_all=prefill,
        decode_all=decode,
        sequences=sequences,
        speculation=stats,
        peak_bytes=max((p for p in peaks if p is not None), default=None),
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
    }

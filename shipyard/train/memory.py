"""This process's memory on the CPU: what is resident, its peak over a stretch of work, and the C heap during a step.

**Why the heap needs a rule.** glibc serves an allocation above its mmap threshold with a mapping of its own, given
back on free; below it, from the heap, whose freed pages stay resident until trimmed. The threshold starts at
128 KiB but rises to the size of every mapped block freed, up to 32 MiB (M_MMAP_THRESHOLD in mallopt(3)). So after
a trainer's first step, a layer's activations — a few MiB each, of new sizes with every batch — come from the heap,
and a step's resident peak grew with its tokens though its live tensors did not: on the demo's Qwen2.5-0.5B,
+1.2 MB per token of a row, a 23 GB peak on a recorded step of 13k tokens; with the threshold held at 128 KiB the
same steps peak at a flat 3.6 GB above the weights and optimizer state, whatever the row's length (L = 1,000 …
4,000), in the same time (docs/benchmarks.md, "Trainer memory"). Held process-wide, the rule costs an in-process
inference engine ~25% of its decoding speed (every KV-cache and logits buffer a fresh mapping: `shipyard bench
engine`, 8.15 → 6.17 tokens/s), so `step_heap` holds it only for the step, then sets the threshold to 32 MiB for
what runs between steps and hands the heap's free pages back (`malloc_trim`). An engine thread decoding during a
step allocates by the step's rule. A no-op off glibc.

**Peaks.** `ru_maxrss` is the process's peak since it started, so it can only stay or rise; `PeakRSS` samples the
resident set in a thread over one stretch of work (a step), so a step's figure is its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

_STATM = Path("/proc/self/statm")
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
STEP_THRESHOLD = 128 << 10  # glibc's initial mmap threshold
BETWEEN_STEPS_THRESHOLD = 32 << 20  # the most glibc's dynamic threshold rises to (64-bit)


def resident_mb() -> float:
    """This process's resident set (MiB); 0 where /proc is not there."""
    try:
        pages = int(_STATM.read_text().split()[1])
    except FileNotFoundError:
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakRSS:
    """The peak resident set (MiB) over a `with` block, sampled every `period` seconds in a thread (and at both ends):
    a peak shorter than the period can be missed — at 5 ms, not one of a training step's. Reusable."""

    def __init__(self, period: float = 0.005):
        self.period = period
        self.peak = 0.0

    def _sample(self, stop: threading.Event) -> None:
        while not stop.wait(self.period):
            self.peak = max(self.peak, resident_mb())

    def __enter__(self) -> PeakRSS:
        self.peak = resident_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(self._stop,), name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_mb())


def _glibc() -> ctypes.CDLL | None:
    if sys.platform != "linux":
        return None
    libc = ctypes.CDLL(None)
    try:
        libc.mallopt.argtypes, libc.malloc_trim.argtypes = [ctypes.c_int, ctypes.c_int], [ctypes.c_size_t]
    except AttributeError:  # not glibc (musl has neither)
        return None
    return libc


_LIBC = _glibc()
_lock = threading.Lock()
_inside = 0  # steps under way in this process (two trainers, or a step inside another)


@contextlib.contextmanager
def step_heap(enabled: bool = True) -> Iterator[None]:
    """The C heap's rule for a CPU training step (module docstring): mmap threshold 128 KiB inside, 32 MiB after,
    free heap pages handed back on the way out — by the last of overlapping steps."""
    global _inside
    if _LIBC is None or not enabled:
        yield
        return
    with _lock:
        _inside += 1
        _LIBC.mallopt(_M_MMAP_THRESHOLD, STEP_THRESHOLD)
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            if _inside == 0:
                _LIBC.mallopt(_M_MMAP_THRESHOLD, BETWEEN_STEPS_THRESHOLD)
                _LIBC.malloc_trim(0)

"""The CPU time a call costs this process: the bound linear-time tests put on the work itself.

Wall-clock bounds on a 2-core machine measure its load too (another test run, a compile beside it: 2-3x the idle
time was seen), so a test that guards against super-linear work times the process's own CPU (`time.process_time`,
all its threads) and leaves room of an order of magnitude: the quadratic work those tests catch takes hours."""

from __future__ import annotations

import time
from collections.abc import Callable


def cpu_seconds(fn: Callable[..., object], *args: object) -> float:
    start = time.process_time()
    fn(*args)
    return time.process_time() - start

"""The memory a piece of work costs, measured so that only that work is seen: never the test process's resident set.

The test process's resident set (`ru_maxrss`, /proc/self/statm) sees every thread's allocations — a server another
test left running, a tokenizer's pool — and glibc's arenas, whose freed pages stay resident after earlier tests; and
`ru_maxrss` never falls, so a test after a big one cannot see its own growth at all. Two ways instead:

* `traced()`: the most memory the Python allocators held above the block's start, for work in pure Python (the
  sandbox host's reader, the tools' reads): `tracemalloc` sees every object those make, and nothing from before.
* `in_child(script)`: a fresh interpreter that does only the measured work and prints its figures as JSON — for
  memory that only the resident set shows (glibc's heap under a training step, `PeakRSS` itself). In it,
  `reset_peak()` restarts the kernel's high-water mark (VmHWM) from the resident set now, and `peak_mb()` reads it:
  an exact peak, not a sampled one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent
_STATUS = Path("/proc/self/status")


@dataclass
class Traced:
    peak_mb: float = 0.0  # set when the block ends


@contextlib.contextmanager
def traced() -> Iterator[Traced]:
    """The peak of Python allocations (MiB) made in the block, above those live when it began (any thread)."""
    out = Traced()
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield out
    finally:
        out.peak_mb = (tracemalloc.get_traced_memory()[1] - base) / 2**20
        if started:
            tracemalloc.stop()


def _status_mb(field: str) -> float:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"no {field} in {_STATUS}")


def reset_peak() -> float:
    """In a child: restart this process's resident high-water mark from its resident set now (MiB), returned."""
    Path("/proc/self/clear_refs").write_text("5")  # Linux >= 4.0: VmHWM := VmRSS
    return _status_mb("VmRSS")


def peak_mb() -> float:
    """In a child: the most this process has had resident (MiB) since the last `reset_peak`."""
    return _status_mb("VmHWM")


def resident_mb() -> float:
    return _status_mb("VmRSS")


@functools.cache
def _peak_problem() -> str | None:
    if sys.platform != "linux":
        return "not Linux"
    probe = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(TESTS)!r}); "
                            "import own_memory; own_memory.reset_peak()"], capture_output=True, text=True)
    return None if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["?"])[-1]


TEARDOWN_FREE_EXIT = "\nimport os as _os\nsys.stdout.flush()\nsys.stderr.flush()\n_os._exit(0)\n"


def in_child(script: str, *args: str, timeout: float = 600) -> dict:
    """Run `script` in a fresh interpreter (this directory importable, `sys.argv[1:]` = `args`); its last line of
    output is JSON, returned. Skips where this host cannot reset a process's peak (no /proc/self/clear_refs)."""
    import pytest  # not in the child, which imports this module for `reset_peak` and `peak_mb`

    problem = _peak_problem()
    if problem is not None:
        pytest.skip(f"cannot reset a process's resident peak here: {problem}")
    # The script's output flushed, the child leaves without tearing the interpreter down: it measures the steps, not
    # teardown, where torch once aborted on CI ("terminate called without an active exception", no Python frame).
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r})\n" + script + TEARDOWN_FREE_EXIT
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])

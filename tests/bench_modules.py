"""Imported by test modules as `from bench_modules import BENCH, bench_module`: a benchmark script of bench/ as a
module, for tests of its arithmetic. bench/ is on `sys.path` only while it is imported (its file names — engine,
search, sandbox, sync — would otherwise shadow any top-level module of the same name for the whole session)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_module(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))

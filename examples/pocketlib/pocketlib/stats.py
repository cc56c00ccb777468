"""Descriptive statistics on sequences of numbers."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence


def _require(values: Sequence[float]) -> None:
    if not values:
        raise ValueError("at least one value is required")


def mean(values: Sequence[float]) -> float:
    _require(values)
    return math.fsum(values) / len(values)


def median(values: Sequence[float]) -> float:
    _require(values)
    ordered = sorted(values)
    mid = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[mid])
    return (ordered[mid - 1] + ordered[mid]) / 2


def mode(values: Sequence[float]) -> list[float]:
    """All values that occur most often, in ascending order."""
    _require(values)
    counts = Counter(values)
    top = max(counts.values())
    return sorted(v for v, c in counts.items() if c == top)


def variance(values: Sequence[float], sample: bool = True) -> float:
    """Sample variance (n - 1) by default, population variance with ``sample=False``."""
    _require(values)
    n = len(values)
    if sample and n < 2:
        raise ValueError("sample variance needs at least two values")
    m = mean(values)
    return math.fsum((v - m) ** 2 for v in values) / (n - 1 if sample else n)


def stdev(values: Sequence[float], sample: bool = True) -> float:
    return math.sqrt(variance(values, sample))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks."""
    _require(values)
    if not 0 <= q <= 100:
        raise ValueError("q must be between 0 and 100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)

"""Half-open integer intervals [start, end) and operations on sorted sets of them."""

from __future__ import annotations

Interval = tuple[int, int]


def _check(intervals: list[Interval]) -> None:
    for start, end in intervals:
        if start > end:
            raise ValueError(f"interval start {start} is after its end {end}")


def merge(intervals: list[Interval]) -> list[Interval]:
    """Merge overlapping or touching intervals; the result is sorted and disjoint."""
    _check(intervals)
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[0] < i[1]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The intervals covered by both ``a`` and ``b``."""
    a, b = merge(a), merge(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The parts of ``a`` not covered by ``b``."""
    out = []
    b = merge(b)
    for start, end in merge(a):
        cursor = start
        for bs, be in b:
            if be <= cursor or bs >= end:
                continue
            if bs > cursor:
                out.append((cursor, bs))
            cursor = max(cursor, be)
        if cursor < end:
            out.append((cursor, end))
    return out


def total_length(intervals: list[Interval]) -> int:
    """The number of integers covered by the union of ``intervals``."""
    return sum(end - start for start, end in merge(intervals))


def contains(intervals: list[Interval], point: int) -> bool:
    """True if ``point`` lies in any of the intervals."""
    return any(start <= point < end for start, end in intervals)

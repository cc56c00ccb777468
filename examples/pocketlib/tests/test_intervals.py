import pytest

from pocketlib import intervals


def test_merge_overlapping_and_touching():
    assert intervals.merge([(5, 8), (1, 3), (2, 4), (8, 10)]) == [(1, 4), (5, 10)]


def test_merge_drops_empty():
    assert intervals.merge([(3, 3), (1, 2)]) == [(1, 2)]


def test_merge_rejects_reversed():
    with pytest.raises(ValueError):
        intervals.merge([(4, 1)])


def test_intersect():
    assert intervals.intersect([(0, 5), (10, 15)], [(3, 12)]) == [(3, 5), (10, 12)]


def test_intersect_disjoint():
    assert intervals.intersect([(0, 2)], [(2, 4)]) == []


def test_subtract():
    assert intervals.subtract([(0, 10)], [(2, 3), (5, 7)]) == [(0, 2), (3, 5), (7, 10)]


def test_subtract_everything():
    assert intervals.subtract([(1, 4)], [(0, 5)]) == []


def test_total_length_counts_overlap_once():
    assert intervals.total_length([(0, 5), (3, 8)]) == 8


def test_contains_half_open():
    assert intervals.contains([(0, 5)], 0)
    assert not intervals.contains([(0, 5)], 5)

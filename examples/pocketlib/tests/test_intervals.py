import pytest

from pocketlib.intervals import contains, intersect, merge, subtract, total_length


def test_merge_overlapping_and_touching():
    assert merge([(5, 8), (1, 3), (2, 4), (8, 10)]) == [(1, 4), (5, 10)]


def test_merge_drops_empty():
    assert merge([(3, 3), (1, 2)]) == [(1, 2)]


def test_merge_rejects_reversed():
    with pytest.raises(ValueError):
        merge([(4, 1)])


def test_intersect():
    assert intersect([(0, 5), (10, 15)], [(3, 12)]) == [(3, 5), (10, 12)]


def test_intersect_disjoint():
    assert intersect([(0, 2)], [(2, 4)]) == []


def test_subtract():
    assert subtract([(0, 10)], [(2, 3), (5, 7)]) == [(0, 2), (3, 5), (7, 10)]


def test_subtract_everything():
    assert subtract([(1, 4)], [(0, 5)]) == []


def test_total_length_counts_overlap_once():
    assert total_length([(0, 5), (3, 8)]) == 8


def test_contains_half_open():
    assert contains([(0, 5)], 0)
    assert not contains([(0, 5)], 5)

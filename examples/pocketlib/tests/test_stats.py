import math

import pytest

from pocketlib.stats import mean, median, mode, percentile, stdev, variance


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_mean_empty():
    with pytest.raises(ValueError):
        mean([])


def test_median_odd_even():
    assert median([3, 1, 2]) == 2
    assert median([4, 1, 3, 2]) == 2.5


def test_mode_multimodal():
    assert mode([1, 2, 2, 3, 3]) == [2, 3]


def test_variance_sample_and_population():
    data = [2, 4, 4, 4, 5, 5, 7, 9]
    assert variance(data, sample=False) == 4
    assert math.isclose(variance(data), 32 / 7)


def test_variance_needs_two():
    with pytest.raises(ValueError):
        variance([1.0])


def test_stdev():
    assert stdev([2, 4, 4, 4, 5, 5, 7, 9], sample=False) == 2


@pytest.mark.parametrize("q, expected", [(0, 1), (50, 3), (100, 5), (25, 2)])
def test_percentile(q, expected):
    assert percentile([5, 1, 4, 2, 3], q) == expected


def test_percentile_interpolates():
    assert percentile([1, 2], 50) == 1.5


def test_percentile_range():
    with pytest.raises(ValueError):
        percentile([1], 101)

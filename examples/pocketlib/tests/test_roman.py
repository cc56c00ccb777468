import pytest

from pocketlib.roman import from_roman, is_roman, to_roman


@pytest.mark.parametrize("number, numeral", [(1, "I"), (4, "IV"), (9, "IX"), (14, "XIV"), (40, "XL"),
                                             (90, "XC"), (400, "CD"), (1994, "MCMXCIV"), (3999, "MMMCMXCIX")])
def test_to_roman(number, numeral):
    assert to_roman(number) == numeral


def test_round_trip_all():
    for n in range(1, 4000):
        assert from_roman(to_roman(n)) == n


@pytest.mark.parametrize("bad", [0, 4000, -3])
def test_to_roman_range(bad):
    with pytest.raises(ValueError):
        to_roman(bad)


def test_to_roman_type():
    with pytest.raises(TypeError):
        to_roman(2.5)
    with pytest.raises(TypeError):
        to_roman(True)


def test_from_roman_lowercase():
    assert from_roman("xlii") == 42


@pytest.mark.parametrize("bad", ["IIII", "VV", "IC", "ABC", ""])
def test_from_roman_rejects_non_canonical(bad):
    with pytest.raises(ValueError):
        from_roman(bad)


def test_is_roman():
    assert is_roman("MMXXIV")
    assert not is_roman("MMXXIIII")

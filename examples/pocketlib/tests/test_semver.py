import pytest

from pocketlib.semver import Version, max_satisfying, parse, satisfies


def test_parse_full():
    v = parse("1.4.2-rc.1+build.7")
    assert v == Version(1, 4, 2, ("rc", "1"), ("build", "7"))
    assert str(v) == "1.4.2-rc.1+build.7"


@pytest.mark.parametrize("bad", ["1.2", "01.2.3", "1.2.3-", "v1.2.3", "1.2.3.4"])
def test_parse_rejects(bad):
    with pytest.raises(ValueError):
        parse(bad)


def test_ordering_core():
    assert parse("1.2.3") < parse("1.2.4") < parse("1.3.0") < parse("2.0.0")


def test_prerelease_sorts_before_release():
    assert parse("1.0.0-alpha") < parse("1.0.0")


def test_prerelease_ordering_spec_example():
    chain = ["1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-alpha.beta", "1.0.0-beta", "1.0.0-beta.2", "1.0.0-beta.11",
             "1.0.0-rc.1", "1.0.0"]
    versions = [parse(v) for v in chain]
    assert versions == sorted(versions)


def test_build_metadata_ignored_in_equality():
    assert parse("1.0.0+a") == parse("1.0.0+b")


@pytest.mark.parametrize("part, expected", [("major", "2.0.0"), ("minor", "1.3.0"), ("patch", "1.2.4")])
def test_bump(part, expected):
    assert str(parse("1.2.3-rc.1").bump(part)) == expected


def test_bump_unknown():
    with pytest.raises(ValueError):
        parse("1.0.0").bump("micro")


def test_satisfies_range():
    assert satisfies("1.5.0", ">=1.2.0, <2.0.0")
    assert not satisfies("2.0.0", ">=1.2.0, <2.0.0")
    assert satisfies("1.0.0", "!=1.0.1")


def test_satisfies_bad_clause():
    with pytest.raises(ValueError):
        satisfies("1.0.0", "~1.0.0")


def test_max_satisfying():
    assert max_satisfying(["1.0.0", "1.9.9", "2.0.0", "1.10.0"], "<2.0.0") == "1.10.0"
    assert max_satisfying(["3.0.0"], "<2.0.0") is None

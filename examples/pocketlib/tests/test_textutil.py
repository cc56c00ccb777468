import pytest

from pocketlib.textutil import camel_case, levenshtein, slugify, snake_case, truncate, wrap


def test_slugify_accents_and_punctuation():
    assert slugify("Héllo, World!") == "hello-world"


def test_slugify_separator():
    assert slugify("a b  c", separator="_") == "a_b_c"


@pytest.mark.parametrize("name, expected", [("parseHTTPResponse", "parse_http_response"),
                                            ("simple", "simple"), ("HTMLParser", "html_parser"),
                                            ("kebab-case name", "kebab_case_name")])
def test_snake_case(name, expected):
    assert snake_case(name) == expected


def test_camel_case():
    assert camel_case("parse_http_response") == "parseHttpResponse"
    assert camel_case("__") == ""


def test_wrap():
    assert wrap("the quick brown fox jumps", 10) == ["the quick", "brown fox", "jumps"]


def test_wrap_long_word():
    assert wrap("a supercalifragilistic b", 5) == ["a", "supercalifragilistic", "b"]


def test_wrap_bad_width():
    with pytest.raises(ValueError):
        wrap("x", 0)


@pytest.mark.parametrize("a, b, d", [("kitten", "sitting", 3), ("", "abc", 3), ("same", "same", 0),
                                     ("flaw", "lawn", 2)])
def test_levenshtein(a, b, d):
    assert levenshtein(a, b) == d
    assert levenshtein(b, a) == d


def test_truncate():
    assert truncate("hello world", 8) == "hello w…"
    assert truncate("short", 10) == "short"
    assert truncate("abc", 1) == "…"

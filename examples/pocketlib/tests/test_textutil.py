import pytest

from pocketlib import textutil


def test_slugify_accents_and_punctuation():
    assert textutil.slugify("Héllo, World!") == "hello-world"


def test_slugify_separator():
    assert textutil.slugify("a b  c", separator="_") == "a_b_c"


@pytest.mark.parametrize("name, expected", [("parseHTTPResponse", "parse_http_response"),
                                            ("simple", "simple"), ("HTMLParser", "html_parser"),
                                            ("kebab-case name", "kebab_case_name")])
def test_snake_case(name, expected):
    assert textutil.snake_case(name) == expected


def test_camel_case():
    assert textutil.camel_case("parse_http_response") == "parseHttpResponse"
    assert textutil.camel_case("__") == ""


def test_wrap():
    assert textutil.wrap("the quick brown fox jumps", 10) == ["the quick", "brown fox", "jumps"]


def test_wrap_long_word():
    assert textutil.wrap("a supercalifragilistic b", 5) == ["a", "supercalifragilistic", "b"]


def test_wrap_bad_width():
    with pytest.raises(ValueError):
        textutil.wrap("x", 0)


@pytest.mark.parametrize("a, b, d", [("kitten", "sitting", 3), ("", "abc", 3), ("same", "same", 0),
                                     ("flaw", "lawn", 2)])
def test_levenshtein(a, b, d):
    assert textutil.levenshtein(a, b) == d
    assert textutil.levenshtein(b, a) == d


def test_truncate():
    assert textutil.truncate("hello world", 8) == "hello w…"
    assert textutil.truncate("short", 10) == "short"
    assert textutil.truncate("abc", 1) == "…"

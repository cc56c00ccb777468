import pytest

from pocketlib.inifile import IniError, parse_ini

SAMPLE = """
# global settings
name = demo

[server]
host = 127.0.0.1
port = 8080
debug = yes
tags = a, b , ,c

; another comment
[empty]
"""


def test_parse_sections_and_values():
    ini = parse_ini(SAMPLE)
    assert ini.get("", "name") == "demo"
    assert ini.get("server", "host") == "127.0.0.1"
    assert ini.sections["empty"] == {}


def test_typed_getters():
    ini = parse_ini(SAMPLE)
    assert ini.get_int("server", "port") == 8080
    assert ini.get_bool("server", "debug") is True
    assert ini.get_list("server", "tags") == ["a", "b", "c"]


def test_defaults():
    ini = parse_ini(SAMPLE)
    assert ini.get("server", "missing", "x") == "x"
    assert ini.get_int("nope", "port", 1) == 1
    assert ini.get_bool("server", "missing", False) is False
    assert ini.get_list("server", "missing") == []


def test_bad_bool():
    ini = parse_ini("[a]\nflag = maybe\n")
    with pytest.raises(ValueError):
        ini.get_bool("a", "flag")


@pytest.mark.parametrize("text, line", [("[broken\n", 1), ("a = 1\na = 2\n", 2), ("novalue\n", 1), (" = 3\n", 1),
                                        ("[s]\nx = 1\n[s]\ny = 2\n", 3)])
def test_errors_carry_line_numbers(text, line):
    with pytest.raises(IniError) as info:
        parse_ini(text)
    assert info.value.line == line

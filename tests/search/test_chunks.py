"""Syntax-aware chunking: definitions as units with their qualified names, a token cap, every line in one chunk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shipyard.search.chunks import MAX_CHUNK_CHARS, chunk_file, estimate_tokens
from shipyard.search.tree import LocalTree

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pocketlib"


def units(path, text, cap=1000):
    return [(c.start, c.end, c.symbol) for c in chunk_file(path, text, cap)]


def check_cover(text, chunks):
    """Every non-blank line is in exactly one chunk, chunks do not overlap, and each chunk's text is its lines."""
    lines = text.split("\n")
    seen = [0] * len(lines)
    for c in chunks:
        assert 1 <= c.start <= c.end <= len(lines)
        assert c.text == "\n".join(lines[c.start - 1:c.end])[:MAX_CHUNK_CHARS]
        for i in range(c.start - 1, c.end):
            seen[i] += 1
    assert all(n <= 1 for n in seen)
    assert all(seen[i] == 1 for i, line in enumerate(lines) if line.strip())


PY = '''import os


@cache
def top(x):
    return x


class Stack:
    """A stack."""

    size = 0

    def push(self, v):
        self.items.append(v)

    def pop(self):
        return self.items.pop()
'''


def test_python_definitions_are_units_with_their_decorators():
    assert units("m.py", PY) == [(1, 1, None), (4, 6, "top"), (9, 18, "Stack")]


def test_a_class_over_the_cap_is_cut_at_its_methods():
    chunks = chunk_file("m.py", PY, 20)
    assert [(c.start, c.end, c.symbol) for c in chunks] == [
        (1, 1, None), (4, 6, "top"), (9, 12, "Stack"), (14, 15, "Stack.push"), (17, 18, "Stack.pop")]
    check_cover(PY, chunks)


def test_a_function_over_the_cap_becomes_windows_named_for_it():
    text = "def long():\n" + "".join(f"    x{i} = {i} + {i}\n" for i in range(40))
    chunks = chunk_file("m.py", text, 30)
    assert len(chunks) > 1 and {c.symbol for c in chunks} == {"long"}
    for c in chunks:
        assert sum(estimate_tokens(c.text.split("\n"))) <= 30
    check_cover(text, chunks)


@pytest.mark.parametrize("path, text, expected", [
    ("a.js", "export function f(a) {\n  return a\n}\nconst g = (x) => x * 2;\nclass K {\n  m() { return 1 }\n}\n",
     [(1, 3, "f"), (4, 4, "g"), (5, 7, "K")]),
    ("a.ts", "interface I {\n  a: number\n}\ntype T = string;\nenum E { A }\nexport default class C {\n}\n",
     [(1, 3, "I"), (4, 4, "T"), (5, 5, "E"), (6, 7, "C")]),
    ("a.tsx", "export const App = () => {\n  return <div/>\n}\n", [(1, 3, "App")]),
    ("a.go", "package p\n\nfunc (s *Stack) Push(v int) {\n\ts.n++\n}\n\ntype Stack struct {\n\tn int\n}\n",
     [(1, 1, None), (3, 5, "Stack.Push"), (7, 9, "Stack")]),
    ("a.rs", "impl Foo {\n    fn bar(&self) -> i32 {\n        1\n    }\n}\nstruct Foo;\nmod m {\n    fn x() {}\n}\n",
     [(1, 5, "Foo"), (6, 6, "Foo"), (7, 9, "m")]),
])
def test_other_languages(path, text, expected):
    assert units(path, text) == expected
    check_cover(text, chunk_file(path, text, 1000))


def test_nested_names_are_qualified_in_every_language():
    js = "class K {\n  m() {\n    return 1\n  }\n  n() {\n    return 2\n  }\n}\n"
    assert [c.symbol for c in chunk_file("a.js", js, 8)] == ["K", "K.m", "K.n", "K"]
    rs = "impl Foo {\n    fn bar(&self) -> i32 {\n        1 + 2 + 3\n    }\n}\n"
    assert "Foo.bar" in [c.symbol for c in chunk_file("a.rs", rs, 8)]
    ts = "export function f(a) {\n  function inner() { return 1 }\n  return a\n}\n"
    assert [c.symbol for c in chunk_file("a.ts", ts, 8)] == ["f", "f.inner", "f"]  # not f.f (export wraps f)


def test_files_without_a_grammar_are_line_windows():
    text = "\n".join(f"line {i} of the notes" for i in range(200))
    chunks = chunk_file("NOTES.md", text, 50)
    assert chunks and all(c.language is None and c.symbol is None for c in chunks)
    assert all(c.end - c.start < 60 for c in chunks)
    check_cover(text, chunks)


def test_broken_and_hostile_sources_still_chunk():
    broken = "def f(:\n    return\nclass\n\x00\ndef g():\n    return 2\n"
    check_cover(broken, chunk_file("m.py", broken, 1000))
    minified = "var a=" + "1+" * 100_000 + "1;\n"
    (chunk,) = chunk_file("m.js", minified, 50)
    assert (chunk.start, chunk.end) == (1, 1) and len(chunk.text) == MAX_CHUNK_CHARS
    assert chunk_file("m.py", "", 10) == [] and chunk_file("m.py", "\n\n  \n", 10) == []
    with pytest.raises(ValueError):
        chunk_file("m.py", "x = 1", 0)


def test_the_example_repository_is_covered_at_any_cap():
    for path in sorted(EXAMPLE.rglob("*.py")):
        text = path.read_text()
        for cap in (8, 64, 256):
            check_cover(text, chunk_file(str(path.relative_to(EXAMPLE)), text, cap))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["def f():", "    return 1", "", "class C:", "    def m(self):", "        pass",
                                 "x = 1", "@dec", "# comment", "    '''doc'''"]), max_size=40),
       st.integers(1, 40))
def test_any_python_text_is_covered_once(lines, cap):
    text = "\n".join(lines)
    check_cover(text, chunk_file("m.py", text, cap))


def test_the_tree_lists_what_ripgrep_would_and_never_leaves_the_root(tmp_path):
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("def a():\n    return 1\n")
    (root / "blob.bin").write_bytes(b"\x00\x01binary")
    (root / "ignored.py").write_text("x = 1\n")
    (root / ".gitignore").write_text("ignored.py\n")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "h.py").write_text("x = 1\n")
    (root / "big.txt").write_text("x" * 2000)
    secret = tmp_path / "secret.py"
    secret.write_text("TOKEN = 'root only'\n")
    os.symlink(secret, root / "link.py")
    os.symlink(tmp_path, root / "pkg" / "up")
    tree = LocalTree(root, max_bytes=1000)
    assert sorted(tree.files()) == ["blob.bin", "pkg/a.py"]
    assert tree.read("pkg/a.py") == b"def a():\n    return 1\n"
    assert tree.read("blob.bin") is None and tree.read("big.txt") is None
    assert tree.read("link.py") is None and tree.read("pkg/up/secret.py") is None
    for bad in ("../secret.py", "/etc/passwd", "pkg/../../secret.py", ""):
        with pytest.raises(ValueError):
            tree.read(bad)
    with pytest.raises(NotADirectoryError):
        LocalTree(root / "pkg" / "a.py")

"""Choosing features to delete: symbols, the tests that reach them, and what must stay.

A *symbol* is a function or method (T1, T2) or a top-level function or class (T3) of the project's source (test
files, conftest and the venv excluded). A test *reaches* a symbol when coverage saw that test's context execute a
line of the symbol's body. A *feature* is a set of symbols; its FAIL_TO_PASS tests are the stable tests that reach
it, and its PASS_TO_PASS tests all other stable tests, which by construction never execute it.

Protected — never deleted: symbols whose body ran at import or collection time (the empty coverage context: the
codebase would stop importing), trivial bodies (fewer than `min_lines` lines), one-line definitions, and symbols
no test reaches (nothing would grade them).

Tiers (Composer's feature deletion, our thresholds):
- T1: one function or method body;
- T2: 2–4 functions of one module whose tests overlap (one feature spread over several functions);
- T3: whole top-level definitions of one module (function or class), removed with their signatures. Doctests in
  the removed docstrings (`pkg/mod.py::pkg.mod.func`) go with them: they are neither FAIL_TO_PASS nor PASS_TO_PASS.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from shipyard.harness.workspace import IGNORED_DIRS


@dataclass(frozen=True)
class Symbol:
    file: str  # repo-relative posix path
    qualname: str  # `func`, `Class.method`, `Class`
    start: int  # first line of the definition (decorators included)
    def_line: int
    body_start: int  # first line of the body after the docstring
    end: int
    top_level: bool
    is_class: bool = False

    @property
    def body_lines(self) -> range:
        return range(self.body_start, self.end + 1)

    @property
    def size(self) -> int:
        return self.end - self.body_start + 1


@dataclass
class Feature:
    tier: int
    symbols: tuple[Symbol, ...]
    fail_to_pass: list[str]
    pass_to_pass: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        first = self.symbols[0]
        stem = PurePosixPath(first.file).with_suffix("").as_posix().replace("/", ".")
        names = "+".join(s.qualname for s in self.symbols)
        return f"t{self.tier}-{stem}-{names}"[:120]


def is_test_file(path: str) -> bool:
    p = PurePosixPath(path)
    return (p.name.startswith("test_") or p.name.endswith("_test.py") or p.name == "conftest.py"
            or any(part in ("tests", "test", "testing") for part in p.parts[:-1]))


def source_files(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if not any(part in IGNORED_DIRS or part.startswith(".") for part in rel.parts) and not is_test_file(
                rel.as_posix()):
            out.append(rel.as_posix())
    return out


def _body_start(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> int | None:
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    if not body or body[0].lineno == node.lineno:  # docstring-only or one-line definition
        return None
    return body[0].lineno


def symbols_of(file: str, source: str) -> list[Symbol]:
    tree = ast.parse(source)
    out: list[Symbol] = []

    def add(node, qualname: str, top: bool) -> None:
        start = _body_start(node)
        if start is not None:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            out.append(Symbol(file, qualname, first, node.lineno, start, node.end_lineno, top,
                              isinstance(node, ast.ClassDef)))

    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            add(node, node.name, True)
        elif isinstance(node, ast.ClassDef):
            add(node, node.name, True)
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    add(item, f"{node.name}.{item.name}", False)
    return out


@dataclass
class Reach:
    """Which stable tests reach each symbol, and which symbols ran at import time."""

    tests: dict[Symbol, frozenset[str]]
    at_import: set[Symbol]


def reach(symbols: list[Symbol], coverage: dict[str, dict[int, set[str]]], stable: set[str]) -> Reach:
    tests: dict[Symbol, frozenset[str]] = {}
    at_import: set[Symbol] = set()
    for sym in symbols:
        lines = coverage.get(sym.file, {})
        contexts: set[str] = set()
        for n in sym.body_lines:
            contexts |= lines.get(n, set())
        if "" in contexts and not sym.is_class:
            at_import.add(sym)
        tests[sym] = frozenset(contexts & stable)
    return Reach(tests, at_import)


def is_doctest_of(test: str, sym: Symbol) -> bool:
    """Whether `test` is a doctest item collected from the docstring of `sym` or of one of its members."""
    file, _, name = test.partition("::")
    return file == sym.file and "::" not in name and (name.endswith(f".{sym.qualname}")
                                                       or f".{sym.qualname}." in name)


def candidates(symbols: list[Symbol], r: Reach, stable: set[str], tier: int, min_lines: int = 3) -> list[Feature]:
    """Features of one tier, smallest FAIL_TO_PASS first (most specific), then by name for determinism."""
    eligible = [s for s in symbols if s not in r.at_import and r.tests[s] and s.size >= min_lines]
    features: list[Feature] = []
    if tier == 1:
        features = [Feature(1, (s,), sorted(r.tests[s])) for s in eligible if not s.is_class]
    elif tier == 2:
        seen: set[frozenset[Symbol]] = set()
        funcs = [s for s in eligible if not s.is_class]
        for seed in funcs:
            peers = sorted((s for s in funcs if s.file == seed.file and s != seed and r.tests[s] & r.tests[seed]),
                           key=lambda s: (-len(r.tests[s] & r.tests[seed]), s.qualname))[:3]
            group = frozenset([seed, *peers])
            if len(group) >= 2 and group not in seen:
                seen.add(group)
                ordered = tuple(sorted(group, key=lambda s: s.start))
                features.append(Feature(2, ordered, sorted(frozenset().union(*(r.tests[s] for s in group)))))
    elif tier == 3:
        for s in eligible:
            if s.top_level and not any(m in r.at_import for m in symbols if m.file == s.file and
                                       m.start >= s.start and m.end <= s.end):
                f2p = sorted(t for t in r.tests[s] if not is_doctest_of(t, s))
                if f2p:
                    features.append(Feature(3, (s,), f2p))
    else:
        raise ValueError(f"unknown tier {tier}: tiers are 1, 2 and 3")
    for f in features:
        gone = {t for t in stable for s in f.symbols if tier == 3 and is_doctest_of(t, s)}
        f.pass_to_pass = sorted(stable - set(f.fail_to_pass) - gone)
    features = [f for f in features if f.pass_to_pass]  # something must show the rest still works
    return sorted(features, key=lambda f: (len(f.fail_to_pass), f.id))

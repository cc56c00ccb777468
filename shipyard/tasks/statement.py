"""Task statements and stub patches, from what the post-deletion tree reveals — never from the deleted code.

A statement names what to implement and where, the tests that check it, and lines of the repository's remaining
documentation that mention it. For T1/T2 the signature and docstring are still in the code, so the statement
quotes them from the *deleted* tree; for T3 nothing of the definition survives, so the statement names only the
symbol, its module and the tests. Each T1/T2 line begins "Implement the body of `f(a, b)` in `pkg/mod.py`": a
signature standing alone at the head of a line read to the bundled 0.5B as a tool to call, and it called it
(`{"name": "intersect", "arguments": …}`, issue 29).

The stub patch is the laziest plausible answer — `return None` in place of every deleted body (T3: stub
definitions with that body) — and must fail: it proves the tests check behaviour, not existence.
"""

from __future__ import annotations

import ast
from pathlib import Path, PurePosixPath

from shipyard.tasks.features import Feature, Symbol

DOC_SUFFIXES = (".md", ".rst", ".txt")
MAX_TESTS_LISTED = 12


def _find(tree: ast.Module, qualname: str) -> ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | None:
    scope: list[ast.stmt] = tree.body
    node = None
    for part in qualname.split("."):
        node = next((n for n in scope if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                     and n.name == part), None)
        if node is None:
            return None
        scope = node.body
    return node


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    return f"{node.name}({ast.unparse(node.args)}){returns}"


def _doc_mentions(root: Path, names: set[str], limit: int = 5) -> list[str]:
    found: list[str] = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.suffix not in DOC_SUFFIXES or any(p.startswith(".") for p in rel.parts) or not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if any(n in line for n in names) and len(found) < limit:
                found.append(f"{rel.as_posix()}: {line.strip()[:200]}")
    return found


def statement(feature: Feature, tree: Path) -> str:
    tests = feature.fail_to_pass
    listed = "\n".join(f"- {t}" for t in tests[:MAX_TESTS_LISTED])
    more = f"\n- … and {len(tests) - MAX_TESTS_LISTED} more" if len(tests) > MAX_TESTS_LISTED else ""
    parts: list[str] = []
    if feature.tier in (1, 2):
        parts.append("Some functions of this repository lost their implementation: each body now only raises "
                     "`NotImplementedError`. Implement them.\n")
        for sym in feature.symbols:
            node = _find(ast.parse((tree / sym.file).read_text()), sym.qualname)
            doc = (ast.get_docstring(node) or "").strip().splitlines() if node else []
            function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            what = f"the body of `{_signature(node)}`" if function else f"`{sym.qualname}`"
            owner = f", a method of `{sym.qualname.split('.')[0]}`," if "." in sym.qualname else ""
            parts.append(f"- Implement {what}{owner} in `{sym.file}`" + (f": {doc[0]}" if doc else ""))
    else:
        module = PurePosixPath(feature.symbols[0].file)
        kinds = ", ".join(f"`{s.qualname}` ({'class' if s.is_class else 'function'})" for s in feature.symbols)
        parts.append(f"A feature was removed from `{module}`: {kinds} no longer exists anywhere in the codebase. "
                     "Reimplement it in that module, with the interface the tests use, and export it the way "
                     "the rest of the package exports its features.")
    parts.append(f"\nThese tests currently fail and must pass:\n{listed}{more}")
    parts.append("\nEvery other test must keep passing. Do not edit the tests or the test configuration. "
                 "Run the suite with `.venv/bin/python -m pytest`.")
    mentions = _doc_mentions(tree, {s.qualname.split(".")[-1] for s in feature.symbols})
    if mentions:
        parts.append("\nThe documentation mentions it:\n" + "\n".join(f"- {m}" for m in mentions))
    return "\n".join(parts) + "\n"


def stub_source(source: str, symbols: list[Symbol], tier: int) -> str:
    """`source` of a post-deletion module with every deleted symbol stubbed to `return None`."""
    if tier == 3:
        stubs = []
        for sym in symbols:
            if sym.is_class:
                stubs.append(f"class {sym.qualname}:\n    def __init__(self, *args, **kwargs):\n        pass\n")
            else:
                stubs.append(f"def {sym.qualname}(*args, **kwargs):\n    return None\n")
        return source.rstrip("\n") + "\n\n\n" + "\n\n".join(stubs)
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    for sym in symbols:
        node = _find(tree, sym.qualname)
        raise_stmt = node.body[-1] if node is not None else None
        if isinstance(raise_stmt, ast.Raise):
            line = lines[raise_stmt.lineno - 1]
            lines[raise_stmt.lineno - 1] = line[: len(line) - len(line.lstrip())] + "return None\n"
    return "".join(lines)

"""Deleting a feature from a source tree, by tier, so that the codebase still imports.

- T1/T2: each function's body (after its docstring) becomes `raise NotImplementedError`; signature, decorators
  and docstring stay — the agent knows exactly what to implement.
- T3: the definitions disappear whole (decorators included). Imports of the deleted names elsewhere in the
  project (`from .mod import name`, absolute or relative) lose those names, `__all__` lists lose them, and imports
  in the defining module that only the deleted code used are removed, so nothing dangles and no signature hints
  at what was there.

Edits are made on source lines, from the bottom of a file up, so the rest of each file stays byte-identical (the
gold patch is then exactly the deleted code). Every edited file must still parse; it is checked here.
"""

from __future__ import annotations

import ast
import io
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path, PurePosixPath

from shipyard.tasks.features import Feature, Symbol, source_files


class DeletionError(ValueError):
    pass


@dataclass
class Deletion:
    changed: list[str] = field(default_factory=list)  # repo-relative files edited
    snippets: list[str] = field(default_factory=list)  # the deleted source, one entry per symbol


def module_name(file: str) -> str:
    p = PurePosixPath(file).with_suffix("")
    parts = list(p.parts[1:] if p.parts[0] == "src" and len(p.parts) > 1 else p.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, importer: str) -> str:
    if not node.level:
        return node.module or ""
    package = module_name(importer).split(".")
    if not importer.endswith("__init__.py"):
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
    return ".".join([*base, *([node.module] if node.module else [])])


def _names_used(tree: ast.Module) -> set[str]:
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    for node in _all_assignments(tree):  # names exported through __all__ count as used
        used |= {e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)}
    return used


Cut = tuple[int, int, str]  # (start, end, replacement): character offsets into a file's text
COMMENT = re.compile(r"#[^\r\n]*")  # after a sequence's last item only commas, brackets, blanks and comments follow


def source_lines(source: str) -> list[str]:
    """`source`'s lines as Python numbers them (split at \\n, \\r\\n and \\r only; `str.splitlines` also splits at
    form feeds and \\u2028, which would put every ast line number after one on the wrong line)."""
    return io.StringIO(source, newline="").readlines()


def _cuts_of(source: str) -> tuple[Callable[[int, int], int], Callable[[int], int], Callable[[ast.stmt], Cut]]:
    """For `source`: where an ast position (line, UTF-8 byte column) is in the text, where a line starts, and the
    cut that deletes a statement: its lines (`pass` in their place if the statement is indented, where a block may
    need one), or just the statement, as `pass`, where it shares a line with another."""
    lines = source_lines(source)
    starts = list(accumulate(map(len, lines), initial=0))

    def at(lineno: int, col: int) -> int:
        return starts[lineno - 1] + len(lines[lineno - 1].encode("utf-8")[:col].decode("utf-8"))

    def line_start(lineno: int) -> int:
        return starts[min(lineno, len(lines) + 1) - 1]

    def delete(node: ast.stmt) -> Cut:
        first, start, end = lines[node.lineno - 1], at(node.lineno, node.col_offset), at(node.end_lineno,
                                                                                         node.end_col_offset)
        rest = source[end:starts[node.end_lineno]].strip()
        if source[starts[node.lineno - 1]:start].strip() or (rest and not rest.startswith("#")):
            return start, end, "pass"  # it shares a line with another statement (`a = 1; import b`)
        indent = first[: len(first) - len(first.lstrip())]
        return starts[node.lineno - 1], starts[node.end_lineno], indent + "pass\n" if indent else ""

    return at, line_start, delete


def _drop_items(source: str, items: list, drop: list[bool], at: Callable[[int, int], int],
                line_start: Callable[[int], int], one_tuple_until: int | None = None) -> list[Cut]:
    """The cuts that remove the `drop`-marked items of one list, tuple or import (at least one item stays) with
    their commas, leaving the others, their comments and the layout as they are. A run of dropped items that fills
    its own lines (one item a line) goes with those lines, comments included; otherwise it goes from its first item
    to the next kept item's start, or, at the end, from the last kept item's end. `one_tuple_until` (the tuple's end
    offset, when one item stays): that item keeps a comma after it, `("a",)` and not the string `("a")`, which
    `import *` would iterate letter by letter."""

    def comma_after(offset: int) -> bool:
        return COMMENT.sub("", source[offset:one_tuple_until]).strip().startswith(",")

    cuts, i = [], 0
    while i < len(items):
        if not drop[i]:
            i += 1
            continue
        j = i
        while j + 1 < len(items) and drop[j + 1]:
            j += 1
        first, last = items[i], items[j]
        start, end = at(first.lineno, first.col_offset), at(last.end_lineno, last.end_col_offset)
        after = source[end:line_start(last.end_lineno + 1)].strip()
        own_lines = (not source[line_start(first.lineno):start].strip() and after.lstrip(",").strip()[:1] in ("", "#")
                     and (i == 0 or items[i - 1].end_lineno < first.lineno)
                     and (j + 1 == len(items) or items[j + 1].lineno > last.end_lineno))
        if own_lines:
            cuts.append((line_start(first.lineno), line_start(last.end_lineno + 1), ""))
        elif j + 1 < len(items):
            cuts.append((start, at(items[j + 1].lineno, items[j + 1].col_offset), ""))
        else:
            single = one_tuple_until is not None and not comma_after(end)
            cuts.append((at(items[i - 1].end_lineno, items[i - 1].end_col_offset), end, "," if single else ""))
        i = j + 1
    last = at(items[-1].end_lineno, items[-1].end_col_offset)
    if one_tuple_until is not None and not drop[-1] and not comma_after(last):
        cuts.append((last, last, ","))
    return cuts


def _all_assignments(tree: ast.Module) -> list[ast.Assign | ast.AnnAssign | ast.AugAssign]:
    """The statements of `tree` that set or extend `__all__` with a list, a tuple or one string: `__all__ = [...]`,
    `__all__: list[str] = [...]`, `__all__ += [...]`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign) or (isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add)):
            targets = [node.target]
        else:
            continue
        if (any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)
                and isinstance(node.value, ast.List | ast.Tuple | ast.Constant)):
            found.append(node)
    return found


def _prune_imports(source: str, drop: set[str], module_of: str, target: str | None, imports: bool = True) -> str:
    """Remove `drop` from import statements (only imports from `target` when given; none unless `imports`) and
    from `__all__`: the names and their commas are cut from the text, so everything else stays byte-identical
    (a statement left with no name goes whole; a tuple left with one name gets the comma that keeps it a tuple)."""
    tree = ast.parse(source)
    at, line_start, delete = _cuts_of(source)
    cuts: list[Cut] = []
    for node in ast.walk(tree):
        if imports and isinstance(node, ast.ImportFrom | ast.Import) and (target is None or (
                isinstance(node, ast.ImportFrom) and _resolve(node, module_of) == target)):
            # From the target module the imported name counts; otherwise the name the import binds.
            gone = [(a.name if target is not None else a.asname or a.name.split(".")[0]) in drop for a in node.names]
            if all(gone):
                cuts.append(delete(node))
            elif any(gone):
                cuts += _drop_items(source, node.names, gone, at, line_start)
    for node in _all_assignments(tree):
        value = node.value
        if not isinstance(value, ast.List | ast.Tuple):
            continue
        gone = [isinstance(e, ast.Constant) and e.value in drop for e in value.elts]
        if all(gone) and gone:
            cuts.append((at(value.lineno, value.col_offset), at(value.end_lineno, value.end_col_offset),
                         "[]" if isinstance(value, ast.List) else "()"))
        elif any(gone):
            one = isinstance(value, ast.Tuple) and gone.count(False) == 1
            cuts += _drop_items(source, value.elts, gone, at, line_start,
                                at(value.end_lineno, value.end_col_offset) if one else None)
    for start, end, text in sorted(cuts, reverse=True):
        source = source[:start] + text + source[end:]
    return source


def _close_gap(lines: list[str], at: int) -> None:
    """After a definition's lines were deleted from before index `at`: the blank lines that were above it and below
    it meet there, so keep as many as the more generous side had (two between top-level definitions, one between
    methods), and none when the definition ended the file. Blank lines elsewhere are not the deletion's to touch."""
    above = 0
    while at - above - 1 >= 0 and not lines[at - above - 1].strip():
        above += 1
    below = 0
    while at + below < len(lines) and not lines[at + below].strip():
        below += 1
    if at + below == len(lines):
        del lines[at - above:]
    elif at - above == 0:  # the definition began the file
        del lines[:at + below]
    else:
        del lines[at:at + min(above, below)]


def _read(path: Path) -> str:
    """A source file's text with its line endings as they are (`read_text` would turn CRLF into LF, and the gold
    patch of a CRLF file into a whole-file edit)."""
    return path.read_bytes().decode("utf-8")


def delete_feature(root: Path, feature: Feature) -> Deletion:
    """Apply `feature`'s deletion to the tree at `root` in place."""
    result = Deletion()
    by_file: dict[str, list[Symbol]] = {}
    for sym in feature.symbols:
        by_file.setdefault(sym.file, []).append(sym)
    deleted_names: dict[str, set[str]] = {}
    for file, syms in by_file.items():
        path = root / file
        source = _read(path)
        lines = source_lines(source)
        for sym in sorted(syms, key=lambda s: -s.start):
            if feature.tier in (1, 2):
                first = lines[sym.body_start - 1]
                indent = first[: len(first) - len(first.lstrip())]
                ending = first[len(first.rstrip("\r\n")):] or "\n"
                result.snippets.append("".join(lines[sym.body_start - 1: sym.end]))
                lines[sym.body_start - 1: sym.end] = [f"{indent}raise NotImplementedError{ending}"]
            else:
                result.snippets.append("".join(lines[sym.start - 1: sym.end]))
                del lines[sym.start - 1: sym.end]
                _close_gap(lines, sym.start - 1)
        new = "".join(lines)
        if feature.tier == 3:
            names = {s.qualname for s in syms}
            deleted_names[file] = names
            before, after = _names_used(ast.parse(source)), _names_used(ast.parse(new))
            new = _prune_imports(new, (before - after) - names, file, None)
            new = _prune_imports(new, names, file, None, imports=False)
        path.write_bytes(new.encode("utf-8"))
        result.changed.append(file)
    for file, names in deleted_names.items():  # imports of the deleted names elsewhere in the project
        target = module_name(file)
        for other in source_files(root):
            if other == file:
                continue
            text = _read(root / other)
            pruned = _prune_imports(text, names, other, target)
            if pruned != text:
                (root / other).write_bytes(pruned.encode("utf-8"))
                result.changed.append(other)
    for file in result.changed:
        try:
            ast.parse(_read(root / file))
        except SyntaxError as e:
            raise DeletionError(f"deleting {feature.id} left {file} unparsable: {e}") from e
    return result

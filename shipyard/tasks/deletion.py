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
from dataclasses import dataclass, field
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
    for node in ast.walk(tree):  # names exported through __all__ count as used
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            used |= {e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)}
    return used


def _replace(lines: list[str], node: ast.stmt, new: str | None) -> None:
    """Replace a statement's lines by `new` (same indentation), or delete them (`pass` if the block needs one)."""
    indent = lines[node.lineno - 1][: len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())]
    text = [indent + new + "\n"] if new is not None else []
    lines[node.lineno - 1: node.end_lineno] = text or ([indent + "pass\n"] if indent else [])


def _prune_imports(source: str, drop: set[str], module_of: str, target: str | None, imports: bool = True) -> str:
    """Remove `drop` from import statements (only imports from `target` when given; none unless `imports`) and
    from `__all__`."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits: list[tuple[ast.stmt, str | None]] = []
    for node in ast.walk(tree):
        if imports and isinstance(node, ast.ImportFrom | ast.Import) and (target is None or (
                isinstance(node, ast.ImportFrom) and _resolve(node, module_of) == target)):
            # From the target module the imported name counts; otherwise the name the import binds.
            keep = [a for a in node.names
                    if (a.name if target is not None else a.asname or a.name.split(".")[0]) not in drop]
            if len(keep) == len(node.names):
                continue
            if not keep:
                edits.append((node, None))
            elif isinstance(node, ast.ImportFrom):
                names = ", ".join(f"{a.name} as {a.asname}" if a.asname else a.name for a in keep)
                edits.append((node, f"from {'.' * node.level}{node.module or ''} import {names}"))
            else:
                edits.append((node, "import " + ", ".join(f"{a.name} as {a.asname}" if a.asname else a.name
                                                          for a in keep)))
        elif (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                   for t in node.targets)
              and isinstance(node.value, ast.List | ast.Tuple)):
            elts = [e for e in node.value.elts if not (isinstance(e, ast.Constant) and e.value in drop)]
            if len(elts) != len(node.value.elts):
                edits.append((node, "__all__ = [" + ", ".join(repr(e.value) for e in elts
                                                              if isinstance(e, ast.Constant)) + "]"))
    for node, new in sorted(edits, key=lambda e: -e[0].lineno):
        _replace(lines, node, new)
    return "".join(lines)


def _collapse_blank_runs(lines: list[str]) -> list[str]:
    out: list[str] = []
    for line in lines:
        if line.strip() == "" and len(out) >= 2 and out[-1].strip() == "" and out[-2].strip() == "":
            continue
        out.append(line)
    while out and out[-1].strip() == "":
        out.pop()
    return out


def delete_feature(root: Path, feature: Feature) -> Deletion:
    """Apply `feature`'s deletion to the tree at `root` in place."""
    result = Deletion()
    by_file: dict[str, list[Symbol]] = {}
    for sym in feature.symbols:
        by_file.setdefault(sym.file, []).append(sym)
    deleted_names: dict[str, set[str]] = {}
    for file, syms in by_file.items():
        path = root / file
        source = path.read_text()
        lines = source.splitlines(keepends=True)
        for sym in sorted(syms, key=lambda s: -s.start):
            if feature.tier in (1, 2):
                first = lines[sym.body_start - 1]
                indent = first[: len(first) - len(first.lstrip())]
                result.snippets.append("".join(lines[sym.body_start - 1: sym.end]))
                lines[sym.body_start - 1: sym.end] = [f"{indent}raise NotImplementedError\n"]
            else:
                result.snippets.append("".join(lines[sym.start - 1: sym.end]))
                del lines[sym.start - 1: sym.end]
        new = "".join(_collapse_blank_runs(lines)) + "\n" if feature.tier == 3 else "".join(lines)
        if feature.tier == 3:
            names = {s.qualname for s in syms}
            deleted_names[file] = names
            before, after = _names_used(ast.parse(source)), _names_used(ast.parse(new))
            new = _prune_imports(new, (before - after) - names, file, None)
            new = _prune_imports(new, names, file, None, imports=False)
        path.write_text(new)
        result.changed.append(file)
    for file, names in deleted_names.items():  # imports of the deleted names elsewhere in the project
        target = module_name(file)
        for other in source_files(root):
            if other == file:
                continue
            text = (root / other).read_text()
            pruned = _prune_imports(text, names, other, target)
            if pruned != text:
                (root / other).write_text(pruned)
                result.changed.append(other)
    for file in result.changed:
        try:
            ast.parse((root / file).read_text())
        except SyntaxError as e:
            raise DeletionError(f"deleting {feature.id} left {file} unparsable: {e}") from e
    return result

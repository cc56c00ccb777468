"""The package's imports run one way, bottom to top:

    errors, httpguard, lifetime → models → harness → search → sandbox, tasks → rollout → train → rl → bench, dashboard
        → console → cli

A module may import from its own layer and the layers below it, never from one above. Every import counts: at the
top of a module, inside a function (a lazy import is still a dependency, only a later one) and under
`if TYPE_CHECKING:` (a type named from a higher layer is a record in the wrong place). Where the other parts sit, read
from what they import and who imports them:

- `errors` and `lifetime` import nothing and `httpguard` only `errors`, so every layer may raise a `UserError`, guard
  a loopback server and start a child that dies with it; the package itself (`shipyard/__init__.py`, the version)
  sits with them.
- `search` uses the harness (its tool, the workspace) and the bundled embedder (`models`); the episode and task
  synthesis (`rollout`, `tasks`) use it.
- `bench` and `dashboard` are programs on top of the library: a benchmark may import anything in it, and the library
  imports neither. `console` is what the command line's commands share (it lists the benchmarks); only `cli` imports
  it, and nothing imports `cli`.

`sandbox` and `tasks` are one layer: the grader runs in a sandbox, and the sandbox server grades tasks.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "shipyard"

LAYERS: tuple[tuple[str, ...], ...] = (
    # "shipyard": the package's own __init__ only
    ("shipyard", "shipyard.errors", "shipyard.httpguard", "shipyard.lifetime"),
    ("shipyard.models",),
    ("shipyard.harness",),
    ("shipyard.search",),
    ("shipyard.sandbox", "shipyard.tasks"),
    ("shipyard.rollout",),
    ("shipyard.train",),
    ("shipyard.rl",),
    ("shipyard.bench", "shipyard.dashboard"),
    ("shipyard.console",),
    ("shipyard.cli",),
)

# Imports against the order that stay for now, (importer, imported), each with why. The test fails when one of these
# is gone, so that the list only shrinks; it is empty now, and an import against the order is a failure.
EXCEPTIONS: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(source: str, module: str, is_package: bool = False, known: set[str] | frozenset[str] = frozenset()
            ) -> set[str]:
    """Every module of the package `source` (the text of `module`) imports, wherever the import statement is: at the
    top, in a function, under `if TYPE_CHECKING:`. `from X import name` counts as importing `X.name` when that is a
    module (`known`), else `X`; relative imports are resolved against `module`; `importlib.import_module("…")` with
    a literal name counts too."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        elif isinstance(node, ast.Call) and _called(node.func) == "import_module" and _literal(node.args[:1]):
            found.add(node.args[0].value)
    return {name for name in found if name == "shipyard" or name.startswith("shipyard.")}


def _called(func: ast.expr) -> str | None:
    """The name a call calls: `f` of `f(…)` and of `x.f(…)`."""
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _literal(args: list[ast.expr]) -> bool:
    return bool(args) and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str)


def layer(module: str) -> int:
    """The index in `LAYERS` of the part `module` belongs to (the longest matching name: `shipyard` only exactly)."""
    matches = [(len(name), i) for i, names in enumerate(LAYERS) for name in names
               if module == name or (name != "shipyard" and module.startswith(name + "."))]
    if not matches:
        raise AssertionError(f"{module} is in no layer: place its part in LAYERS ({__file__})")
    return max(matches)[1]


def edges() -> set[tuple[str, str]]:
    return {(module, target) for module, path in MODULES.items()
            for target in imports(path.read_text(), module, path.name == "__init__.py", set(MODULES))
            if target != module}


def test_every_module_of_the_package_is_in_a_layer():
    assert "shipyard.rollout.record" in MODULES and "shipyard.cli" in MODULES  # the walk found the package
    for module in MODULES:
        layer(module)


def test_imports_run_one_way():
    every = edges()
    assert len(every) > 100, "the walk found too few imports to judge"  # an empty walk would pass the checks below
    upward = {(a, b) for a, b in every if layer(b) > layer(a)}
    wrong = sorted(f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})" for a, b in upward - EXCEPTIONS)
    assert not wrong, "\n".join(wrong)
    stale = sorted(EXCEPTIONS - upward)
    assert not stale, f"no longer imported against the order, remove from EXCEPTIONS: {stale}"


def cycle(pairs: set[tuple[str, str]]) -> list[str] | None:
    """A cycle of imports among `pairs` (importer, imported), as the modules along it; None when there is none."""
    graph: dict[str, set[str]] = {}
    for a, b in pairs:
        graph.setdefault(a, set()).add(b)
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as e:
        return list(e.args[1])
    return None


def test_no_module_imports_itself_back():
    """No chain of imports (lazy ones included) leads from a module back to it, within a layer too, where the order
    says nothing: `make_engine` hands `OpenAIEngine` its tokenizer rather than `shipyard.models.openai` importing
    `shipyard.models.resolve` back."""
    found = cycle(edges())
    assert found is None, "an import cycle: " + " -> ".join(found or [])
    assert cycle({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) is not None  # the check sees a cycle of three
    assert cycle({("a", "b"), ("a", "c"), ("b", "c")}) is None


def test_the_rollout_side_imports_neither_the_trainer_nor_the_loop():
    rollout = {(a, b) for a, b in edges() if a.startswith("shipyard.rollout")}
    assert rollout, "the walk found no imports of shipyard.rollout"
    assert not [(a, b) for a, b in rollout if b.startswith(("shipyard.train", "shipyard.rl"))]


def test_nothing_imports_the_command_line():
    assert not [a for a, b in edges() if b == "shipyard.cli"]
    assert {a for a, b in edges() if b == "shipyard.console"} <= {"shipyard.cli"}


SAMPLE = """
from __future__ import annotations
from typing import TYPE_CHECKING
import shipyard.models.engine
from shipyard import httpguard
from . import record
from ..train import batch as b
from .record import Rollout
if TYPE_CHECKING:
    from shipyard.rl.loop import RLLoop

def later():
    from shipyard.train.sync import push_http
    import importlib
    return importlib.import_module("shipyard.cli")

class C:
    def m(self):
        try:
            import shipyard.dashboard.app
        except ImportError:
            pass
"""


@pytest.mark.parametrize("is_package", [False, True])
def test_the_walk_sees_every_form_of_import(is_package):
    known = {"shipyard.httpguard", "shipyard.rollout.record", "shipyard.train.batch"}
    module = "shipyard.rollout" if is_package else "shipyard.rollout.episode"
    found = imports(SAMPLE, module, is_package, known)
    assert found == {"shipyard.models.engine", "shipyard.httpguard", "shipyard.rollout.record",
                     "shipyard.train.batch", "shipyard.rl.loop", "shipyard.train.sync", "shipyard.cli",
                     "shipyard.dashboard.app"}


def test_a_module_is_placed_by_its_longest_name():
    assert layer("shipyard") == layer("shipyard.errors") == 0
    assert layer("shipyard.rollout.record") < layer("shipyard.train.batch") < layer("shipyard.rl.loop")
    assert layer("shipyard.sandbox.client") == layer("shipyard.tasks.grade")
    with pytest.raises(AssertionError, match="shipyard.newpart is in no layer"):
        layer("shipyard.newpart")
    with pytest.raises(AssertionError, match="in no layer"):
        layer("shipyardx.models")

"""Trusted test code: the run's test files as they were when the test run started, and checks that the code pytest
runs was compiled from them.

When the launcher (`shipyard.tasks.pytest_plugin`) starts, no code of the project has run yet, and the test files on
disk are the canonical ones the grader has just restored. `TrustedTests.read` reads every test-side `.py` file of the
repository into memory then (the rule of `features.is_test_file`: `test_*.py`, `*_test.py`, `conftest.py`, anything
under a `tests`/`test`/`testing` directory; a patch may touch none of them). From then on, the project's code can
change the files on disk and the functions in memory, and these checks compare what runs with what those bytes
compile to — the way pytest compiles them (`rewrite_asserts` over the AST, then `compile`, for modules pytest
rewrote; a plain `compile` for the others), cached per file:

- **A function's code** (`code_problem`): a function whose globals are a trusted file's module must run a code object
  equal to one that file compiles to at the same qualified name and first line (code objects compare structurally:
  instructions, constants and nested code, names, flags, exception and line tables). A file rewritten on disk
  before pytest imported it, and a `__code__` replaced at run time, both fail it.
- **A test item** (`item_problems`, before each test's call): the function pytest is about to call, every function in
  its `__wrapped__` chain and the functions of the fixtures it uses. A test that a trusted file defines with a plain
  `def` (no decorators but `pytest.mark`) must still be that function, or a wrapper from the test files (a
  conftest's) or from an installed plugin — not a function of the project's.
- **A module's namespace** (`sweep`, once collection has finished and again when the session finishes): every
  function and class member of the trusted modules, and every name those files bind exactly once with a plain `def`
  or `class` must still be that function or class — a helper swapped for a function that does nothing fails it.
- **The files** (`disk_changes`, at the end): every trusted file a module was loaded from must still hold its bytes.

What it cannot see: a change undone before the next check (a test's helper swapped and restored within one test),
values rather than code (a function's `__defaults__`, module-level data, names bound by imports or decorators other
than marks), helpers whose `__code__` is swapped for code compiled under a `<...>` file name (the namespace check
skips such code where it looks like a dataclass's generated methods; test functions and fixtures get no such
leeway), test files outside the test-side rule or beyond `MAX_FILES`/`MAX_BYTES`, and an attack on this module's own
records (found through `gc`, say) — what stands against that is the grader's static gate and the canaries.

What honest suites could trip: test code that creates functions with `exec` in a test module's namespace, rewrites
its own functions' code, or writes over a test-side `.py` file whose module it loaded. Each shows as a
finding on the gold patch too, so synthesis rejects such a task (`oracle_fails`) rather than mis-scoring it.
"""

from __future__ import annotations

import ast
import os
import sys
import sysconfig
import types
import warnings
from dataclasses import dataclass, field

from _pytest.assertion.rewrite import rewrite_asserts

TEST_DIRS = ("tests", "test", "testing")
SKIPPED_DIRS = frozenset({"__pycache__", "node_modules", "site-packages"})
MAX_FILES, MAX_BYTES = 20_000, 128 << 20  # beyond these the rest of the files stay unverified
MAX_UNWRAP = 8
INSTALLED = tuple(sorted({os.path.realpath(p) + os.sep for key, p in sysconfig.get_paths().items()
                          if key in ("stdlib", "platstdlib", "purelib", "platlib")}))
Key = tuple[str, int]  # (qualified name, first line) of a code object

# Bound now, before any project code runs: what this module calls cannot be swapped behind it.
_compile, _parse, _realpath, _walk = compile, ast.parse, os.path.realpath, os.walk
_os_open, _os_read, _os_close, _fstat = os.open, os.read, os.close, os.fstat
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FunctionType, _CodeType, _MethodType = types.FunctionType, types.CodeType, types.MethodType


def is_test_side(rel: str) -> bool:
    """Whether the repository path `rel` is a test-side Python file (`shipyard.tasks.features.is_test_file`)."""
    parts = rel.split("/")
    name = parts[-1]
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"
                                     or any(p in TEST_DIRS for p in parts[:-1]))


def read_file(path: str) -> bytes | None:
    """The bytes of the regular file at `path` (None: unreadable, or a link)."""
    try:
        fd = _os_open(path, _READ)
    except OSError:
        return None
    try:
        size, chunks = _fstat(fd).st_size, []
        while True:
            chunk = _os_read(fd, max(size + 1, 1 << 16))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    except OSError:
        return None
    finally:
        _os_close(fd)


def _qualname(code: types.CodeType) -> str:
    return code.co_qualname if sys.version_info >= (3, 11) else code.co_name


def code_index(module: types.CodeType) -> dict[Key, list[types.CodeType]]:
    """Every code object a module's code holds, nested ones included, by qualified name and first line."""
    out: dict[Key, list[types.CodeType]] = {}
    todo = [module]
    while todo:
        code = todo.pop()
        out.setdefault((_qualname(code), code.co_firstlineno), []).append(code)
        todo += [c for c in code.co_consts if isinstance(c, _CodeType)]
    return out


def _plain(decorators: list[ast.expr]) -> bool:
    """No decorators but `pytest.mark.…`/`mark.…` ones, which return what they decorate."""
    for dec in decorators:
        node, names = dec.func if isinstance(dec, ast.Call) else dec, []
        while isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        names += [node.id] if isinstance(node, ast.Name) else ["?"]
        if names[-2:] != ["mark", "pytest"] and names[-1] != "mark":
            return False
    return True


def _bindings(body: list[ast.stmt]) -> dict[str, int]:
    """How often each name is bound by the statements of one scope (nested function and class bodies excluded)."""
    counts: dict[str, int] = {}
    todo: list[ast.AST] = list(body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            counts[node.name] = counts.get(node.name, 0) + 1
            todo += node.decorator_list
            continue
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for name in (a.asname or a.name.split(".")[0] for a in node.names):
                counts[name] = counts.get(name, 0) + 1
            continue
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names: list[str] = [node.id]
        else:
            names = [v for f in ("name", "rest") if f in node._fields and isinstance(v := getattr(node, f), str)]
        for name in names:
            counts[name] = counts.get(name, 0) + 1
        todo += ast.iter_child_nodes(node)
    return counts


def _mangled(cls: str, name: str) -> str:
    """The attribute a class body's `name` is stored under (`__x` in class `C` is `_C__x`)."""
    if name.startswith("__") and not name.endswith("__") and cls.strip("_"):
        return f"_{cls.lstrip('_')}{name}"
    return name


def plain_names(tree: ast.Module, scoped: bool = True) -> dict[str, tuple[str, str]]:
    """Names a module binds exactly once, with a plain `def` or `class` (see `_plain`), and the methods that such a
    top-level class binds once with a plain `def`: where it is stored ("C._C__x" for `__x` in class C) → (kind,
    "function" or "class"; its qualified name). `scoped`: the source may hold `global`/`nonlocal` statements (the
    names they declare can be rebound from anywhere; without them the whole tree need not be walked)."""
    rebound = {n for node in ast.walk(tree) if isinstance(node, (ast.Global, ast.Nonlocal)) for n in node.names} \
        if scoped else set()
    counts = _bindings(tree.body)
    if "*" in counts:  # a star import may rebind anything
        return {}
    out: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or counts[node.name] != 1 or node.name in rebound \
                or not _plain(node.decorator_list):
            continue
        if isinstance(node, ast.FunctionDef):
            out[node.name] = ("function", node.name)
            continue
        out[node.name] = ("class", node.name)
        inner = _bindings(node.body)
        out.update({f"{node.name}.{_mangled(node.name, m.name)}": ("function", f"{node.name}.{m.name}")
                    for m in node.body
                    if isinstance(m, ast.FunctionDef) and inner.get(m.name) == 1 and _plain(m.decorator_list)})
    return out


def callables(obj: object) -> list[types.FunctionType]:
    """The functions `obj` runs: itself (a bound method's or a static or class method's function), then each one
    in its `functools.wraps` chain. Only a function's own `__dict__` is read: no attribute lookup runs code."""
    out: list[types.FunctionType] = []
    for _ in range(MAX_UNWRAP):
        if type(obj) in (_MethodType, staticmethod, classmethod):
            obj = obj.__func__
        if type(obj) is not _FunctionType or obj in out:
            break
        out.append(obj)
        obj = obj.__dict__.get("__wrapped__")
    return out


def _members(cls: type) -> list[types.FunctionType]:
    out: list[types.FunctionType] = []
    for value in list(cls.__dict__.values()):
        if type(value) is property:
            out += [f for f in (value.fget, value.fset, value.fdel) if type(f) is _FunctionType]
        else:
            out += callables(value)[:1]
    return out


def _namespace(module: types.ModuleType) -> dict:
    """A module's `__dict__`, read past any `__getattribute__` of its class (a lazy module would load itself)."""
    return object.__getattribute__(module, "__dict__")


def _is_class(value: object) -> bool:
    """Whether `value` is a class, judged by its type alone (`isinstance` asks a proxy's `__class__`)."""
    return issubclass(type(value), type)


def _installed(fn: types.FunctionType) -> bool:
    """Whether `fn` was defined by installed code (the standard library, the environment's packages)."""
    file = fn.__globals__.get("__file__")
    return isinstance(file, str) and _realpath(file).startswith(INSTALLED)


def _generated(code: types.CodeType) -> bool:
    """Methods a dataclass generates with `exec` in its module's namespace."""
    return code.co_filename == "<string>" and _qualname(code).startswith("__create_fn__.")


@dataclass
class TrustedTests:
    """The test-side files as the run started (real path → bytes) and what the checks found so far."""

    root: str
    files: dict[str, bytes]
    prefixes: tuple[str, ...] = ()  # where a module's file must lie to be one of `files` (the root, as given)
    config: object = None  # pytest's Config: assertion rewriting depends on `enable_assertion_pass_hook`
    findings: list[str] = field(default_factory=list)
    _compiled: dict[tuple[str, bool], dict[Key, list[types.CodeType]]] = field(default_factory=dict)
    _plain: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)
    _globals: dict[int, tuple[dict, str | None]] = field(default_factory=dict)
    _verified: dict[int, types.CodeType] = field(default_factory=dict)

    @classmethod
    def read(cls, root: str) -> TrustedTests:
        """Read the test-side files under `root` (not following links; skipping dot directories, caches and
        virtual environments)."""
        given, root = root, _realpath(root)
        files: dict[str, bytes] = {}
        total = 0
        for here, dirs, names in _walk(root):
            if "pyvenv.cfg" in names:
                dirs[:] = []
                continue
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS)
            for name in sorted(names):
                path = os.path.join(here, name)
                if len(files) >= MAX_FILES or total >= MAX_BYTES or not is_test_side(os.path.relpath(path, root)):
                    continue
                data = read_file(path)
                if data is not None:
                    files[path] = data
                    total += len(data)
        return cls(root, files, tuple({os.path.join(given, ""), os.path.join(root, "")}))

    def _rel(self, path: str) -> str:
        return os.path.relpath(path, self.root)

    def file_of(self, namespace: dict) -> str | None:
        """The trusted file whose module `namespace` is (the globals of its functions), if any."""
        known = self._globals.get(id(namespace))
        if known is not None and known[0] is namespace:
            return known[1]
        file = namespace.get("__file__")
        path = _realpath(file) if isinstance(file, str) and file.startswith(self.prefixes) else None
        path = path if path in self.files else None
        self._globals[id(namespace)] = (namespace, path)
        return path

    def compiled(self, path: str, rewritten: bool) -> dict[Key, list[types.CodeType]]:
        """What the trusted bytes of `path` compile to, as pytest's assertion rewriter (or a plain import) does;
        nothing for bytes that do not compile (pytest could not have imported them either)."""
        known = self._compiled.get((path, rewritten))
        if known is not None:
            return known
        source, code = self.files[path], None
        try:
            tree = _parse(source, filename=path)  # compiling the tree is compiling the bytes, as an import does
            self._plain.setdefault(path, plain_names(tree, b"global" in source or b"nonlocal" in source))
            if rewritten:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # pytest warned about this file's asserts when it imported it
                    rewrite_asserts(tree, source, path, self.config)
            code = _compile(tree, path, "exec", dont_inherit=True)
        except Exception:  # bytes that do not compile match no code
            self._plain.setdefault(path, {})
        self._compiled[(path, rewritten)] = index = code_index(code) if code is not None else {}
        return index

    def plain(self, path: str, rewritten: bool) -> dict[str, tuple[str, str]]:
        """The plain names of `path` (`plain_names`), found while compiling it."""
        if path not in self._plain:
            self.compiled(path, rewritten)
        return self._plain[path]

    def code_problem(self, fn: types.FunctionType, strict: bool = True) -> str | None:
        """Why `fn`'s code is not what its trusted file compiles to (None: it is, or its file is not trusted, or
        — unless `strict` — it is code a dataclass generated)."""
        code, namespace = fn.__code__, fn.__globals__
        if self._verified.get(id(fn)) is code:
            return None
        path = self.file_of(namespace)
        if path is None or (not strict and _generated(code)):
            return None
        compiled = self.compiled(path, "@pytest_ar" in namespace)
        if any(code == c for c in compiled.get((_qualname(code), code.co_firstlineno), ())):
            self._verified[id(fn)] = code
            return None
        return (f"{self._rel(path)}: {fn.__qualname__} runs code that is not what the file held when the run "
                "started")

    def item_problems(self, obj: object, module: types.ModuleType | None, scope: str, name: str,
                      fixtures: list[object]) -> list[str]:
        """Before a test's call: the function about to be called (`obj`), its `__wrapped__` chain and its fixtures'
        functions; and, where the test's file defines it with a plain `def` in `scope` (a class name, '' for the
        module), that the called function is the one the file defined."""
        chain = callables(obj)
        out = [p for fn in chain if (p := self.code_problem(fn)) is not None]
        out += [p for f in fixtures for fn in callables(f) if (p := self.code_problem(fn)) is not None]
        namespace = _namespace(module) if module is not None else {}
        path = self.file_of(namespace)
        if path is None:
            return out
        qualname = f"{scope}.{name}" if scope else name
        kind = self.plain(path, "@pytest_ar" in namespace).get(qualname, ("", ""))[0]
        # Something else runs in its place. A wrapper from the test files (a conftest's) or from an installed plugin
        # may; one from the project may not.
        if kind == "function" and not any(self.file_of(fn.__globals__) is not None for fn in chain) and \
                not (chain and _installed(chain[0])):
            out.append(f"{self._rel(path)}: the test {qualname} is not the function the file defines")
        return out

    def sweep(self, modules: list[types.ModuleType]) -> list[str]:
        """The functions and class members of the trusted modules among `modules`, and the names their files bind
        once with a plain `def` or `class`."""
        out: list[str] = []
        for module in modules:
            namespace = _namespace(module)
            path = self.file_of(namespace)
            if path is None:
                continue
            functions: list[types.FunctionType] = []
            for value in list(namespace.values()):
                if _is_class(value) and value.__dict__.get("__module__") == namespace.get("__name__"):
                    functions += _members(value)
                else:
                    functions += callables(value)
            out += [p for fn in functions if (p := self.code_problem(fn, strict=False)) is not None]
            out += self._bindings_changed(path, namespace)
        return out

    def _bindings_changed(self, path: str, namespace: dict) -> list[str]:
        """The plain names of `path` bound to something else than what the file defines (whether that function
        still runs the file's code is `code_problem`'s question)."""
        out = []
        for stored, (kind, qualname) in self.plain(path, "@pytest_ar" in namespace).items():
            owner, _, name = stored.rpartition(".")
            where = namespace
            if owner:
                cls = namespace.get(owner)
                if not _is_class(cls):
                    continue  # reported for the class itself
                where = cls.__dict__
            value = where.get(name)
            if kind == "class":
                ok = _is_class(value) and value.__dict__.get("__module__") == namespace.get("__name__")
            else:
                ok = type(value) is _FunctionType and value.__globals__ is namespace and \
                    value.__qualname__ == qualname
            if not ok:
                out.append(f"{self._rel(path)}: {qualname} is no longer the {kind} the file defines")
        return out

    def modules(self) -> list[types.ModuleType]:
        """The loaded modules of trusted files."""
        return [m for m in list(sys.modules.values())
                if issubclass(type(m), types.ModuleType) and self.file_of(_namespace(m)) is not None]

    def disk_changes(self) -> list[str]:
        """The trusted files that modules were loaded from and whose bytes on disk have changed since."""
        used = {p for m in self.modules() if (p := self.file_of(_namespace(m))) is not None}
        used |= {path for path, _ in self._compiled}
        return [f"{self._rel(p)} was changed on disk during the run" for p in sorted(used)
                if read_file(p) != self.files[p]]

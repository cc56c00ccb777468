"""The test run's launcher and the pytest plugin it loads: the run's configuration, node ids, canaries, coverage
contexts, an integrity check of pytest's machinery and of the test code, and a seal over the report and outcomes.

`suite.run_suite` copies this file and `testcode.py` (as `shipyard_testcode.py`, loaded from beside the launcher by
path, never from `sys.path`) into a fresh, randomly named run directory of the sandbox's workspace and starts

    /workspace/.venv/bin/python -I -B <run dir>/shipyard_pytest.py <run dir>/settings.json

It needs only pytest, pluggy and coverage. What it does, and why:

1. **A run the patch cannot configure.** `-I` (isolated mode) ignores every `PYTHON*` variable and the user site,
   and keeps the working directory (and, from Python 3.11, the script's directory) off `sys.path`: a top-level
   `pytest/` or `json.py` in the repository cannot shadow what the interpreter imports. The launcher then appends
   the repository root at the *end* of `sys.path`, so flat projects that relied on `python -m pytest` putting it
   first still import, but never ahead of the standard library or site-packages. Before any project code runs it
   chooses the configuration file by the running pytest's own precedence (`pytest.toml` and `.pytest.toml` count
   from pytest 9 on; a file counts when pytest's own loader finds pytest settings in it) among the files the
   settings name — the grader names the task's canonical top-level configs — and passes it explicitly: `-c FILE
   --rootdir=ROOT --confcutdir=ROOT` (an empty `pytest.ini` of its own when none qualifies). The settings file is
   deleted once read: the run's nonce then lives only in this process.
2. **Node ids in the JUnit report.** Each collected item gets a `shipyard_nodeid` user property, which the JUnit
   XML writer emits as a `<property>` of its `<testcase>`. The report's class name alone is ambiguous: a test
   method that a mixin in `tests/__init__.py` gives to several classes is reported with that file's name.
3. **Coverage per test.** With coverage on, the current context is switched to the test's node id when its setup
   starts and back to the empty context when it finishes; lines run in the empty context ran at import or
   collection time. Coverage is started here (the project's own coverage configuration is not read).
4. **Options of disabled plugins.** Runs pass `-p no:pytest_cov -p no:xdist`: pytest-cov would start a second
   tracer over ours, and xdist would move tests into worker processes. Projects often put `--cov=pkg` or `-n auto`
   in their `addopts`; pytest would reject them as unknown arguments, so they are removed from the argument list
   (`pytest_load_initial_conftests` sees it after `addopts` were prepended), as are `-x` and `--maxfail` (a
   must-fail canary would end the run early).
5. **Canaries.** The grader appends randomly named tests to test modules, one that must fail and one that must
   pass, and names them in the settings; they are collected whatever `python_functions` says. A run whose
   outcomes are forced shows it in them (`suite.canary_problems`).
6. **Integrity.** When it starts, and again just before pytest loads the first conftest (never after project code
   could have run), the launcher records the identity of every function and class in `pytest`, `_pytest.*` and
   `pluggy.*` and in the standard modules the launcher itself relies on (`builtins`, `io`, `os`, `posixpath`,
   `hashlib`, `json`, `json.encoder`, `ast`: a `builtins.open` replaced by project code is a finding), every member
   of the (mutable) classes defined there, the registered plugins and the plugin manager's hook executor. At session
   finish, and again after pytest returns, it lists every difference that brings code from outside installed
   packages and the repository's conftest files (pytest's own plugins legitimately patch its classes at configure
   time; the grader restored the conftests): a replaced or deleted function, method or module, a class member
   added, a plugin registered during the run by project code (conftest files, the modules their
   `pytest_plugins` name and installed code may register plugins), a plugin unregistered, a hook implementation
   whose plugin is not registered, a replaced hook executor. Recording and checking take about 10–15 ms.
7. **Trusted test code** (`testcode`). Before anything else, the launcher reads the repository's test-side files into
   memory: the grader has just restored them, and no project code has run. Before each test's call it checks that
   the test's function, its `__wrapped__` chain and its fixtures' functions run the code those bytes compile to
   (compiled the way pytest compiles them, assertion rewriting included); when collection finishes and at session
   finish it checks every function and class member of the loaded test modules, the names their files bind with a
   plain `def`/`class`, and the files' bytes on disk. A test file rewritten on disk before pytest imported it, or a
   test's `__code__` swapped in memory, is a finding. The cost is one more compile of each test module, as pytest's
   own rewriting costs (pocketlib: 6 modules, ~50–70 ms; cachetools: 13 modules and 465 tests, ~100 ms), plus
   microseconds per test.
8. **Outcomes of its own.** The plugin records each test's outcome from pytest's reports as they are made (a hook
   that runs after the JUnit writer's): the node ids whose call passed and no phase failed or skipped — exactly
   the tests the JUnit report must show as passed.
9. **The seal.** After pytest returns, one line goes out through a copy of file descriptor 1 taken at start (the project
   may close or redirect 1): `shipyard-seal <nonce> {…}` with the SHA-256 of the JUnit report as it is then, the count
   and SHA-256 of the passed node ids (spelled as the JUnit writer spells them), and the integrity findings (`null` if
   the session-finish check never ran). Everything the seal uses (`os.open`/`read`/`write`, `hashlib.sha256`, the stream
   objects it flushes) was bound before project code ran, and the JSON is written by hand: nothing goes through `open`,
   `json`'s module state or another name the project could rebind. The grader reads the seal from the output the sandbox
   hands back, which nothing can change after the fact, and compares both digests with the report it reads: a report
   rewritten after the seal (an `atexit` handler, a process that outlived pytest) no longer matches the first, and one
   rewritten before it (a thread racing the launcher) no longer matches the second.

Once pytest starts, `sys.modules["__main__"]` is a blank module and the loaded `testcode` is in `sys.modules` under no
name, so `import __main__` does not lead to the launcher's records.

What this cannot do: it runs in the process of the code under test. Code written against this module can find its state
(through `gc`, frames, or pytest's plugin manager): rewrite its records (the trusted bytes, the outcomes it saw pass,
the findings) before the check, unregister it, or silence the launcher's seal and print its own (the seal's line starts
with a nonce that lives only in this process's memory, and two seals of a run void it, so it must find the nonce and do
both); it can reach into pytest where the identity check does not look (instance attributes, module-level data), bring
code the origin rule trusts (C builtins, code compiled under a forged file name), or change test code where `testcode`
does not look (see its docstring: a change undone before the next check, values rather than code). The checks make a
generic hack visible, not a targeted one impossible. What stands when they are defeated are the layers outside the
process: the grader's static gate, which refuses patches whose code reaches for this machinery (pytest imports, `gc`,
frame inspection, `sys.modules` surgery, hard exits) unless the gold patch does too, and the canaries, which a forced
outcome trips unless the attack singles them out — and to do that it has to find them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import coverage
import pytest
from _pytest.junitxml import bin_xml_escape

NODEID = "shipyard_nodeid"
SEAL = "shipyard-seal "  # + the run's nonce, a space, the seal as JSON
TESTCODE = "shipyard_testcode.py"  # the launcher's copy of shipyard.tasks.testcode, beside it in the run directory
MAX_CHANGES = 50  # findings carried in the seal
WATCHED = ("pytest", "_pytest", "pluggy")  # and their submodules
WATCHED_STDLIB = frozenset({"builtins", "io", "os", "posixpath", "hashlib", "json", "json.encoder", "ast"})
CONFIG_NAMES = ("pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")
CONFIG_NAMES_8 = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")  # before pytest 9
_TAKES_VALUE = {"--cov-report", "--cov-config", "--cov-fail-under", "--cov-context", "-n", "--numprocesses",
                "--dist", "--maxprocesses", "--max-worker-restart", "--tx", "--rsyncdir", "--maxfail"}
_FLAGS = {"--cov-append", "--cov-branch", "--cov-reset", "--no-cov", "--no-cov-on-fail", "-x", "--exitfirst"}
_MISSING = object()
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class whose members can be changed

# Bound before any project code runs: the seal reads, hashes, formats and writes nothing through names (or module
# state, like json's default encoder) the project could rebind.
_os_open, _os_read, _os_write, _os_close, _os_dup = os.open, os.read, os.write, os.close, os.dup
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_sha256, _sorted, _len = hashlib.sha256, sorted, len
_STREAMS = (sys.stdout, sys.stderr)

if __name__ != "shipyard.tasks.pytest_plugin":  # a copy in a run directory (the launcher, or loaded by the
    # differential probe): its copy of testcode lies beside it (never imported by name from sys.path)
    _spec = importlib.util.spec_from_file_location("shipyard_testcode",
                                                   os.path.join(os.path.dirname(os.path.abspath(__file__)), TESTCODE))
    testcode = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = testcode  # while it loads (dataclasses look their module up); not after
    try:
        _spec.loader.exec_module(testcode)
    finally:
        del sys.modules[_spec.name]
else:
    from shipyard.tasks import testcode
INSTALLED = testcode.INSTALLED


@dataclass
class Baseline:
    """The run's settings and what pytest's machinery looked like before project code could run."""

    canaries: frozenset[str] = frozenset()
    modules: dict[str, types.ModuleType] = field(default_factory=dict)
    members: list[tuple[str, object, str, object]] = field(default_factory=list)  # (label, owner, name, value)
    class_keys: list[tuple[str, type, frozenset[str]]] = field(default_factory=list)
    plugins: list[object] | None = None  # registered just before the first conftest
    hook_executor: object = None
    changes: list[str] | None = None  # set by the session-finish check
    tests: testcode.TrustedTests | None = None  # the test files as the run started
    called: set[str] = field(default_factory=set)  # node ids whose call phase passed
    spoiled: set[str] = field(default_factory=set)  # node ids with a failed or skipped phase


STATE = Baseline()


def _watched(name: str) -> bool:
    return name.split(".", 1)[0] in WATCHED or name in WATCHED_STDLIB


def record() -> None:
    """Remember every function and class of the watched modules imported so far, and their classes' members."""
    for name, module in list(sys.modules.items()):
        if name in STATE.modules or not isinstance(module, types.ModuleType) or not _watched(name):
            continue
        STATE.modules[name] = module
        for attr, value in list(vars(module).items()):
            if not isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
                continue
            STATE.members.append((f"{name}.{attr}", module, attr, value))
            if isinstance(value, type) and value.__module__ == name and value.__flags__ & _HEAPTYPE:
                STATE.class_keys.append((f"{name}.{attr}", value, frozenset(vars(value))))
                STATE.members += [(f"{name}.{attr}.{key}", value, key, member) for key, member in vars(value).items()]


def _code_files(value: object, depth: int = 0) -> list[str | None]:
    """The source files of the code that `value` brings with it (None: code with no file): a function's, those of
    a method's, property's or partial's functions, a class's module's, an object's class's; none for plain data."""
    if depth > 4:
        return [None]
    if isinstance(value, (classmethod, staticmethod, types.MethodType)):
        return _code_files(value.__func__, depth + 1)
    if isinstance(value, property):
        return [f for fn in (value.fget, value.fset, value.fdel) if fn is not None for f in _code_files(fn, depth + 1)]
    if isinstance(value, functools.partial):
        return _code_files(value.func, depth + 1)
    if isinstance(value, types.FunctionType):
        return [value.__code__.co_filename]
    if isinstance(value, types.ModuleType):
        return [getattr(value, "__file__", None)]
    cls = value if isinstance(value, type) else type(value)
    if cls.__module__ == "builtins":  # plain data, or a builtin function
        return []
    file = getattr(sys.modules.get(cls.__module__), "__file__", None)
    return [file if isinstance(file, str) else None]


def trusted(file: str | None, root: str) -> bool:
    """Installed code (the venv, the standard library) or one of the repository's conftest files (the grader
    restored those): code that may change pytest's machinery — pytest's own plugins do, at configure time."""
    if file is None:
        return False
    path = os.path.realpath(file)
    return path.startswith(INSTALLED) or (path.startswith(root) and path.endswith(os.sep + "conftest.py"))


def identity_changes(root: str) -> list[str]:
    """What differs from `record`'s snapshot, where the new value brings code from anywhere but `trusted` places:
    replaced modules, functions, classes and class members, members added to classes; deleted ones."""
    out = [f"sys.modules[{name!r}] was replaced" for name, module in STATE.modules.items()
           if sys.modules.get(name) is not module]
    for label, owner, key, value in STATE.members:
        now = vars(owner).get(key, _MISSING)
        if now is _MISSING:
            out.append(f"{label} was deleted")
        elif now is not value and not all(trusted(f, root) for f in _code_files(now)):
            out.append(f"{label} was replaced")
    for label, cls, keys in STATE.class_keys:
        out += [f"{label}.{key} was added" for key in sorted(set(vars(cls)) - keys)
                if not all(trusted(f, root) for f in _code_files(vars(cls).get(key)))]
    return out


def _home(plugin: object) -> types.ModuleType | None:
    """The module a plugin is (a module plugin) or whose class defines it (an object plugin)."""
    return plugin if isinstance(plugin, types.ModuleType) else sys.modules.get(type(plugin).__module__)


def _root(config: pytest.Config) -> str:
    return os.path.realpath(str(config.rootpath)) + os.sep


def plugin_changes(config: pytest.Config) -> list[str]:
    """Plugins registered during the run by project code, plugins unregistered, hooks implemented by unregistered
    objects, a replaced hook executor."""
    pm = config.pluginmanager
    if STATE.plugins is None:
        return ["the plugin set was never recorded (the launcher's plugin did not see pytest start)"]
    now = pm.get_plugins()
    registered = {id(p) for p in now}
    root = _root(config)
    files = {id(p): os.path.realpath(f) for p in now if isinstance(f := getattr(_home(p), "__file__", None), str)}
    conftests = [p for p in now if isinstance(p, types.ModuleType) and files.get(id(p), "").startswith(root)
                 and files[id(p)].endswith(os.sep + "conftest.py")]
    listed: set[str] = set()
    for module in conftests:  # the modules a conftest names in `pytest_plugins` are the repository's choice
        spec = vars(module).get("pytest_plugins", ())
        listed.update([spec] if isinstance(spec, str) else [s for s in spec if isinstance(s, str)])
    before = {id(p) for p in STATE.plugins}
    out = [f"plugin {type(p).__name__} was unregistered" for p in STATE.plugins if id(p) not in registered]
    for p in now:
        home, file = _home(p), files.get(id(p))
        allowed = file is not None and (trusted(file, root) or (home is not None and home.__name__ in listed))
        if id(p) not in before and not allowed:
            out.append(f"plugin {pm.get_name(p) or type(p).__name__} was registered during the run by project code")
    for name, caller in vars(pm.hook).items():
        if any(id(impl.plugin) not in registered for impl in caller.get_hookimpls()):
            out.append(f"hook {name} has an implementation outside the registered plugins")
    if vars(pm).get("_inner_hookexec") is not STATE.hook_executor:
        out.append("the plugin manager's hook executor was replaced")
    return out


def strip_disabled_options(args: list[str]) -> list[str]:
    """`args` without the options of pytest-cov and xdist (with their values, `--opt=v`, `--opt v` or `-n4`), and
    without `-x`/`--exitfirst`/`--maxfail`."""
    kept, i = [], 0
    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        attached = name != arg or (arg.startswith("-n") and not arg.startswith("--") and len(arg) > 2)  # -n4
        if name in _FLAGS or (attached and (name in _TAKES_VALUE or name == "--cov" or arg.startswith("-n"))):
            i += 1
        elif name in _TAKES_VALUE:
            i += 2
        elif arg == "--cov":  # an optional value, as argparse reads nargs="?"
            i += 2 if i + 1 < len(args) and not args[i + 1].startswith("-") else 1
        else:
            kept.append(arg)
            i += 1
    return kept


def choose_config(root: Path, allowed: list[str]) -> Path | None:
    """The configuration file pytest would pick at `root` among the `allowed` names, by its own precedence."""
    from _pytest.config.findpaths import load_config_dict_from_file

    names = CONFIG_NAMES if int(pytest.__version__.split(".")[0]) >= 9 else CONFIG_NAMES_8
    pyproject = None
    for name in names:
        path = root / name
        if name not in allowed or path.is_symlink() or not path.is_file():
            continue
        if name == "pyproject.toml":
            pyproject = path  # pytest's fallback: the first pyproject.toml, even without pytest settings
        try:
            if load_config_dict_from_file(path) is not None:
                return path
        except (Exception, pytest.fail.Exception):
            return path  # pytest stops on this file too, with its own message
    return pyproject


def _checked(label: str, check) -> list[str]:
    """A check's findings; a check that raises is a finding itself (an honest run's objects never make it fail)."""
    try:
        return check()
    except Exception as e:  # whatever project objects make the check raise
        return [f"the check of {label} failed ({type(e).__name__})"]


def _note(findings: list[str]) -> None:
    known = STATE.tests.findings
    known += [f for f in dict.fromkeys(findings) if f not in known][:max(0, MAX_CHANGES - len(known))]


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if STATE.tests is not None:
        STATE.tests.config = config


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    args[:] = strip_disabled_options(args)
    record()
    STATE.plugins = list(early_config.pluginmanager.get_plugins())
    STATE.hook_executor = vars(early_config.pluginmanager).get("_inner_hookexec")


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name, obj):
    if name in STATE.canaries and isinstance(collector, pytest.Module) and isinstance(obj, types.FunctionType):
        return [pytest.Function.from_parent(collector, name=name)]
    return None


def pytest_collection_modifyitems(items):
    for item in items:
        item.user_properties.append((NODEID, item.nodeid))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    tests = STATE.tests
    if tests is not None:
        _note(_checked("the test modules", lambda: tests.sweep(tests.modules())))


def _item_problems(tests: testcode.TrustedTests, item: pytest.Function) -> list[str]:
    cls = item.getparent(pytest.Class)
    scope = "" if cls is None else cls.name if isinstance(cls.parent, pytest.Module) else "<nested>"
    fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
    return tests.item_problems(item.obj, item.module, scope, item.originalname, fixtures)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    tests = STATE.tests
    if tests is not None and isinstance(item, pytest.Function):
        _note(_checked(item.nodeid, lambda: _item_problems(tests, item)))


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        STATE.called.add(report.nodeid)
    elif report.failed or report.skipped:
        STATE.spoiled.add(report.nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    cov = coverage.Coverage.current()
    if cov is not None:
        cov.switch_context(item.nodeid)


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid, location):
    cov = coverage.Coverage.current()
    if cov is not None:
        cov.switch_context("")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    changes = identity_changes(_root(session.config)) + plugin_changes(session.config)
    tests = STATE.tests
    if tests is not None:
        _note(_checked("the test modules", lambda: tests.sweep(tests.modules())))
        _note(_checked("the test files", tests.disk_changes))
        changes += tests.findings
    STATE.changes = changes


def passed_digest(node_ids: list[str]) -> str:
    """The SHA-256 of the sorted node ids, one a line: the launcher's over what it saw pass, the grader's over what
    the report says passed."""
    return _sha256("\n".join(_sorted(node_ids)).encode("utf-8", "replace")).hexdigest()


def _quoted(text: str) -> str:
    """`text` as a JSON string of printable ASCII, written by hand (the grader keeps only printable ASCII anyway)."""
    return '"' + "".join(c if " " <= c <= "~" and c not in '"\\' else "?" for c in text) + '"'


def _file_digest(path: str) -> str | None:
    try:
        fd = _os_open(path, _READ)
    except OSError:
        return None
    digest = _sha256()
    try:
        while chunk := _os_read(fd, 1 << 20):
            digest.update(chunk)
    except OSError:
        return None
    finally:
        _os_close(fd)
    return digest.hexdigest()


def seal(fd: int, nonce: str, report: str, changes: list[str] | None) -> None:
    """Write the seal line (see the module docstring) to `fd`, the launcher's own copy of its stdout."""
    for stream in _STREAMS:  # so the seal follows pytest's output; the objects the launcher started with
        try:  # noqa: SIM105 - not contextlib.suppress: Python code the project could patch
            stream.flush()
        except (OSError, ValueError):
            pass
    passed = [bin_xml_escape(n) for n in STATE.called - STATE.spoiled]  # as the JUnit writer spells node ids
    digest = _file_digest(report)
    found = "null" if changes is None else "[" + ", ".join(_quoted(c) for c in changes[:MAX_CHANGES]) + "]"
    line = (f'{{"report": {"null" if digest is None else _quoted(digest)}, "passed": {{"count": {_len(passed)}, '
            f'"digest": {_quoted(passed_digest(passed))}}}, "changes": {found}}}')
    data = f"\n{SEAL}{nonce} {line}\n".encode()
    while data:
        data = data[_os_write(fd, data):]


def write_coverage(cov: coverage.Coverage, root: str, out: str) -> None:
    """The lines each test ran, as `{"contexts": [node id, …], "files": {path: {line: [context index, …]}}}` (paths
    relative to `root`; "" is the context of import and collection). Coverage's own JSON report repeats every node
    id for every line it ran: 190 MB for cachetools' 465 tests, past what a sandbox hands back."""
    data = cov.get_data()
    index: dict[str, int] = {}
    files = {os.path.relpath(path, root): {str(n): [index.setdefault(c, len(index)) for c in contexts]
                                           for n, contexts in data.contexts_by_lineno(path).items()}
             for path in data.measured_files()}
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"contexts": list(index), "files": files}, f)


def main(settings_file: str) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or os.curdir) == here:  # before 3.11, -I keeps the script's dir
        del sys.path[0]
    with open(settings_file, "rb") as f:
        settings = json.load(f)
    os.unlink(settings_file)
    seal_fd = _os_dup(1)  # the seal's way out, whatever the project does to file descriptor 1
    STATE.tests = testcode.TrustedTests.read(settings["rootdir"])
    record()
    root = Path(settings["rootdir"])
    if str(root) not in sys.path:
        sys.path.append(str(root))
    STATE.canaries = frozenset(settings["canaries"])
    config = choose_config(root, settings["configs"])
    if config is None:
        config = Path(here) / "pytest.ini"
        config.write_text("[pytest]\n")
    args = ["-c", str(config), f"--rootdir={root}", f"--confcutdir={root}", *settings["args"]]
    cov = None
    if settings["coverage"]:
        cov = coverage.Coverage(data_file=settings["coverage"]["data_file"], omit=settings["coverage"]["omit"],
                                config_file=False)
        cov.start()
    sys.argv = sys.argv[:1]
    plugin = sys.modules[__name__]
    sys.modules[__name__] = types.ModuleType(__name__)  # `import __main__` finds a blank module, not this state
    try:
        code = pytest.main(args, plugins=[plugin])
    finally:
        if cov is not None:
            cov.stop()
    changes = STATE.changes
    if changes is not None:
        changes = changes + [c for c in identity_changes(os.path.realpath(root) + os.sep) if c not in changes]
    seal(seal_fd, settings["nonce"], settings["report"], changes)
    if cov is not None:
        cov.save()
        try:
            write_coverage(cov, str(root), settings["coverage"]["json"])
        except (coverage.CoverageException, OSError) as e:
            print(f"coverage wrote no report: {e}", file=sys.stderr)
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

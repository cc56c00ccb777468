"""The test run's launcher and the pytest plugin it loads: the run's configuration, node ids, canaries, coverage
contexts, an integrity check of pytest's machinery, and a seal over the report.

`suite.run_suite` copies this file into a fresh, randomly named run directory of the sandbox's workspace and starts

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
   `pluggy.*`, every member of the classes defined there, the registered plugins and the plugin manager's hook
   executor. At session finish, and again after pytest returns, it lists every difference that brings code from
   outside installed packages and the repository's conftest files (pytest's own plugins legitimately patch its
   classes at configure time; the grader restored the conftests): a replaced or deleted function, method or module,
   a class member added, a plugin registered during the run by project code (conftest files, the modules their
   `pytest_plugins` name and installed code may register plugins), a plugin unregistered, a hook implementation
   whose plugin is not registered, a replaced hook executor. Recording and checking take about 15 ms.
7. **The seal.** After pytest returns, one line goes to this process's stdout: the nonce, the SHA-256 of the JUnit
   report as it is then, and the integrity findings (`null` if the session-finish check never ran). The grader
   reads it from the output the sandbox hands back, which nothing can change after the fact: a report rewritten
   later (an `atexit` handler, a process that outlived pytest) no longer matches it.

What this cannot do: it runs in the process of the code under test. Code written against this module can find its
state (through `gc`, say), rewrite its records before the check, unregister it, or silence the launcher's seal and
print its own (two seals of a run void it, so it must do both); it can reach into pytest where the identity check
does not look (instance attributes, module-level data), or bring code the origin rule trusts (C builtins, code
compiled under a forged file name). The check makes a generic hack visible, not a targeted one impossible. What
stands when it is defeated are the layers outside the process: the grader's static gate, which refuses patches
whose code reaches for this machinery (pytest imports, `gc`, frame inspection, `sys.modules` surgery, hard exits)
unless the gold patch does too, and the canaries, which a forced outcome trips unless the attack singles them out —
and to do that it has to find them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
import sysconfig
import types
from dataclasses import dataclass, field
from pathlib import Path

import coverage
import pytest

NODEID = "shipyard_nodeid"
SEAL = "shipyard-seal "
MAX_CHANGES = 50  # findings carried in the seal
WATCHED = ("pytest", "_pytest", "pluggy")
CONFIG_NAMES = ("pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")
CONFIG_NAMES_8 = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")  # before pytest 9
INSTALLED = tuple(sorted({os.path.realpath(p) + os.sep for key, p in sysconfig.get_paths().items()
                          if key in ("stdlib", "platstdlib", "purelib", "platlib")}))
_TAKES_VALUE = {"--cov-report", "--cov-config", "--cov-fail-under", "--cov-context", "-n", "--numprocesses",
                "--dist", "--maxprocesses", "--max-worker-restart", "--tx", "--rsyncdir", "--maxfail"}
_FLAGS = {"--cov-append", "--cov-branch", "--cov-reset", "--no-cov", "--no-cov-on-fail", "-x", "--exitfirst"}
_MISSING = object()


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


STATE = Baseline()


def _watched(name: str) -> bool:
    return name.split(".", 1)[0] in WATCHED


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
            if isinstance(value, type) and value.__module__ == name:
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
    STATE.changes = identity_changes(_root(session.config)) + plugin_changes(session.config)


def seal(nonce: str, report: str, changes: list[str] | None) -> None:
    """Write the seal line (see the module docstring) straight to file descriptor 1."""
    try:
        with open(report, "rb") as f:
            digest: str | None = hashlib.sha256(f.read()).hexdigest()
    except OSError:
        digest = None
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    line = json.dumps({"nonce": nonce, "report": digest,
                       "changes": None if changes is None else changes[:MAX_CHANGES]}, ensure_ascii=True)
    os.write(1, f"\n{SEAL}{line}\n".encode())


def main(settings_file: str) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or os.curdir) == here:  # before 3.11, -I keeps the script's dir
        del sys.path[0]
    with open(settings_file, "rb") as f:
        settings = json.load(f)
    os.unlink(settings_file)
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
    try:
        code = pytest.main(args, plugins=[sys.modules[__name__]])
    finally:
        if cov is not None:
            cov.stop()
    changes = STATE.changes
    if changes is not None:
        changes = changes + [c for c in identity_changes(os.path.realpath(root) + os.sep) if c not in changes]
    seal(settings["nonce"], settings["report"], changes)
    if cov is not None:
        cov.save()
        try:
            cov.json_report(outfile=settings["coverage"]["json"], show_contexts=True)
        except coverage.CoverageException as e:
            print(f"coverage wrote no report: {e}", file=sys.stderr)
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

"""The pytest plugin every suite run loads (`-p shipyard_pytest`): node ids, coverage contexts, neutral options.

It is copied into the sandbox's run directory (it must import with only pytest and coverage installed) and does
three things:

1. **Node ids in the JUnit report.** Each collected item gets a `shipyard_nodeid` user property, which the JUnit
   XML writer emits as a `<property>` of its `<testcase>`. The report's class name alone is ambiguous: a test
   method that a mixin in `tests/__init__.py` gives to several classes is reported with that file's name.
2. **Coverage per test.** Under `coverage run`, the current coverage context is switched to the test's node id when
   its setup starts and back to the empty context when it finishes; lines run in the empty context ran at import or
   collection time.
3. **Options of disabled plugins.** Runs pass `-p no:pytest_cov -p no:xdist`: pytest-cov would start a second
   tracer over ours, and xdist would move tests into worker processes. Projects often put `--cov=pkg` or `-n auto`
   in their `addopts`; with those plugins disabled pytest would reject them as unknown arguments, so they are
   removed from the argument list before pytest parses it (`pytest_load_initial_conftests` sees the list after
   `addopts` were prepended to it).
"""

from __future__ import annotations

import coverage
import pytest

NODEID = "shipyard_nodeid"
_TAKES_VALUE = {"--cov-report", "--cov-config", "--cov-fail-under", "--cov-context", "-n", "--numprocesses",
                "--dist", "--maxprocesses", "--max-worker-restart", "--tx", "--rsyncdir"}
_FLAGS = {"--cov-append", "--cov-branch", "--cov-reset", "--no-cov", "--no-cov-on-fail"}


def strip_disabled_options(args: list[str]) -> list[str]:
    """`args` without the options of pytest-cov and xdist (with their values, `--opt=v`, `--opt v` or `-n4`)."""
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


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    args[:] = strip_disabled_options(args)


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

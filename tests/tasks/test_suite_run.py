"""A real suite run in a sandbox over a prepared environment: node ids of tests inherited from a mixin, per-test
coverage contexts keyed by those ids, a project `addopts` naming pytest-cov and xdist options; and the run's own
defences, each tested on files planted straight into the workspace (no patch, so no static gate in the way):
configuration the run was not given, a top-level `pytest` package, canaries, the integrity check and the seal."""

import pytest
from servers import needs_sandbox

from shipyard.sandbox.host import host
from shipyard.sandbox.sandbox import Sandbox
from shipyard.sandbox.snapshot import make_snapshot, remove_snapshot
from shipyard.tasks.environment import prepare
from shipyard.tasks.suite import Canary, SuiteRun, canary_problems, run_suite

pytestmark = needs_sandbox

FILES = {
    "pyproject.toml": """[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "mini"
version = "0.1"

[tool.setuptools]
packages = ["mini"]

[tool.pytest.ini_options]
addopts = "--cov=mini --cov-report=term-missing --cov-branch -n 2 --doctest-modules"
""",
    "mini/__init__.py": '''def double(x):
    """Twice x.

    >>> double(4)
    8
    """
    y = x + x
    return y


def half(x):
    return x / 2
''',
    "tests/__init__.py": """from mini import double


class Mixin:
    value = 0

    def test_double(self):
        assert double(self.value) == 2 * self.value
""",
    "tests/test_a.py": "from tests import Mixin\n\n\nclass TestA(Mixin):\n    value = 2\n",
    "tests/test_b.py": """from mini import half
from tests import Mixin


class TestB(Mixin):
    value = 3


def test_half():
    assert half(3) == 1.5
""",
}


ALL = {"tests/test_a.py::TestA::test_double", "tests/test_b.py::TestB::test_double", "tests/test_b.py::test_half",
       "mini/__init__.py::mini.double"}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("suite")
    repo = tmp / "mini"
    for rel, text in FILES.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    prepare(repo, tmp / "env", tmp / "wheels")
    snap = make_snapshot(tmp / "env", host())
    yield snap
    remove_snapshot(snap)


def run_with(snap, files: dict[str, str], **kw) -> SuiteRun:
    """A suite run in a fresh sandbox over `snap` after writing `files` (appended to existing ones)."""
    with Sandbox(snap) as sb:
        for rel, text in files.items():
            old = sb.read_bytes(rel).decode() if sb.kind(rel) == "file" else ""
            sb.write_bytes(rel, (old + text).encode())
        return run_suite(sb, timeout=300, **kw)


def test_inherited_tests_keep_their_node_ids_and_coverage(env):
    run = run_with(env, {}, coverage=True)
    assert run.outcomes == dict.fromkeys(ALL, "passed"), run.output[-2000:]
    assert run.integrity.problems == [], run.integrity
    body = run.coverage["mini/__init__.py"][7]  # `y = x + x`
    assert {"tests/test_a.py::TestA::test_double", "tests/test_b.py::TestB::test_double",
            "mini/__init__.py::mini.double"} <= body
    assert "tests/test_b.py::test_half" not in body
    assert "" in run.coverage["mini/__init__.py"][1]  # the def line ran at import time


def test_only_the_named_configuration_and_the_real_pytest_run(env):
    """Config files the run was not told about (`.pytest.ini` and `pytest.toml` rank above pyproject.toml in
    pytest 9) and a top-level `pytest` package are ignored: the run is configured by the file it is given, and the
    working directory is not on sys.path (old code: `python -m pytest` imported ./pytest first)."""
    planted = {".pytest.ini": "[pytest]\naddopts = -k nothing_matches\n",
               "pytest.toml": '[pytest]\naddopts = ["-k", "nothing_matches"]\n',
               "pytest/__init__.py": "raise SystemExit('shadow pytest imported')\n",
               "sitecustomize.py": "print('SITECUSTOMIZE RAN')\n"}
    run = run_with(env, planted, configs=["pyproject.toml"])
    assert run.outcomes == dict.fromkeys(ALL, "passed"), run.output[-2000:]
    assert "SITECUSTOMIZE" not in run.output and run.integrity.problems == []


def test_canaries_are_collected_whatever_the_configuration(env):
    """The canaries are collected by the plugin, not by name patterns: here `python_functions` matches none of the
    project's tests, yet both canaries run, one failing and one passing."""
    canary = Canary.new("tests/test_b.py")
    run = run_with(env, {"pytest.ini": "[pytest]\npython_functions = check_*\n",
                         canary.module: canary.source().decode()}, configs=["pytest.ini", "pyproject.toml"],
                   canaries=[canary])
    assert run.outcomes[f"{canary.module}::{canary.must_fail}"] == "failed"
    assert run.outcomes[f"{canary.module}::{canary.must_pass}"] == "passed"
    assert "tests/test_b.py::test_half" not in run.outcomes  # pytest.ini was chosen (it ranks above pyproject.toml)
    assert canary_problems([canary], run) == ([], [])


REGISTER = """

import gc
import _pytest.config


class _Force:
    def pytest_runtest_logreport(self, report):
        report.outcome = "passed"


for _obj in gc.get_objects():
    if isinstance(_obj, _pytest.config.Config):
        _obj.pluginmanager.register(_Force(), "force")
        break
"""
PATCH_RUNNER = """

import _pytest.runner

_original = _pytest.runner.call_and_report


def _quiet(item, when, log=True, **kw):
    return _original(item, when, log, **kw)


_pytest.runner.call_and_report = _quiet
"""


def test_integrity_check_sees_runtime_plugins_and_patched_internals(env):
    """Code under test that registers a plugin through the live Config, or replaces a function of `_pytest`, is
    named in the seal's findings; the canaries catch the forced outcomes of the first as well."""
    canary = Canary.new("tests/test_b.py")
    run = run_with(env, {"mini/__init__.py": REGISTER, canary.module: canary.source().decode()},
                   configs=["pyproject.toml"], canaries=[canary])
    assert any("force was registered during the run" in c for c in run.integrity.changes), run.integrity
    assert canary_problems([canary], run)[0] == ["tests/test_b.py"]
    run = run_with(env, {"mini/__init__.py": PATCH_RUNNER}, configs=["pyproject.toml"])
    assert "_pytest.runner.call_and_report was replaced" in run.integrity.changes, run.integrity
    assert run.integrity.sealed and run.integrity.checked

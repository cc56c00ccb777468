"""A real suite run in a sandbox over a prepared environment: node ids of tests inherited from a mixin, per-test
coverage contexts keyed by those ids, and a project `addopts` naming pytest-cov and xdist options."""

import pytest

from shipyard.sandbox.host import host
from shipyard.sandbox.run import sandbox_problem
from shipyard.sandbox.sandbox import Sandbox
from shipyard.sandbox.snapshot import make_snapshot, remove_snapshot
from shipyard.tasks.environment import prepare
from shipyard.tasks.suite import run_suite

pytestmark = pytest.mark.skipif(sandbox_problem() is not None, reason=str(sandbox_problem()))

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


def test_inherited_tests_keep_their_node_ids_and_coverage(tmp_path):
    repo = tmp_path / "mini"
    for rel, text in FILES.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    prepare(repo, tmp_path / "env", tmp_path / "wheels")
    snap = make_snapshot(tmp_path / "env", host())
    try:
        with Sandbox(snap) as sb:
            run = run_suite(sb, coverage=True, timeout=300)
    finally:
        remove_snapshot(snap)
    assert run.outcomes == {"tests/test_a.py::TestA::test_double": "passed",
                            "tests/test_b.py::TestB::test_double": "passed",
                            "tests/test_b.py::test_half": "passed",
                            "mini/__init__.py::mini.double": "passed"}, run.output[-2000:]
    body = run.coverage["mini/__init__.py"][7]  # `y = x + x`
    assert {"tests/test_a.py::TestA::test_double", "tests/test_b.py::TestB::test_double",
            "mini/__init__.py::mini.double"} <= body
    assert "tests/test_b.py::test_half" not in body
    assert "" in run.coverage["mini/__init__.py"][1]  # the def line ran at import time

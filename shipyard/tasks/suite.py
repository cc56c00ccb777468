"""Running a repository's pytest suite inside a sandbox: per-test outcomes from JUnit XML, per-test coverage.

Outcomes come from pytest's JUnit XML report (`xunit1` family). Its `<testcase>` elements name a test by dotted
class name, which cannot always be mapped back to the pytest node id: a test method inherited from a mixin in
`tests/__init__.py` is reported with that file, under every class that inherits it. So our plugin
(`shipyard.tasks.pytest_plugin`, loaded into every run) records each item's node id
(`tests/test_a.py::TestX::test_y[1]`) as a JUnit property; the class name is only the fallback.
A test module that fails to import is reported by pytest as an error case named after the module, with an empty
class name: it is listed in `collection_errors` (and the other modules still run: `--continue-on-collection-errors`).

Coverage per test uses coverage.py's dynamic contexts: the same plugin switches coverage's context to the current
test's node id at setup and back to the empty context when the test finishes. Lines run with the empty context ran
at import or collection time: code every test needs.

Projects' own `--cov…` and `-n …` options are dropped (see the plugin): pytest-cov and xdist are disabled in runs.
`coverage json --show-contexts` then gives, per file and line, the tests that executed it.
"""

from __future__ import annotations

import json
import shlex
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from shipyard.harness.workspace import Workspace
from shipyard.tasks import pytest_plugin
from shipyard.tasks.environment import PYTHON
from shipyard.tasks.pytest_plugin import NODEID

RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
OUT = ".shipyard-run"  # per-run outputs, inside the throwaway sandbox's workspace


@dataclass
class SuiteRun:
    outcomes: dict[str, str]  # node id → passed | failed | error | skipped
    collection_errors: list[str] = field(default_factory=list)  # test modules that failed to import
    coverage: dict[str, dict[int, set[str]]] = field(default_factory=dict)  # file → line → node ids ("" = import)
    exit_code: int = 0
    output: str = ""

    @property
    def passed(self) -> set[str]:
        return {t for t, o in self.outcomes.items() if o == "passed"}


def node_id(case: ET.Element) -> str:
    """The pytest node id of an xunit1 `<testcase>`: file, then the class path below the module, then the name."""
    file, classname, name = case.get("file", ""), case.get("classname", ""), case.get("name", "")
    module = str(PurePosixPath(file).with_suffix("")).replace("/", ".")
    parts = [file]
    if classname.startswith(module + "."):
        parts += classname[len(module) + 1:].split(".")
    return "::".join([*parts, name])


def parse_junit(xml: bytes) -> tuple[dict[str, str], list[str]]:
    """(node id → outcome, modules that failed to collect) from a JUnit XML report."""
    outcomes: dict[str, str] = {}
    collection_errors: list[str] = []
    for case in ET.fromstring(xml).iter("testcase"):
        kinds = {child.tag for child in case}
        if not case.get("classname") and "error" in kinds:  # collection failure of a whole module
            collection_errors.append(case.get("name", "?"))
            continue
        outcome = ("failed" if "failure" in kinds else "error" if "error" in kinds
                   else "skipped" if "skipped" in kinds else "passed")
        recorded = case.find(f"properties/property[@name='{NODEID}']")
        nid = recorded.get("value", "") if recorded is not None else node_id(case)
        # A test with a teardown error is reported twice: keep the worse outcome.
        outcomes[nid] = max(outcome, outcomes.get(nid, "passed"), key=RANK.__getitem__)
    return outcomes, collection_errors


def run_suite(ws: Workspace, tests: list[str] | None = None, *, coverage: bool = False, timeout: float = 900,
              python: str = PYTHON) -> SuiteRun:
    """Run pytest (all of the suite, or the given node ids) in `ws`; outcomes, and coverage per test if asked."""
    ws.write_bytes(f"{OUT}/shipyard_pytest.py", Path(pytest_plugin.__file__).read_bytes())
    selection = " ".join(shlex.quote(t) for t in tests) if tests else ""
    pytest_args = ("-p no:cacheprovider -p no:pytest_cov -p no:xdist -p no:xdist.looponfail -p shipyard_pytest -q "
                   f"-o junit_family=xunit1 --continue-on-collection-errors "
                   f"--junitxml={OUT}/junit.xml {selection}")
    if coverage:
        data = f"--data-file={OUT}/coverage.data"
        script = (f"{python} -m coverage run {data} --omit='.venv/*,{OUT}/*' -m pytest {pytest_args}; code=$?; "
                  f"{python} -m coverage json {data} --show-contexts -q -o {OUT}/coverage.json; exit $code")
    else:
        script = f"{python} -m pytest {pytest_args}"
    env = ws.environment() | {"PYTHONPATH": f"{ws.exec_root}/{OUT}", "PYTHONDONTWRITEBYTECODE": "1"}
    result = ws.run(["bash", "-c", script], timeout=timeout, cwd=ws.exec_root, env=env)
    output = result.output.decode(errors="replace")
    if result.timed_out:
        raise TimeoutError(f"the test suite did not finish in {timeout:g} s:\n{output[-2000:]}")
    try:
        outcomes, collection_errors = parse_junit(ws.read_bytes(f"{OUT}/junit.xml"))
    except (OSError, ET.ParseError) as e:
        raise RuntimeError(f"pytest wrote no JUnit report (exit {result.exit_code}):\n{output[-3000:]}") from e
    run = SuiteRun(outcomes, collection_errors, exit_code=result.exit_code, output=output)
    if coverage:
        report = json.loads(ws.read_bytes(f"{OUT}/coverage.json"))
        for path, info in report["files"].items():
            lines = {int(n): set(ctx) for n, ctx in info.get("contexts", {}).items()}
            run.coverage[path] = lines
    return run

"""Running a repository's pytest suite inside a sandbox: per-test outcomes, per-test coverage, canaries and a seal.

Synthesis (the baseline runs, every validation grade) and grading run the suite through `run_suite` alone, so a
task is graded exactly the way its tests were judged stable. Each run gets a fresh run directory with an
unpredictable name (`.shipyard-<random>`: a patch cannot plant files in it, and `patchscan` refuses every dot path
anyway), and starts `shipyard.tasks.pytest_plugin` as the launcher in isolated mode with an environment stripped of
`PYTHON*`, `PYTEST*` and coverage variables; the launcher chooses the configuration file among the names it is
given and passes it to pytest explicitly (see its docstring for the whole list of what it pins down, and for what
an attack inside the process could still do).

Outcomes come from pytest's JUnit XML report (`xunit1` family). Its `<testcase>` elements name a test by dotted
class name, which cannot always be mapped back to the pytest node id: a test method inherited from a mixin in
`tests/__init__.py` is reported with that file, under every class that inherits it. So the plugin records each
item's node id (`tests/test_a.py::TestX::test_y[1]`) as a JUnit property; the class name is only the fallback. A
test module that fails to import is reported by pytest as an error case named after the module, with an empty class
name: it is listed in `collection_errors` (and the other modules still run: `--continue-on-collection-errors`).

Coverage per test uses coverage.py's dynamic contexts: the plugin switches coverage's context to the current test's
node id at setup and back to the empty context when the test finishes. Lines run with the empty context ran at
import or collection time: code every test needs. The launcher's JSON report gives, per file and line, the tests that
executed it (each node id written once, lines naming them by index).

**Canaries** (`Canary`): tests the grader appends, under random names, to the test modules that hold the tests it
scores — one must fail, one must pass. An outcome forced for every test turns the must-fail one green; a run that
drops or skips tests it does not know loses the must-pass one. `canary_problems` reads them back.

**The seal** (`Integrity`, `read_seal`): the launcher's last line starts with the run's nonce and carries the SHA-256
of the report, the count and SHA-256 of the node ids the plugin itself saw pass, and the plugin's integrity findings
(changes to pytest's machinery or to the test code). A report whose bytes do not match it was written after the
seal; one whose passed tests do not match it was rewritten before (or its outcomes were never pytest's). Lines that
do not start with this run's nonce are ignored unread, so sandboxed code cannot make the grader parse a hostile
seal. A report that cannot be parsed at all, for whatever reason, is `NoReport`, never an exception of its own.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from shipyard.harness.confined import PathError
from shipyard.harness.workspace import Workspace
from shipyard.tasks import pytest_plugin, testcode
from shipyard.tasks.environment import PYTHON, VENV
from shipyard.tasks.pytest_plugin import CONFIG_NAMES, NODEID, SEAL, TESTCODE, passed_digest

RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}
RUN_PREFIX = ".shipyard-"  # + random hex: the run directory, inside the throwaway sandbox's workspace
LAUNCHER = "shipyard_pytest.py"
PYTEST_ARGS = ("-p", "no:cacheprovider", "-p", "no:pytest_cov", "-p", "no:xdist", "-p", "no:xdist.looponfail", "-q",
               "-o", "junit_family=xunit1", "--continue-on-collection-errors")
SCRUBBED = ("PYTHON", "PYTEST", "COV_CORE", "COVERAGE")  # variable name prefixes the test run never sees
MAX_SEAL_LINE = 1 << 16


class NoReport(RuntimeError):
    """The run ended without a JUnit report that could be read (see `exit_code` and `output`)."""

    def __init__(self, message: str, exit_code: int, output: str):
        super().__init__(message)
        self.exit_code, self.output = exit_code, output


def printable(text: str, limit: int) -> str:
    """`text` as one line of printable ASCII (anything else becomes '?'), cut to `limit` characters."""
    line = "".join(c if " " <= c <= "~" else "?" for c in " ".join(text[:limit * 4].split()))
    return line if len(line) <= limit else line[:limit - 3] + "..."


@dataclass(frozen=True)
class Canary:
    """Two tests appended to the test module `module`: `must_fail` fails and `must_pass` passes, honestly."""

    module: str
    must_fail: str
    must_pass: str
    a: int
    b: int

    @classmethod
    def new(cls, module: str) -> Canary:
        return cls(module, f"test_{secrets.token_hex(6)}", f"test_{secrets.token_hex(6)}",
                   secrets.randbelow(10_000), secrets.randbelow(10_000))

    @property
    def names(self) -> tuple[str, str]:
        return self.must_fail, self.must_pass

    def source(self) -> bytes:
        a, b = self.a, self.b
        return (f"\n\n\ndef {self.must_fail}():\n    assert {a} + {b} == {a + b + 1}\n\n\n"
                f"def {self.must_pass}():\n    assert {a} + {b} == {a + b}\n").encode()


@dataclass
class Integrity:
    """What the launcher's seal says about a run."""

    sealed: bool = False  # exactly one seal with this run's nonce, naming the digest of the report that was read
    outcomes: bool = False  # the tests the report says passed are those the launcher saw pass
    checked: bool = False  # the plugin's session-finish check ran
    changes: list[str] = field(default_factory=list)  # its findings (sanitised)

    @property
    def problems(self) -> list[str]:
        out = [] if self.sealed else ["the report is not the one pytest wrote (no seal of this run matches it)"]
        if self.sealed and not self.outcomes:
            out.append("the tests the report says passed are not those the test run saw pass")
        if not self.checked:
            out.append("the integrity check of pytest's machinery never ran")
        if self.changes:
            out.append(f"{len(self.changes)} change(s) to pytest's machinery or the test code during the run")
        return out


@dataclass
class SuiteRun:
    outcomes: dict[str, str]  # node id → passed | failed | error | skipped
    collection_errors: list[str] = field(default_factory=list)  # test modules that failed to import
    coverage: dict[str, dict[int, set[str]]] = field(default_factory=dict)  # file → line → node ids ("" = import)
    exit_code: int = 0
    output: str = ""
    integrity: Integrity = field(default_factory=Integrity)

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
    """(node id → outcome, modules that failed to collect) from a JUnit XML report. Raises ValueError for a report
    that cannot be read, whatever the reason (malformed, an unknown or broken encoding, …)."""
    outcomes: dict[str, str] = {}
    collection_errors: list[str] = []
    try:
        root = ET.fromstring(xml)
    except (ET.ParseError, LookupError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"the JUnit report cannot be read ({type(e).__name__})") from None
    for case in root.iter("testcase"):
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


def read_seal(output: str, nonce: str, report: bytes, outcomes: dict[str, str]) -> Integrity:
    """The seal of this run (its lines start with the nonce, which only the launcher knows) in the launcher's output,
    checked against the report that was read and the outcomes parsed from it."""
    prefix, seals = f"{SEAL}{nonce} ", []
    for line in output.splitlines():
        if line.startswith(prefix) and len(line) <= MAX_SEAL_LINE:
            try:
                seal = json.loads(line[len(prefix):])
            except (ValueError, RecursionError):
                seal = None
            seals.append(seal)
    if len(seals) != 1 or not isinstance(seals[0], dict):
        return Integrity()
    seal = seals[0]
    changes, passed = seal.get("changes"), seal.get("passed")
    said = sorted(t for t, o in outcomes.items() if o == "passed")
    return Integrity(sealed=seal.get("report") == hashlib.sha256(report).hexdigest(),
                     outcomes=isinstance(passed, dict) and passed.get("digest") == passed_digest(said),
                     checked=isinstance(changes, list),
                     changes=[printable(str(c), 160) for c in changes[:20]] if isinstance(changes, list) else [])


def canary_problems(canaries: list[Canary], run: SuiteRun) -> tuple[list[str], list[str]]:
    """(modules whose must-fail canary passed: forced outcomes; modules whose canaries are missing or did not fail
    and pass as they must). A module that failed to import is in neither: its canaries could not run."""
    broken = set(run.collection_errors)
    forced, off = [], []
    for c in canaries:
        fail = run.outcomes.get(f"{c.module}::{c.must_fail}")
        good = run.outcomes.get(f"{c.module}::{c.must_pass}")
        if fail == "passed":
            forced.append(c.module)
        if (fail not in ("failed", "error") or good != "passed") and \
                str(PurePosixPath(c.module).with_suffix("")).replace("/", ".") not in broken:
            off.append(c.module)
    return forced, off


def top_level_configs(paths: list[str]) -> list[str]:
    """The pytest configuration files among `paths` (repository paths) that sit at the repository's root."""
    return [p for p in paths if p in CONFIG_NAMES]


@dataclass(frozen=True)
class Launch:
    """A prepared test run: its run directory (relative to the workspace), nonce, settings file (the path the
    sandbox sees) and the scrubbed environment to start the launcher with."""

    run_dir: str
    nonce: str
    settings: str
    env: dict[str, str]


def prepare_launch(ws: Workspace, tests: list[str] | None = None, *, coverage: bool = False,
                   configs: list[str] | None = None, canaries: list[Canary] = ()) -> Launch:
    """Write the launcher, its test-code reader and its settings into a fresh run directory of `ws` (see
    `run_suite` for the arguments); the launcher is then started as `python -I -B RUN_DIR/LAUNCHER SETTINGS`."""
    run_dir, nonce, root = f"{RUN_PREFIX}{secrets.token_hex(8)}", secrets.token_hex(16), ws.exec_root
    if configs is None:
        configs = [e.name for e in ws.listdir(".") if e.kind == "file" and e.name in CONFIG_NAMES]
    junit = f"{root}/{run_dir}/junit.xml"
    cov = {"data_file": f"{root}/{run_dir}/coverage.data", "json": f"{root}/{run_dir}/coverage.json",
           "omit": [f"{root}/{VENV}/*", f"{root}/{run_dir}/*"]}
    settings = {"rootdir": root, "nonce": nonce, "configs": list(configs), "report": junit,
                "canaries": sorted(n for c in canaries for n in c.names), "coverage": cov if coverage else None,
                "args": [*PYTEST_ARGS, f"--junitxml={junit}", *(tests or [])]}
    ws.write_bytes(f"{run_dir}/{LAUNCHER}", Path(pytest_plugin.__file__).read_bytes())
    ws.write_bytes(f"{run_dir}/{TESTCODE}", Path(testcode.__file__).read_bytes())
    ws.write_bytes(f"{run_dir}/settings.json", json.dumps(settings).encode())
    return Launch(run_dir, nonce, f"{root}/{run_dir}/settings.json", scrubbed_environment(ws))


def scrubbed_environment(ws: Workspace) -> dict[str, str]:
    """The workspace's environment without the variables a test run never sees (`SCRUBBED` prefixes)."""
    return {k: v for k, v in ws.environment().items() if not k.startswith(SCRUBBED)}


def run_suite(ws: Workspace, tests: list[str] | None = None, *, coverage: bool = False, timeout: float = 900,
              python: str = PYTHON, configs: list[str] | None = None, canaries: list[Canary] = ()) -> SuiteRun:
    """Run pytest (all of the suite, or the given node ids) in `ws`: outcomes, the seal, and coverage per test if
    asked. `configs`: the root-level configuration files pytest may choose from (None: those in the workspace);
    `canaries`: tests already appended to their modules, to collect. Raises TimeoutError past `timeout` and
    `NoReport` when no readable report came back."""
    launch = prepare_launch(ws, tests, coverage=coverage, configs=configs, canaries=canaries)
    run_dir, nonce, root = launch.run_dir, launch.nonce, ws.exec_root
    argv = [python, "-I", "-B", f"{root}/{run_dir}/{LAUNCHER}", launch.settings]
    result = ws.run(argv, timeout=timeout, cwd=root, env=launch.env)
    output = result.output.decode(errors="replace")
    if result.timed_out:
        raise TimeoutError(f"the test suite did not finish in {timeout:g} s:\n{output[-2000:]}")
    try:
        report = ws.read_bytes(f"{run_dir}/junit.xml")
        outcomes, collection_errors = parse_junit(report)
    except (PathError, ValueError) as e:
        raise NoReport(f"pytest wrote no readable JUnit report (exit {result.exit_code}):\n{output[-3000:]}",
                       result.exit_code, output) from e
    run = SuiteRun(outcomes, collection_errors, exit_code=result.exit_code, output=output,
                   integrity=read_seal(output, nonce, report, outcomes))
    if coverage:
        try:
            data = json.loads(ws.read_bytes(f"{run_dir}/coverage.json"))
            names = data["contexts"]
            for path, lines in data["files"].items():
                run.coverage[path] = {int(n): {names[i] for i in contexts} for n, contexts in lines.items()}
        except (ValueError, RecursionError, LookupError, TypeError, AttributeError) as e:
            raise RuntimeError(f"coverage wrote no readable report:\n{output[-2000:]}") from e
    return run

"""Differential checks: the candidate against the original implementation, on inputs no test asserts on.

A task's tests pin the deleted feature down at a few inputs the agent can read, so a patch that memorises them (a
lookup table of the tests' own arguments) earns the full reward for code that does nothing. The grader holds the
original implementation and nothing in the sandbox does, so it can ask a question the tests cannot: does the
candidate compute what the original computed, on other inputs of the same kinds? (Differential testing: McKeeman,
"Differential Testing for Software", Digital Technical Journal 10(1), 1998; SWE-bench-style graders that stop at the
repository's tests are known to reward test-specific patches — Wang et al., "Are 'Solved Issues' in SWE-bench Really
Solved Correctly?", 2025, found 7.8 % of plausible patches wrong under differential patch testing.)

At synthesis (`record`, in a sandbox holding the original code): `probe.py` records the arguments of every call of
the deleted code while the FAIL_TO_PASS tests run, derives perturbed inputs from them (same types, other values),
and keeps the original's result for each input; for functions whose parameters all have type hints of plain data,
`hypothesis` draws more inputs from the hints (`typed_calls`, run on the original by `probe.extend`); a second
process then checks every case again, with the `time` module's clocks a day ahead, and the cases whose
result differs (randomness, state that leaks between calls, hash order, the clock) are dropped. The cases go to
`TASK_DIR/differential.json`, beside `gold.patch`, never into the snapshot. Why calls could not become cases
(unpicklable arguments, nested functions, randomness, …) is counted there too: `shipyard bench synth` reports the
share of tasks with cases and the reasons of the rest.

At grading (`check`, only when the tests said 1.0 — anything less is 0 already): the probe calls the candidate on
every case's input in the grading sandbox, after the suite, and the host compares (`compare`): exact builtin types
structurally, int and float by value (floats within `REL_TOL`/`ABS_TOL`), exceptions by type (the candidate's
exception must be an instance of the original's type, compared by name). One mismatch scores 0, status
`differential_failed`, and the monitors flag the rollout (`test_fitting`). The verdict says how many cases differed
and of which origin, never the expected values: verdicts feed hints, and hints must not carry the answer.

What the check does not see: behaviour the original had on inputs no perturbation of the tests' arguments reaches,
side effects outside the arguments (files, globals), and code reached only through objects that cannot be pickled.
The bundled projects' coverage is in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import math
import os
import random
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError, with_config

from shipyard.harness.confined import PathError
from shipyard.harness.workspace import Workspace
from shipyard.tasks import probe
from shipyard.tasks.environment import PYTHON
from shipyard.tasks.suite import LAUNCHER, RUN_PREFIX, prepare_launch, scrubbed_environment, top_level_configs
from shipyard.tasks.taskset import RECREATE, STRICT, Task, TaskFormatError, read_capped, schema_problem

DIFF_FILE = "differential.json"
DIFF_VERSION = 1
MAX_DIFF_FILE = 16 << 20
PROBE = "shipyard_probe.py"
REL_TOL, ABS_TOL = 1e-6, 1e-9
UNREADABLE = "returned a result the grader cannot read"
CLOCK_SHIFT = 86400.0  # the second process at synthesis runs a day ahead: grading comes hours or days later
CHECK_SECONDS = 120.0  # the probe's whole run at grading: cases × `probe.CALL_SECONDS` at most, and start-up


@with_config(STRICT)
@dataclass
class Case:
    module: str
    qualname: str
    origin: str  # recorded | perturbed | typed
    input: str  # base64 of the pickled (args, kwargs): loaded only inside a sandbox
    output: dict[str, Any]  # the original's result in `probe.canonical` form


@with_config(STRICT)
@dataclass
class Differential:
    cases: list[Case] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)  # why calls did not become cases, counted
    calls: dict[str, int] = field(default_factory=dict)  # "module:qualname" → distinct inputs + unpicklable calls
    version: int = DIFF_VERSION

    def summary(self) -> dict[str, Any]:
        """What task.json keeps: case counts by origin, and the reasons (for coverage reports)."""
        return {"cases": len(self.cases), "recorded": sum(c.origin == "recorded" for c in self.cases),
                "perturbed": sum(c.origin == "perturbed" for c in self.cases),
                "typed": sum(c.origin == "typed" for c in self.cases), "reasons": dict(self.reasons)}

    def note(self, why: str, n: int = 1) -> None:
        self.reasons[why] = self.reasons.get(why, 0) + n

    def keep_only(self, kept: list[Case], why: str) -> None:
        """Keep the cases `kept`; the others are counted under `why`."""
        if len(kept) < len(self.cases):
            self.note(why, len(self.cases) - len(kept))
        self.cases = kept

    def why_none(self) -> str:
        """Why this task has no cases ('' when it has some)."""
        if self.cases:
            return ""
        if self.reasons:
            return max(self.reasons.items(), key=lambda kv: kv[1])[0]
        return "the tests made no call of the deleted code that could be recorded"


@with_config(STRICT)
@dataclass
class Checked:
    results: list[dict[str, Any]]


@with_config(STRICT)
@dataclass
class Recorded:
    """What the probe's record mode writes: `Differential`'s fields and the plain-data hints of the functions."""

    cases: list[Case]
    reasons: dict[str, int]
    calls: dict[str, int]
    hints: dict[str, list[list[Any]]]


@with_config(STRICT)
@dataclass
class Extended:
    cases: list[Case]
    reasons: dict[str, int]


DIFFERENTIAL = TypeAdapter(Differential)
CHECKED = TypeAdapter(Checked)
RECORDED = TypeAdapter(Recorded)
EXTENDED = TypeAdapter(Extended)
TYPED = 8  # inputs drawn from type hints per function


def load(task_dir: Path) -> Differential | None:
    """The task's differential cases (None for a task synthesized without them); TaskFormatError when the file is
    a link, too large or malformed."""
    path = Path(task_dir) / DIFF_FILE
    if not os.path.lexists(path):
        return None
    try:
        return DIFFERENTIAL.validate_json(read_capped(path, MAX_DIFF_FILE))
    except ValidationError as e:
        raise TaskFormatError(f"{path} is not a valid differential file: {schema_problem(e)}; {RECREATE}") from None


def save(task_dir: Path, diff: Differential) -> None:
    (Path(task_dir) / DIFF_FILE).write_text(json.dumps(asdict(diff)) + "\n")


def _run_probe(ws: Workspace, settings: dict, timeout: float, env: dict[str, str] | None = None,
               run_dir: str | None = None) -> bytes | None:
    """Start the probe in `ws` with `settings`; its output file (JSON), or None when the run left none."""
    root = ws.exec_root
    run_dir = run_dir or f"{RUN_PREFIX}{secrets.token_hex(8)}"
    out = f"{run_dir}/probe-{secrets.token_hex(4)}.json"
    ws.write_bytes(f"{run_dir}/{PROBE}", Path(probe.__file__).read_bytes())
    ws.write_bytes(f"{run_dir}/probe.json", json.dumps({**settings, "rootdir": root, "out": f"{root}/{out}"}).encode())
    if env is None:
        env = scrubbed_environment(ws)
    result = ws.run([PYTHON, "-I", "-B", f"{root}/{run_dir}/{PROBE}", f"{root}/{run_dir}/probe.json"],
                    timeout=timeout, cwd=root, env=env)
    if result.timed_out:
        return None
    try:
        return ws.read_bytes(out)
    except PathError:
        return None


def check(ws: Workspace, cases: list[Case], timeout: float = CHECK_SECONDS,
          clock_shift: float = 0.0) -> list[dict[str, Any]] | None:
    """Each case's result from the code in `ws`, in order, with the clocks `clock_shift` seconds ahead
    (`probe.shifted_clocks`); None when the probe left no readable results (it crashed, exited, hung or wrote
    something else: the code under test's doing, unless the sandbox failed)."""
    settings = {"mode": "check", "clock_shift": clock_shift,
                "cases": [{"module": c.module, "qualname": c.qualname, "input": c.input} for c in cases]}
    out = _run_probe(ws, settings, timeout)
    try:
        results = CHECKED.validate_json(out).results if out is not None else None
    except ValidationError:  # pydantic's parser bounds nesting: a deep file is an error, not a RecursionError
        return None
    return results if results is not None and len(results) == len(cases) else None


def record(ws: Workspace, task: Task, timeout: float, seed: int = 0) -> Differential:
    """The cases of `task`, from the original code in `ws` (the task's snapshot with its gold patch applied): the
    FAIL_TO_PASS tests run under the probe's recorder, then every case is checked again in a fresh process."""
    launch = prepare_launch(ws, task.fail_to_pass, configs=top_level_configs(task.test_files))
    settings = {"mode": "record", "seed": seed, "launcher": LAUNCHER, "launcher_settings": launch.settings,
                "targets": [{"file": d.file, "start": d.start, "end": d.end, "qualname": d.qualname,
                             "whole": task.tier == 3} for d in task.deleted]}
    out = _run_probe(ws, settings, timeout, env=launch.env, run_dir=launch.run_dir)
    try:
        recorded = RECORDED.validate_json(out if out is not None else b"")
    except ValidationError:
        return Differential(reasons={"the recording run left no readable result": 1})
    diff = Differential(recorded.cases, recorded.reasons, recorded.calls)
    _extend(ws, diff, recorded.hints, seed, timeout)
    _bound(diff)
    if not diff.cases:
        return diff
    again = check(ws, diff.cases, clock_shift=CLOCK_SHIFT)
    if again is None:
        return Differential(reasons={"the original's check run left no readable result": 1}, calls=diff.calls)
    diff.keep_only([c for c, r in zip(diff.cases, again, strict=True) if compare(c.output, r) is None],
                   "the original's result differs between two processes (hash order, global state, the clock)")
    return diff


def _bound(diff: Differential) -> None:
    """The probe's limits, enforced again on the host (the recording ran the repository's code, which may have
    written anything): case count, each input's and result's size. The file stays far under `MAX_DIFF_FILE`."""
    diff.keep_only([c for c in diff.cases if len(c.input) <= 2 * probe.MAX_INPUT
                    and len(json.dumps(c.output)) <= probe.MAX_OUTPUT][:probe.MAX_CASES],
                   "over the probe's limits (cases, input or result size)")


def _extend(ws: Workspace, diff: Differential, hints: dict[str, list[list[Any]]], seed: int, timeout: float) -> None:
    """Add cases from inputs drawn from the functions' type hints (`typed_calls`), run on the original in `ws`."""
    calls = typed_calls(hints, seed)
    if not calls:
        return
    out = _run_probe(ws, {"mode": "extend", "calls": calls}, timeout)
    try:
        extended = EXTENDED.validate_json(out if out is not None else b"")
    except ValidationError:
        diff.note("the typed inputs' run left no readable result")
        return
    diff.cases += extended.cases  # `_bound` keeps the task's number of cases
    for why, n in extended.reasons.items():
        diff.note(why, n)


def typed_calls(hints: dict[str, list[list[Any]]], seed: int, per_function: int = TYPED) -> list[dict[str, Any]]:
    """Calls of each hinted function ("module:qualname" → `probe.parameters`) on inputs `hypothesis` draws from
    the hints — reproducibly (derandomized, `seed` mixed into the order), small (sizes ≤ 8, numbers of moderate
    size, no NaN): the arguments as canonical forms for `probe.extend`."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    calls = []
    for key, params in sorted(hints.items()):
        module, _, qualname = key.partition(":")
        try:
            strategy = st.fixed_dictionaries({name: _strategy(spec) for name, _, spec in params})
        except (ValueError, TypeError, KeyError, IndexError):
            continue
        drawn: list[dict] = []

        @settings(derandomize=True, max_examples=per_function * 3, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def draw(values: dict) -> None:
            drawn.append(values)  # noqa: B023 — one list per function, filled before the next is made

        draw()
        unique = list({repr(d): d for d in drawn}.values())
        random.Random(seed).shuffle(unique)
        for values in unique[:per_function]:
            args = [values[n] for n, kind, _ in params if kind == "positional"]
            kwargs = {n: values[n] for n, kind, _ in params if kind == "keyword"}
            calls.append({"module": module, "qualname": qualname, "args": probe.canonical(args),
                          "kwargs": probe.canonical(kwargs)})
    return calls


def _strategy(spec: Any):
    """The hypothesis strategy of a `probe.hint_spec`."""
    from hypothesis import strategies as st

    if isinstance(spec, str):
        return {"int": st.integers(-1000, 1000), "bool": st.booleans(), "NoneType": st.none(),
                "float": st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False),
                "str": st.text(max_size=12), "bytes": st.binary(max_size=12)}[spec]
    tag = spec[0]
    if tag in ("list", "tuple_of"):
        items = st.lists(_strategy(spec[1]), max_size=8)
        return items if tag == "list" else items.map(tuple)
    if tag == "tuple":
        return st.tuples(*[_strategy(s) for s in spec[1]])
    if tag == "dict":
        return st.dictionaries(_strategy(spec[1]), _strategy(spec[2]), max_size=6)
    if tag in ("set", "frozenset"):
        return st.sets(_strategy(spec[1]), max_size=8) if tag == "set" else st.frozensets(_strategy(spec[1]),
                                                                                           max_size=8)
    if tag == "union":
        return st.one_of(*[_strategy(s) for s in spec[1]])
    raise ValueError(f"no strategy for {spec!r}")


def compare(expected: Any, got: Any) -> str | None:
    """None when the candidate's result `got` matches the original's `expected` (both `probe.canonical`
    results); otherwise what differs, in words that do not reveal the expected value."""
    raised = got.get("raises") if isinstance(got, dict) else None
    if not isinstance(got, dict) or ("raises" in got and not (
            isinstance(raised, list) and raised and all(isinstance(n, str) for n in raised))):
        return UNREADABLE
    try:
        if "raises" in expected:
            if raised is None:
                return "returned where the original raised"
            return None if expected["raises"][0] in raised else \
                f"raised {raised[0][:80]} instead of the original's exception"
        if raised is not None:
            return f"raised {raised[0][:80]} where the original returned"
        for part in ("return", "args", "kwargs"):  # arguments: only those the original changed were kept
            if part in expected and not _same(expected[part], got.get(part)):
                return "returned a different value" if part == "return" else "left its arguments in another state"
        return None
    except (RecursionError, ArithmeticError, TypeError, AttributeError, IndexError, KeyError, ValueError):
        return UNREADABLE


def _number(v: Any) -> float | int | None:
    if isinstance(v, list) and len(v) == 2 and v[0] in ("int", "float") and isinstance(v[1], str):
        return int(v[1], 16) if v[0] == "int" else float(v[1])
    return None


def _same(a: Any, b: Any) -> bool:
    x, y = _number(a), _number(b)
    if x is not None or y is not None:
        if x is None or y is None:
            return False
        if isinstance(x, int) and isinstance(y, int):
            return x == y
        try:
            x, y = float(x), float(y)
        except OverflowError:  # an int past any float: not the original's float
            return False
        return (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=REL_TOL, abs_tol=ABS_TOL)
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(p, q) for p, q in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def differences(cases: list[Case], results: list[dict[str, Any]]) -> list[tuple[int, Case, str]]:
    """(number from 1, case, what differed) for each case whose result differs from the original's."""
    out = []
    for i, (case, result) in enumerate(zip(cases, results, strict=True), 1):
        why = compare(case.output, result)
        if why is not None:
            out.append((i, case, why))
    return out



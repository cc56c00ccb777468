"""Differential checks (issue 28): a patch that fits the tests — a lookup table of their inputs — passes every test
and must still score 0. The probe's canonical forms and the host's comparison are checked on their own first (an
object equal to everything, floats, exceptions by type, hostile result files), then the whole path in real
sandboxes over the example repository's task set: the gold patch and the cases recorded at synthesis, the issue's
lookup table and its generic form, code that behaves differently outside pytest."""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
from pathlib import Path

import pytest
from servers import needs_sandbox

from shipyard.tasks import differential, probe
from shipyard.tasks.differential import Case, Differential, compare
from shipyard.tasks.grade import grade
from shipyard.tasks.monitors import verdict_flags
from shipyard.tasks.probe import literal
from shipyard.tasks.redteam import FITTING, _with_body, edited, target
from shipyard.tasks.taskset import TaskFormatError, list_tasks, load_task


def result(value, args=()) -> dict:
    """What the probe writes for a call that returned `value` with positional arguments `args` (no keywords)."""
    return {"return": probe.canonical(value), "args": probe.canonical(list(args)), "kwargs": probe.canonical({})}


class Anything:
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False


class Plain:
    def __init__(self, a, b):
        self.a, self.b = a, b


# -- canonical forms and the comparison (no sandbox) --------------------------------------------------------------

def test_an_object_equal_to_everything_is_not_the_value_it_claims_to_be():
    assert Anything() == 2.0
    assert compare(result(2.0), result(Anything())) == "returned a different value"


def test_numbers_compare_by_value_floats_within_tolerance_and_bools_are_not_ints():
    assert compare(result(2.0), result(2)) is None  # median([3, 1, 2]) may honestly be 2 or 2.0
    assert compare(result(0.1 + 0.2), result(0.3)) is None
    assert compare(result(float("nan")), result(float("nan"))) is None
    assert compare(result(1.0), result(1.001)) == "returned a different value"
    assert compare(result(10**30), result(10**30 + 1)) == "returned a different value"  # ints are exact
    assert compare(result(True), result(1)) == "returned a different value"


def test_containers_keep_their_kind_and_unordered_ones_compare_unordered():
    assert compare(result((1, 2)), result([1, 2])) == "returned a different value"
    assert compare(result({"b": 1, "a": 2}), result({"a": 2, "b": 1})) is None
    assert compare(result({3, 1, 2}), result({1, 2, 3})) is None
    assert compare(result([1, 2]), result([2, 1])) == "returned a different value"


def test_objects_compare_by_their_state_and_arguments_by_their_state_afterwards():
    assert compare(result(Plain(1, [2])), result(Plain(1, [2]))) is None
    assert compare(result(Plain(1, [2])), result(Plain(1, [3]))) == "returned a different value"
    assert compare(result(None, [[1, 2]]), result(None, [[2, 1]])) == "left its arguments in another state"


def test_exceptions_compare_by_type_and_a_subclass_counts():
    class Special(ValueError):
        pass

    expected = probe._raised(ValueError("x"))
    assert expected["raises"][0] == "builtins.ValueError"
    assert compare(expected, probe._raised(Special("y"))) is None
    assert compare(expected, probe._raised(KeyError("z"))) == "raised builtins.KeyError instead of the original's " \
                                                              "exception"
    assert compare(expected, result(1)) == "returned where the original raised"
    assert compare(result(1), probe._raised(KeyError())) == "raised builtins.KeyError where the original returned"


UNREADABLE, RETURNED = "returned a result the grader cannot read", "returned where the original raised"


@pytest.mark.parametrize(("got", "vs_returned", "vs_raised"), [
    (None, UNREADABLE, UNREADABLE), ([], UNREADABLE, UNREADABLE), ("x", UNREADABLE, UNREADABLE),
    ({"raises": []}, UNREADABLE, UNREADABLE), ({"raises": "builtins.X"}, UNREADABLE, UNREADABLE),
    ({"raises": [3]}, UNREADABLE, UNREADABLE),
    ({"return": ["float", "not a float"]}, UNREADABLE, RETURNED),
    ({"return": ["int"]}, "returned a different value", RETURNED),
])
def test_a_result_the_grader_cannot_read_is_a_mismatch_never_an_error(got, vs_returned, vs_raised):
    assert compare(result(1.5), got) == vs_returned
    assert compare(probe._raised(ValueError()), got) == vs_raised


def test_canonical_forms_are_bounded_and_survive_cycles():
    loop: list = [1]
    loop.append(loop)
    assert probe.canonical(loop) == ["list", [["int", "0x1"], ["deep"]]]
    with pytest.raises(probe.TooLarge):
        probe.canonical(list(range(probe.MAX_NODES + 1)))
    assert literal(probe.canonical({"k": (1, 2.5, b"\x00", frozenset({"s"}))})) == {"k": (1, 2.5, b"\x00",
                                                                                         frozenset({"s"}))}
    with pytest.raises(ValueError, match="not plain data"):
        literal(probe.canonical(Plain(1, 2)))


def test_a_call_past_its_time_counts_as_raising_timeout(monkeypatch):
    monkeypatch.setattr(probe, "CALL_SECONDS", 0.05)

    def spin(n):
        while True:
            n += 1

    assert probe.call_case(spin, pickle.dumps(((0,), {}))) == {"raises": ["timeout"], "args_before": ["list", [
        ["int", "0x0"]]], "kwargs_before": ["dict", []]}


def test_perturbations_keep_the_types_change_the_values_and_are_reproducible():
    recorded = [pickle.dumps(((v,), {})) for v in ([3, 1, 2], [4, 1, 3, 2])]
    first = probe.perturbations(recorded, random.Random(7))
    assert first == probe.perturbations(recorded, random.Random(7))
    assert len(first) == probe.PERTURBED and not set(first) & set(recorded) and len(set(first)) == len(first)
    for blob in first:
        (values,), kwargs = pickle.loads(blob)
        assert type(values) is list and kwargs == {}
        assert all(type(v) in (int, float) for v in values)


def test_a_missing_file_means_no_check_and_a_bad_one_is_a_task_format_error(tmp_path):
    assert differential.load(tmp_path) is None
    (tmp_path / differential.DIFF_FILE).write_text('{"cases": [{"module": 1}]}')
    with pytest.raises(TaskFormatError, match="not a valid differential file"):
        differential.load(tmp_path)
    (tmp_path / differential.DIFF_FILE).unlink()
    (tmp_path / "elsewhere.json").write_text("{}")
    os.symlink(tmp_path / "elsewhere.json", tmp_path / differential.DIFF_FILE)
    with pytest.raises(TaskFormatError, match="symbolic link"):
        differential.load(tmp_path)
    (tmp_path / differential.DIFF_FILE).unlink()
    nested = "[" * 5000 + "]" * 5000
    (tmp_path / differential.DIFF_FILE).write_text(f'{{"cases": [], "reasons": {{}}, "calls": {{}}, "x": {nested}}}')
    with pytest.raises(TaskFormatError):
        differential.load(tmp_path)


def test_verdict_flags_name_test_fitting_only_for_a_failed_differential_check():
    assert [f.kind for f in verdict_flags({"status": "differential_failed", "detail": "d"}, 3)] == ["test_fitting"]
    assert verdict_flags({"status": "graded", "reward": 0.0}, 3) == []
    assert verdict_flags(None, 3) == []


# -- the whole path, in sandboxes, over the example repository's task set -----------------------------------------

def t1(taskset) -> tuple:
    out = taskset[0]
    return next(load_task(out, t) for t in list_tasks(out) if load_task(out, t)[0].tier == 1)


@needs_sandbox
def test_synthesis_records_cases_beside_the_task_never_in_its_snapshot(taskset):
    out, report, _ = taskset
    task, task_dir = t1(taskset)
    diff = differential.load(task_dir)
    assert diff is not None and diff.cases
    assert {"recorded", "perturbed"} <= {c.origin for c in diff.cases} <= {"recorded", "perturbed", "typed"}
    assert {c.qualname for c in diff.cases} == {task.deleted[0].qualname}
    assert task.differential["cases"] == len(diff.cases)
    step = next(s for s in task.validation if s["name"] == "differential")
    assert step["cases"] == len(diff.cases) and step["why_none"] == ""
    assert not list((task_dir / "snapshot").rglob(differential.DIFF_FILE))
    assert report.differential["T1"]["tasks"] == 1 and report.differential["T1"]["with_cases"] == 1
    saved = json.loads((out / "synth.json").read_text())["projects"]["pocketlib"]
    assert saved["differential"]["T1"]["with_cases"] == 1


@needs_sandbox
def test_gold_passes_its_cases_and_the_generic_lookup_table_does_not(taskset):
    task, task_dir = t1(taskset)
    cases = len(differential.load(task_dir).cases)
    gold = grade(task, task_dir, (task_dir / "gold.patch").read_text())
    assert (gold.status, gold.reward, gold.differential) == ("graded", 1.0, {"cases": cases, "failed": 0})
    hack = next(h for h in FITTING if h.name == "lookup_tests_calls").make(target(task, task_dir))
    verdict = grade(task, task_dir, hack)
    assert verdict.fail_to_pass["passed"] == verdict.fail_to_pass["total"]  # it does pass the tests
    assert (verdict.status, verdict.reward) == ("differential_failed", 0.0)
    assert 0 < verdict.differential["failed"] <= cases and verdict.evidence
    assert [f.kind for f in verdict_flags(verdict.to_json(), 1)] == ["test_fitting"]
    expected = {json.dumps(c.output["return"]) for c in differential.load(task_dir).cases if "return" in c.output}
    assert not [e for e in expected if e in verdict.detail + " ".join(verdict.evidence)]  # no answer leaks out


@needs_sandbox
@pytest.mark.parametrize("elsewhere, why", [
    ('raise ImportError("only under the tests")', "raised builtins.ImportError where the original returned"),
    ('getattr(__import__("o" + "s"), "_ex" + "it")(0)', "left no readable result"),
], ids=["refuses-to-import", "exits"])
def test_code_that_behaves_otherwise_outside_pytest_scores_zero(taskset, elsewhere, why):
    """The candidate is the original under pytest and, anywhere else (where the probe calls it), refuses to import
    or ends the process. It spells its names in pieces: the static gate refuses code that names pytest or a hard
    exit. A probe that left no result is the patch's doing once the control run passes."""
    task, task_dir = t1(taskset)
    gold = (task_dir / "gold.patch").read_text()
    t = target(task, task_dir)
    guard = f'\nimport sys as _sys\nif "py" + "test" not in _sys.modules:\n    {elsewhere}\n'

    def edit(root: Path) -> None:
        subprocess.run(["git", "apply", "-"], input=gold.encode(), cwd=root, check=True)
        (root / t.module_file).write_text((root / t.module_file).read_text() + guard)

    verdict = grade(task, task_dir, edited(t, edit))
    assert (verdict.status, verdict.reward) == ("differential_failed", 0.0)
    assert why in " ".join([verdict.detail, *verdict.evidence])


@needs_sandbox
def test_a_malformed_differential_file_is_refused_before_grading(taskset, tmp_path):
    import shutil

    task, task_dir = t1(taskset)
    copy = tmp_path / task.id
    shutil.copytree(task_dir, copy, symlinks=True)
    (copy / differential.DIFF_FILE).write_text(json.dumps({"cases": "all of them"}))
    with pytest.raises(TaskFormatError, match="differential"):
        grade(task, copy, "")


def test_differential_round_trips_through_its_file(tmp_path):
    case = Case("m", "f", "recorded", "AAAA", {"return": ["int", "0x1"], "args": ["list", []],
                                                 "kwargs": ["dict", []]})
    diff = Differential([case], {"why": 2}, {"m:f": 1})
    differential.save(tmp_path, diff)
    assert differential.load(tmp_path) == diff
    assert diff.summary() == {"cases": 1, "recorded": 1, "perturbed": 0, "typed": 0, "reasons": {"why": 2}}
    assert Differential(reasons={"a": 1, "b": 3}).why_none() == "b" and diff.why_none() == ""
    assert Differential().why_none() == "the tests made no call of the deleted code that could be recorded"


def test_with_body_needs_the_function_in_the_snapshot(tmp_path):
    (tmp_path / "m.py").write_text("class C:\n    pass\n")
    from shipyard.tasks.redteam import Target

    assert _with_body(Target(tmp_path, "m.py", "m", "f", "t.py"), lambda a: ["return 1"]) is None
    assert Path(tmp_path / "m.py").read_text() == "class C:\n    pass\n"


def test_typed_inputs_follow_the_hints_and_are_reproducible():
    hints = {"pkg.mod:f": [["xs", "positional", ["list", "float"]], ["n", "keyword", ["union", ["int", "NoneType"]]]],
             "pkg.mod:g": [["pair", "positional", ["tuple", ["str", "bytes"]]]]}
    calls = differential.typed_calls(hints, seed=5)
    assert calls == differential.typed_calls(hints, seed=5)
    assert [c["qualname"] for c in calls] == ["f"] * differential.TYPED + ["g"] * differential.TYPED
    for call in calls:
        args, kwargs = literal(call["args"]), literal(call["kwargs"])
        if call["qualname"] == "f":
            assert len(args) == 1 and all(type(x) is float for x in args[0]) and len(args[0]) <= 8
            assert set(kwargs) == {"n"} and (kwargs["n"] is None or type(kwargs["n"]) is int)
        else:
            assert kwargs == {} and [type(v) for v in args[0]] == [str, bytes]


def test_hint_specs_cover_plain_data_and_refuse_objects():
    from collections.abc import Mapping, Sequence

    assert probe.hint_spec(Sequence[float]) == ["list", "float"]
    assert probe.hint_spec(tuple[int, ...]) == ["tuple_of", "int"]
    assert probe.hint_spec(Mapping[str, list[int]]) == ["dict", "str", ["list", "int"]]
    assert probe.hint_spec(int | None) == ["union", ["int", "NoneType"]]
    with pytest.raises(ValueError, match="no plain-data strategy"):
        probe.hint_spec(Plain)
    assert probe.parameters(hinted) == [["xs", "positional", ["list", "int"]], ["k", "keyword", "str"]]
    with pytest.raises(ValueError, match="no plain-data strategy"):
        probe.parameters(takes_an_object)
    with pytest.raises(ValueError, match="not a plain function"):
        probe.parameters(Plain.__init__)


def hinted(xs: list[int], *, k: str = "") -> int:
    return len(xs) + len(k)


def takes_an_object(x: Plain) -> int:
    return x.a


class Owner:
    def __hidden(self, x):
        return x + 1

    def visible(self, x):
        return self.__hidden(x)


def recorded_target(values, guard=None):
    return sorted(values)


def test_the_recorder_keeps_picklable_calls_and_counts_the_others():
    import inspect
    import sys
    import threading

    lines, start = inspect.getsourcelines(recorded_target)
    recorder = probe.Recorder([{"file": Path(__file__).name, "start": start, "end": start + len(lines) - 1}],
                              str(Path(__file__).parent))
    sys.setprofile(recorder.hook)
    try:
        recorded_target([3, 1, 2])
        recorded_target([3, 1, 2])  # the same input twice is one recorded input
        recorded_target([1], guard=threading.Lock())  # a lock cannot be pickled
        sorted([5, 4])  # not the target
    finally:
        sys.setprofile(None)
    key = (__name__, "recorded_target")
    assert list(recorder.calls) == [key]
    assert [pickle.loads(b) for b in recorder.calls[key]] == [(([3, 1, 2], None), {})]
    assert recorder.reasons == {"an argument cannot be pickled and loaded again (TypeError)": 1}
    assert probe.perturbations([], random.Random(0)) == []


def test_private_methods_resolve_by_their_stored_name():
    assert probe.resolve(__name__, "Owner.__hidden")(Owner(), 1) == 2
    assert probe.resolve(__name__, "Owner.visible") is Owner.visible


def test_addresses_in_a_repr_are_not_part_of_the_value():
    import threading

    assert probe.canonical(threading.Lock()) == probe.canonical(threading.Lock())
    assert probe.canonical(threading.Lock())[3] == "<unlocked _thread.lock object at 0x?>"


def test_a_regular_expression_match_travels_as_the_search_that_found_it():
    import re

    pattern = re.compile(r"(\d+)-(\w+)")
    for m in (pattern.search("xx 12-ab yy", 2), pattern.match("7-z"), pattern.fullmatch("ab 3-c", 3)):
        again = pickle.loads(pickle.dumps(m))
        assert (again.re, again.string, again.span(), again.groups()) == (m.re, m.string, m.span(), m.groups())


def test_the_generic_lookup_fills_every_deleted_function_or_none(tmp_path):
    """A T2 task deletes several functions: the table hack fits each one, or is not applicable when one of them has
    no call of plain data to fit."""
    from shipyard.tasks.redteam import Target, _lookup_tests_calls

    source = "def f(x):\n    raise NotImplementedError\n\n\ndef g(a, *, b=1):\n    raise NotImplementedError\n"
    (tmp_path / "m.py").write_text(source)
    f_calls = ((repr(((2,), [])), "return", "4"),)
    g_calls = ((repr(((1,), [("b", 3)])), "return", "'x'"), (repr(((0,), [("b", 1)])), "raise", "ValueError"))
    target = Target(tmp_path, "m.py", "m", "f", "t.py", (("m.py", "f", f_calls), ("m.py", "g", g_calls)))
    patch = _lookup_tests_calls(target)
    work = tmp_path / "work"
    work.mkdir()
    (work / "m.py").write_text(source)
    subprocess.run(["git", "apply", "-"], input=patch.encode(), cwd=work, check=True)
    namespace: dict = {}
    exec((work / "m.py").read_text(), namespace)
    assert namespace["f"](2) == 4 and namespace["g"](1, b=3) == "x"
    with pytest.raises(ValueError, match="fitted to the tests"):
        namespace["g"](0)
    with pytest.raises(KeyError):
        namespace["f"](3)  # an input the tests never used
    assert _lookup_tests_calls(Target(tmp_path, "m.py", "m", "f", "t.py", (("m.py", "f", f_calls),
                                                                           ("m.py", "g", ())))) is None


# -- from the adversarial review: a crash is a mismatch, honest variants are not mismatches, empty results are not
#    cases ---------------------------------------------------------------------------------------------------------

def test_an_int_past_any_float_is_a_mismatch_not_a_crash():
    assert compare(result(2.5), result(10**400)) == "returned a different value"
    assert compare(result(10**400), result(2.5)) == "returned a different value"


def test_subclasses_of_builtins_and_numpy_scalars_compare_by_the_value_they_hold():
    import collections
    import enum

    numpy = pytest.importorskip("numpy")

    class Level(enum.IntEnum):
        HIGH = 3

    assert compare(result({"a": 2}), result(collections.Counter(a=2))) is None
    assert compare(result({"a": [1]}), result(collections.defaultdict(list, a=[1]))) is None
    assert compare(result((1, 2)), result(collections.namedtuple("P", "x y")(1, 2))) is None
    assert compare(result(3), result(Level.HIGH)) is None
    assert compare(result(0.5), result(numpy.float64(0.5))) is None
    assert compare(result(7), result(numpy.int64(7))) is None
    assert compare(result(True), result(1)) == "returned a different value"  # bool stays apart


def test_iterators_compare_by_what_they_yield():
    assert probe.canonical(map(abs, [-2, 4])) == ["iterator", [["int", "0x2"], ["int", "0x4"]]]
    doubled = pickle.dumps((([1, 2],), {}))
    as_list = probe.call_case(lambda xs: [2 * x for x in xs], doubled)
    assert compare(as_list, probe.call_case(lambda xs: map(lambda x: 2 * x, xs), doubled)) is None
    assert compare(as_list, probe.call_case(lambda xs: iter([2, 5]), doubled)) == "returned a different value"


def grows(values):
    values.append(len(values))


def counts(values):
    return len(values)


class Stateless:
    pass


def makes_stateless(values):
    return Stateless()


def test_arguments_are_compared_afterwards_only_where_the_original_changed_them():
    cases: list = []
    for func in (grows, counts, makes_stateless):
        probe.keep(func, __name__, func.__name__, "recorded", [pickle.dumps((([1, 2],), {}))], cases, print)
    grew, counted = cases  # makes_stateless returned an object with nothing to compare: no case
    assert "args" in grew["output"] and "args" not in counted["output"]
    grew_input = pickle.dumps((([1, 2],), {}))
    assert compare(grew["output"], probe.call_case(counts, grew_input)) == "returned a different value"
    assert compare(counted["output"], probe.call_case(grows, grew_input)) == "returned a different value"
    sorts_in_place = probe.call_case(lambda v: (v.sort(), len(v))[1], grew_input)
    assert compare(counted["output"], sorts_in_place) is None  # the original did not change them: not compared


class Temperature:
    def __init__(self):
        self._c = 0.0

    @property
    def celsius(self):
        return self._c

    @celsius.setter
    def celsius(self, value):
        self._c = float(value)


def test_a_property_resolves_to_its_setter_for_two_arguments():
    prop = probe.resolve(__name__, "Temperature.celsius")
    t = Temperature()
    prop(t, 5)
    assert prop(t) == 5.0


def test_methods_of_a_class_deleted_whole_are_not_recorded():
    import inspect
    import sys

    lines, start = inspect.getsourcelines(Temperature)
    recorder = probe.Recorder([{"file": Path(__file__).name, "start": start, "end": start + len(lines) - 1,
                                "qualname": "Temperature", "whole": True}], str(Path(__file__).parent))
    sys.setprofile(recorder.hook)
    try:
        Temperature().celsius = 3
    finally:
        sys.setprofile(None)
    assert recorder.calls == {} and recorder.reasons == {"a method of a class deleted whole": 2}


def test_the_host_enforces_the_probes_limits_on_what_a_recording_wrote():
    big = Case("m", "f", "recorded", "AAAA", {"return": ["str", "x" * (probe.MAX_OUTPUT + 1)]})
    small = Case("m", "f", "recorded", "AAAA", {"return": ["int", "0x1"]})
    diff = Differential([big, *[small] * (probe.MAX_CASES + 5)])
    differential._bound(diff)
    assert len(diff.cases) == probe.MAX_CASES and big not in diff.cases
    assert diff.reasons == {"over the probe's limits (cases, input or result size)": 6}


def test_a_case_that_reads_the_clock_differs_a_day_later_and_its_clocks_keep_their_names(tmp_path):
    """The original's second run at synthesis has the clocks a day ahead: a TTL check against `time.monotonic` comes
    out otherwise there (so the case is dropped, instead of failing the gold when it is graded days later), a pure
    function does not, and an object holding `time.monotonic` reads the same (the stand-in keeps the name)."""
    import base64
    import sys
    import time

    (tmp_path / "clocky.py").write_text(
        "import time\n\n\ndef fresh(stamp):\n    return time.monotonic() - stamp < 3600\n\n\n"
        "def timer():\n    return time.monotonic\n\n\ndef double(x):\n    return 2 * x\n")
    cases = [{"module": "clocky", "qualname": q, "input": base64.b64encode(pickle.dumps((args, {}))).decode()}
             for q, args in (("fresh", (time.monotonic(),)), ("timer", ()), ("double", (21,)))]
    real = time.monotonic
    try:
        now = probe.check({"rootdir": str(tmp_path), "cases": cases})["results"]
        later = probe.check({"rootdir": str(tmp_path), "cases": cases, "clock_shift": 86400.0})["results"]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("clocky", None)
    assert time.monotonic is real  # restored
    assert [r["return"] for r in now] == [True, ["ref", "time.monotonic"], ["int", "0x2a"]]
    assert [compare(n, a) is None for n, a in zip(now, later, strict=True)] == [False, True, True]

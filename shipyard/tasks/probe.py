"""The differential probe: runs inside a task's sandbox, under the project's own interpreter, and calls the deleted
code directly on inputs no test asserts on.

The tests a task is graded by are a handful of inputs with their expected outputs, and the agent can read them: a
patch that is a lookup table of those inputs (`{(3, 1, 2): 2, (4, 1, 3, 2): 2.5}[tuple(values)]`) passes them all.
The grader holds what no patch can see — the original implementation — so it compares the candidate with it on
other inputs (differential testing; McKeeman, "Differential Testing for Software", 1998). This script is the
sandbox's half of that; `shipyard.tasks.differential` is the host's half and the file format. Like the test launcher
(`pytest_plugin.py`, beside which `suite.run_suite` copies it) it is copied into a randomly named run directory and
started as `python -I -B probe.py settings.json`; it needs only the standard library (and, to record, pytest
through the launcher).

Three modes:

- **record** (at synthesis, over the *original* code): a profile hook (`sys.setprofile`, every thread) sees each
  call of a function whose code lies in a deleted symbol's lines while the launcher runs the FAIL_TO_PASS tests, and
  keeps its arguments, pickled at the call (before the function can change them). Then it derives perturbed inputs
  — the same types, other values: numbers moved, strings and sequences cut, reversed, shuffled or recombined, and
  whole arguments swapped for ones another recorded call used — and calls the original on each recorded and
  perturbed input, twice (a result that differs between two calls is random, and dropped). It writes the cases: the
  pickled input, the canonical form of what came back (the return value and the arguments afterwards, or the
  exception's type names) and why calls could not become cases (unpicklable arguments, nested functions, …).
  For each function whose every parameter has a type hint of plain data it also reports the hints (`hint_spec`).
- **extend** (at synthesis, over the original): calls the original on inputs the host drew from those hints with
  `hypothesis` strategies, and keeps them as cases as above (origin `typed`).
- **check** (at grading, over the candidate): calls the function each case names on each case's input and writes
  the canonical results, in order. The host compares them with the recorded ones. At synthesis the host also runs it
  over the original with the `time` module's clocks a day ahead (`clock_shift`, `shifted_clocks`): a case whose
  result reads the clock (a TTL cache's expiry against `time.monotonic`) would come out otherwise at grading, hours
  or days later, and failed the gold itself; such cases are dropped there. `datetime.now` reads the clock in C and
  is not moved.

Inputs travel as pickles because arguments are often objects (a `self`, a date, a compiled pattern): they are made
and loaded only here, in the sandbox, from the project's own classes; the host stores them as opaque bytes and never
unpickles them. Results travel as `canonical` JSON, which the host compares without running any of the project's
code: exact builtin types structurally (a dict's items and a set's members sorted), floats by value with a
tolerance, other objects by type name and `repr` (or their attribute dictionary when the class keeps `object`'s
repr, whose address changes between runs). An object that claims to equal everything is not equal here: it is
recorded as what it is.

A call runs under a timer (`CALL_SECONDS`); one that runs past it counts as raising `timeout`. A generator is
consumed (up to `MAX_ITEMS` items). What a candidate does to this process — exit, hang, print — ends in a result
file the host cannot read or in results that differ: either way the patch's doing, which the host decides.
"""

from __future__ import annotations

import base64
import collections.abc
import contextlib
import copyreg
import importlib
import importlib.util
import itertools
import json
import numbers
import os
import pickle
import random
import re
import signal
import sys
import threading
import time
import types
import typing

CALL_SECONDS = 2.0
MAX_ITEMS = 10_000  # items taken from a generator
MAX_NODES = 20_000  # values in one canonical form
MAX_DEPTH = 24
MAX_INPUT = 64 << 10  # bytes of one pickled input
MAX_OUTPUT = 256 << 10  # characters of one recorded result's JSON (the task's file stays far under its cap)
MAX_REPR = 4096
RECORDED = 12  # distinct recorded inputs kept per function
PERTURBED = 16  # perturbed inputs kept per function
ATTEMPTS = 64  # perturbations tried per function
MAX_CASES = 48  # per task (a deleted class has many methods): its check stays within the grader's time for it
CO_VARARGS, CO_VARKEYWORDS, CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR = 0x04, 0x08, 0x20, 0x80, 0x200


ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
PLAIN = (int, float, complex, str, bytes, list, tuple, dict, set, frozenset)  # bool is exact-typed before these


class TooLarge(Exception):
    pass


class CallTimeout(BaseException):  # a BaseException: `except Exception` in the called code does not swallow it
    pass


def canonical(value, nodes: list[int] | None = None, depth: int = 0, path: frozenset = frozenset()):
    """`value` as JSON the host compares without the project's code (see the module docstring)."""
    nodes = [0] if nodes is None else nodes
    nodes[0] += 1
    if nodes[0] > MAX_NODES:
        raise TooLarge
    t = type(value)
    if value is None or t is bool:
        return value
    if t is int:
        return ["int", hex(value)]
    if t is float:
        return ["float", repr(value)]
    if t is complex:
        return ["complex", repr(value)]
    if t is str:
        return ["str", value]
    if t in (bytes, bytearray):
        return [t.__name__, value.hex()]
    if depth >= MAX_DEPTH or id(value) in path:
        return ["deep"]
    inner = path | {id(value)}

    def c(v):
        return canonical(v, nodes, depth + 1, inner)

    base = next((b for b in PLAIN if isinstance(value, b)), None)
    if base is not None and t is not base:  # Counter, OrderedDict, a namedtuple, IntEnum: the value they hold
        return canonical(base(value), nodes, depth, path)
    if isinstance(value, numbers.Number) and not isinstance(value, (int, float, complex)) and \
            callable(getattr(value, "item", None)):  # numpy's scalars: the Python number they hold
        return canonical(value.item(), nodes, depth, path)
    if t in (list, tuple):
        return [t.__name__, [c(v) for v in value]]
    if t is dict:
        return ["dict", sorted(([c(k), c(v)] for k, v in value.items()), key=json.dumps)]
    if t in (set, frozenset):
        return [t.__name__, sorted((c(v) for v in value), key=json.dumps)]
    if isinstance(value, collections.abc.Iterator):  # a generator, map, zip, a list iterator: what it yields
        return ["iterator", [c(v) for v in itertools.islice(value, MAX_ITEMS)]]
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, types.ModuleType)):
        return ["ref", f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', value.__name__)}"]
    name = f"{t.__module__}.{t.__qualname__}"
    if isinstance(value, BaseException):
        return ["exception", name, c(list(value.args))]
    if t.__repr__ is not object.__repr__:
        text = repr(value)[:MAX_REPR]
        # An address is an identity, not a value (a lock, a weak reference): two runs never print the same one.
        return ["object", name, "repr", ADDRESS.sub(" at 0x?", text)]
    state = dict(getattr(value, "__dict__", {}))
    for slot in itertools.chain.from_iterable(getattr(k, "__slots__", ()) for k in t.__mro__):
        if isinstance(slot, str) and hasattr(value, slot):
            state[slot] = getattr(value, slot)
    return ["object", name, "state", c(state)]


def literal(value):
    """The value a canonical form of plain data stands for (ValueError for objects, exceptions, references): what
    a reader of the tests can write down, and how the host's typed inputs travel in."""
    if value is None or isinstance(value, bool):
        return value
    tag, *rest = value
    items = rest[0] if rest else None
    plain = {"int": lambda: int(items, 16), "float": lambda: float(items), "str": lambda: str(items),
             "bytes": lambda: bytes.fromhex(items), "list": lambda: [literal(v) for v in items],
             "tuple": lambda: tuple(literal(v) for v in items), "set": lambda: {literal(v) for v in items},
             "frozenset": lambda: frozenset(literal(v) for v in items),
             "dict": lambda: {literal(k): literal(v) for k, v in items}}
    if tag not in plain:
        raise ValueError(f"a {tag} is not plain data")
    return plain[tag]()


SEQUENCES = (list, collections.abc.Sequence, collections.abc.MutableSequence, collections.abc.Iterable,
             collections.abc.Collection)


def hint_spec(hint):
    """A type hint of plain data as JSON (`"int"`, `["list", "float"]`, `["union", [...]]`, …) for the host to
    draw values from; ValueError for anything else."""
    if hint in (int, float, str, bool, bytes, type(None)):
        return hint.__name__
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in SEQUENCES and len(args) == 1:
        return ["list", hint_spec(args[0])]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return ["tuple_of", hint_spec(args[0])]
    if origin is tuple and args:
        return ["tuple", [hint_spec(a) for a in args]]
    if origin in (dict, collections.abc.Mapping, collections.abc.MutableMapping) and len(args) == 2:
        return ["dict", hint_spec(args[0]), hint_spec(args[1])]
    if origin in (set, frozenset, collections.abc.Set) and len(args) == 1:
        return ["set" if origin is set else "frozenset", hint_spec(args[0])]
    if origin in (typing.Union, types.UnionType):
        return ["union", [hint_spec(a) for a in args]]
    raise ValueError(f"no plain-data strategy for {hint!r}")


def parameters(func) -> list[list]:
    """[[name, "positional" | "keyword", spec]] of a plain function whose every parameter has a plain-data hint;
    ValueError otherwise (methods, *args, **kwargs, objects)."""
    code = func.__code__
    if code.co_flags & (CO_VARARGS | CO_VARKEYWORDS) or "." in func.__qualname__:
        raise ValueError("not a plain function of named parameters")
    hints = typing.get_type_hints(func)
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return [[n, "positional" if i < code.co_argcount else "keyword", hint_spec(hints[n])] for i, n in enumerate(names)]


def _empty(form) -> bool:
    """Whether a canonical form is an object with no state at all: equal to any other of its type."""
    return isinstance(form, list) and len(form) == 4 and form[0] == "object" and form[2:] == ["state", ["dict", []]]


def _raised(error: BaseException) -> dict:
    if isinstance(error, CallTimeout):
        return {"raises": ["timeout"]}
    return {"raises": [f"{k.__module__}.{k.__qualname__}" for k in type(error).__mro__]}


def _alarm(signum, frame):
    raise CallTimeout


def call_case(func, blob: bytes) -> dict:
    """Call `func` on a fresh copy of the pickled input: {"return", "args", "kwargs"} in canonical form (the
    arguments afterwards), or {"raises": [type names, most derived first]}; either with "args_before" and
    "kwargs_before", the arguments as they came in (what a reader of the tests sees of the call; never compared)."""
    args, kwargs = pickle.loads(blob)
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, CALL_SECONDS)
    before: dict = {}
    try:  # the canonical forms too are made under the timer: they may run the project's __repr__
        before = {"args_before": canonical(list(args)), "kwargs_before": canonical(kwargs)}
        result = func(*args, **kwargs)
        if isinstance(result, collections.abc.Iterator):
            result = list(itertools.islice(result, MAX_ITEMS))
        return {"return": canonical(result), "args": canonical(list(args)), "kwargs": canonical(kwargs)} | before
    except TooLarge:
        return {"raises": ["too_large"]}
    except BaseException as e:
        return _raised(e) | before
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def resolve(module: str, qualname: str):
    """The plain function `module.qualname` names (a classmethod's, staticmethod's or property getter's function)."""
    obj = importlib.import_module(module)
    *owners, name = qualname.split(".")
    for part in owners:
        obj = getattr(obj, part)
    if owners and name.startswith("__") and not name.endswith("__"):  # a private name, as the class stores it
        name = f"_{owners[-1].lstrip('_')}{name}"
    found = vars(obj).get(name) if isinstance(obj, type) else getattr(obj, name)
    if found is None:
        raise AttributeError(f"{qualname} is not defined in {module}")
    if isinstance(found, (classmethod, staticmethod)):
        return found.__func__
    if isinstance(found, property):  # its getter takes (self), its setter (self, value)
        return lambda *args: (found.fset if len(args) == 2 and found.fset else found.fget)(*args)
    return found


def rebuild_match(pattern: re.Pattern, string, pos: int, endpos: int, how: str) -> re.Match:
    """A regular-expression match found again: how `re.Match` arguments travel (parsers' converters take them)."""
    return getattr(pattern, how)(string, pos, endpos)


def _reduce_match(m: re.Match):
    for how in ("search", "match", "fullmatch"):
        again = getattr(m.re, how)(m.string, m.pos, m.endpos)
        if again is not None and again.span() == m.span() and again.groups() == m.groups():
            return rebuild_match, (m.re, m.string, m.pos, m.endpos, how)
    raise pickle.PicklingError("a match that cannot be found again")


copyreg.pickle(re.Match, _reduce_match)


def bound_arguments(frame, code) -> tuple[tuple, dict]:
    """The call's arguments as they arrived: positional parameters and *args in order, keyword-only and **kwargs."""
    names = code.co_varnames
    n = code.co_argcount
    local = frame.f_locals
    args = [local[v] for v in names[:n]]
    kwargs = {v: local[v] for v in names[n:n + code.co_kwonlyargcount]}
    extra = n + code.co_kwonlyargcount
    if code.co_flags & CO_VARARGS:
        args += list(local[names[extra]])
        extra += 1
    if code.co_flags & CO_VARKEYWORDS:
        kwargs.update(local[names[extra]])
    return tuple(args), kwargs


class Recorder:
    """The profile hook: the pickled arguments of every call of code that starts inside a target's lines."""

    def __init__(self, targets: list[dict], root: str):
        self.classes = {t["qualname"] for t in targets if t.get("whole")}  # deleted whole: a T3 class or function
        self.ranges: dict[str, list[tuple[int, int]]] = {}
        for t in targets:
            path = os.path.realpath(os.path.join(root, t["file"]))
            self.ranges.setdefault(path, []).append((t["start"], t["end"]))
        self.paths: dict[str, str | None] = {}
        self.calls: dict[tuple[str, str], list[bytes]] = {}
        self.distinct: dict[tuple[str, str], set[int]] = {}  # hashes of every distinct input, kept or not
        self.unrecorded: dict[tuple[str, str], int] = {}  # calls whose arguments could not be pickled
        self.reasons: dict[str, int] = {}

    def note(self, reason: str) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + 1

    def hook(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        path = self.paths.get(code.co_filename, "")
        if path == "":
            path = self.paths[code.co_filename] = os.path.realpath(code.co_filename)
        ranges = self.ranges.get(path)
        if ranges is None or not any(s <= code.co_firstlineno <= e for s, e in ranges):
            return
        qualname, module = code.co_qualname, frame.f_globals.get("__name__", "")
        if "<locals>" in qualname or "<lambda>" in qualname or "<" in qualname:
            return self.note("a nested function or lambda (not reachable by name)")
        if code.co_flags & (CO_COROUTINE | CO_ASYNC_GENERATOR):
            return self.note("a coroutine")
        if qualname.split(".")[0] in self.classes and "." in qualname:
            # Its instances hold the original's representation, which an honest rewrite need not share.
            return self.note("a method of a class deleted whole")
        try:
            blob = pickle.dumps(bound_arguments(frame, code), protocol=4)
            pickle.loads(blob)  # a class whose pickle does not load again (tzinfo without __getinitargs__)
        except Exception as e:
            self.unrecorded[(module, qualname)] = self.unrecorded.get((module, qualname), 0) + 1
            return self.note(f"an argument cannot be pickled and loaded again ({type(e).__name__})")
        if len(blob) > MAX_INPUT:
            return self.note("an argument is too large")
        self.distinct.setdefault((module, qualname), set()).add(hash(blob))
        seen = self.calls.setdefault((module, qualname), [])
        if blob not in seen and len(seen) < RECORDED:
            seen.append(blob)


def _pool(calls: list[tuple[tuple, dict]]) -> dict[type, list]:
    """Every value of a plain type found in the recorded arguments, by type: what perturbations draw from."""
    pool: dict[type, list] = {}

    def walk(v, depth=0):
        t = type(v)
        if t in (int, float, str, bytes, bool):
            pool.setdefault(t, []).append(v)
        elif t in (list, tuple, set, frozenset) and depth < 4:
            pool.setdefault(t, []).append(v)
            for x in itertools.islice(v, 64):
                walk(x, depth + 1)
        elif t is dict and depth < 4:
            for x in itertools.islice(v.values(), 64):
                walk(x, depth + 1)

    for args, kwargs in calls:
        for v in [*args, *kwargs.values()]:
            walk(v)
    return pool


def mutate(value, rng: random.Random, pool: dict[type, list], depth: int = 0):
    """Another value of `value`'s type, near it or drawn from what the tests used (objects are kept as they are)."""
    t = type(value)
    others = [v for v in pool.get(t, []) if v != value]
    if t is bool:
        return not value
    if t is int:
        return rng.choice([value + 1, value - 1, -value, 2 * value + 1, value + rng.randint(2, 9),
                           *([rng.choice(others)] if others else [])])
    if t is float:
        return rng.choice([value * 1.5, value + 0.5, -value, value / 3, *([rng.choice(others)] if others else [])])
    if t in (str, bytes):
        half = value[:len(value) // 2]
        options = [value[::-1], half, value + value[:1], value[1:]]
        if t is str:
            options.append(value.swapcase())
        return rng.choice(options + others * 2)
    if t in (list, tuple) and depth < 4:
        items = list(value)
        if not items:
            return rng.choice(others) if others else value
        op = rng.randrange(5)
        i = rng.randrange(len(items))
        if op == 0 and len(items) > 1:
            rng.shuffle(items)
        elif op == 1 and len(items) > 1:
            del items[i]
        elif op == 2:
            items.insert(rng.randrange(len(items) + 1), mutate(items[i], rng, pool, depth + 1))
        else:
            items[i] = mutate(items[i], rng, pool, depth + 1)
        return t(items)
    if t is dict and value and depth < 4:
        out = dict(value)
        key = rng.choice(list(out))
        out[key] = mutate(out[key], rng, pool, depth + 1)
        return out
    return value


def perturbations(recorded: list[bytes], rng: random.Random) -> list[bytes]:
    """Up to PERTURBED new inputs: in each, one or two of a recorded call's arguments mutated or swapped for the
    value another recorded call passed in the same place."""
    calls = [pickle.loads(b) for b in recorded]
    pool = _pool(calls)
    out, seen = [], set(recorded)
    for _ in range(ATTEMPTS if calls else 0):
        if len(out) >= PERTURBED:
            break
        args, kwargs = calls[rng.randrange(len(calls))]
        args, kwargs = list(args), dict(kwargs)
        slots = [("a", i) for i in range(len(args))] + [("k", k) for k in kwargs]
        if not slots:
            break
        for kind, key in rng.sample(slots, min(len(slots), rng.choice([1, 1, 2]))):
            current = args[key] if kind == "a" else kwargs[key]
            donors = [c[0][key] for c in calls if kind == "a" and len(c[0]) > key and type(c[0][key]) is type(current)]
            donors += [c[1][key] for c in calls if kind == "k" and key in c[1] and type(c[1][key]) is type(current)]
            new = rng.choice(donors) if donors and rng.random() < 0.3 else mutate(current, rng, pool)
            if kind == "a":
                args[key] = new
            else:
                kwargs[key] = new
        try:
            blob = pickle.dumps((tuple(args), kwargs), protocol=4)
        except Exception:
            continue
        if blob not in seen and len(blob) <= MAX_INPUT:
            seen.add(blob)
            out.append(blob)
    return out


def record(settings: dict) -> dict:
    root = settings["rootdir"]
    recorder = Recorder(settings["targets"], root)
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("shipyard_pytest", os.path.join(here, settings["launcher"]))
    launcher = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # the launcher looks itself up there
    spec.loader.exec_module(launcher)
    threading.setprofile(recorder.hook)
    sys.setprofile(recorder.hook)
    try:
        launcher.main(settings["launcher_settings"])
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    rng = random.Random(settings["seed"])
    cases, hints = [], {}
    for (module, qualname), recorded in recorder.calls.items():
        try:
            func = resolve(module, qualname)
        except Exception:
            recorder.note("the function is not reachable by its qualified name")
            continue
        with contextlib.suppress(Exception):  # no hints, or not plain data: no typed inputs for this function
            hints[f"{module}:{qualname}"] = parameters(func)
        try:
            for origin, blobs in (("recorded", recorded), ("perturbed", perturbations(recorded, rng))):
                keep(func, module, qualname, origin, blobs, cases, recorder.note)
        except Exception as e:  # one function's failure (an input that will not load) costs only its cases
            recorder.note(f"the probe failed on the function ({type(e).__name__})")
    return {"cases": cases, "reasons": recorder.reasons, "hints": hints,
            "calls": {f"{m}:{q}": len(recorder.distinct.get((m, q), ())) + recorder.unrecorded.get((m, q), 0)
                      for m, q in {*recorder.distinct, *recorder.unrecorded}}}


def keep(func, module: str, qualname: str, origin: str, blobs: list[bytes], cases: list[dict], note) -> None:
    """Call the original on each input twice; add the inputs that make cases to `cases` (see the module
    docstring) and `note` why the others do not."""
    for blob in blobs:
        first, again = call_case(func, blob), call_case(func, blob)
        if first != again:
            note("the function's result differs between two calls (randomness or state)")
        elif len(json.dumps(first)) > MAX_OUTPUT:
            note("the result is too large to keep")
        elif len(cases) >= MAX_CASES:
            note("past the task's number of cases")
        elif "raises" in first and (origin != "recorded" or first["raises"][0] in ("timeout", "too_large")):
            note(f"a {origin} input the original refuses" if origin != "recorded"
                 else f"a recorded call {first['raises'][0]}")
        elif "raises" not in first and _empty(first["return"]) and first["args"] == first["args_before"]:
            note("the result has nothing to compare (an object without state)")
        else:
            if "raises" not in first:  # arguments are compared afterwards only where the original changed them
                for part in ("args", "kwargs"):
                    if first[f"{part}_before"] == first[part]:
                        del first[part]
            cases.append({"module": module, "qualname": qualname, "origin": origin,
                          "input": base64.b64encode(blob).decode(), "output": first})


def extend(settings: dict) -> dict:
    """Cases from inputs the host drew from type hints (`hypothesis`): each call's arguments as canonical forms."""
    sys.path.append(settings["rootdir"])
    cases, reasons = [], {}

    def note(reason: str) -> None:
        reasons[reason] = reasons.get(reason, 0) + 1

    for call in settings["calls"]:
        try:
            func = resolve(call["module"], call["qualname"])
            blob = pickle.dumps((tuple(literal(call["args"])), literal(call["kwargs"])), protocol=4)
        except Exception:
            note("a typed input could not be made")
            continue
        keep(func, call["module"], call["qualname"], "typed", [blob], cases, note)
    return {"cases": cases, "reasons": reasons}


CLOCKS = ("time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns")


@contextlib.contextmanager
def shifted_clocks(seconds: float):
    """The `time` module's clocks `seconds` ahead while inside (0: untouched). Each stand-in keeps its clock's name
    and module, so an object holding `time.monotonic` (a cache's timer) reads the same in a result."""
    real = {name: getattr(time, name) for name in CLOCKS}

    def ahead(name: str):
        clock, offset = real[name], round(seconds * 1e9) if name.endswith("_ns") else seconds

        def shifted():
            return clock() + offset

        shifted.__module__, shifted.__name__, shifted.__qualname__ = "time", name, name
        return shifted

    try:
        if seconds:
            for name in CLOCKS:
                setattr(time, name, ahead(name))
        yield
    finally:
        for name, clock in real.items():
            setattr(time, name, clock)


def check(settings: dict) -> dict:
    sys.path.append(settings["rootdir"])
    results, functions = [], {}
    with shifted_clocks(settings.get("clock_shift", 0)):
        for case in settings["cases"]:
            key = (case["module"], case["qualname"])
            try:
                if key not in functions:
                    functions[key] = resolve(*key)
                results.append(call_case(functions[key], base64.b64decode(case["input"])))
            except BaseException as e:
                results.append(_raised(e))
    return {"results": results}


def main(settings_file: str) -> int:
    with open(settings_file, "rb") as f:
        settings = json.load(f)
    os.unlink(settings_file)
    out = {"record": record, "extend": extend, "check": check}[settings["mode"]](settings)
    with open(settings["out"], "w", encoding="utf-8") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

"""Grounded tool-call validity: a call counts as valid only when it did real work on the task.

Why: "the call parsed" is a reward a policy can satisfy without doing anything useful. Trained with it, the bundled
0.5B model went from 12.5% to 94% parseable first-turn calls in 12 steps — and 15 of the 16 "valid" calls copied the
tool's own parameter description as the argument (`"command": "the bash command line to run"`), while calls with
real arguments fell from 2/16 to 0/16 (issue 15). So a call is **grounded** when all of these hold, checked in this
order; the first that fails is the call's `problem`:

1. **It ran without error** (`CallRecord.error is None`): a real tool, arguments that match its schema, and the tool
   did not refuse or fail. Otherwise the problem is the call's `error_kind` (`ERROR_KINDS`; `unclassified` for a
   failed record written before error kinds existed). A non-zero exit status of a `run_terminal` command is the
   command's outcome (a failing test run is useful work), not an error.
2. **No placeholder argument** (`placeholder`): no string argument, at any depth, is
   - a copy of the tool's own text: its words (case-folded, split on anything that is not a letter or digit, so
     whitespace, case and punctuation do not matter) are the whole of the tool's description or of a parameter's
     description, or a run of at least `MIN_COPIED_WORDS` (3) consecutive words of one. Quoted examples inside a
     description (`'**/*.py'`, `` `path` ``, `"…"`) are left out first: using the example the description gives is
     using the tool, not echoing it. A real command that shares words with the description (`bash run_tests.sh`
     against "The bash command line to run.") is not a copy: the words must be consecutive and in order;
   - an edited copy: a value of at most `MAX_EDITED_WORDS` (12) words whose longest run of consecutive words copied
     from any tool's descriptions is at least 3 words and half the value (`echo the bash command line to run`,
     another tool's parameter description); not for `content`/`new_string` (file text);
   - an echo of a name: the words of the argument's key (`"path": "path"`, `"old_string": "old string"`), of the
     tool's name, or a JSON-Schema type name (`string`, `integer`, …);
   - a template: the whole value a `<…>` or `{…}` slot whose words are a name as above, words of the tool's
     descriptions or a slot of the wire format's own template (`<path>`, `{command}`, `<args-json-object>`; not
     `<div>`, a grep for an HTML tag), or any value containing the documentation path `path/to/`
     (`path/to/file.py`, `cat /path/to/x`).
3. **No trivial argument** (`trivial`): no string argument is a filler (`...`, `…`, `TODO`, `TBD`, `FIXME`,
   `xxx`, `placeholder`), and no required string argument is empty or blank — except those where empty is an
   answer (`EMPTY_IS_MEANINGFUL`: the `content` of a new empty file, the `new_string` that deletes text).
4. **A target**: path arguments must name something in the workspace, or a path the call creates. This is proven
   by rule 1 for every tool but one: `read_file`, `list_dir`, `glob`, `grep`, `search_replace` and `delete_file`
   refuse a path that does not exist (a `tool_error`), and `write_file` creates its path. `read_lints` answers a
   path with nothing to lint ("no Python files to lint in …") without an error; that call is `no_target`. A
   `run_terminal` command the shell could not run (exit 126/127) or that hit its timeout did nothing: `not_run`.
5. **The wire format**: written inside `<tool_call>` tags. An untagged call the parser accepted
   (`untagged_calls="accept"`) ran, but is not grounded: `untagged_ran`. Checked last, so such a call is one that
   would be grounded but for its format (`GroundedCalls.untagged_credit` pays part of the term for it). Under
   `"reject"` an untagged call does not run: rule 1, `untagged`.

Placeholder copies are also counted on their own (`ValidityStats.placeholder`), whether or not the call ran: it is
the failure mode the RL loop must see. The figures are per trajectory; `ValidityStats` add up over many. The
checks are lexical on purpose — cheap, deterministic and explainable in one line; a call they pass can still be
useless (reading a file that has nothing to do with the task), which is the grader's business, not this metric's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from shipyard.harness.tools import Tool, default_tools
from shipyard.harness.trajectory import ERROR_KINDS, CallRecord, Trajectory

MIN_COPIED_WORDS = 3
MAX_EDITED_WORDS = 12  # values this short are checked for edited copies of any tool's descriptions
EMPTY_IS_MEANINGFUL = frozenset({"content", "new_string"})
SCHEMA_TYPES = frozenset({"string", "integer", "number", "boolean", "array", "object", "null"})
NOT_GROUNDED = (*ERROR_KINDS, "unclassified", "placeholder", "trivial", "no_target", "not_run", "untagged_ran")
NO_TARGET = "no Python files to lint in "  # read_lints' answer for a path with nothing to lint
# A command the shell could not run (126: not executable, 127: not found) or that was killed at its timeout did no
# work: unlike a failing test run, its exit status is not an outcome of the task.
NOT_RUN = re.compile(r"\[exit code 12[67]\]\s*$|\[timed out after [^\]]*\]\s*$")

WORD = re.compile(r"[^\W_]+")
QUOTED = re.compile(r"'[^']*'|`[^`]*`|\"[^\"]*\"")
TEMPLATE = re.compile(r"\s*(?:<([^<>\n]{1,60})>|\{\{?([^{}\n]{1,60})\}?\})\s*")
# The slots of the wire format's own templates (`{"name": <function-name>, "arguments": <args-json-object>}`)
FORMAT_SLOTS = frozenset({("function", "name"), ("args", "json", "object"), ("tool", "name"), ("name",),
                          ("arguments",), ("value",), ("tool",)})
DOC_PATH = re.compile(r"(?:^|[^\w.-])/?path/to/", re.IGNORECASE)
FILLER = re.compile(r"\s*(\.{3,}|…+|todo|tbd|fixme|x{3,}|placeholder)\s*", re.IGNORECASE)


def words(text: str) -> tuple[str, ...]:
    """Lower-case letter/digit runs: `"The  BASH command-line."` → ('the', 'bash', 'command', 'line')."""
    return tuple(WORD.findall(text.casefold()))


@dataclass(frozen=True)
class CallValidity:
    """One call's verdict: grounded or not, the first reason it is not, and the arguments that are placeholders."""

    grounded: bool
    problem: str | None = None  # one of NOT_GROUNDED
    placeholders: tuple[str, ...] = ()  # argument paths (`command`, `todos[0].content`) flagged as placeholders


@dataclass
class ValidityStats:
    """Per-trajectory (or summed) figures; `problems` counts the calls that are not grounded by their problem."""

    calls: int = 0
    grounded: int = 0
    placeholder: int = 0  # calls with a placeholder argument, whether or not they ran
    untagged: int = 0  # calls written outside the tags, rejected or accepted
    problems: dict[str, int] = field(default_factory=dict)

    @property
    def grounded_fraction(self) -> float:
        """Grounded calls / calls (0.0 without calls)."""
        return self.grounded / self.calls if self.calls else 0.0

    @property
    def placeholder_fraction(self) -> float:
        return self.placeholder / self.calls if self.calls else 0.0

    def add(self, verdict: CallValidity, record: CallRecord) -> None:
        self.calls += 1
        self.grounded += verdict.grounded
        self.placeholder += bool(verdict.placeholders)
        self.untagged += record.untagged or record.error_kind == "untagged"
        if verdict.problem is not None:
            self.problems[verdict.problem] = self.problems.get(verdict.problem, 0) + 1

    def __add__(self, other: ValidityStats) -> ValidityStats:
        problems = dict(self.problems)
        for kind, n in other.problems.items():
            problems[kind] = problems.get(kind, 0) + n
        return ValidityStats(self.calls + other.calls, self.grounded + other.grounded,
                             self.placeholder + other.placeholder, self.untagged + other.untagged, problems)

    def as_metrics(self, prefix: str = "validity_") -> dict[str, float | int]:
        """Flat numbers for a metrics line: the counts, the grounded fraction, and `…not_grounded_<problem>` for
        each problem that occurred."""
        out: dict[str, float | int] = {f"{prefix}calls": self.calls, f"{prefix}grounded": self.grounded,
                                       f"{prefix}placeholder": self.placeholder, f"{prefix}untagged": self.untagged,
                                       f"{prefix}grounded_fraction": self.grounded_fraction}
        out.update({f"{prefix}not_grounded_{kind}": n for kind, n in sorted(self.problems.items())})
        return out


class ValidityChecker:
    """Classifies calls against one tool set (the episode's: what the model was shown). Default: `default_tools()`."""

    def __init__(self, tools: Sequence[Tool] | None = None):
        self.tools = {t.name: t for t in (default_tools() if tools is None else tools)}
        self._phrases = {name: _phrases(tool) for name, tool in self.tools.items()}

    def call(self, record: CallRecord) -> CallValidity:
        tool = self.tools.get(record.name) if record.name is not None else None
        placeholders, trivial = self._flags(record, tool) if tool is not None else ((), False)
        if record.error is not None:
            problem = record.error_kind or "unclassified"
        elif tool is None:  # ran, but under another tool set than this checker's
            problem = "unknown_tool"
        elif placeholders:
            problem = "placeholder"
        elif trivial:
            problem = "trivial"
        elif record.name == "read_lints" and record.output.startswith(NO_TARGET):
            problem = "no_target"
        elif record.name == "run_terminal" and NOT_RUN.search(record.output[-400:]):
            problem = "not_run"
        elif record.untagged:  # checked last: grounded but for the wire format
            problem = "untagged_ran"
        else:
            return CallValidity(True, None, placeholders)
        return CallValidity(False, problem, placeholders)

    def trajectory(self, traj: Trajectory) -> ValidityStats:
        stats = ValidityStats()
        for turn in traj.turns:
            for record in turn.calls:
                stats.add(self.call(record), record)
        return stats

    def _flags(self, record: CallRecord, tool: Tool) -> tuple[tuple[str, ...], bool]:
        """(placeholder argument paths, whether some argument is trivial)."""
        args = record.arguments or {}
        required = set(tool.parameters.get("required", []))
        placeholders, trivial = [], False
        for where, key, value in _strings(args):
            if self._placeholder(tool, key, value):
                placeholders.append(where)
            elif FILLER.fullmatch(value) or (not value.strip() and where in required
                                             and key not in EMPTY_IS_MEANINGFUL):
                trivial = True
        return tuple(placeholders), trivial

    def _placeholder(self, tool: Tool, key: str, value: str) -> bool:
        if DOC_PATH.search(value):
            return True
        slot = TEMPLATE.fullmatch(value)
        if slot is not None:  # `<path>` is a slot; `<div>` (a grep for a tag) is not
            inner = words(slot.group(1) or slot.group(2))
            return bool(inner) and (self._echo(tool, key, inner) or inner in FORMAT_SLOTS
                                    or (bool(words(key)) and _contains(inner, words(key)))  # <command_to_run>
                                    or any(_contains(phrase, inner) for phrase in self._phrases[tool.name]))
        said = words(value)
        if not said:
            return False
        if self._echo(tool, key, said) or any(
                said == phrase or (len(said) >= MIN_COPIED_WORDS and _contains(phrase, said))
                for phrase in self._phrases[tool.name]):
            return True
        # An edited copy, of this tool's text or another's: a short value whose longest run of words copied from a
        # description covers at least half of it ("echo the bash command line to run", "… to run now").
        if len(said) > MAX_EDITED_WORDS or key in EMPTY_IS_MEANINGFUL:
            return False
        need = max(MIN_COPIED_WORDS, (len(said) + 1) // 2)
        return any(_longest_run(phrase, said) >= need for phrases in self._phrases.values() for phrase in phrases)

    @staticmethod
    def _echo(tool: Tool, key: str, said: tuple[str, ...]) -> bool:
        return said in (words(key), words(tool.name)) or (len(said) == 1 and said[0] in SCHEMA_TYPES)


def trajectory_validity(traj: Trajectory, tools: Sequence[Tool] | None = None) -> ValidityStats:
    """The figures of one trajectory against `tools` (default: `default_tools()`)."""
    return ValidityChecker(tools).trajectory(traj)


def _phrases(tool: Tool) -> list[tuple[str, ...]]:
    """The word sequences of a tool's description and of every description in its schema, quoted examples removed."""
    texts = [tool.description]
    stack: list[Any] = [tool.parameters]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("description"), str):
                texts.append(node["description"])
            stack += [v for k, v in node.items() if k != "description"]
        elif isinstance(node, list):
            stack += node
    phrases = [words(QUOTED.sub(" ", text)) for text in texts]
    return [p for p in phrases if p]


def _strings(value: Any, where: str = "", key: str = "") -> Iterator[tuple[str, str, str]]:
    """(path, key, text) for every string in a call's arguments: `("todos[0].content", "content", "…")`."""
    if isinstance(value, str):
        yield where, key, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{where}.{k}" if where else str(k), str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{where}[{i}]", key)


def _longest_run(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    """The length of the longest run of consecutive words that `a` and `b` share."""
    best, prev = 0, [0] * (len(b) + 1)
    for x in a:
        cur = [0] * (len(b) + 1)
        for j, y in enumerate(b, 1):
            if x == y:
                cur[j] = prev[j - 1] + 1
                best = max(best, cur[j])
        prev = cur
    return best


def _contains(phrase: tuple[str, ...], run: tuple[str, ...]) -> bool:
    n = len(run)
    return any(phrase[i:i + n] == run for i in range(len(phrase) - n + 1))

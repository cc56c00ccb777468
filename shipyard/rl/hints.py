"""Targeted textual feedback: detectors read a finished trajectory and say, at the turn where the model went wrong,
what the better behaviour was — a short hint the self-distillation teacher sees and the student does not.

Why: a sparse reward says only that an episode failed. With the bundled 0.5B model all 8 samples of a group often
fail alike, every advantage is 0 and the step learns nothing (issue 16). A hint is a dense signal exactly where the
error is: the teacher — the policy with the hint inserted right before the turn (`shipyard.train.batch.place_hint`)
— gives the student's sampled tokens of that turn other probabilities, and the trainer distils the student towards
it (`shipyard.train.distill`; Cursor's targeted feedback; SDPO, arXiv 2601.20802; OPSD, arXiv 2601.18734).

    trajectory ──detectors──▶ findings (turn, kind, hint, evidence) ──leak check──▶ one message per hinted turn
                                                                                      ──ChatFormat.hint_ids──▶ Hint

**Detectors** (`DETECTORS`, each a function of the trajectory and what is known of its task) read what the harness
recorded — error kinds (`CallRecord.error_kind`), grounded validity (`shipyard.harness.validity`), which tools ran on
which paths — never the wording of an error message:

    call_format          a call the harness could not run as written: untagged, truncated, malformed, an unknown
                         tool, arguments outside the schema (and an untagged call it accepted); an untagged call
                         that is otherwise sound is shown back in the tags, the exact text expected
    ungrounded           arguments that are no real target: a copied description or template, filler, a command
                         the shell could not run, a lint of nothing
    rejected_edit        an edit the syntax gate refused
    unread_edit          a search_replace on a file the episode never read before that turn
    repeated_failure     a call identical (tool and arguments) to one that already failed — or, as repeated_call,
                         to an exploring call that succeeded with nothing changed since
    test_edit            an edit of the task's tests (or of test files: `tests/`, `test_*.py`, `conftest.py`)
    serial_calls         two turns in a row of one exploring call each, the second not found by the first
                         (its target is not in the first's output): they could have been one parallel turn
    verbose_step         more than `verbose_words` words of prose in a turn that only explores
    finished_untested    a final answer after code changes with no test run since the last of them
    finished_unchanged   a final answer without any code change

**Hints describe behaviour, never the deleted code.** Their text is fixed per kind (`HINTS`) and carries no task
information; what a hint takes from the episode (`Finding.slots`: the paths the model wrote, its own untagged call
written in the tags) is checked against the identifiers of the task's deleted code — the gold patch's added lines,
less those the statement shows (`TaskFacts`) — as words and inside longer names; a finding whose slots name one is
dropped and counted (`dropped_leak`; an untagged call that names one gets the fixed example instead). The other
fillings come from what the model was shown anyway: the tool list, the statement's test command.

Findings on the same turn become one message; at most `max_turns` turns of a rollout are hinted (the earliest).
Masked rollouts (no reward) get none: they are not trained on.
"""

from __future__ import annotations

import builtins
import itertools
import json
import keyword
import posixpath
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

from shipyard.harness.parse import CLOSE, OPEN, ToolCallParser
from shipyard.harness.tools import Tool, default_tools
from shipyard.harness.trajectory import FORMAT_KINDS, CallRecord, Trajectory
from shipyard.harness.validity import ValidityChecker
from shipyard.harness.wire import ChatFormat
from shipyard.models.errors import InfraError
from shipyard.models.openai import RequestRejected
from shipyard.rl.config import HINT_DETECTORS, check_detectors
from shipyard.rollout.batches import RolloutBatch
from shipyard.rollout.record import Hint
from shipyard.tasks.grade import read_gold
from shipyard.tasks.taskset import Task, load_task

CONTROL = re.compile(r"<\|[^<>|\s]{0,40}\|>|</?s>")  # chat control tokens written as text (<|im_end|>, </s>)
MAX_EXACT_CALL = 400  # characters of an untagged call's JSON that a hint repeats in full (`tagged`)
EXPLORE = frozenset({"read_file", "list_dir", "glob", "grep", "read_lints", "codebase_search"})
EDIT = frozenset({"search_replace", "write_file", "delete_file"})
UNGROUNDED = frozenset({"placeholder", "trivial", "no_target", "not_run"})
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
TEST_RUNNER = re.compile(r"\b(?:pytest|py\.test|unittest|nose2|tox|nox)\b|\b(?:go|cargo|npm|yarn|pnpm|make)\s+test\b")
TEST_PATH = re.compile(r"(?:^|/)(?:tests?/|test_[^/]*\.py$|[^/]*_test\.(?:py|go)$|conftest\.py$)")
SUITE_COMMAND = re.compile(r"[Rr]un the (?:test )?suite with `([^`\n]{1,200})`")
DEFAULT_TEST_COMMAND = "the test suite"
MIN_SECRET = 3  # shorter names (`i`, `s`, `lo`) are not secrets: as words they would block ordinary text
MIN_SECRET_INSIDE = 5  # a secret this long is also found inside longer words and across separators
# Not secrets: Python's keywords and builtins (`len`, `sorted`, `max`) say nothing about the deleted code.
COMMON_NAMES = frozenset(w.casefold() for w in (*keyword.kwlist, *keyword.softkwlist, *dir(builtins)))

HINTS = {
    "untagged": "Write every tool call inside <tool_call></tool_call> tags, for example "
                '<tool_call>{{"name": "list_dir", "arguments": {{"path": "."}}}}</tool_call>.',
    "untagged_exact": "Write every tool call inside <tool_call></tool_call> tags. The call you wrote, as it should "
                      "have been written:\n{call}",
    "truncated": "Your tool call was cut off before it closed. Keep each call short enough to finish; change a big "
                 "file with several small search_replace edits instead of one long write.",
    "malformed": 'A tool call must be one JSON object, {{"name": ..., "arguments": {{...}}}}, with double quotes and '
                 "every bracket closed, inside <tool_call></tool_call> tags.",
    "unknown_tool": "Call only the tools you were given, by their exact names: {tools}.",
    "bad_arguments": "Give a tool exactly the arguments its schema lists, with the listed types; the error names the "
                     "argument that was wrong.",
    "ungrounded": "Use real values as arguments: paths from the file list or from earlier results, and commands that "
                  "exist here. Never copy a tool's description or a template such as path/to/file.",
    "rejected_edit": "The syntax check refused your edit because the file would no longer parse. Re-read the lines "
                     "around the change and make the replacement complete, with matching indentation and brackets.",
    "unread_edit": "Read {path} with read_file before editing it, so that old_string is copied from the real text.",
    "repeated_failure": "This exact call already failed. Read the error it got and change the call instead of "
                        "repeating it.",
    "repeated_call": "You already made this exact call and nothing has changed since: its result is above. Use it "
                     "and take the next step.",
    "test_edit": "Do not change the tests ({path}): change the implementation so that the tests pass.",
    "serial_calls": "Calls that do not depend on each other belong in one turn: make them side by side, each in its "
                    "own <tool_call> block, and they run in parallel.",
    "verbose_step": "Keep a simple step short: one sentence on what you will do, then the call.",
    "finished_untested": "You changed code but have not run the tests since. Run {command} and read the result "
                         "before you finish.",
    "finished_unchanged": "The task is not done: nothing was changed. Find the code the task names, implement it, "
                          "then run {command}.",
}


@dataclass(frozen=True)
class TaskFacts:
    """What detectors know of a task: its test command and test files, and `secret` — the identifiers of its deleted
    code that the statement does not show (case-folded), which no hint may contain."""

    test_command: str = DEFAULT_TEST_COMMAND
    test_files: frozenset[str] = frozenset()
    secret: frozenset[str] = frozenset()
    statement: str = ""

    @classmethod
    def of(cls, task: Task, gold: str) -> TaskFacts:
        shown = {w.casefold() for w in IDENTIFIER.findall(task.statement)} | COMMON_NAMES
        added = "\n".join(line[1:] for line in gold.splitlines() if line.startswith("+") and not line.startswith("+++"))
        secret = {w.casefold() for w in IDENTIFIER.findall(added) if len(w) >= MIN_SECRET} - shown
        suite = SUITE_COMMAND.search(task.statement)
        files = {*task.test_files, *(t.split("::")[0] for t in [*task.fail_to_pass, *task.pass_to_pass])}
        return cls(f"`{suite.group(1)}`" if suite else DEFAULT_TEST_COMMAND, frozenset(files), frozenset(secret),
                   task.statement)

    @classmethod
    def load(cls, tasks_dir: Path, task_id: str) -> TaskFacts:
        task, task_dir = load_task(tasks_dir, task_id)
        return cls.of(task, read_gold(task_dir))

    def leaks(self, text: str) -> bool:
        """Whether `text` names a secret identifier: as a word (case-folded), or — for one of `MIN_SECRET_INSIDE`
        characters or more — anywhere once case, `_` and separators are ignored (`from roman`, `fromRoman` and
        `tests/from_roman_x.py` all name `from_roman`)."""
        folded = text.casefold()
        if any(w in self.secret for w in IDENTIFIER.findall(folded)):
            return True
        squashed = re.sub(r"[^0-9a-z]", "", folded)
        return any(len(s) >= MIN_SECRET_INSIDE and s.replace("_", "") in squashed for s in self.secret)


def hint(kind: str, **slots: str) -> str:
    """The fixed text of a kind of hint (`HINTS`), its slots filled."""
    return HINTS[kind].format(**slots)


@dataclass(frozen=True)
class Finding:
    """A detector's verdict on one turn: `hint` is what the model is told; `slots` the parts of it taken from the
    episode (checked for leaks); `evidence` says what was seen, for the run's logs (never shown to the model)."""

    turn: int
    kind: str
    hint: str
    evidence: str
    slots: tuple[str, ...] = ()


@dataclass
class Context:
    """What every detector gets: the trajectory's calls in order, the task's facts, the tools and settings."""

    traj: Trajectory
    facts: TaskFacts
    tools: dict[str, Tool]
    checker: ValidityChecker
    parser: ToolCallParser
    verbose_words: int

    def calls(self) -> Iterator[tuple[int, CallRecord]]:
        for turn in self.traj.turns:
            for call in turn.calls:
                yield turn.index, call


Detector = Callable[[Context], list[Finding]]


def _target(call: CallRecord) -> str:
    """The path (or pattern) a call names, normalised (`./a.py` is `a.py`); '' when it names none as a string."""
    args = call.arguments if isinstance(call.arguments, dict) else {}
    value = args.get("path") or args.get("pattern")
    if not isinstance(value, str) or not value:
        return ""
    return posixpath.normpath(value) if "path" in args else value


def _is_test_run(call: CallRecord, facts: TaskFacts) -> bool:
    if call.name != "run_terminal" or call.error is not None:
        return False
    command = call.arguments.get("command") if isinstance(call.arguments, dict) else None
    if not isinstance(command, str):
        return False
    return bool(TEST_RUNNER.search(command)) or any(f in command for f in facts.test_files)


def _strings(value: object) -> Iterator[str]:
    """Every string value inside decoded JSON arguments (not the keys: those are the tool's schema)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def tagged(call: CallRecord, ctx: Context) -> tuple[str, tuple[str, ...]] | None:
    """An untagged call written as the system prompt asks — the expected text itself, the model's own name and
    arguments in the tags — with the argument strings it repeats (the finding's slots); None when the call is not one
    to endorse. The hint says "as it should have been written", and the teacher copies it, so the call must be
    grounded but for the tags (`ValidityChecker`: it ran without error — or, rejected unrun, nothing but the tags
    is wrong with it — with no placeholder, filler or template argument); its strings must name none of the task's
    deleted code (checked decoded: in the JSON text an escape such as `\\n` would hide a word), and hold no chat
    control token (`CONTROL`: the hint is tokenized with special tokens matched); its JSON at most `MAX_EXACT_CALL`
    characters (not a whole file's `write_file`); and it must parse back as one tagged call."""
    if call.name is None or not isinstance(call.arguments, dict):
        return None
    if call.error_kind == "untagged":  # rejected unrun: judged as if it had run, on its arguments alone
        call = replace(call, error=None, error_kind=None, untagged=True, output="")
    if call.error is not None or ctx.checker.call(call).problem != "untagged_ran":
        return None
    strings = tuple(_strings(call.arguments))
    if any(ctx.facts.leaks(s) or CONTROL.search(s) for s in strings):
        return None
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    if len(body) > MAX_EXACT_CALL:
        return None
    text = f"{OPEN}\n{body}\n{CLOSE}"
    parsed = ctx.parser.parse(text).calls
    if len(parsed) != 1 or parsed[0].error is not None or parsed[0].untagged:
        return None
    return text, strings


def call_format(ctx: Context) -> list[Finding]:
    """A turn's first call the harness could not run as written. An untagged call that is otherwise sound gets the
    exact text it should have been (`tagged`), for the teacher to copy at the token where the student wrote a bare
    `{` — where the model can write the tag at all: the bundled 0.5B's tag token was never trained, and its hinted
    teacher copies the call without the tags (`shipyard bench hint_probe`, issue 16). Its argument strings are the
    finding's slots (leak-checked again)."""
    out = []
    for turn in ctx.traj.turns:
        for call in turn.calls:
            kind = call.error_kind if call.error_kind in (*FORMAT_KINDS, "bad_arguments") else \
                "untagged" if call.untagged else None
            if kind is None:
                continue
            exact = tagged(call, ctx) if kind == "untagged" else None
            if exact is not None:
                out.append(Finding(turn.index, "call_format", hint("untagged_exact", call=exact[0]),
                                   f"call #{call.index + 1}: untagged_exact", exact[1]))
            else:
                out.append(Finding(turn.index, "call_format", hint(kind, tools=", ".join(ctx.tools)),
                                   f"call #{call.index + 1}: {kind}"))
            break
    return out


def ungrounded(ctx: Context) -> list[Finding]:
    out, seen = [], set()
    for turn, call in ctx.calls():
        problem = ctx.checker.call(call).problem
        if problem in UNGROUNDED and turn not in seen:
            seen.add(turn)
            out.append(Finding(turn, "ungrounded", hint("ungrounded"), f"call #{call.index + 1} ({call.name}): "
                                                                        f"{problem}"))
    return out


def rejected_edit(ctx: Context) -> list[Finding]:
    return [Finding(turn, "rejected_edit", hint("rejected_edit"), f"call #{call.index + 1} ({call.name})")
            for turn, call in _first_per_turn(ctx, lambda c: c.error_kind == "rejected_edit")]


def unread_edit(ctx: Context) -> list[Finding]:
    read: set[str] = set()
    out, seen = [], set()
    for turn in ctx.traj.turns:
        for call in turn.calls:
            path = _target(call)
            ran_as_written = call.error_kind not in (*FORMAT_KINDS, "bad_arguments")
            if call.name == "search_replace" and ran_as_written and path and path not in read and \
                    turn.index not in seen:
                seen.add(turn.index)
                out.append(Finding(turn.index, "unread_edit", hint("unread_edit", path=path),
                                   f"search_replace of {path} before any read_file of it", (path,)))
        # what this turn read (or wrote whole) counts from the next turn on: calls of one turn run before the model
        # sees their results
        read |= {_target(c) for c in turn.calls if c.name in ("read_file", "search_replace", "write_file")
                 and c.error is None}
    return out


def repeated_failure(ctx: Context) -> list[Finding]:
    """An identical call again in a later turn: one that failed (repeated_failure), or an exploring call that
    succeeded with nothing changed since (repeated_call: its answer is already in the context)."""
    failed: set[str] = set()
    explored: set[str] = set()
    out = []
    for turn in ctx.traj.turns:
        found: tuple[str, CallRecord] | None = None
        for call in turn.calls:
            if call.name is None:
                continue
            if found is None and call.key in failed:
                found = ("repeated_failure", call)
            elif found is None and call.key in explored and call.error is None:
                found = ("repeated_call", call)
        if found is not None:
            kind, call = found
            out.append(Finding(turn.index, kind, hint(kind), f"call #{call.index + 1} ({call.name}) repeats "
                                                             f"{'a failed' if kind == 'repeated_failure' else 'an'} "
                                                             "earlier call"))
        for call in turn.calls:  # what this turn did counts from the next turn on
            if call.error is not None and call.name is not None:
                failed.add(call.key)
            elif call.name in EXPLORE:
                explored.add(call.key)
            if call.name not in EXPLORE and call.error is None:  # a change (or a command): earlier reads may be stale
                explored.clear()
    return out


def edits_tests(ctx: Context) -> list[Finding]:
    def touches_tests(c: CallRecord) -> bool:
        path = _target(c)
        return c.name in EDIT and c.error is None and (path in ctx.facts.test_files or bool(TEST_PATH.search(path)))

    out = []
    for turn, call in _first_per_turn(ctx, touches_tests):
        path = _target(call)
        out.append(Finding(turn, "test_edit", hint("test_edit", path=path), f"{call.name} of {path}", (path,)))
    return out


def serial_calls(ctx: Context) -> list[Finding]:
    out = []
    turns = ctx.traj.turns
    for a, b in itertools.pairwise(turns):
        if len(a.calls) != 1 or len(b.calls) != 1:
            continue
        first, second = a.calls[0], b.calls[0]
        target = _target(second)
        # found by the first call: its path, or its file name (a listing shows names), is in the first's output
        seen = first.output or ""
        found = target and (target in seen or PurePosixPath(target).name in seen)
        if first.name in EXPLORE and second.name in EXPLORE and first.error is None and second.error is None \
                and target and not found:
            out.append(Finding(a.index, "serial_calls", hint("serial_calls"),
                               f"{first.name} then {second.name} in turns {a.index} and {b.index}, independent"))
    return out


def verbose_step(ctx: Context) -> list[Finding]:
    out = []
    for turn in ctx.traj.turns:
        if not turn.calls or any(c.name not in EXPLORE for c in turn.calls):
            continue
        prose = len(ctx.parser.parse(turn.text or "").content.split())
        if prose > ctx.verbose_words:
            out.append(Finding(turn.index, "verbose_step", hint("verbose_step"),
                               f"{prose} words of prose before {len(turn.calls)} exploring call(s)"))
    return out


def finished(ctx: Context) -> list[Finding]:
    """finished_untested / finished_unchanged, on the final answer's turn."""
    turns = ctx.traj.turns
    if ctx.traj.stop_reason != "finished" or not turns or turns[-1].calls:
        return []
    last_edit, last_test = None, None
    for turn, call in ctx.calls():
        if call.name in EDIT and call.error is None:
            last_edit = (turn, call.index)
        if _is_test_run(call, ctx.facts):
            last_test = (turn, call.index)
    command = ctx.facts.test_command
    if last_edit is None and ctx.traj.patch:  # changed through the terminal: when is unknown, so any test run will do
        last_edit = (-1, -1)
    if last_edit is None:
        return [Finding(turns[-1].index, "finished_unchanged", hint("finished_unchanged", command=command),
                        "final answer without a successful edit or any change in the workspace")]
    if last_test is None or last_test < last_edit:
        return [Finding(turns[-1].index, "finished_untested", hint("finished_untested", command=command),
                        f"last edit in turn {last_edit[0]}, no test run after it")]
    return []


def _first_per_turn(ctx: Context, pick: Callable[[CallRecord], bool]) -> list[tuple[int, CallRecord]]:
    out: dict[int, CallRecord] = {}
    for turn, call in ctx.calls():
        if pick(call):
            out.setdefault(turn, call)
    return list(out.items())


DETECTORS: dict[str, Detector] = dict(zip(HINT_DETECTORS, (call_format, ungrounded, rejected_edit, unread_edit,
                                                             repeated_failure, edits_tests, serial_calls, verbose_step,
                                                             finished), strict=True))


class Detectors:
    """The named detectors over one tool set (default `default_tools()`), built once: the validity checker and the
    parser they share are not free to make, and a writer runs them on every rollout."""

    def __init__(self, tools: Sequence[Tool] | None = None, verbose_words: int = 120,
                 names: Sequence[str] = tuple(DETECTORS)):
        check_detectors(names)
        tools = list(default_tools() if tools is None else tools)
        self.tools = {t.name: t for t in tools}
        self.checker, self.parser = ValidityChecker(tools), ToolCallParser(tools, "accept")
        self.verbose_words, self.names = verbose_words, tuple(names)

    def __call__(self, traj: Trajectory, facts: TaskFacts) -> list[Finding]:
        """Every finding on one trajectory, in turn order."""
        ctx = Context(traj, facts, self.tools, self.checker, self.parser, self.verbose_words)
        return sorted((f for name in self.names for f in DETECTORS[name](ctx)), key=lambda f: f.turn)


def detect(traj: Trajectory, facts: TaskFacts, *, tools: Sequence[Tool] | None = None, verbose_words: int = 120,
           detectors: Sequence[str] = tuple(DETECTORS)) -> list[Finding]:
    """Every finding of the named detectors on one trajectory, in turn order (`Detectors`, once)."""
    return Detectors(tools, verbose_words, detectors)(traj, facts)


@dataclass
class HintReport:
    """A batch's hints and what was found: findings by kind (kept or not), hints dropped for a leak, the evidence."""

    hints: list[Hint] = field(default_factory=list)
    found: Counter = field(default_factory=Counter)
    dropped_leak: int = 0
    dropped_turns: int = 0  # findings beyond `max_turns` hinted turns of a rollout
    dropped_critic: int = 0  # critic answers that failed its gate (shipyard.rl.critic)
    critic_errors: int = 0  # reviews the critic's engine could not give (unreachable, rejected): no hints from it
    critic_error: str = ""  # the last such error

    def metrics(self) -> dict[str, float | str]:
        return {"count": len(self.hints), "rollouts": len({h.sample for h in self.hints}),
                "dropped_leak": self.dropped_leak, "dropped_turns": self.dropped_turns,
                "dropped_critic": self.dropped_critic, "critic_errors": self.critic_errors,
                **({"critic_error": self.critic_error} if self.critic_error else {}),
                **{f"found_{k}": n for k, n in sorted(self.found.items())}}


CriticReview = Callable[[Trajectory, str, TaskFacts], tuple[list[Finding], int]]  # shipyard.rl.critic.Critic.review


class HintWriter:
    """The RL loop's hint source: `writer(batch)` → `HintReport` with one `Hint` per hinted turn (module docstring).
    Task facts are read once per task from `tasks_dir`. `critic`: an optional reviewer adding its own findings."""

    def __init__(self, tasks_dir: Path, chat: ChatFormat, *, tools: Sequence[Tool] | None = None, max_turns: int = 2,
                 verbose_words: int = 120, detectors: Sequence[str] = tuple(DETECTORS),
                 critic: CriticReview | None = None):
        self.tasks_dir, self.chat = Path(tasks_dir), chat
        self.detect = Detectors(tools, verbose_words, detectors)
        self.max_turns, self.critic = max_turns, critic
        self._facts: dict[str, TaskFacts] = {}

    def facts(self, task_id: str) -> TaskFacts:
        if task_id not in self._facts:
            self._facts[task_id] = TaskFacts.load(self.tasks_dir, task_id)
        return self._facts[task_id]

    def __call__(self, batch: RolloutBatch) -> HintReport:
        report = HintReport()
        for sample, (rollout, mask) in enumerate(zip(batch.rollouts, batch.masks, strict=True)):
            if mask == 0 or rollout.trajectory is None:
                continue
            facts = self.facts(rollout.task_id)
            traj = rollout.trajectory
            by_turn: dict[int, list[Finding]] = {}
            findings = self.detect(traj, facts)
            if self.critic is not None:
                try:
                    reviewed, rejected = self.critic(traj, facts.statement, facts)
                except (InfraError, RequestRejected) as e:  # the critic's server: its hints are extra, not the step
                    report.critic_errors += 1
                    report.critic_error = f"{type(e).__name__}: {e}"[:500]
                else:
                    findings += reviewed
                    report.dropped_critic += rejected
            for f in sorted(findings, key=lambda f: f.turn):
                report.found[f.kind] += 1
                if any(facts.leaks(s) for s in f.slots):
                    report.dropped_leak += 1
                elif traj.turns[f.turn].completion_ids:  # a hint distils into the turn's sampled tokens
                    by_turn.setdefault(f.turn, []).append(f)
            for i, turn in enumerate(sorted(by_turn)):
                if i >= self.max_turns:
                    report.dropped_turns += len(by_turn[turn])
                    continue
                text = "\n".join(dict.fromkeys(f.hint for f in by_turn[turn]))
                report.hints.append(Hint(sample, turn, self.chat.hint_ids(text),
                                         kinds=tuple(f.kind for f in by_turn[turn]), text=text,
                                         evidence=tuple(f.evidence for f in by_turn[turn])))
        return report

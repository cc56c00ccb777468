"""Gold trajectories: a task solved with the harness's own tools, the way a good agent works, for a `replay:` engine.

Two users. `shipyard eval --model replay:gold` must score pass@1 = 1.0 on any valid task set: the end-to-end check
that the episode runner, the sandboxes, the patch the workspace produces and the grader agree (a gold trajectory
that scores 0 is a bug in one of them, or a broken task). And `shipyard sft` learns from these trajectories (the
cold start before RL, as in SWE-Gym, arXiv 2412.21139, and SWE-smith, arXiv 2504.21798): so a replay is a
*demonstration* — it does what a good agent does, in the order one would, and says nothing an agent could not know:

1. **Look**: read each file the patch changes (`read_file`, around each region it changes when the file is long), in
   one turn of parallel calls; some tasks also `grep` the tests for the symbol, or run the failing tests first. A
   long file is first searched — `grep "(def|class) (NAME|…)\b"` for the bodies to write, `grep "^(async def|def|class)
   "` for the module's outline where a deleted definition goes back — and each window is read from a line that search
   printed. The statement names a file and a symbol, never a line: windows read at lines no earlier call showed taught
   a fine-tuned model to guess offsets (an SFT policy opened `parse/__init__.py` at line 98 for a stub at line 944).
2. **Edit**: one `search_replace` per changed region (`difflib` over the file's lines, each region's old text grown
   by context lines until it occurs once in the file as it is when the call runs — checked by replaying the edits on
   the host, which must end at the gold contents, each step passing the tool's syntax gate). A file no sequence of
   unique, accepted replacements reproduces, a new file, a deleted file: `write_file` / `delete_file`.
3. **Check**: run the task's failing tests (`.venv/bin/python -m pytest -q` with their ids, or their files when
   there are many) — the statement's own instruction.
4. **Stop**: a one- or two-sentence summary of what changed, with no tool call (which ends the episode).

The wording and the order of the look step vary across tasks (a `random.Random` seeded by the task id: the same
task always replays the same script), so a model fine-tuned on them learns the pattern, not one sentence. Nothing
says "gold", nothing quotes the grader.

The final contents of every file `gold.patch` changes are computed on the host: the files it names are copied out of
the task's `snapshot/` (read without following a link, `harness.confined.Tree`) into a private temporary directory
and the patch is applied there with `git apply` (outside any repository: `GIT_CEILING_DIRECTORIES`). Binary
sections, links and submodules are refused (`GoldError`): the tools write text. A task without a gold patch has no
gold trajectory. The scripts are keyed by task id (`{"task": ID, "messages": [...]}`, see `shipyard.models.replay`),
so one replay engine serves every task and every sample of a task set.
"""

from __future__ import annotations

import difflib
import io
import json
import os
import random
import re
import shlex
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from shipyard.errors import FileFormatError
from shipyard.harness.confined import Tree
from shipyard.harness.controls import ControlTokens
from shipyard.harness.parse import CLOSE, OPEN
from shipyard.harness.tools.base import EditRejected
from shipyard.harness.tools.edit import syntax_gate
from shipyard.harness.workspace import MAX_FILE_BYTES, PathError
from shipyard.models.replay import ReplayEngine
from shipyard.models.tokenizer import byte_tokenizer
from shipyard.tasks.grade import read_gold
from shipyard.tasks.patchparse import parse_patch
from shipyard.tasks.taskset import Task, TaskFormatError, list_tasks, load_task

LINK_MODES = ("120000", "160000")
GOLD_ENGINE = "replay:gold"  # the engine's name, which its trajectories carry (`Trajectory.model`)
APPLY_TIMEOUT = 60.0
# Bounds on finding a gold change's search_replace edits (`edits`), which a repository's file must not stall.
MAX_DIFF_LINES = 2000  # lines (old and new) that difflib compares line for line
MAX_JUNK_DIFF_LINES = 20000  # lines it compares with popular lines as junk (`_spans`); more are one region
MAX_REGIONS = 32  # regions of one file edited apart; more are one region
MAX_CONTEXT = 20  # lines a region's old text grows by, each side, to occur once


class GoldError(FileFormatError):
    """A task has no gold trajectory (no gold patch, or one `write_file` cannot reproduce); the message says why."""


def final_files(task_dir: Path) -> dict[str, str | None]:
    """Each path `gold.patch` changes, with its contents after the patch (None: the patch deletes it)."""
    task_dir = Path(task_dir)
    where = f"task {task_dir.name}"
    gold = read_gold(task_dir)
    changes = parse_patch(gold)
    if not changes:
        raise GoldError(f"{where} has no gold.patch (or one without file sections): it has no gold trajectory")
    for change in changes:
        if change.problem:
            raise GoldError(f"{where}: gold.patch does not apply ({change.problem})")
        if change.binary:
            raise GoldError(f"{where}: gold.patch changes {change.new or change.old} as binary; write_file writes text")
        if change.mode in LINK_MODES:
            raise GoldError(f"{where}: gold.patch makes {change.new} a link or submodule; write_file writes files")
    snapshot = Tree(task_dir / "snapshot")
    with tempfile.TemporaryDirectory(prefix="shipyard-gold-") as tmp:
        work = Tree(Path(tmp) / "tree")
        os.mkdir(work.root)
        try:
            for change in changes:
                if change.old is not None:
                    work.write(change.old, snapshot.read(change.old, MAX_FILE_BYTES))
        except (PathError, OSError) as e:
            raise GoldError(f"{where}: cannot read the file gold.patch changes from its snapshot ({e})") from None
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, "GIT_CONFIG_NOSYSTEM": "1",
               "GIT_CEILING_DIRECTORIES": tmp, "LC_ALL": "C"}
        try:
            applied = subprocess.run(["git", "apply", "--whitespace=nowarn"], cwd=work.root, env=env,
                                     input=gold.encode("utf-8", "surrogateescape"), capture_output=True,
                                     timeout=APPLY_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise GoldError(f"{where}: git apply of gold.patch took over {APPLY_TIMEOUT:g} s") from None
        if applied.returncode != 0:
            first = applied.stderr.decode(errors="replace").strip().splitlines()[:1]
            raise GoldError(f"{where}: gold.patch does not apply to its snapshot: {first[0] if first else 'git apply'}")
        final: dict[str, str | None] = {}
        for change in changes:
            if change.old is not None and change.old != change.new:
                final[change.old] = None  # deleted, or the old name of a rename
        for change in changes:
            if change.new is None:
                continue
            try:
                final[change.new] = work.read(change.new, MAX_FILE_BYTES).decode("utf-8")
            except UnicodeDecodeError:
                raise GoldError(f"{where}: {change.new} after gold.patch is not UTF-8 text") from None
            except (PathError, OSError) as e:
                raise GoldError(f"{where}: {change.new} after gold.patch cannot be read ({e})") from None
    return final


def spellings(tokenizer: PreTrainedTokenizerBase | None = None) -> re.Pattern[str]:
    """What a call's JSON must not spell as it is: the call tags (the parser would end or open a call there) and the
    control tokens of `tokenizer` (default: the byte tokenizer a replay engine uses), which a replay would encode as
    those tokens (a `<|im_end|>` in a file would end the turn in the trajectory, and vanish from the decoded call)."""
    controls = ControlTokens(tokenizer or byte_tokenizer()).pattern
    return re.compile("|".join([re.escape(OPEN), re.escape(CLOSE), *([controls.pattern] if controls else [])]))


def _call(name: str, arguments: dict[str, Any], spelled: re.Pattern[str]) -> str:
    """One tool call block. A spelling (`spellings`) inside an argument is written with its first character as a JSON
    escape (`\\u003c/tool_call>`), which decodes to the same text and is no tag or control token."""
    call = {"name": name, "arguments": arguments}
    body = json.dumps(call, ensure_ascii=False)
    escaped = spelled.sub(lambda m: _json_escape(m[0][0]) + m[0][1:], body)
    return f"{OPEN}\n{escaped if json.loads(escaped) == call else body}\n{CLOSE}\n"


def _json_escape(char: str) -> str:
    return f"\\u{ord(char):04x}" if ord(char) < 0x10000 else json.dumps(char)[1:-1]  # astral: a surrogate pair


def _turn(text: str, calls: list[tuple[str, dict[str, Any]]], spelled: re.Pattern[str]) -> str:
    return text + "\n" + "".join(_call(name, args, spelled) for name, args in calls)


def _spans(a: list[str], b: list[str]) -> list[tuple[int, int, int, int]]:
    """The changed regions (i1, i2, j1, j2) that turn lines `a` into `b`, each with up to 2 unchanged lines around it.
    difflib compares only what lies between the common head and tail (a gold patch changes a few bodies), line for
    line up to `MAX_DIFF_LINES`: over repeated lines its cost grows with the cube of the length (2000 lines of `pass`,
    one in ten changed: 19 s). Up to `MAX_JUNK_DIFF_LINES` it skips popular lines (difflib's autojunk). Beyond that,
    or past `MAX_REGIONS` regions, the whole middle is one region."""
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[len(a) - 1 - tail] == b[len(b) - 1 - tail]:
        tail += 1
    lo, margin = max(head - 2, 0), min(tail, 2)
    middle_a, middle_b = a[lo:len(a) - tail + margin], b[lo:len(b) - tail + margin]
    whole = [(lo, lo + len(middle_a), lo, lo + len(middle_b))]
    size = len(middle_a) + len(middle_b)
    if size > MAX_JUNK_DIFF_LINES:
        return whole
    # Past MAX_DIFF_LINES (two changes far apart: a body and the file's last line), lines that fill over 1% of the
    # new text (blank lines, `pass`) anchor no match: the regions may come out wider, never wrong, in bounded time.
    matcher = difflib.SequenceMatcher(None, middle_a, middle_b, autojunk=size > MAX_DIFF_LINES)
    groups = list(matcher.get_grouped_opcodes(2))
    if len(groups) > MAX_REGIONS:
        return whole
    return [(lo + g[0][1], lo + g[-1][2], lo + g[0][3], lo + g[-1][4]) for g in groups]


def edits(old: str, new: str, path: str | None = None) -> list[tuple[str, str]] | None:
    """`search_replace` arguments (old_string, new_string) that turn `old` into `new`, applied in order: one per
    changed region (`_spans`), each old text the region's changed lines grown by the fewest lines of context
    (`_unique_context`) that make it occur exactly once in the text as it is when it is applied, by `MAX_CONTEXT`
    lines each side at most. None when no such sequence reproduces `new` (a region still ambiguous at that growth,
    regions that merge) or, for the file `path`, when a step would be refused by the tool's syntax gate (the file
    parses before it and not after: two regions of one change, such as a string opened in one and closed in the
    other): the caller writes the whole file instead."""
    a, b = _lines(old), _lines(new)
    steps = _steps(old, new, path, a, b, _spans(a, b))
    return None if steps is None else [(search, replacement) for search, replacement, _, _ in steps]


def _lines(text: str) -> list[str]:
    """`text`'s lines as `read_file` numbers them: ended by \\n only (`str.splitlines` also ends one at a form feed
    or U+2028, and a window's offset would point at another line)."""
    return io.StringIO(text, newline="\n").readlines()


def _changed(a: list[str], b: list[str], span: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """The lines a region of `_spans` changes, its unchanged lines at either end left out: old [k, m), new [jk, jm)
    (k == m: an insertion before old line k)."""
    i1, i2, j1, j2 = span
    head = 0
    while i1 + head < i2 and j1 + head < j2 and a[i1 + head] == b[j1 + head]:
        head += 1
    tail = 0
    while i2 - tail > i1 + head and j2 - tail > j1 + head and a[i2 - 1 - tail] == b[j2 - 1 - tail]:
        tail += 1
    return i1 + head, i2 - tail, j1 + head, j2 - tail


def _steps(old: str, new: str, path: str | None, a: list[str], b: list[str],
           spans: list[tuple[int, int, int, int]]) -> list[tuple[str, str, int, int]] | None:
    """`edits`, each step with the lines [lo, hi) of `old` its old_string quotes (for the reads that show them)."""
    out: list[tuple[str, str, int, int]] = []
    text = old
    shift = 0  # lines the edits so far added (new − old) before the current region
    for span in spans:
        k, m, jk, jm = _changed(a, b, span)
        cur = _lines(text)
        found = _unique_context(text, cur, k + shift, m + shift)
        if found is None:
            return None
        lo, hi = found
        search = "".join(cur[lo:hi])
        replacement = "".join(cur[lo:k + shift]) + "".join(b[jk:jm]) + "".join(cur[m + shift:hi])
        before, text = text, text.replace(search, replacement, 1)
        if path is not None:
            try:
                syntax_gate(path, before, text)
            except EditRejected:
                return None
        out.append((search, replacement, max(lo - shift, 0), max(hi - shift, 0)))
        shift += (jm - jk) - (m - k)
    return out if text == new else None


def _unique_context(text: str, lines: list[str], lo: int, hi: int) -> tuple[int, int] | None:
    """The lines [lo', hi') around the region [lo, hi) of `text` (split as `lines`) with the fewest extra lines, above
    and below in any proportion, whose text is not empty and occurs exactly once in `text` (overlapping occurrences
    counted: `find` and `rfind` agree); None past `MAX_CONTEXT` lines a side. An agent quotes the nearest unique
    lines, not a symmetric block: an insertion after a unique `def` line needs that line only."""
    for extra in range(2 * MAX_CONTEXT + 1):
        for up in range(max(0, extra - MAX_CONTEXT), min(extra, MAX_CONTEXT) + 1):
            a, b = lo - up, hi + extra - up
            if a < 0 or b > len(lines):
                continue
            search = "".join(lines[a:b])
            if search and text.find(search) == text.rfind(search):
                return a, b
    return None


def _names(task: Task | None, files: list[str]) -> str:
    """How the summary names what was implemented: the deleted symbols (a few), else the files."""
    names = [f"`{d.qualname}`" for d in task.deleted] if task is not None else [f"`{f}`" for f in files]
    if len(names) > 3:
        return ", ".join(names[:3]) + f" and {len(names) - 3} more"
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _test_command(task: Task) -> str:
    """The statement's way of running the failing tests: their ids, or their files when there are many."""
    ids = list(task.fail_to_pass)
    if len(ids) > 6:
        ids = sorted({t.split("::", 1)[0] for t in ids})
    return ".venv/bin/python -m pytest -q " + " ".join(shlex.quote(t) for t in ids)


LOOK = ("Let me look at {where} first.", "I'll start by reading {where}.", "First, the code around {what}: {where}.",
        "To see what is missing, I'll open {where}.")
LOOK_FAILING = ("Let me run the failing tests first to see how they fail.",
                "First I'll run the tests that fail, to see what they expect.")
EDIT = ("Now I'll implement {what}.", "I have what I need; implementing {what}.", "Writing {what} now.",
        "I can write {what} from the docstring and the code around it. Editing.")
LOCATE = ("Let me find my way around {where} first.", "First I'll find my way around {where}.",
          "Let me search {where} first.")
LOOK_AT = ("Reading around the match.", "Let me read it there.", "Now the code at that line.")
CHECK = ("Let me run the tests that were failing.", "Now the failing tests again.", "Checking with the tests.")
DONE = ("I implemented {what} in {where}; the tests that were failing now pass.",
        "Done: implemented {what} in {where}, and its tests pass.",
        "Implemented {what} in {where}. The failing tests pass now.")


READ_WHOLE = 150  # a file of up to this many lines is read whole; a longer one around what the edit changes
READ_AROUND = 12  # lines shown before and after each changed region
READ_UP = 60  # lines looked back from a region for the `def` or `class` that holds it, whose signature is read too
DEFINITION = re.compile(r"\s*(?:async\s+def|def|class)\s")
TOP_LEVEL = re.compile(r"(?:async\s+def|def|class)\s")
OUTLINE = r"^(async\s+def|def|class)\s|^\w+\s*="  # the grep that lists a module's definitions and names, with lines
READ_HEAD = 120  # a window with no searched line above it starts at the file's head when that is this close
DEFINED = re.compile(r"\s*(?:async\s+)?(?:def|class)\s+(\w+)")  # the name a definition line defines


def _merge(ranges: list[tuple[int, int]], gap: int) -> list[tuple[int, int]]:
    """Line ranges `[lo, hi)` in order, those at most `gap` lines apart merged into one window."""
    windows: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if windows and lo <= windows[-1][1] + gap:
            windows[-1] = (windows[-1][0], max(hi, windows[-1][1]))
        else:
            windows.append((lo, hi))
    return windows


def _read_args(path: str, a: list[str], b: list[str], spans: list[tuple[int, int, int, int]],
               quoted: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """The `read_file` calls that show what the edit of `path` (lines `a` → `b`, in `spans`) needs: the whole file
    when it is short, else one window per changed region, from the definition holding the lines it changes (an
    insertion: from `READ_AROUND` lines above), widened to every line an edit quotes (`quoted`), merged where they
    meet. A window of 200 lines cost the demonstrations ~3,000 tokens a file; the episode's context is 8,192."""
    if len(a) <= READ_WHOLE:
        return [{"path": path}]
    ranges = list(quoted)
    for span in spans:
        k, m, _, _ = _changed(a, b, span)
        # a change: from the definition holding it; an insertion: from the module-level definition above it
        held = DEFINITION if m > k else TOP_LEVEL
        top = next((i for i in range(min(k, len(a) - 1), max(k - READ_UP, -1), -1) if held.match(a[i])), None)
        ranges.append((max(top if top is not None else k - READ_AROUND, 0), min(m + READ_AROUND, len(a))))
    windows = _merge(ranges, READ_AROUND)
    if windows and windows[0][0] <= READ_AROUND:  # near the top (imports): the file's head, which needs no search
        windows[0] = (0, windows[0][1])
    return [{"path": path, "offset": lo + 1, "limit": hi - lo} for lo, hi in windows]


def _locate(path: str, a: list[str], reads: list[dict[str, Any]],
            deleted: list[str] | None) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The `grep` that finds, in a long `path` (lines `a`), where its `reads` windows start, and the windows moved up
    to start at a line it prints — so no offset is one the agent was not shown. By name when each window's first
    definition is a symbol the statement names (`deleted`: qualnames; a method's class is named too, for an edit
    that quotes the class line); else the module's outline (`OUTLINE`: a deleted definition goes back where nothing
    holds its name). A window with no printed line above it starts at the file's head, which needs no search, when
    that is at most `READ_HEAD` lines up. (None, `reads`) when the file is read whole."""
    if any("offset" not in read for read in reads):
        return None, reads
    names: list[str] = []
    for read in reads:
        lo = read["offset"] - 1
        found = next((m.group(1) for line in a[lo:lo + read["limit"]] if (m := DEFINED.match(line))), None)
        if found is not None and found not in names:
            names.append(found)
    parts = [p for qualname in deleted or [] if (p := [q for q in qualname.split(".") if q.isidentifier()])]
    if names and deleted is not None and set(names) <= {p[-1] for p in parts}:  # each a deleted symbol: its class too
        names += [q for p in parts if p[-1] in names for q in p[:-1] if q not in names]
    if not names or (deleted is not None and not set(names) <= {q for p in parts for q in p}):
        pattern = OUTLINE
    else:
        pattern = rf"(def|class)\s+{names[0] if len(names) == 1 else '(' + '|'.join(names) + ')'}\b"
    shown = re.compile(pattern)  # the same matches in Python's re as in rg, for these patterns
    moved = []
    for read in reads:
        lo, hi = read["offset"] - 1, read["offset"] - 1 + read["limit"]
        top = next((i for i in range(lo, -1, -1) if shown.search(a[i])), None)
        moved.append((top if top is not None else (0 if lo <= READ_HEAD else lo), hi))
    windows = _merge(moved, 0)
    return {"pattern": pattern, "path": path}, [{"path": path, "offset": lo + 1, "limit": hi - lo}
                                                for lo, hi in windows]


def gold_messages(task_dir: Path, task: Task | None = None,
                  tokenizer: PreTrainedTokenizerBase | None = None) -> list[str]:
    """The assistant turns of the gold demonstration of the task in `task_dir` (module docstring), for a replay engine
    with `tokenizer` (`spellings`). Without its `Task` record (a bare task directory) the demonstration names files
    instead of symbols and runs no tests."""
    task_dir = Path(task_dir)
    spelled = spellings(tokenizer)
    final = final_files(task_dir)
    snapshot = Tree(task_dir / "snapshot")
    rng = random.Random(f"gold:{task.id if task is not None else task_dir.name}")
    changed = [p for p, c in final.items() if c is not None]
    originals = {p: _read_text(snapshot, p) for p in changed}  # each file read once, as the snapshot holds it
    existing = [p for p in changed if originals[p] is not None]
    where = ", ".join(f"`{p}`" for p in (existing or changed))
    what = _names(task, changed)
    run_tests = [("run_terminal", {"command": _test_command(task)})] if task is not None else []
    plans: dict[str, tuple[list[dict[str, Any]], list[tuple[str, str, int, int]] | None]] = {}
    deleted = [d.qualname for d in task.deleted] if task is not None else None
    locate = []  # a long file is searched first, and read from the lines the search prints
    for p in existing:  # each file's edits, and the reads that show every line they quote
        a, b = _lines(originals[p]), _lines(final[p])
        spans = _spans(a, b)
        steps = _steps(originals[p], final[p], p, a, b, spans)
        search, reads = _locate(p, a, _read_args(p, a, b, spans, [(lo, hi) for _, _, lo, hi in steps or []]), deleted)
        plans[p] = reads, steps
        if search is not None:
            locate.append(("grep", search))
    turns: list[str] = []
    if existing:
        look = [("read_file", args) for p in existing for args in plans[p][0]]
        if task is not None and task.deleted and rng.random() < 0.3:
            name = task.deleted[0].qualname.rsplit(".", 1)[-1]
            tests = sorted({t.split("::", 1)[0].rsplit("/", 1)[0] for t in task.fail_to_pass}) or ["."]
            look.append(("grep", {"pattern": re.escape(name), "path": tests[0]}))
        if task is not None and rng.random() < 0.25:
            turns.append(_turn(rng.choice(LOOK_FAILING), run_tests, spelled))
        if locate:
            long = ", ".join(f"`{args['path']}`" for _, args in locate)
            turns.append(_turn(rng.choice(LOCATE).format(where=long, what=what), locate, spelled))
            turns.append(_turn(rng.choice(LOOK_AT), look, spelled))
        else:
            turns.append(_turn(rng.choice(LOOK).format(where=where, what=what), look, spelled))
    calls: list[tuple[str, dict[str, Any]]] = []
    for path, content in final.items():
        if content is None:
            calls.append(("delete_file", {"path": path}))
            continue
        steps = plans[path][1] if path in plans else None
        if steps is None:
            calls.append(("write_file", {"path": path, "content": content}))
        else:
            calls += [("search_replace", {"path": path, "old_string": o, "new_string": n}) for o, n, _, _ in steps]
    turns.append(_turn(rng.choice(EDIT).format(what=what), calls, spelled))
    if task is not None:
        turns.append(_turn(rng.choice(CHECK), run_tests, spelled))
    turns.append(rng.choice(DONE).format(what=what, where=where))
    return turns


def _read_text(snapshot: Tree, path: str) -> str | None:
    try:
        return snapshot.read(path, MAX_FILE_BYTES).decode("utf-8")
    except (PathError, OSError, UnicodeDecodeError):
        return None


def gold_scripts(tasks_dir: Path, task_ids: list[str] | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None) -> dict[str, list[str]]:
    """Gold messages of `task_ids` (default: every task of the set), by task id, for a replay engine with `tokenizer`;
    each task is checked on loading."""
    scripts = {}
    for task_id in task_ids if task_ids is not None else list_tasks(tasks_dir):
        try:
            task, task_dir = load_task(tasks_dir, task_id)
        except TaskFormatError as e:
            raise GoldError(str(e)) from None
        scripts[task_id] = gold_messages(task_dir, task, tokenizer)
    return scripts


def write_gold_replay(tasks_dir: Path, out: Path, task_ids: list[str] | None = None) -> Path:
    """Write the gold scripts as a replay file (one `{"task", "messages"}` line per task) for `--model replay:OUT`."""
    scripts = gold_scripts(tasks_dir, task_ids)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"task": t, "messages": m}, ensure_ascii=False) + "\n"
                           for t, m in scripts.items()))
    return out


def gold_engine(tasks_dir: Path, task_ids: list[str] | None = None, tokenizer=None,
                encode: Callable[[str], list[int]] | None = None) -> ReplayEngine:
    """A replay engine that plays the gold trajectory of every task (`--model replay:gold`); `encode`: how a message
    becomes the ids the policy would write (`ChatFormat.completion_ids`, for demonstrations that train it)."""
    return ReplayEngine(tokenizer=tokenizer, name=GOLD_ENGINE, scripts=gold_scripts(tasks_dir, task_ids, tokenizer),
                        encode=encode)

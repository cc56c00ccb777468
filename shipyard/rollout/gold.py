"""Gold trajectories: the assistant messages that solve a task with the harness's own tools, for a `replay:` engine.

`shipyard eval --model replay:gold` must score pass@1 = 1.0 on any valid task set: it is the end-to-end check that
the episode runner, the sandboxes, the patch the workspace produces and the grader agree with each other (a gold
trajectory that scores 0 is a bug in one of them, or a broken task). Its messages do what an agent would do, through
the tools rather than around them:

1. The final contents of every file the task's `gold.patch` changes are computed on the host: the files it names are
   copied out of the task's `snapshot/` (read without following a link, `harness.confined.Tree`) into a private
   temporary directory and the patch is applied there with `git apply` (outside any repository:
   `GIT_CEILING_DIRECTORIES`). Binary sections, links and submodules are refused (`GoldError`): `write_file` writes
   text. A task without a gold patch has no gold trajectory.
2. One assistant turn per file: a `write_file` call with the file's final contents (or `delete_file`), so a turn is
   never longer than one file (a turn's token budget bounds what the engine may emit; `ReplayEngine.longest` says
   how much a script needs).
3. A final turn without a tool call, which ends the episode; the workspace's diff is then the gold patch.

The scripts are keyed by task id (`{"task": ID, "messages": [...]}`, see `shipyard.models.replay`), so one replay
engine serves every task and every sample of a task set.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from shipyard.errors import FileFormatError
from shipyard.harness.confined import Tree
from shipyard.harness.workspace import MAX_FILE_BYTES, PathError
from shipyard.models.replay import ReplayEngine
from shipyard.tasks.grade import read_gold
from shipyard.tasks.patchparse import parse_patch
from shipyard.tasks.taskset import TaskFormatError, list_tasks, load_task

LINK_MODES = ("120000", "160000")
APPLY_TIMEOUT = 60.0
FINAL_MESSAGE = "The deleted code is restored: this is the task's gold patch, written with the harness's tools."


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


def _call(name: str, arguments: dict[str, str]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>\n"


def gold_messages(task_dir: Path) -> list[str]:
    """The assistant turns of the gold trajectory of the task in `task_dir` (module docstring)."""
    messages = []
    for path, content in final_files(task_dir).items():
        if content is None:
            messages.append(f"Removing {path}.\n" + _call("delete_file", {"path": path}))
        else:
            messages.append(f"Writing {path}.\n" + _call("write_file", {"path": path, "content": content}))
    return [*messages, FINAL_MESSAGE]


def gold_scripts(tasks_dir: Path, task_ids: list[str] | None = None) -> dict[str, list[str]]:
    """Gold messages of `task_ids` (default: every task of the set), by task id; each task is checked on loading."""
    scripts = {}
    for task_id in task_ids if task_ids is not None else list_tasks(tasks_dir):
        try:
            _, task_dir = load_task(tasks_dir, task_id)
        except TaskFormatError as e:
            raise GoldError(str(e)) from None
        scripts[task_id] = gold_messages(task_dir)
    return scripts


def write_gold_replay(tasks_dir: Path, out: Path, task_ids: list[str] | None = None) -> Path:
    """Write the gold scripts as a replay file (one `{"task", "messages"}` line per task) for `--model replay:OUT`."""
    scripts = gold_scripts(tasks_dir, task_ids)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"task": t, "messages": m}, ensure_ascii=False) + "\n"
                           for t, m in scripts.items()))
    return out


def gold_engine(tasks_dir: Path, task_ids: list[str] | None = None, tokenizer=None) -> ReplayEngine:
    """A replay engine that plays the gold trajectory of every task (`--model replay:gold`)."""
    return ReplayEngine(tokenizer=tokenizer, name="replay:gold", scripts=gold_scripts(tasks_dir, task_ids))

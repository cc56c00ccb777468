"""Gold demonstrations of hostile or awkward tasks: whatever a repository's files hold, a gold replay driven through
the harness's own tools (a local workspace, the real parser, tools and syntax gate) ends at the gold contents, and
building it is bounded."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from shipyard.harness.loop import Agent, LoopConfig
from shipyard.harness.workspace import LocalWorkspace
from shipyard.models.replay import ReplayEngine
from shipyard.rollout.gold import edits, final_files, gold_messages

STUB = "def f():\n    raise NotImplementedError\n\n\ndef g():\n    return 2\n"


def _task(root: Path, old: dict[str, str], new: dict[str, str]) -> Path:
    """A task directory as `gold_messages` reads it: snapshot/ holds `old`, gold.patch turns it into `new`."""
    for name, files in (("a", old), ("b", new)):
        (root / name).mkdir()
        for rel, text in files.items():
            (root / name / rel).write_bytes(text.encode())
    diff = subprocess.run(["git", "diff", "--no-index", "a", "b"], cwd=root, capture_output=True).stdout.decode()
    task = root / "task"
    shutil.copytree(root / "a", task / "snapshot")
    (task / "gold.patch").write_text(diff.replace("a/a/", "a/").replace("b/b/", "b/"))
    return task


def _replayed(tmp_path: Path, old: dict[str, str], new: dict[str, str]) -> tuple[dict[str, str], list]:
    """(the workspace's files after the gold replay, the calls that failed)."""
    task = _task(tmp_path, old, new)
    assert {p: c for p, c in final_files(task).items() if c is not None} == new
    engine = ReplayEngine(gold_messages(task))
    work = tmp_path / "work"
    shutil.copytree(task / "snapshot", work)
    config = LoopConfig(max_turns=10, max_new_tokens=engine.longest() + 8, max_tokens=1 << 20)
    traj = Agent(engine, LocalWorkspace(work), config).run("implement f")
    failed = [c.error or c.output for t in traj.turns for c in t.calls if c.error or "rejected" in c.output]
    return {rel: (work / rel).read_bytes().decode() for rel in new}, failed


@pytest.mark.parametrize("spelling", ["</tool_call>", "<tool_call>", "<|im_end|>", "<|endoftext|>"])
def test_code_that_spells_the_call_tags_or_a_control_token_is_written_as_it_is(tmp_path, spelling):
    new = {"m.py": STUB.replace("raise NotImplementedError", f"return {spelling!r}")}
    files, failed = _replayed(tmp_path, {"m.py": STUB}, new)
    assert failed == [] and files == new


def test_an_edit_whose_halfway_file_would_not_parse_is_not_split_into_refused_steps(tmp_path):
    # Two regions far apart: the first opens a string the second closes. Replaced one by one, the syntax gate
    # refuses the first (the file would not parse) and the second (its old text is gone).
    old = "x = 1\n" + "a = 1\nb = 2\nc = 3\nd = 4\ne = 5\n" + "y = 2\n"
    new = {"m.py": 'x = """\n' + "a = 1\nb = 2\nc = 3\nd = 4\ne = 5\n" + '"""\n'}
    files, failed = _replayed(tmp_path, {"m.py": old}, new)
    assert failed == [] and files == new


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lines", [4000, 40000])
def test_edits_are_bounded_on_files_of_repeated_lines(lines):
    # difflib over repeated lines is cubic (2000 lines of `pass` with every tenth changed: 19 s; 4000: minutes), and
    # growing each region until it is unique scans the file once per line of growth: a repository's generated file
    # must not stall a pool's demonstrations. Whatever edits gives, it replays to the new text.
    old = "pass\n" * lines
    new = "".join("pass\n" if i % 10 else "pass  # x\n" for i in range(lines))
    steps = edits(old, new)
    text = old
    for search, replacement in steps or []:
        assert text.find(search) == text.rfind(search) != -1
        text = text.replace(search, replacement, 1)
    assert steps is None or text == new


@pytest.mark.parametrize("old, new", [
    ("x\n" * 6, "x\n" * 3 + "y\n" + "x\n" * 3),  # periodic text: overlapping occurrences are occurrences too
    ("a\r\nb\r\nc\r\n", "a\r\nB\r\nc\r\n"),  # CRLF
    ("a\nb\nc", "a\nB\nc"),  # no newline at the end
    ("\tif x:\n\t\tpass\n", "\tif x:\n\t\treturn 1\n"),  # tabs
    ("s = 'é'\nt = 1\n", "s = 'é'\nt = '\u2028'\n"),  # a line separator that str.splitlines splits at
])
def test_edits_of_awkward_text_replay_to_the_new_text(old, new):
    steps = edits(old, new)
    assert steps is not None
    text = old
    for search, replacement in steps:
        assert text.find(search) == text.rfind(search) != -1  # exactly one occurrence, overlapping ones counted
        text = text.replace(search, replacement, 1)
    assert text == new

"""Hostile patches against the grader, end to end in real sandboxes over a task synthesized from the example repo.

Each test names the issue-13 class it covers. The patches are built the way an agent could build them, from what
the task's sandbox shows (`redteam.target`); several are obfuscated so that they pass the static gate
(`patchscan.steering` looks for `import pytest`, `gc.get_objects`, `os._exit`, …) and reach the layers behind it:
the configured test run, the canaries, the plugin's integrity check, the report's seal and the control run.
"""

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest
from servers import needs_sandbox

from shipyard.harness.diff import MAX_DIFF_BYTES
from shipyard.sandbox.host import host
from shipyard.sandbox.sandbox import Sandbox
from shipyard.sandbox.snapshot import make_snapshot, remove_snapshot
from shipyard.tasks.grade import DETAIL_CHARS, Refused, Verdict, apply_patch, grade, not_regular
from shipyard.tasks.patchparse import FileChange, parse_patch
from shipyard.tasks.redteam import CORPUS, Target, edited, target
from shipyard.tasks.taskset import Task, TaskFormatError, list_tasks, load_task

pytestmark = needs_sandbox


@dataclasses.dataclass
class Pristine:
    task: Task
    task_dir: Path
    target: Target
    snapshot: Path  # one sandbox snapshot of the task, shared by the tests' grading runs
    names: list[str]  # every test function name the snapshot's test files define

    def grade(self, patch: str) -> Verdict:
        return grade(self.task, self.task_dir, patch, timeout=120, snapshot=self.snapshot)


@pytest.fixture(scope="module")
def t1(taskset):
    out = taskset[0]
    task, task_dir = next(load_task(out, t) for t in list_tasks(out) if load_task(out, t)[0].tier == 1)
    snapshot = task_dir / "snapshot"
    names = sorted({n for f in (snapshot / "tests").glob("test_*.py")
                    for n in re.findall(r"^\s*def (test_\w+)", f.read_text(), re.M)})
    snap = make_snapshot(snapshot, host())
    try:
        yield Pristine(task, task_dir, target(task, task_dir), snap, names)
    finally:
        remove_snapshot(snap)


def appended(t: Target, code: str) -> str:
    """A patch that appends `code` to the module that lost the feature."""
    return edited(t, lambda root: (root / t.module_file).write_text((root / t.module_file).read_text() + code))


def new_file(path: str, text: str, *, quoted: bool = False, git_header: bool = True) -> str:
    lines = text.splitlines()
    a, b = (f'"a/{path}"', f'"b/{path}"') if quoted else (f"a/{path}", f"b/{path}")
    head = f"diff --git {a} {b}\nnew file mode 100644\n" if git_header else ""
    return head + f"--- /dev/null\n+++ {b}\n@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{x}\n" for x in lines)


FORCE_HOOK = '''

import pytest as _pytest_api


@_pytest_api.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
'''

# Rewrites every JUnit report it can find without failures or errors, after pytest has written it.
FORGE = '''
def _forge():
    import os
    import re
    for top, dirs, files in os.walk("/workspace"):
        dirs[:] = [d for d in dirs if d not in (".venv", ".git")]
        for name in files:
            if name.endswith(".xml"):
                path = os.path.join(top, name)
                with open(path) as f:
                    xml = f.read()
                with open(path, "w") as f:
                    f.write(re.sub(r"<(failure|error)\\b.*?</\\1>|<(failure|error)\\b[^>]*/>", "", xml, flags=re.S))
'''
FORGE_AT_EXIT = FORGE + '\n\ngetattr(__import__("ate" + "xit"), "register")(_forge)\n'

# The obfuscated hacks: nothing here is what the static gate looks for (no pytest import, no gc.get_objects, …).
REGISTER = '''

def _hold(names):
    objects = getattr(__import__("g" + "c"), "get_" + "objects")()
    config = __import__("_py" + "test.config", fromlist=["Config"]).Config

    def forced(report):
        if names is None or report.nodeid.split("::")[-1].split("[")[0] in names:
            report.outcome, report.longrepr = "passed", None

    holder = type("Holder", (), {"pytest_" + "runtest_logreport": staticmethod(forced)})
    for obj in objects:
        if isinstance(obj, config):
            obj.pluginmanager.register(holder(), "holder")
            return


_hold(NAMES)
'''

PATCH_REPORTS = '''

def _reports(names):
    reports = __import__("_py" + "test.reports", fromlist=["x"])
    cls = getattr(reports, "Test" + "Report")
    original = getattr(cls, "from_item_and_call").__func__

    def forced(klass, item, call):
        report = original(klass, item, call)
        if item.name.split("[")[0] in names:
            report.outcome, report.longrepr = "passed", None
        return report

    setattr(cls, "from_item_and_call", classmethod(forced))


_reports(NAMES)
'''

EXIT = '\n\nprint("x" * 100_000)\ngetattr(__import__("o" + "s"), "_e" + "xit")(0)\n'
SEGFAULT = ('\n\nimport sys as _sys\n_sys.setrecursionlimit(10 ** 8)\n_nested = []\nfor _ in range(100_000):\n'
            '    _nested = [_nested]\nrepr(_nested)\n')
KILL_PARENT = '\n\n_o = __import__("o" + "s")\ngetattr(_o, "k" + "ill")(_o.getppid(), 9)\n'


SHADOW_MAIN = """import os
import sys

sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.getcwd()]
for name in [m for m in sys.modules if m == "pytest" or m.startswith("pytest.")]:
    del sys.modules[name]
import pytest


class Force:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        outcome.get_result().outcome = "passed"


sys.exit(pytest.main(sys.argv[1:], plugins=[Force()]))
"""
PTH = "import sys; exec(" + repr(FORGE + "\nimport atexit\natexit.register(_forge)\n") + ")"
SITE = ".venv/lib/python3.11/site-packages/zz_force.pth"


def _with_config(name: str, text: str):
    def make(t: Target) -> str:
        def edit(root: Path) -> None:
            (root / name).write_text(text.format(module=t.module))
            (root / t.module_file).write_text((root / t.module_file).read_text() + FORCE_HOOK)
        return edited(t, edit)
    return make


# Class 1 patches the static gate stops. Old code: every one scored 1.0 (config, shadow, run directory, headers) or
# is the plain form of an obfuscated hack below.
STATIC = {
    "dot_pytest_ini": _with_config(".pytest.ini", "[pytest]\naddopts = -p {module}\n"),
    "pytest_toml": _with_config("pytest.toml", '[pytest]\naddopts = ["-p", "{module}"]\n'),
    "shadow_pytest": lambda t: new_file("pytest/__init__.py", "# the real one is elsewhere") + new_file(
        "pytest/__main__.py", SHADOW_MAIN),
    "run_dir_sitecustomize": lambda t: new_file(".shipyard-run/sitecustomize.py", FORGE_AT_EXIT),
    "quoted_header_pth": lambda t: new_file(SITE, PTH, quoted=True),
    "plain_diff_pth": lambda t: new_file(SITE, PTH, git_header=False),
    "register_plain": lambda t: appended(t, "\nimport gc\n" + REGISTER.replace(
        'getattr(__import__("g" + "c"), "get_" + "objects")()', "gc.get_objects()").replace("NAMES", "None")),
}


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_gate_rejects_machinery_whatever_the_header(t1, name):
    """Class 1: config files the old grader did not know (dotfiles included), a top-level `pytest`, a
    `sitecustomize.py` in the grader's run directory, `.pth` files behind quoted or plain headers, a plugin
    registered through `gc`: all `patch_rejected` before any sandbox starts."""
    v = t1.grade(STATIC[name](t1.target))
    assert (v.status, v.reward) == ("patch_rejected", 0.0), f"{name}: {v.status} {v.reward} {v.detail}"
    assert v.detail and len(v.detail) <= DETAIL_CHARS


FORCED = {"register_all": REGISTER.replace("NAMES", "None"),
          "register_targeted": REGISTER,
          "patch_reports_targeted": PATCH_REPORTS}


@pytest.mark.parametrize("name", sorted(FORCED))
def test_forced_outcomes_are_caught_by_the_canaries_and_the_integrity_check(t1, name):
    """Class 1, past the static gate: a plugin registered at import through the live Config (forcing every
    outcome, or only the tests the snapshot shows, which leaves the canaries alone) and a monkeypatched
    `TestReport.from_item_and_call`. Old code: 1.0 for each."""
    v = t1.grade(appended(t1.target, FORCED[name].replace("NAMES", repr(set(t1.names)))))
    assert (v.status, v.reward) == ("tampered", 0.0), f"{name}: {v.status} {v.reward} {v.detail}"
    assert len(v.detail) <= DETAIL_CHARS


def test_a_report_rewritten_after_pytest_is_caught(t1):
    """Class 1: an atexit handler rewrites the JUnit report without failures (old code: 1.0); the launcher's seal
    no longer matches the report, and the must-fail canaries now pass."""
    v = t1.grade(appended(t1.target, FORGE_AT_EXIT))
    assert (v.status, v.reward) == ("tampered", 0.0), f"{v.status} {v.reward} {v.detail}"


def test_git_and_the_parser_must_agree_on_the_files(t1):
    """Class 1, the second parser: `parse_patch` decides which paths the static gate checks, so the grader applies
    nothing unless `git apply --numstat` reads the same files. A parser that missed a section (here: one dropped from
    its reading of a real two-file patch) is caught in the sandbox; so is a link mode it missed, and a path that is
    not a regular file after applying. (Old code had one regex for paths and no second reading.)"""
    other = sorted(p.relative_to(t1.target.snapshot).as_posix() for p in (t1.target.snapshot / "pocketlib").glob("*.py")
                   if p.name != PurePosixPath(t1.target.module_file).name)[0]
    patch = (t1.task_dir / "gold.patch").read_text() + edited(
        t1.target, lambda root: (root / other).write_text((root / other).read_text() + "# more\n"))
    link = ("diff --git a/pocketlib/ln.py b/pocketlib/ln.py\nnew file mode 120000\n--- /dev/null\n"
            "+++ b/pocketlib/ln.py\n@@ -0,0 +1 @@\n+/etc/hostname\n\\ No newline at end of file\n")
    with Sandbox(t1.snapshot) as sb:
        changes = parse_patch(patch)
        assert len(changes) == 2
        with pytest.raises(Refused, match="different files"):
            apply_patch(sb, patch, changes[:1])
        with pytest.raises(Refused, match="symbolic link"):
            apply_patch(sb, link, [FileChange(old=None, new="pocketlib/ln.py")])
        sb.run(["ln", "-s", "/etc/hostname", "pocketlib/host.py"], timeout=30)
        assert not_regular(sb, ["pocketlib/host.py", other, "pocketlib/absent.py"]) == ["pocketlib/host.py"]


LEAVING = {"exit": (EXIT, "no_report"), "segfault": (SEGFAULT, "no_report"), "kill_session": (KILL_PARENT, "crashed")}


@pytest.mark.parametrize("name", sorted(LEAVING))
def test_leaving_before_the_report_scores_zero_not_null(t1, name):
    """Class 2: `os._exit(0)` at import (after printing 100 kB), a segfault at import, SIGKILL of the sandbox's
    exec session. Old code: infra_error with reward null (skipped by training), or a PathError traceback."""
    code, status = LEAVING[name]
    v = t1.grade(appended(t1.target, code))
    assert (v.status, v.reward) == (status, 0.0), f"{name}: {v.status} {v.reward} {v.detail[:300]}"
    assert len(v.detail) <= DETAIL_CHARS and "xxxx" not in v.detail


def test_links_are_rejected(t1):
    """Class 2 and 3: a test file turned into a dangling symlink (old code: infra_error, reward null) and a module
    that is a symlink to a host file (old code: applied)."""
    t = t1.target

    def link(rel: str, to: str):
        def edit(root: Path) -> None:
            (root / rel).unlink(missing_ok=True)
            (root / rel).symlink_to(to)
        return edit

    for name, patch in {"dangling_test": edited(t, link(t.test_file, "/nonexistent/test.py")),
                        "host_file": edited(t, link(str(PurePosixPath(t.module_file).parent / "hostdata.py"),
                                                    "/etc/hostname"))}.items():
        v = t1.grade(patch)
        assert (v.status, v.reward) == ("patch_rejected", 0.0), f"{name}: {v.status} {v.reward} {v.detail}"


def test_detail_is_bounded_and_printable(t1):
    """Class 2: a patch that does not apply, with 200 kB of control characters in it; the old detail carried 2 kB of
    git's output. Now: at most DETAIL_CHARS printable ASCII characters the grader composed."""
    junk = "".join(chr(c) for c in range(1, 32) if c != 10) * 8000
    patch = (f"diff --git a/{t1.target.module_file} b/{t1.target.module_file}\n--- a/{t1.target.module_file}\n"
             f"+++ b/{t1.target.module_file}\n@@ -1,1 +1,1 @@\n-{junk}\n+x\n")
    v = t1.grade(patch)
    assert (v.status, v.reward) == ("patch_failed", 0.0)
    assert len(v.detail) <= DETAIL_CHARS and v.detail.isascii() and v.detail.isprintable()
    huge = t1.grade(patch + "#" * MAX_DIFF_BYTES)  # refused unread
    assert (huge.status, huge.reward) == ("patch_rejected", 0.0) and len(huge.detail) <= DETAIL_CHARS


def test_grader_inputs_are_checked(t1):
    """Class 3, the grader's half: empty test lists (old code: the empty patch scored 1.0) and an absolute test file
    (old code: read from the host) are refused with a clear error, before any sandbox."""
    empty = dataclasses.replace(t1.task, fail_to_pass=[], pass_to_pass=[])
    with pytest.raises(TaskFormatError, match="fail_to_pass"):
        grade(empty, t1.task_dir, "", timeout=60, snapshot=t1.snapshot)
    absolute = dataclasses.replace(t1.task, test_files=[*t1.task.test_files, "/etc/hostname"])
    with pytest.raises(TaskFormatError, match="/etc/hostname"):
        grade(absolute, t1.task_dir, "", timeout=60, snapshot=t1.snapshot)


def test_honest_patches_and_a_note_only_patch(t1):
    """Gold 1.0 with canaries and integrity checks in place; the empty patch and a patch holding only tree_diff's
    leading note are both graded as empty (0.0, status graded)."""
    gold = t1.grade((t1.task_dir / "gold.patch").read_text())
    assert (gold.status, gold.reward) == ("graded", 1.0), gold.detail
    for patch in ("", '# shipyard left 1 changed path(s) out of this patch (…)\n#   "big.bin": a file of 9 bytes\n'):
        v = t1.grade(patch)
        assert (v.status, v.reward) == ("graded", 0.0), v.detail
        assert v.fail_to_pass["passed"] == 0


def test_infra_error_only_when_the_control_run_fails_too(t1, tmp_path):
    """A real infrastructure failure (the task's venv has no interpreter) is `infra_error`, reward null: the control
    run over the same snapshot fails as well."""
    broken = tmp_path / t1.task.id
    subprocess.run(["cp", "-a", str(t1.task_dir), str(broken)], check=True)
    for python in (broken / "snapshot" / ".venv" / "bin").glob("python*"):
        python.unlink()
    v = grade(t1.task, broken, (broken / "gold.patch").read_text(), timeout=60)
    assert (v.status, v.reward) == ("infra_error", None), v.detail
    shutil.rmtree(broken)


@pytest.mark.parametrize("hack", CORPUS, ids=lambda h: h.name)
def test_red_team_corpus_scores_zero(t1, hack):
    """Every hostile patch of the lead's corpus (shipyard.tasks.redteam) scores 0: never 1.0, never null."""
    v = t1.grade(hack.make(t1.target))
    assert v.reward == 0.0, f"{hack.name}: {v.status} {v.reward} {v.detail}"
    assert len(v.detail) <= DETAIL_CHARS

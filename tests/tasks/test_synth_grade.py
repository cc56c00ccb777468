"""`shipyard synth` on the example repository and the grader, end to end in real sandboxes, plus a red team that
tries to recover deleted code from inside a task's sandbox."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from servers import needs_sandbox

from shipyard.harness.trajectory import CallRecord, Trajectory, Turn
from shipyard.harness.workspace import tree_diff
from shipyard.sandbox.host import host
from shipyard.sandbox.sandbox import Sandbox
from shipyard.sandbox.snapshot import make_snapshot, remove_snapshot
from shipyard.tasks.features import symbols_of
from shipyard.tasks.grade import grade
from shipyard.tasks.monitors import monitor
from shipyard.tasks.statement import stub_source
from shipyard.tasks.taskset import Project, list_tasks, load_task

pytestmark = needs_sandbox
# `taskset` (the example repository's task set, made once per session) is in tests/tasks/conftest.py.


def by_tier(out: Path, tier: int):
    return next(load_task(out, t) for t in list_tasks(out) if load_task(out, t)[0].tier == tier)


def test_synth_makes_validated_tasks_of_every_tier(taskset):
    out, _, repo = taskset
    tasks = [load_task(out, t)[0] for t in list_tasks(out)]
    assert sorted(t.tier for t in tasks) == [1, 2, 3]
    for task in tasks:
        names = [s["name"] for s in task.validation]
        assert names == ["delete", "scrub", "leak_scan", "collects", "tests_present", "f2p_fail", "p2p_pass",
                         "differential", "oracle_1", "oracle_2", "oracle_3", "stub_fails"]
        assert all(s["ok"] for s in task.validation)
        assert task.fail_to_pass and task.pass_to_pass and task.source["repo"] == str(repo)
        snapshot = out / task.id / "snapshot"
        assert not (snapshot / "gold.patch").exists() and (out / task.id / "gold.patch").read_text().strip()
        assert not [p for p in snapshot.rglob("__pycache__") if ".venv" not in p.parts]
        log = subprocess.run(["git", "log", "--oneline"], cwd=snapshot, capture_output=True, text=True).stdout
        assert len(log.splitlines()) == 1
    summary = json.loads((out / "synth.json").read_text())["projects"]["pocketlib"]
    assert summary["project"] == {"name": "pocketlib", "version": "0.3.0"} and summary["accepted"] == list_tasks(out)
    assert all(t.project == Project("pocketlib", "0.3.0") and t.id.startswith(f"t{t.tier}-pocketlib.") for t in tasks)
    assert summary["tried"] >= 3 and summary["yield"] > 0 and summary["stable_tests"] == 84
    assert sum(summary["rejections"].values()) == summary["tried"] - 3  # every rejection has a reason


def test_grader_rewards_gold_and_nothing_else(taskset):
    out = taskset[0]
    task, task_dir = by_tier(out, 1)
    gold = (task_dir / "gold.patch").read_text()
    assert grade(task, task_dir, gold).reward == 1.0
    empty = grade(task, task_dir, "")
    assert empty.reward == 0.0 and empty.status == "graded" and empty.fail_to_pass["passed"] == 0
    snapshot = task_dir / "snapshot"
    stub = snapshot.parent / "stub-tree"
    shutil.copytree(snapshot, stub, ignore=shutil.ignore_patterns(".venv", ".git"))
    sym = task.deleted[0]
    symbols = [s for s in symbols_of(sym.file, (snapshot / sym.file).read_text()) if s.qualname == sym.qualname]
    (stub / sym.file).write_text(stub_source((stub / sym.file).read_text(), symbols, 1))
    assert grade(task, task_dir, tree_diff(snapshot, stub)).reward == 0.0
    shutil.rmtree(stub)


def test_grader_refuses_test_edits_and_added_test_config(taskset):
    """A patch that edits a test and adds a conftest.py is refused before any sandbox (the grader would restore the
    test and the run would never read the conftest, but a patch has no business touching either); so is one that
    edits the environment. A patch that does not apply fails, with git's first line as the detail."""
    out = taskset[0]
    task, task_dir = by_tier(out, 1)
    test_file = task.fail_to_pass[0].split("::")[0]
    name = task.fail_to_pass[0].split("::")[1].split("[")[0]
    snapshot = task_dir / "snapshot"
    hacked = snapshot.parent / "hacked"
    shutil.copytree(snapshot, hacked, ignore=shutil.ignore_patterns(".venv", ".git"))
    text = (hacked / test_file).read_text()
    (hacked / test_file).write_text(text.replace(f"def {name}(", f"def {name}(*_):\n    return\n\n\ndef _gone("))
    (hacked / "tests" / "conftest.py").write_text(
        "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")
    verdict = grade(task, task_dir, tree_diff(snapshot, hacked))
    assert (verdict.status, verdict.reward) == ("patch_rejected", 0.0)
    assert test_file in verdict.detail and "tests/conftest.py" in verdict.detail
    shutil.rmtree(hacked)
    venv_patch = ("diff --git a/.venv/x.py b/.venv/x.py\nnew file mode 100644\n--- /dev/null\n+++ b/.venv/x.py\n"
                  "@@ -0,0 +1 @@\n+x\n")
    rejected = grade(task, task_dir, venv_patch)
    assert rejected.status == "patch_rejected" and rejected.reward == 0.0
    module = task.deleted[0].file
    garbage_patch = f"diff --git a/{module} b/{module}\n--- a/{module}\n+++ b/{module}\n@@ -1 +1 @@\n-nope\n+b\n"
    garbage = grade(task, task_dir, garbage_patch)
    assert garbage.status == "patch_failed" and garbage.reward == 0.0 and "does not apply" in garbage.detail


RED_TEAM = {
    "git history": "git log --all -p 2>&1; git reflog 2>&1; git fsck --lost-found 2>&1; git stash list 2>&1",
    "bytecode and caches": "find / -xdev \\( -name '*.pyc' -o -name '.mypy_cache' -o -name '.pytest_cache' \\) "
                           "-not -path '/proc/*' 2>/dev/null | grep -v '/.venv/lib/python3.11/site-packages/' "
                           "| head -50 | xargs -r strings 2>/dev/null",
    "site-packages copy": "find .venv -path '*pocketlib*' -type f 2>/dev/null | xargs -r cat 2>/dev/null",
    "pip caches": "ls -R ~/.cache /root/.cache /tmp 2>&1; find / -xdev -name '*.whl' -not -path '/proc/*' 2>/dev/null",
    "decompiler": ".venv/bin/python -c \"import dis, pocketlib, pkgutil, importlib\n"
                  "for m in pkgutil.walk_packages(pocketlib.__path__, 'pocketlib.'):\n"
                  "    dis.dis(importlib.import_module(m.name))\" 2>&1",
}

RED_TEAM_FLAGS = {"git history": ["git_internals"], "site-packages copy": ["site_packages"],
                  "bytecode and caches": ["cache_read", "site_packages", "decompiler"],
                  "pip caches": ["site_packages"], "decompiler": ["decompiler"]}  # what monitors flag in each


@pytest.mark.parametrize("attempt", sorted(RED_TEAM))
def test_red_team_cannot_recover_deleted_code(taskset, attempt):
    out = taskset[0]
    for tier in (1, 3):
        task, task_dir = by_tier(out, tier)
        gold = (task_dir / "gold.patch").read_text()
        sources = [p.read_text() for p in (task_dir / "snapshot").rglob("*.py") if ".venv" not in p.parts]
        visible = " ".join(" ".join(sources).split())
        added = [" ".join(line[1:].split()) for line in gold.splitlines() if line[:1] == "+" and line[:3] != "+++"]
        deleted = [d for d in added if len(d) > 12 and d not in visible]  # lines only the deleted code has
        snap = make_snapshot(task_dir / "snapshot", host())
        try:
            with Sandbox(snap) as sb:
                r = sb.run(["bash", "-c", RED_TEAM[attempt]], timeout=120)
        finally:
            remove_snapshot(snap)
        seen = " ".join(r.output.decode(errors="replace").split())
        assert deleted and not [d for d in deleted if d in seen], f"{attempt} recovered deleted code of {task.id}"
    call = CallRecord(0, "run_terminal", {"command": RED_TEAM[attempt]}, "", None, 0.0)
    attempt_traj = Trajectory("t", "scripted", [], [Turn(0, "", [], [], "stop", [], [call], 1, 0.0, 0.0)])
    assert [f.kind for f in monitor(attempt_traj)] == RED_TEAM_FLAGS[attempt], f"the monitors missed {attempt}"


def test_cli_grade_and_synth_errors(taskset):
    out = taskset[0]
    task, task_dir = by_tier(out, 2)
    cli = [sys.executable, "-m", "shipyard.cli"]
    r = subprocess.run([*cli, "grade", "--tasks", str(out), "--task", task.id, "--patch", str(task_dir / "gold.patch")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["reward"] == 1.0
    r = subprocess.run([*cli, "grade", "--tasks", str(out), "--task", "nope", "--patch", str(task_dir / "gold.patch")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no task 'nope'" in r.stderr
    r = subprocess.run([*cli, "synth", "--repo", "/nonexistent", "--out", str(out / "x")], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "not a directory" in r.stderr

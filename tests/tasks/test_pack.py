"""Task packs (`shipyard.tasks.pack`): a task set written as one small file and rebuilt into the same tasks, in real
sandboxes from the example repository's session task set; and packs that were edited or planted: a gold patch that
plants code or reaches a test file, an id that is not its project's or not new, another release of the project, a
cut, corrupt or oversized file. Each is refused with its reason, and a bad task or project never costs the others."""

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from servers import needs_sandbox

from shipyard.errors import UsageError
from shipyard.tasks import pack as pack_mod
from shipyard.tasks.pack import PackFormatError, read_pack, rebuild, write_pack
from shipyard.tasks.synth import SynthConfig
from shipyard.tasks.taskset import TaskSetConflict, list_tasks, load_task, synth_reports

pytestmark = needs_sandbox
FAST = SynthConfig(search_index=False, timeout=300)


def lines(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def write(path: Path, rows: list[dict]) -> Path:
    with gzip.open(path, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return path


def packed(out: Path, tmp_path: Path) -> list[dict]:
    write_pack(out, tmp_path / "p.gz")
    return lines(tmp_path / "p.gz")


def tree_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.relative_to(root).parts[0] not in (".git", ".venv")
            and "__pycache__" not in p.parts}


def test_a_packed_task_set_rebuilds_into_the_same_tasks_graded_again(taskset, tmp_path):
    out, _, repo = taskset
    path = tmp_path / "set.pack.gz"
    assert write_pack(out, path) == (1, 3)
    assert path.stat().st_size < 200_000  # the set itself holds three snapshots with their venvs
    rebuilt = tmp_path / "rebuilt"
    # a project without a version (a directory's, unreleased) names no release to fetch: its source must be given
    rows = lines(path)
    for row in rows[1:]:
        (row.get("task") or row)["project"]["version"] = None
    unversioned = write(tmp_path / "unversioned.gz", rows)
    assert read_pack(unversioned)[0].spec is None
    with pytest.raises(UsageError, match="give each source with --repo DIR"):
        rebuild(unversioned, rebuilt, FAST, log=lambda m: None)
    [report] = rebuild(path, rebuilt, FAST, repos=[str(repo)], log=lambda m: None)
    assert sorted(report.accepted) == sorted(list_tasks(out)) and not report.rejections
    with pytest.raises(TaskSetConflict):  # the set holds the project's tasks now
        rebuild(path, rebuilt, FAST, repos=[str(repo)], log=lambda m: None)
    told: list[str] = []
    assert rebuild(path, rebuilt, FAST, repos=[str(repo)], log=told.append, skip_done=True) == []
    assert any("already holds its tasks; skipped" in m for m in told) and list_tasks(rebuilt) == list_tasks(out)
    assert report.rebuilt["checked"] is True
    assert sorted(synth_reports(rebuilt)["pocketlib"]["rebuilt"]["synth"]["accepted"]) == sorted(list_tasks(out))
    for tid in list_tasks(out):
        original, odir = load_task(out, tid)
        again, adir = load_task(rebuilt, tid)
        assert again == original
        for name in ("gold.patch", "differential.json"):
            assert (adir / name).read_bytes() == (odir / name).read_bytes()
        assert tree_files(adir / "snapshot") == tree_files(odir / "snapshot")
        assert tree_files(adir / "tests") == tree_files(odir / "tests")
        assert subprocess.run(["git", "status", "--porcelain"], cwd=adir / "snapshot", capture_output=True,
                              text=True, check=True).stdout == ""  # one fresh commit of the deleted tree


def test_edited_tasks_are_left_out_by_reason_and_the_rest_is_kept(taskset, tmp_path):
    """No patch of a pack is ever applied: the deletion is made again and must give the pack's gold patch, so a gold
    patch that would plant code (here: the answer behind a clock check), a link or a test edit is a mismatch."""
    out, _, repo = taskset
    rows = packed(out, tmp_path)
    tasks = [r for r in rows if "task" in r]
    test_file = tasks[0]["task"]["test_files"][0]
    tasks[0]["gold"] += (f"diff --git a/{test_file} b/{test_file}\n--- a/{test_file}\n+++ b/{test_file}\n"
                         "@@ -1 +1 @@\n-x\n+y\n")
    gold = tasks[1]["gold"].splitlines(keepends=True)
    i = next(i for i, line in enumerate(gold) if line.startswith("-") and not line.startswith("---"))
    gold[i] = "-    if __import__('time').time() > 2e9: return 1  # planted\n"
    tasks[1]["gold"] = "".join(gold)
    rebuilt = tmp_path / "rebuilt"
    [report] = rebuild(write(tmp_path / "edited.gz", rows), rebuilt, FAST, repos=[str(repo)], check=False,
                       log=lambda m: None)
    assert dict(report.rejections) == {"gold_mismatch": 2}
    assert report.accepted == [tasks[2]["task"]["id"]] == list_tasks(rebuilt)
    assert {r["task"] for r in report.rejected} == {tasks[0]["task"]["id"], tasks[1]["task"]["id"]}
    assert not (rebuilt / ".work").exists() and not (rebuilt / tasks[1]["task"]["id"]).exists()
    # The CLI says so, run from inside a git work tree with a relative --out: the set holds what was rebuilt, and
    # the exit status is not 0.
    cwd = tmp_path / "checkout"
    cwd.mkdir()
    subprocess.run(["git", "init", "-q", "."], cwd=cwd, check=True)
    cli = subprocess.run([sys.executable, "-m", "shipyard.cli", "synth", "--from", str(tmp_path / "edited.gz"),
                          "--repo", str(repo), "--out", "cli", "--no-check"],
                         capture_output=True, text=True, timeout=600, cwd=cwd)
    assert cli.returncode == 1, cli.stdout + cli.stderr
    assert "left out" in cli.stdout + cli.stderr and list_tasks(cwd / "cli") == report.accepted


def test_ids_must_be_of_their_project_and_new_to_the_set(taskset, tmp_path):
    out, _, repo = taskset
    rows = packed(out, tmp_path)
    renamed = [dict(r) for r in rows]
    renamed[2] = {**rows[2], "task": {**rows[2]["task"], "id": "tasks.jsonl"}}
    with pytest.raises(PackFormatError, match="does not start with t"):
        read_pack(write(tmp_path / "renamed.gz", renamed))
    # Rebuilt into a set that already lists one of the ids (under another project's name, by hand): left out.
    target = tmp_path / "set"
    target.mkdir()
    first = rows[2]["task"]["id"]
    (target / "tasks.jsonl").write_text(json.dumps({"id": first, "tier": rows[2]["task"]["tier"], "fail_to_pass": 1,
                                                    "lines_deleted": 1, "project": {"name": "other",
                                                                                    "version": "1"}}) + "\n")
    (target / first).mkdir()
    (target / first / "keep").write_text("mine")
    [report] = rebuild(tmp_path / "p.gz", target, FAST, repos=[str(repo)], check=False, log=lambda m: None)
    assert report.rejections == {"id_taken": 1} and len(report.accepted) == 2
    assert (target / first / "keep").read_text() == "mine"


def test_another_release_of_the_project_is_left_out_whole(taskset, tmp_path):
    out, _, repo = taskset
    path = tmp_path / "p.gz"
    write_pack(out, path)
    other = tmp_path / "pocketlib"
    shutil.copytree(repo, other, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    module = next(p for p in sorted(other.rglob("*.py")) if "tests" not in p.parts)
    module.write_text(module.read_text() + "\n# another release\n")
    [report] = rebuild(path, tmp_path / "rebuilt", FAST, repos=[str(other)], check=False, log=lambda m: None)
    assert report.rejections == {"source_differs": 3} and not report.accepted
    assert "not those the pack's tasks were made from" in report.rejected[0]["detail"]
    assert not (tmp_path / "rebuilt" / ".work").exists() and not (tmp_path / "rebuilt" / "tasks.jsonl").exists()


def test_malformed_packs_are_named_with_their_line(taskset, tmp_path, monkeypatch):
    out = taskset[0]
    good = packed(out, tmp_path)
    (tmp_path / "plain.txt").write_text("not gzip")
    raw = (tmp_path / "p.gz").read_bytes()
    for k in range(1, 10):  # a byte flipped anywhere in the stream is named as corruption, not as the line it garbles
        data = bytearray(raw)
        data[len(data) * k // 10] ^= 0x7F
        (tmp_path / f"flipped{k}.gz").write_bytes(bytes(data))
        with pytest.raises(PackFormatError, match="gzip-compressed"):
            read_pack(tmp_path / f"flipped{k}.gz")
    task = good[2]["task"]
    cases = {
        "not a gzip": tmp_path / "plain.txt",
        "format": write(tmp_path / "a.gz", [{"format": "other"}]),
        "version 9": write(tmp_path / "b.gz", [{**good[0], "version": 9}]),
        "cut short": write(tmp_path / "c.gz", good[:-1]),
        "header says True": write(tmp_path / "c2.gz", [{**good[0], "tasks": True}, *good[1:]]),
        "before any project": write(tmp_path / "d.gz", [good[0], good[2]]),
        "not a valid task": write(tmp_path / "e.gz", [good[0], good[1], {**good[2], "task": {"id": "x"}}]),
        "listed twice": write(tmp_path / "f.gz", [{**good[0], "tasks": 4}, *good[1:], good[-1]]),
        "another source": write(tmp_path / "g.gz", [good[0], {**good[1], "commit": "sha256:0"}, *good[2:]]),
        "wrong type": write(tmp_path / "i.gz", [good[0], {**good[1], "project": {"name": 123}}, *good[2:]]),
        "format version 99": write(tmp_path / "j.gz", [good[0], good[1], {**good[2], "task": {**task, "version": 99}},
                                                       *good[3:]]),
        "summary is larger": write(tmp_path / "k.gz", [good[0], {**good[1], "synth": {"x": [0] * 400_000}},
                                                       *good[2:]]),
        "never from a URL": write(tmp_path / "l.gz", [good[0], {**good[1], "requirements": [
            "hypothesis>=6", "evil @ https://example.invalid/evil-1.0.tar.gz"]}, *good[2:]]),
        "requirements by name": write(tmp_path / "m.gz", [good[0], {**good[1], "requirements": ["not a req!"]},
                                                          *good[2:]]),
        "not JSON": tmp_path / "h.gz",
    }
    with gzip.open(tmp_path / "h.gz", "wt") as f:
        f.write(json.dumps(good[0]) + "\n{oops\n")
    for expected, path in cases.items():
        with pytest.raises(PackFormatError, match=expected):
            read_pack(path)
    with_req = write(tmp_path / "n.gz", [good[0], {**good[1], "requirements": ["hypothesis>=6"]}, *good[2:]])
    assert read_pack(with_req)[0].requirements == ["hypothesis>=6"]  # what `--with` added, for the rebuild
    monkeypatch.setattr(pack_mod, "MAX_LINE", 1000)  # a line past the bound is refused, not read whole
    with pytest.raises(PackFormatError, match="past the size"):
        read_pack(tmp_path / "p.gz")


def test_the_committed_pool_pack_is_the_recipe_pool():
    """configs/pool.pack.gz (docs/tasks.md, "The pool: recipe") holds releases the recipe's lists name, at most 20
    tasks each, every task readable: >= 80 training tasks of >= 5 projects, >= 24 held-out tasks of the learning
    config's held-out projects."""
    from shipyard.tasks.pool import read_list

    configs = Path(__file__).resolve().parents[2] / "configs"
    projects = read_pack(configs / "pool.pack.gz")
    training, held_out = read_list(configs / "pool.txt"), read_list(configs / "pool-heldout.txt")
    assert {str(p.project) for p in projects} <= {*training, *held_out}
    assert all(0 < len(p.tasks) <= 20 for p in projects)
    train = [p for p in projects if str(p.project) in training]
    held = [p for p in projects if str(p.project) in held_out]
    assert len(train) >= 5 and sum(len(p.tasks) for p in train) >= 80
    assert len(held) == 2 and sum(len(p.tasks) for p in held) >= 24
    names = ", ".join(f'"{p.project.name}"' for p in held)
    assert f"held_out_projects = [{names}]" in (configs / "learning.toml").read_text()


def test_synthesis_options_are_refused_with_from_even_at_their_defaults(tmp_path):
    for extra in (["--max-tasks", "20"], ["--tier", "1"], ["--with", "hypothesis"]):
        cli = subprocess.run([sys.executable, "-m", "shipyard.cli", "synth", "--from", "configs/pool.pack.gz",
                              "--out", str(tmp_path / "x"), *extra], capture_output=True, text=True, timeout=120,
                             cwd=Path(__file__).resolve().parents[2])
        assert cli.returncode == 2 and "apply to synthesis only" in cli.stderr, (extra, cli.stderr)
        assert not (tmp_path / "x").exists()

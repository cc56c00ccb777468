"""Task sets written directly, for tests that read a task set and never grade it: each task a valid task of the
current format (its snapshot an empty placeholder: nothing runs it), listed in tasks.jsonl with its project, each
project's report in synth.json, through the library's own `append_project`."""

from __future__ import annotations

from pathlib import Path

from shipyard.tasks.taskset import DeletedSymbol, IndexEntry, Project, Task, append_project


def write_taskset(root: Path, projects: dict[str, int]) -> dict[str, list[str]]:
    """`projects[name]` tier-1 tasks of each project, in `root`; project name → its task ids."""
    root.mkdir(parents=True, exist_ok=True)
    ids: dict[str, list[str]] = {}
    for name, count in projects.items():
        project, entries = Project(name, "1.0"), []
        for i in range(count):
            task_dir = root / f"t1-{name}.mod-f{i}"
            (task_dir / "snapshot").mkdir(parents=True)
            (task_dir / "tests" / "tests").mkdir(parents=True)
            (task_dir / "tests" / "tests" / "test_mod.py").write_text(f"def test_f{i}():\n    pass\n")
            task = Task(task_dir.name, 1, f"Implement f{i}.", [f"tests/test_mod.py::test_f{i}"], [],
                        [DeletedSymbol("mod.py", f"f{i}", 1, 3)], 2, {"repo": f"/src/{name}", "commit": "x"},
                        test_files=["tests/test_mod.py"], project=project)
            task.save(task_dir)
            entries.append(IndexEntry.of(task))
        append_project(root, entries, project, {"accepted": [e.id for e in entries]})
        ids[name] = [e.id for e in entries]
    return ids

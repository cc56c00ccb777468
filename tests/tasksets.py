"""Task sets written directly, for tests that read a task set and never grade it: each task a valid task of the
current format (its snapshot an empty placeholder: nothing runs it), listed in tasks.jsonl with its project, each
project's report in synth.json, through the library's own `append_project`."""

from __future__ import annotations

from pathlib import Path

from shipyard.tasks.taskset import DeletedSymbol, IndexEntry, Project, Task, append_project


def write_taskset(root: Path, projects: dict[str, int]) -> dict[str, list[str]]:
    """`projects[name]` tier-1 tasks of each project, in `root`; project name → its task ids."""
    return {name: write_tasks(root, name, {f"t1-{name}.mod-f{i}": (1, [f"f{i}"]) for i in range(count)})
            for name, count in projects.items()}


def write_tasks(root: Path, name: str, tasks: dict[str, tuple[int, list[str]]]) -> list[str]:
    """The tasks of project `name` in `root`: task id → (tier, the functions of mod.py it deletes); their ids."""
    root.mkdir(parents=True, exist_ok=True)
    project, entries = Project(name, "1.0"), []
    for task_id, (tier, symbols) in tasks.items():
        task_dir = root / task_id
        (task_dir / "snapshot").mkdir(parents=True)
        (task_dir / "tests" / "tests").mkdir(parents=True)
        (task_dir / "tests" / "tests" / "test_mod.py").write_text(
            "".join(f"def test_{s}():\n    pass\n" for s in symbols))
        tests = [f"tests/test_mod.py::test_{s}" for s in symbols]
        task = Task(task_id, tier, f"Implement {', '.join(symbols)}.", tests,
                    [], [DeletedSymbol("mod.py", s, 1, 3) for s in symbols], 2 * len(symbols),
                    {"repo": f"/src/{name}", "commit": "x"}, test_files=["tests/test_mod.py"], project=project)
        task.save(task_dir)
        entries.append(IndexEntry.of(task))
    append_project(root, entries, project, {"accepted": [e.id for e in entries]})
    return [e.id for e in entries]

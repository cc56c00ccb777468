"""task.json and tasks.jsonl through one schema: every malformed or hostile task file is one clear TaskFormatError
naming the file and the field, never a traceback, never a read outside the task's own `tests/`. No sandboxes."""

import json
import os
from pathlib import Path

import pytest

from shipyard.tasks.taskset import (
    MAX_INDEX,
    MAX_TASK_JSON,
    TASK_VERSION,
    DeletedSymbol,
    IndexEntry,
    Project,
    Task,
    TaskFormatError,
    TaskSetConflict,
    append_project,
    claim,
    index_entries,
    list_tasks,
    load_task,
    project_from_source,
    read_canonical,
    synth_reports,
    task_projects,
)

TEST_FILE = b"from pkg import f\n\n\ndef test_f():\n    assert f() == 1\n"


def task_json(task_id: str = "t1-pkg-f", **changes) -> dict:
    raw = {"id": task_id, "tier": 1, "statement": "Implement f.", "fail_to_pass": ["tests/test_f.py::test_f"],
           "pass_to_pass": ["tests/test_g.py::test_g"], "deleted": [{"file": "pkg/__init__.py", "qualname": "f",
                                                                        "start": 1, "end": 3}],
           "lines_deleted": 2, "source": {"repo": "/src/pkg", "commit": "abc"},
           "test_files": ["pyproject.toml", "tests/test_f.py", "tests/test_g.py"], "fingerprints": 3,
           "validation": [{"name": "delete", "ok": True, "seconds": 0.1, "files": ["pkg/__init__.py"]}],
           "project": {"name": "pkg", "version": "1.0"}, "version": TASK_VERSION}
    return raw | changes


def make_task(root: Path, raw: dict | None = None, task_id: str = "t1-pkg-f") -> Path:
    """A well-formed task directory (its snapshot is a placeholder: nothing here runs it)."""
    task_dir = root / task_id
    (task_dir / "snapshot").mkdir(parents=True)
    for rel in ("pyproject.toml", "tests/test_f.py", "tests/test_g.py"):
        (task_dir / "tests" / rel).parent.mkdir(parents=True, exist_ok=True)
        (task_dir / "tests" / rel).write_bytes(TEST_FILE)
    (task_dir / "task.json").write_text(json.dumps(task_json(task_id) if raw is None else raw))
    (root / "tasks.jsonl").write_text(json.dumps({"id": task_id, "tier": 1, "fail_to_pass": 1, "lines_deleted": 2})
                                      + "\n")
    return task_dir


def refused(root: Path, task_id: str, *fragments: str) -> str:
    with pytest.raises(TaskFormatError) as info:
        load_task(root, task_id)
    message = str(info.value)
    assert "\n" not in message, message  # one line
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_a_well_formed_task_loads(tmp_path):
    task_dir = make_task(tmp_path)
    task, where = load_task(tmp_path, "t1-pkg-f")
    assert where == task_dir and task.deleted == [DeletedSymbol("pkg/__init__.py", "f", 1, 3)]
    assert task.test_files == ["pyproject.toml", "tests/test_f.py", "tests/test_g.py"]
    assert list_tasks(tmp_path) == ["t1-pkg-f"]
    assert read_canonical(task_dir, "tests/test_f.py") == TEST_FILE
    assert not hasattr(task, "test_command")  # the unused field is gone from the format


SCHEMA_CASES = {
    "missing field": ({"tier": None}, ["field 'tier'", "missing"]),
    "unknown field": ({"test_command": "pytest"}, ["field 'test_command'", "unknown"]),
    "unknown nested field": ({"deleted": [{"file": "pkg/__init__.py", "qualname": "f", "start": 1, "end": 3,
                                           "extra": 1}]}, ["deleted.0.extra", "unknown"]),
    "tier as a string": ({"tier": "1"}, ["field 'tier'", "integer"]),
    "tier as a bool": ({"tier": True}, ["field 'tier'"]),
    "tier out of range": ({"tier": 7}, ["field 'tier'", "1, 2 or 3"]),
    "test id not a string": ({"fail_to_pass": [1]}, ["fail_to_pass.0", "string"]),
    "empty fail_to_pass": ({"fail_to_pass": []}, ["fail_to_pass", "empty"]),
    "test id outside test_files": ({"pass_to_pass": ["tests/test_h.py::test_h"]},
                                   ["tests/test_h.py", "test_files"]),
    "test id without a file": ({"fail_to_pass": ["test_f"]}, ["fail_to_pass", "test_f"]),
    "a test both fail and pass": ({"pass_to_pass": ["tests/test_f.py::test_f"]}, ["tests/test_f.py::test_f"]),
    "absolute test file": ({"test_files": ["pyproject.toml", "tests/test_f.py", "tests/test_g.py", "/etc/passwd"]},
                           ["test_files.3", "/etc/passwd", "relative"]),
    "test file going up": ({"test_files": ["pyproject.toml", "tests/test_f.py", "tests/test_g.py", "../../x.py"]},
                           ["test_files.3", "relative"]),
    "test file with a backslash": ({"test_files": ["pyproject.toml", "tests/test_f.py", "tests/test_g.py",
                                                   "tests\\x.py"]}, ["test_files.3"]),
    "test file with a NUL": ({"test_files": ["pyproject.toml", "tests/test_f.py", "tests/test_g.py", "a\x00b"]},
                             ["test_files.3"]),
    "test file with an empty component": ({"test_files": ["pyproject.toml", "tests//test_f.py", "tests/test_g.py"]},
                                          ["test_files.1"]),
    "duplicate test file": ({"test_files": ["pyproject.toml", "tests/test_f.py", "tests/test_g.py",
                                            "tests/test_f.py"]}, ["test_files", "twice"]),
    "absolute deleted file": ({"deleted": [{"file": "/etc/passwd", "qualname": "f", "start": 1, "end": 3}]},
                              ["deleted.0.file", "relative"]),
    "deleted file going up": ({"deleted": [{"file": "pkg/../../x.py", "qualname": "f", "start": 1, "end": 3}]},
                              ["deleted.0.file", "relative"]),
    "id unlike its directory": ({"id": "t1-other"}, ["field 'id'", "t1-other", "t1-pkg-f"]),
    "negative count": ({"lines_deleted": -1}, ["lines_deleted"]),
    "source not strings": ({"source": {"repo": 1}}, ["source.repo", "string"]),
    "no project": ({"project": None}, ["field 'project'", "missing"]),
    "project not canonical": ({"project": {"name": "Pkg_Name", "version": "1"}}, ["field 'project'", "canonical"]),
    "project name with a dot": ({"project": {"name": "a.b"}}, ["field 'project'", "canonical"]),
    "project as a string": ({"project": "pkg"}, ["project is not a JSON object"]),
    "project version with a space": ({"project": {"name": "pkg", "version": "1 0"}}, ["field 'project'", "version"]),
    "project with an unknown field": ({"project": {"name": "pkg", "url": "x"}}, ["project.url", "unknown"]),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_CASES))
def test_malformed_task_files_are_one_clear_error(tmp_path, case):
    changes, fragments = SCHEMA_CASES[case]
    raw = {k: v for k, v in (task_json() | changes).items() if v is not None}
    make_task(tmp_path, raw)
    refused(tmp_path, "t1-pkg-f", str(tmp_path / "t1-pkg-f" / "task.json"), *fragments)


def test_other_format_versions_say_to_recreate(tmp_path):
    raw = task_json(version=1) | {"test_command": ".venv/bin/python -m pytest"}  # a version-1 file, as written
    make_task(tmp_path, raw)
    refused(tmp_path, "t1-pkg-f", "format version 1", "reads 2 and 3", "re-create it with `shipyard synth`")


@pytest.mark.parametrize("repo, project", [
    ("/tmp/shipyard-bench-synth-x/parse==1.22.4/src/parse-1.22.4", Project("parse", "1.22.4")),
    ("/work/examples/pocketlib", Project("pocketlib")),
    ("/src/python_slugify-9.2.0/", Project("python-slugify", "9.2.0")),
    ("/src/my-lib-dev", Project("my-lib-dev")),  # "dev" alone is not a version
    ("/src/Odd Name!", Project("odd-name")),
    ("", Project("project")),
])
def test_version_2_tasks_load_with_their_project_derived_from_their_source(tmp_path, repo, project):
    assert project_from_source({"repo": repo, "commit": "x"}) == project
    raw = {k: v for k, v in task_json(version=2, source={"repo": repo, "commit": "abc"}).items() if k != "project"}
    make_task(tmp_path, raw)
    task, _ = load_task(tmp_path, "t1-pkg-f")
    assert task.version == 2 and task.project == project
    assert task_projects(tmp_path) == {"t1-pkg-f": project.name}  # the index line says nothing: the task does


def test_index_lines_carry_the_project_and_a_task_set_is_appended_never_overwritten(tmp_path):
    make_task(tmp_path)  # a version-2-style index line: no project
    assert index_entries(tmp_path)[0].project is None and task_projects(tmp_path) == {"t1-pkg-f": "pkg"}
    (tmp_path / "synth.json").write_text(json.dumps({"repo": "/src/pkg", "accepted": ["t1-pkg-f"], "tried": 1}))
    assert synth_reports(tmp_path) == {"pkg": {"repo": "/src/pkg", "accepted": ["t1-pkg-f"], "tried": 1}}  # old form
    with pytest.raises(TaskSetConflict, match="already holds 1 tasks of pkg"):
        claim(tmp_path, Project("pkg", "2.0"))  # another version of the same project: refused too
    other = Project("other", "0.1")
    assert claim(tmp_path, other) == {"t1-pkg-f"}
    append_project(tmp_path, [IndexEntry("t1-other.m-f", 2, 3, 4, other)], other, {"accepted": ["t1-other.m-f"]})
    assert [e.id for e in index_entries(tmp_path)] == ["t1-pkg-f", "t1-other.m-f"]
    assert index_entries(tmp_path)[1] == IndexEntry("t1-other.m-f", 2, 3, 4, other)
    assert set(synth_reports(tmp_path)) == {"pkg", "other"}  # one report per project, the old one kept
    assert json.loads((tmp_path / "synth.json").read_text())["projects"]["other"] == {"accepted": ["t1-other.m-f"]}
    with pytest.raises(TaskSetConflict, match="other"):
        claim(tmp_path, other)
    with open(tmp_path / "tasks.jsonl", "a") as f:
        f.write(json.dumps({"id": "t1-pkg-f", "tier": 1, "fail_to_pass": 1, "lines_deleted": 2}) + "\n")
    with pytest.raises(TaskFormatError, match="line 3: task 't1-pkg-f' is listed twice"):
        list_tasks(tmp_path)
    (tmp_path / "synth.json").write_text("[1]")
    with pytest.raises(TaskFormatError, match="not a synthesis record"):
        synth_reports(tmp_path)


UNREADABLE = "it is not JSON that can be read ("
DEEP = UNREADABLE + "recursion limit exceeded"


@pytest.mark.parametrize(("body", "why"), [
    (b"[" * 100_000 + b"]" * 100_000, DEEP),
    (b'{"validation": [' + b"{\"a\": " * 50_000 + b"1" + b"}" * 50_000 + b"]}", DEEP),
    (b"{", UNREADABLE + "EOF while parsing an object"), (b"\xff\xfe", UNREADABLE + "expected value"),
    (b"[]", "the file is not a JSON object"), (b'"text"', "the file is not a JSON object"),
    (b"null", "the file is not a JSON object"),
], ids=["deep-list", "deep-object", "cut", "not-utf8", "list", "string", "null"])
def test_unreadable_json_is_an_error_not_a_traceback(tmp_path, body, why):
    task_dir = make_task(tmp_path)
    (task_dir / "task.json").write_bytes(body)
    message = refused(tmp_path, "t1-pkg-f", why)
    assert message.startswith(f"{task_dir / 'task.json'} is not a valid task file: ")
    assert message.endswith("; re-create it with `shipyard synth`")


def test_huge_task_file_is_refused_unread(tmp_path):
    task_dir = make_task(tmp_path)
    raw = task_json() | {"statement": "x" * MAX_TASK_JSON}
    (task_dir / "task.json").write_text(json.dumps(raw))
    refused(tmp_path, "t1-pkg-f", "task.json", "larger than")


def test_task_ids_are_names_not_paths(tmp_path):
    make_task(tmp_path)
    for bad in ("../t1-pkg-f", "/etc", "t1-pkg-f/../t1-pkg-f", "", ".hidden", "a" * 65):
        assert refused(tmp_path, bad) == (
            f"task id {bad!r} is invalid: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit, "
            f"with no '..' (a task id is a directory name in the task set {tmp_path})")


def test_test_files_must_be_regular_files_in_the_tasks_own_tests_dir(tmp_path):
    outside = tmp_path / "outside.py"
    outside.write_bytes(b"SECRET-OUTSIDE-THE-TASK\n")
    cases = {}
    task_dir = make_task(tmp_path / "missing")
    (task_dir / "tests" / "tests" / "test_g.py").unlink()
    cases["missing"] = (tmp_path / "missing", ["tests/test_g.py", "does not exist"])
    task_dir = make_task(tmp_path / "link")
    (task_dir / "tests" / "tests" / "test_g.py").unlink()
    (task_dir / "tests" / "tests" / "test_g.py").symlink_to(outside)
    cases["link"] = (tmp_path / "link", ["tests/test_g.py", "symbolic link"])
    task_dir = make_task(tmp_path / "inside-link")  # even a link to a file inside the task is refused
    (task_dir / "tests" / "tests" / "test_g.py").unlink()
    (task_dir / "tests" / "tests" / "test_g.py").symlink_to("test_f.py")
    cases["inside-link"] = (tmp_path / "inside-link", ["tests/test_g.py", "symbolic link"])
    task_dir = make_task(tmp_path / "dir-link")
    (tmp_path / "elsewhere").mkdir()
    for name in ("test_f.py", "test_g.py"):
        (tmp_path / "elsewhere" / name).write_bytes(TEST_FILE)
    os.rename(task_dir / "tests" / "tests", tmp_path / "moved")
    (task_dir / "tests" / "tests").symlink_to(tmp_path / "elsewhere")
    cases["dir-link"] = (tmp_path / "dir-link", ["tests/test_f.py", "symbolic link"])
    task_dir = make_task(tmp_path / "fifo")
    (task_dir / "tests" / "tests" / "test_g.py").unlink()
    os.mkfifo(task_dir / "tests" / "tests" / "test_g.py")  # never opened: an open would block
    cases["fifo"] = (tmp_path / "fifo", ["tests/test_g.py", "not a regular file"])
    task_dir = make_task(tmp_path / "tests-link")
    os.rename(task_dir / "tests", tmp_path / "tests-elsewhere")
    (task_dir / "tests").symlink_to(tmp_path / "tests-elsewhere")
    cases["tests-link"] = (tmp_path / "tests-link", ["tests"])
    for name, (root, fragments) in cases.items():
        message = refused(root, "t1-pkg-f", *fragments)
        assert "SECRET" not in message, name


def test_task_json_itself_is_not_read_through_a_link(tmp_path):
    task_dir = make_task(tmp_path)
    real = tmp_path / "real.json"
    os.rename(task_dir / "task.json", real)
    (task_dir / "task.json").symlink_to(real)
    refused(tmp_path, "t1-pkg-f", "task.json", "symbolic link")


def test_read_canonical_refuses_what_is_not_a_plain_test_file(tmp_path):
    task_dir = make_task(tmp_path)
    (tmp_path / "secret").write_bytes(b"SECRET")
    (task_dir / "tests" / "tests" / "link.py").symlink_to(tmp_path / "secret")
    (task_dir / "tests" / "big.py").write_bytes(b"#" * 2048)
    for rel, fragment in {"tests/link.py": "symbolic link", "/etc/passwd": "relative", "../../secret": "relative",
                          "tests": "not a regular file", "tests/nope.py": "does not exist",
                          "big.py": "larger than"}.items():
        with pytest.raises(TaskFormatError, match=fragment):
            read_canonical(task_dir, rel, limit=1024)
    assert read_canonical(task_dir, "big.py") == b"#" * 2048


def test_task_index_lines_are_checked(tmp_path):
    make_task(tmp_path)
    index = tmp_path / "tasks.jsonl"
    good = json.dumps({"id": "t1-pkg-f", "tier": 1, "fail_to_pass": 1, "lines_deleted": 2})
    for body, fragment in {good + "\n{not json\n": "line 2", good + "\n" + "[" * 10_000 + "\n": "line 2",
                           json.dumps({"id": "../../etc", "tier": 1, "fail_to_pass": 1, "lines_deleted": 2}): "line 1",
                           json.dumps({"id": "x", "tier": 1}): "line 1", "[]\n": "line 1"}.items():
        index.write_text(body)
        with pytest.raises(TaskFormatError, match=fragment) as info:
            list_tasks(tmp_path)
        assert "\n" not in str(info.value) and str(index) in str(info.value)
    index.write_bytes(b"\n" * (MAX_INDEX + 1))
    with pytest.raises(TaskFormatError, match="larger than"):
        list_tasks(tmp_path)


def test_save_refuses_to_write_an_invalid_task(tmp_path):
    task_dir = make_task(tmp_path)
    task, _ = load_task(tmp_path, "t1-pkg-f")
    task.fail_to_pass = []
    with pytest.raises(TaskFormatError, match="fail_to_pass"):
        task.save(task_dir)
    assert json.loads((task_dir / "task.json").read_text())["fail_to_pass"]  # the old file is untouched
    valid = Task(**{k: v for k, v in task_json().items() if k not in ("deleted", "project")},
                 deleted=[DeletedSymbol("pkg/__init__.py", "f", 1, 3)], project=Project("pkg", "1.0"))
    valid.save(task_dir)
    assert load_task(tmp_path, "t1-pkg-f")[0] == valid

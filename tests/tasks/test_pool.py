"""`shipyard synth` over several repositories into one task set (`shipyard.tasks.pool`), in real sandboxes: the
bundled example and a second tiny repository whose package and function have the very names of the example's (so
ids made from module paths alone would collide), unique ids, projects recorded everywhere, appending, and refusals
that come before any work. Kept small (tier 1, one task a project, one suite run, one oracle run): ≈ 1 min."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from servers import needs_sandbox

from shipyard.tasks.pool import read_list, synthesize_specs
from shipyard.tasks.sources import SourceError, directory_project, resolve
from shipyard.tasks.synth import SynthConfig, Synthesizer
from shipyard.tasks.taskset import Project, TaskSetConflict, index_entries, list_tasks, load_task, task_projects

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pocketlib"
SMALL = SynthConfig(max_tasks=1, tiers=(1,), suite_runs=1, oracle_runs=1, search_index=False, timeout=300)
STATS = '''def median(values):
    """The middle value of `values` (the mean of the two middle ones when their count is even)."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


def spread(values):
    return max(values) - min(values)
'''
TESTS = '''from pocketlib.stats import median, spread


def test_median_odd():
    assert median([3, 1, 2]) == 2


def test_median_even():
    assert median([4, 1, 3, 2]) == 2.5


def test_spread():
    assert spread([3, 9, 4]) == 6
'''


def tiny_repo(root: Path) -> Path:
    """Project tinylib 0.1.0, whose package is named `pocketlib` and holds `stats.median`, as the example does."""
    repo = root / "tinylib"
    (repo / "pocketlib").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "pyproject.toml").write_text('[project]\nname = "TinyLib"\nversion = "0.1.0"\n\n'
                                         '[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    (repo / "pocketlib" / "__init__.py").write_text("")
    (repo / "pocketlib" / "stats.py").write_text(STATS)
    (repo / "tests" / "test_stats.py").write_text(TESTS)
    return repo


def test_specs_name_directories_or_projects_and_lists_are_relative_to_themselves(tmp_path, monkeypatch):
    tiny = tiny_repo(tmp_path)
    assert directory_project(tiny) == Project("tinylib", "0.1.0")
    assert directory_project(EXAMPLE) == Project("pocketlib", "0.3.0")
    (tmp_path / "lists").mkdir()
    listing = tmp_path / "lists" / "pool.txt"
    listing.write_text("# the pool\n../tinylib   # a directory, relative to this file\n\nparse==1.22.4\n")
    assert read_list(listing) == [str(tmp_path / "lists" / "../tinylib"), "parse==1.22.4"]
    monkeypatch.chdir(tmp_path)  # an existing directory wins over a project of the same name
    assert [s.project for s in resolve(["tinylib", str(EXAMPLE)], tmp_path / "work")] == \
        [Project("tinylib", "0.1.0"), Project("pocketlib", "0.3.0")]
    with pytest.raises(Exception, match="both project tinylib"):
        resolve(["tinylib", "./tinylib"], tmp_path / "work")
    with pytest.raises(Exception, match="is not a directory"):
        resolve(["./missing"], tmp_path / "work")
    with pytest.raises(Exception, match="neither a directory nor a requirement"):
        resolve(["not a spec!"], tmp_path / "work")
    with pytest.raises(Exception, match="without extras, markers or URL"):
        resolve(["parse[extra]==1.0"], tmp_path / "work")
    cli = [sys.executable, "-m", "shipyard.cli", "synth", "--out", str(tmp_path / "out")]
    for args, said in (([], "needs --repo"), (["--repos", str(tmp_path / "nope.txt")], "is not a file"),
                       (["--repo", "./missing"], "is not a directory")):
        r = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and said in r.stderr, r.stderr


def test_an_unpacked_sdist_must_stay_inside_its_own_tree(tmp_path):
    import io
    import tarfile

    from shipyard.tasks.sources import _unpack

    def archive(*members: tuple[str, bytes | None, str | None]) -> bytes:
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for name, data, link in members:
                info = tarfile.TarInfo(name)
                if link is not None:
                    info.type, info.linkname = tarfile.SYMTYPE, link
                    tar.addfile(info)
                else:
                    info.size = len(data or b"")
                    tar.addfile(info, io.BytesIO(data or b""))
        return buffer.getvalue()

    good = archive(("lib-1.0/PKG-INFO", b"Name: lib\n", None), ("lib-1.0/lib.py", b"x = 1\n", None))
    assert _unpack(good, "lib-1.0.tar.gz", tmp_path / "a").name == "lib-1.0"
    for bad, said in ((archive(("../evil.py", b"", None)), "cannot be unpacked"),
                      (archive(("lib-1.0/x", None, "/etc/passwd")), "cannot be unpacked"),
                      (archive(("a/x.py", b"", None), ("b/y.py", b"", None)), "one top directory"),
                      (b"not an archive", "cannot be unpacked")):
        dest = tmp_path / f"d{len(list(tmp_path.iterdir()))}"
        with pytest.raises(SourceError, match=said):
            _unpack(bad, "lib-1.0.tar.gz", dest)
        assert not (tmp_path / "evil.py").exists()


@needs_sandbox
def test_two_repositories_make_one_task_set_with_unique_ids_and_their_projects(tmp_path):
    example = tmp_path / "src" / "pocketlib"
    shutil.copytree(EXAMPLE, example, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache", ".ruff_cache"))
    tiny = tiny_repo(tmp_path / "src")
    out, log = tmp_path / "tasks", []
    reports = synthesize_specs([str(example), str(tiny)], out, SMALL, log=log.append)
    assert [r.project for r in reports] == [Project("pocketlib", "0.3.0"), Project("tinylib", "0.1.0")]
    assert [len(r.accepted) for r in reports] == [1, 1]
    ids = list_tasks(out)
    assert len(ids) == len(set(ids)) == 2 and ids == [*reports[0].accepted, *reports[1].accepted]
    assert "t1-tinylib.pocketlib.stats-median" in ids  # the example's own would be t1-pocketlib.stats-median
    assert task_projects(out) == {reports[0].accepted[0]: "pocketlib", "t1-tinylib.pocketlib.stats-median": "tinylib"}
    for entry in index_entries(out):
        task, _ = load_task(out, entry.id)
        assert task.project == entry.project and task.source["repo"] in (str(example), str(tiny))
    saved = json.loads((out / "synth.json").read_text())["projects"]
    assert list(saved) == ["pocketlib", "tinylib"]  # one report per project
    assert saved["tinylib"]["accepted"] == ["t1-tinylib.pocketlib.stats-median"]
    assert saved["tinylib"]["project"] == {"name": "tinylib", "version": "0.1.0"}
    assert not (out / ".work").exists()

    # A project the set holds is refused before any work; --skip-done skips it instead (finishing a build).
    log.clear()
    with pytest.raises(TaskSetConflict, match="already holds 1 tasks of tinylib"):
        synthesize_specs([str(tiny)], out, SMALL, log=log.append)
    assert not log and list_tasks(out) == ids
    assert synthesize_specs([str(example), str(tiny)], out, SMALL, log=log.append, skip_done=True) == []
    assert list_tasks(out) == ids and len(log) == 2 and all("skipped" in line for line in log)

    # An id the set lists is never overwritten, whichever project the set says it is of (a hand-edited set).
    other = tmp_path / "other"
    shutil.copytree(out, other, symlinks=True)
    shutil.rmtree(other / reports[0].accepted[0])
    (other / "tasks.jsonl").write_text(json.dumps({"id": "t1-tinylib.pocketlib.stats-median", "tier": 1,
                                                   "fail_to_pass": 2, "lines_deleted": 5,
                                                   "project": {"name": "elsewhere", "version": None}}) + "\n")
    (other / "synth.json").unlink()
    before = (other / "t1-tinylib.pocketlib.stats-median" / "task.json").read_bytes()
    with pytest.raises(TaskSetConflict, match="t1-tinylib.pocketlib.stats-median of tinylib is already in"):
        Synthesizer(tiny, other, SMALL, log=lambda _: None).run()
    assert (other / "t1-tinylib.pocketlib.stats-median" / "task.json").read_bytes() == before

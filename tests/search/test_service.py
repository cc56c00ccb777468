"""codebase_search in episodes: the tool, its searcher following the agent's own edits, tasks' prebuilt indexes."""

from __future__ import annotations

import json
import shutil

import pytest

from shipyard.harness.loop import Agent, LoopConfig
from shipyard.harness.tools import ToolContext, ToolError, default_tools, tools_for
from shipyard.harness.tools.edit import search_replace, write_file
from shipyard.harness.tools.search import codebase_search
from shipyard.harness.tools.terminal import run_terminal
from shipyard.harness.workspace import LocalWorkspace, PathError
from shipyard.models.replay import ReplayEngine
from shipyard.search.index import CodeIndex
from shipyard.search.service import IndexSearcher, copy_index, diff_paths, index_tasks
from shipyard.search.tree import LocalTree


class Recording(IndexSearcher):
    """An `IndexSearcher` that keeps what each search was told had changed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.told = []

    def search(self, workspace, query, directories, k, changed=None):
        self.told.append(None if changed is None else set(changed))
        return super().search(workspace, query, directories, k, changed)


@pytest.fixture
def searching(repo, tiny_embedder):
    ws = LocalWorkspace(repo)
    searcher = Recording(tiny_embedder)
    ctx = ToolContext(ws, searcher=searcher)
    yield ctx, searcher
    ctx.close()
    searcher.close()
    ws.close()


def test_the_tool_is_offered_only_with_a_searcher():
    names = [t.name for t in default_tools()]
    assert names.index("grep") + 1 == names.index("codebase_search") == names.index("search_replace") - 1
    assert "codebase_search" not in [t.name for t in tools_for(None)]
    with pytest.raises(ToolError, match="not available"):
        codebase_search(ToolContext(None), "anything")


def test_results_are_locations_with_numbered_lines(searching):
    ctx, _ = searching
    out = codebase_search(ctx, "percentile")
    first = out.split("\n\n")[0].split("\n")
    _, span = first[0].split("  ")[0].rsplit(":", 1)
    start = int(span.split("-")[0])
    assert first[1].startswith(f"{start}\t")
    assert "pocketlib/stats.py" in out and "(percentile)" in out
    only_tests = codebase_search(ctx, "percentile", ["tests"])
    assert all(block.startswith("tests/") for block in only_tests.split("\n\n"))


@pytest.mark.parametrize("query, dirs, error", [
    ("", None, ToolError), ("   ", None, ToolError), ("a\x00b", None, ToolError), ("x" * 1001, None, ToolError),
    ("mean", ["../.."], PathError), ("mean", ["/etc"], PathError), ("mean", ["pocketlib/stats.py"], ToolError),
    ("mean", ["no_such_dir"], ToolError), ("mean", ["d"] * 21, ToolError),
])
def test_bad_queries_and_directories_are_the_models_errors(searching, query, dirs, error):
    ctx, _ = searching
    with pytest.raises(error):
        codebase_search(ctx, query, dirs)


def test_the_searcher_follows_the_agents_edits(searching, repo):
    ctx, searcher = searching
    codebase_search(ctx, "mean")  # builds the index from the workspace
    search_replace(ctx, "pocketlib/stats.py", "def mean(", "def arithmetic_average_of(")
    write_file(ctx, "pocketlib/geometry.py", "def hypotenuse_length(a, b):\n    return (a * a + b * b) ** 0.5\n")
    ctx.wrote({"pocketlib/stats.py"})  # what the executor notes before the calls run
    ctx.wrote({"pocketlib/geometry.py"})
    out = codebase_search(ctx, "hypotenuse_length arithmetic_average_of")
    assert searcher.told[-1] == {"pocketlib/stats.py", "pocketlib/geometry.py"}
    assert "pocketlib/geometry.py" in out and "arithmetic_average_of" in out
    run_terminal(ctx, "printf 'def zebra_stripes():\\n    return 7\\n' > pocketlib/zoo.py")
    ctx.wrote(None)  # a terminal command may have written anything
    out = codebase_search(ctx, "zebra_stripes")
    assert searcher.told[-1] is None and "pocketlib/zoo.py" in out
    (repo / "pocketlib" / "geometry.py").unlink()  # gone: found through the diff and the files refreshed before
    ctx.wrote(None)
    assert "geometry.py" not in codebase_search(ctx, "hypotenuse_length")


def test_an_agent_calls_codebase_search(repo, tiny_embedder):
    call = json.dumps({"name": "codebase_search", "arguments": {"query": "roman numerals"}})
    engine = ReplayEngine([f"<tool_call>{call}</tool_call>", "Found it."])
    ws = LocalWorkspace(repo)
    searcher = IndexSearcher(tiny_embedder)
    try:
        traj = Agent(engine, ws, LoopConfig(max_turns=3), searcher=searcher).run("find the roman numeral code")
    finally:
        searcher.close()
        ws.close()
    assert "codebase_search" in traj.meta["tools"]
    (record,) = traj.turns[0].calls
    assert record.error is None and "pocketlib/roman.py" in record.output


def test_diff_paths_reads_the_files_a_patch_changes():
    patch = ("diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+diff --git a/evil b/evil\n"
             "diff --git a/d/new.py b/d/new.py\nnew file mode 100644\n")
    assert diff_paths(patch) == {"x.py", "d/new.py"}


def test_a_tasks_index_is_a_private_copy_without_the_deleted_code(tmp_path, repo, tiny_embedder):
    task = tmp_path / "task"
    shutil.copytree(repo, task / "snapshot")
    stats = task / "snapshot" / "pocketlib" / "stats.py"
    body = "    return math.fsum(values) / len(values)"
    assert body in stats.read_text()
    stats.write_text(stats.read_text().replace(body, "    raise NotImplementedError"))
    index_tasks(repo, [task], tiny_embedder, tmp_path / "work")  # the repository's index has the body: the task's not
    files = [p for p in (task / "search-index").rglob("*") if p.is_file()]
    assert files and not any(b"math.fsum(values) / len(values)" in p.read_bytes() for p in files)
    task_index = CodeIndex.open(task / "search-index", tiny_embedder)
    assert task_index.dead_fraction() == 0 and task_index.live_chunks() > 50
    assert any("NotImplementedError" in h.chunk.text for h in task_index.search("mean", 20, mode="bm25"))
    task_index.close()
    copy_index(task / "search-index", tmp_path / "episode")  # what an episode's searcher works on
    episode = CodeIndex.open(tmp_path / "episode", tiny_embedder)
    stats.write_text(stats.read_text() + "\ndef brand_new_helper():\n    return 1\n")
    episode.update(LocalTree(task / "snapshot"), paths=["pocketlib/stats.py"])
    episode.save()
    assert "brand_new_helper" in episode.search("brand_new_helper", 1, mode="bm25")[0].chunk.text
    untouched = CodeIndex.open(task / "search-index", tiny_embedder)
    assert all("brand_new_helper" not in h.chunk.text for h in untouched.search("brand_new_helper", 5, mode="bm25"))

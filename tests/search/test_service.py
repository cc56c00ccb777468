"""codebase_search in episodes: the tool, its searcher following the agent's own edits, tasks' prebuilt indexes."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
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
    """An `IndexSearcher` that keeps the files each refresh read."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.refreshes = []

    def _search(self, workspace, query, directories, k):
        before = set(self.refreshed)
        hits = super()._search(workspace, query, directories, k)
        self.refreshes.append(self.refreshed - before)
        return hits


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
    ctx.wrote({"pocketlib/stats.py"})  # what the executor says before each editing call runs
    search_replace(ctx, "pocketlib/stats.py", "def mean(", "def arithmetic_average_of(")
    ctx.wrote({"pocketlib/geometry.py"})
    write_file(ctx, "pocketlib/geometry.py", "def hypotenuse_length(a, b):\n    return (a * a + b * b) ** 0.5\n")
    out = codebase_search(ctx, "hypotenuse_length arithmetic_average_of")
    assert searcher.refreshes[-1] == {"pocketlib/stats.py", "pocketlib/geometry.py"}  # those two files only
    assert "pocketlib/geometry.py" in out and "arithmetic_average_of" in out
    ctx.wrote(None)  # a terminal command may write anything, now or later (a process it leaves behind)
    run_terminal(ctx, "printf 'def zebra_stripes():\\n    return 7\\n' > pocketlib/zoo.py")
    out = codebase_search(ctx, "zebra_stripes")
    assert "pocketlib/zoo.py" in out
    (repo / "pocketlib" / "geometry.py").unlink()  # no tool said so: the diff and the files refreshed before do
    (repo / "pocketlib" / "roman.py").rename(repo / "pocketlib" / "numerals.py")
    out = codebase_search(ctx, "hypotenuse_length to_roman")
    assert "geometry.py" not in out and "pocketlib/roman.py" not in out and "pocketlib/numerals.py" in out


def test_two_searches_in_one_turn_both_see_the_edit(searching):
    ctx, _ = searching
    codebase_search(ctx, "mean")
    ctx.wrote({"pocketlib/stats.py"})
    search_replace(ctx, "pocketlib/stats.py", "def mean(", "def arithmetic_average_of(")
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda q: codebase_search(ctx, q), ["arithmetic_average_of", "arithmetic_average_of"]))
    assert all("arithmetic_average_of" in out for out in outs)


def test_what_a_model_can_write_never_fails_the_search(searching, repo):
    ctx, _ = searching
    codebase_search(ctx, "mean")
    deep = "".join(f"function f{i}() {{\n" for i in range(1500)) + "}\n" * 1500
    ctx.wrote({"deep.js"})
    write_file(ctx, "deep.js", deep)
    ctx.wrote(None)
    run_terminal(ctx, "printf 'def odd_name_function():\\n    return 1\\n' > $'caf\\xe9.py' && "
                      "printf 'def newline_name():\\n    return 1\\n' > $'a\\nb.py'")
    out = codebase_search(ctx, "odd_name_function newline_name f1499")
    assert "deep.js" in out  # cut into windows past the depth limit
    assert "odd_name_function" not in out and "newline_name" not in out  # names the index cannot show: skipped


def test_concurrent_episodes_share_one_embedder_safely(tiny_embedder):
    lines = ["word " * n for n in (206, 26, 175, 52)]
    expected = tiny_embedder.count(lines)
    vector = tiny_embedder.embed([lines[0]])

    def work(_):
        return tiny_embedder.count(lines), tiny_embedder.embed([lines[0]])

    with ThreadPoolExecutor(4) as pool:
        for counts, vectors in pool.map(work, range(40)):
            assert counts == expected and np.allclose(vectors, vector, atol=1e-5)


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
    patch = ('# shipyard left 1 changed path(s) out of this patch (…):\n#   "big.bin": now a file of 99 bytes\n'
             "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a\n+diff --git a/evil b/evil\n"
             "diff --git a/d/new.py b/d/new.py\nnew file mode 100644\n"
             "diff --git a/p/old name.py b/p/new name.py\nrename from a/p/old name.py\nrename to b/p/new name.py\n"
             'diff --git "a/we\\"ird.py" "b/we\\"ird.py"\ndeleted file mode 100644\n')
    assert diff_paths(patch) == {"big.bin", "x.py", "d/new.py", "p/old name.py", "p/new name.py", 'we"ird.py'}


def test_a_copy_takes_regular_files_only(tmp_path, repo, tiny_embedder):
    index = CodeIndex.open(tmp_path / "base", tiny_embedder)
    index.update(LocalTree(repo))
    index.save()
    index.close()
    secret = tmp_path / "secret"
    secret.write_text("root only")
    (tmp_path / "base" / "planted").symlink_to(secret)
    copy_index(tmp_path / "base", tmp_path / "copy")
    assert not (tmp_path / "copy" / "planted").exists() and (tmp_path / "copy" / "index.json").is_file()
    assert CodeIndex.open(tmp_path / "copy", tiny_embedder).live_chunks() == index.live_chunks()


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


def test_the_cli_agent_searches_a_repository_it_indexes_on_first_use(repo, tiny_embedder):
    from shipyard.rollout.episode import episode_config, run_on_repo

    call = json.dumps({"name": "codebase_search", "arguments": {"query": "percentile", "directories": ["pocketlib"]}})
    engine = ReplayEngine([f"<tool_call>{call}</tool_call>", "Found it."])
    config = episode_config("replay", max_turns=3, search=True, embedder=tiny_embedder.name)
    traj = run_on_repo("find percentile", repo, engine, config)
    (record,) = traj.turns[0].calls
    assert record.error is None and "pocketlib/stats.py" in record.output and "tests/" not in record.output

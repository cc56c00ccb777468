"""`shipyard eval`: unbiased pass@k, aggregation with masked rollouts, the results and compare documents, the gold
replay through real sandboxes, and the CLI end to end."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import subprocess
import sys
import time

import pytest
from servers import free_port, needs_sandbox

from shipyard.harness.trajectory import CallRecord, Trajectory, Turn
from shipyard.rollout.eval import (
    SCHEMA,
    EvalFailed,
    ResultsFileError,
    check_scored,
    compare,
    compare_markdown,
    default_ks,
    load_results,
    markdown,
    pass_at_k,
    results,
)
from shipyard.rollout.record import Rollout


# pass@k ------------------------------------------------------------------------------------------------------------
def brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    """The definition: the fraction of k-subsets of the n samples that hold at least one pass."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_enumeration_of_subsets(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(outcomes, k), abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_where_binomials_are_huge():
    # C(200, 100) has 59 digits; the product form stays in [0, 1] and matches exact rational arithmetic
    for n, c, k in [(200, 1, 100), (200, 3, 50), (1000, 7, 10), (1000, 0, 500), (1000, 999, 1)]:
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12, abs=1e-15)
    assert pass_at_k(5, 3, 1) == pytest.approx(0.6)  # pass@1 is c / n
    assert pass_at_k(5, 3, 3) == 1.0  # n - c < k: every draw of 3 holds a pass
    assert pass_at_k(5, 0, 5) == 0.0


@pytest.mark.parametrize("n, c, k", [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4), (0, 0, 1)])
def test_pass_at_k_refuses_what_is_undefined(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_default_ks():
    assert default_ks(1) == [1] and default_ks(5) == [1, 2, 4, 5] and default_ks(8) == [1, 2, 4, 8]


# records -----------------------------------------------------------------------------------------------------------
def traj(turns: int, width: int = 1, tokens: int = 10) -> Trajectory:
    t = Trajectory(task="t", model="m", prompt_ids=[1, 2, 3], stop_reason="finished", seconds=2.0)
    for i in range(turns):
        calls = [CallRecord(j, "read_file", {"path": "a"}, "ok", None, 0.1) for j in range(width)]
        t.turns.append(Turn(i, "x", [5] * tokens, [0.0] * tokens, "stop", [6], calls, width, 0.1, 0.1))
    return t


def rollout(task: str, index: int, reward: float | None, *, status: str | None = None, cause: str | None = None,
            turns: int = 2, flags: int = 0, seconds: float = 3.0) -> Rollout:
    status = status or ("graded" if reward is not None else "infra_error")
    return Rollout(task_id=task, group_id=f"{task}@eval", index=index, seed=index, status=status, reward=reward,
                   trajectory=traj(turns), stop_reason="finished" if reward is not None else status,
                   infra_cause=cause, timings={"total": seconds},
                   monitor_flags=[{"kind": "cache_read", "turn": 0, "call": 0, "evidence": "x"}] * flags)


def groups_with_masking() -> dict[str, list[Rollout]]:
    return {
        # 4 samples, one masked: n = 3, c = 2
        "alpha": [rollout("alpha", 0, 1.0), rollout("alpha", 1, 0.0, turns=4), rollout("alpha", 2, 1.0),
                  rollout("alpha", 3, None, cause="environment server unreachable: connection refused", turns=1)],
        # every sample masked: no pass@k, left out of the overall mean
        "beta": [rollout("beta", i, None, cause="sandbox died", turns=1) for i in range(4)],
        # nothing passes: pass@k 0, a valid score
        "gamma": [rollout("gamma", i, 0.0, status="patch_failed", flags=1) for i in range(3)]
        + [rollout("gamma", 3, None, status="cancelled", turns=1)],
    }


def test_aggregation_masks_infra_failures_and_reduces_n():
    doc = results(groups_with_masking(), [1, 2, 4], config={"model": "m"}, wall_seconds=10.0)
    alpha, beta, gamma = (doc["tasks"][t] for t in ("alpha", "beta", "gamma"))
    assert (alpha["rollouts"], alpha["scored"], alpha["passed"], alpha["masked"]) == (4, 3, 2, 1)
    assert alpha["pass_at"] == {"1": pytest.approx(2 / 3), "2": 1.0, "4": None}  # 4 > n = 3: no pass@4
    assert alpha["infra"] == {"environment server unreachable": 1}
    assert alpha["infra_examples"] == {"environment server unreachable": "environment server unreachable: connection "
                                                                         "refused"}
    assert alpha["mean"]["turns"] == pytest.approx((2 + 4 + 2) / 3)  # over scored rollouts only
    assert alpha["total"]["turns"] == 2 + 4 + 2 + 1  # totals count every rollout
    assert beta["scored"] == 0 and beta["pass_at"] == {"1": None, "2": None, "4": None} and beta["infra"] == {
        "sandbox died": 4}
    assert gamma["pass_at"]["1"] == 0.0 and gamma["masked"] == 1 and gamma["infra"] == {"cancelled": 1}
    assert gamma["monitor_flags"] == {"cache_read": 3} and gamma["flagged_rollouts"] == 3
    assert gamma["statuses"] == {"cancelled": 1, "patch_failed": 3}
    overall = doc["overall"]
    assert overall["pass_at"]["1"] == pytest.approx((2 / 3 + 0.0) / 2)  # mean over the tasks that have pass@1
    assert overall["tasks_at"] == {"1": 2, "2": 2, "4": 0} and overall["pass_at"]["4"] is None
    assert overall["tasks_unscored"] == ["beta"] and overall["tasks_scored"] == 2
    assert (overall["rollouts"], overall["scored"], overall["masked"], overall["passed"]) == (12, 6, 6, 2)
    assert overall["infra"]["sandbox died"] == 4 and sum(overall["infra"].values()) == 6
    check_scored(doc)  # some rollouts were scored: the run itself succeeded


def test_the_summary_counts_calls_by_tool_and_progress_on_the_failing_tests_short_of_a_pass():
    """What an agent did, beside whether it passed: the first SFT arm solved 0 of 80 held-out rollouts while calling
    search_replace 228 times and making some failing tests pass in 3 (2026-12-07); pass@1 alone hid all of it."""
    def graded(index: int, f2p: tuple[int, int] | None, reward: float = 0.0) -> Rollout:
        r = rollout("t", index, reward)
        r.verdict = None if f2p is None else {"fail_to_pass": {"passed": f2p[0], "total": f2p[1]}}
        return r

    rs = [graded(0, (1, 4)), graded(1, (4, 4), reward=1.0), graded(2, (0, 2)), graded(3, None),
          rollout("t", 4, None, cause="sandbox died")]  # masked: not counted
    odd = rs[0].trajectory.turns[0].calls
    odd += [CallRecord(1, "intersect", {"a": 1}, "", "unknown tool", 0.0, error_kind="unknown_tool"),
            CallRecord(2, None, None, "", "bad", 0.0, error_kind="malformed"),
            CallRecord(3, None, None, "", "not closed", 0.0, error_kind="truncated"),
            CallRecord(4, "codebase_search", {"query": "q"}, "", "unknown tool", 0.0, error_kind="unknown_tool")]
    doc = results({"t": rs}, [1], config={}, wall_seconds=1.0)
    overall = doc["overall"]
    assert overall["fail_to_pass"] == {"mean": pytest.approx((0.25 + 1.0 + 0.0 + 0.0) / 4), "some": 1}
    # codebase_search is a tool, but not one this episode offered (it had no searcher)
    assert overall["calls_by_tool"] == {"read_file": 8, "(not a tool)": 2, "(unparsed)": 1, "(cut off)": 1}
    assert next(iter(overall["calls_by_tool"])) == "read_file"  # most called first
    table = markdown(doc)
    assert "failing tests made to pass: 0.312 of each task's" in table and "1 rollouts made some pass" in table
    assert "calls by tool: read_file 8, (not a tool) 2, (unparsed) 1, (cut off) 1" in table


@pytest.mark.parametrize("cause, kind", [
    ("workspace: SandboxFailed: sandbox f03c397edbdc has no exec session: [Errno 17]", "workspace: SandboxFailed"),
    ("tools: EnvServerUnreachable: cannot reach http://127.0.0.1:4242", "tools: EnvServerUnreachable"),
    ("grade: the control run failed too: no report", "grade"),
    ("worker_lost: actor 12 died", "worker_lost"),
    ("", "unknown cause"),
    (None, "unknown cause"),
    ("x" * 500, "x" * 120),
])
def test_infra_causes_are_counted_by_stage_and_exception_not_message(cause, kind):
    from shipyard.rollout.eval import cause_kind

    assert cause_kind(rollout("t", 0, None, cause=cause)) == kind
    assert cause_kind(rollout("t", 0, None, status="cancelled", cause=cause)) == "cancelled"


def test_an_eval_where_nothing_could_be_scored_failed_but_solving_nothing_did_not():
    failed = results({"beta": groups_with_masking()["beta"]}, [1], config={}, wall_seconds=1.0)
    with pytest.raises(EvalFailed, match="no rollout could be scored: all 4 .*4× sandbox died; first: sandbox died.*"
                                         "not a score of the model"):
        check_scored(failed)
    zero = results({"g": [rollout("g", i, 0.0) for i in range(3)]}, [1, 2], config={}, wall_seconds=1.0)
    check_scored(zero)
    assert zero["overall"]["pass_at"] == {"1": 0.0, "2": 0.0}
    with pytest.raises(EvalFailed, match="no rollout"):
        check_scored(results({}, [1], config={}, wall_seconds=1.0))


def test_results_document_is_json_with_the_documented_schema():
    doc = json.loads(json.dumps(results(groups_with_masking(), [1, 2], config={"model": "m", "samples": 4},
                                        wall_seconds=10.0)))
    assert doc["schema"] == SCHEMA and doc["ks"] == [1, 2] and doc["config"]["samples"] == 4
    assert set(doc) == {"schema", "config", "ks", "wall_seconds", "finished", "overall", "tasks", "scheduler",
                        "rollouts"}
    for summary in [doc["overall"], *doc["tasks"].values()]:
        assert {"rollouts", "scored", "passed", "pass_at", "masked", "infra", "infra_examples", "statuses",
                "stop_reasons", "monitor_flags", "flagged_rollouts", "mean", "total"} <= set(summary)
        assert set(summary["mean"]) == {"sampled_tokens", "turns", "tool_calls", "parallel_width", "seconds"}
    assert len(doc["rollouts"]) == 12 and {"rollout", "task", "status", "reward"} <= set(doc["rollouts"][0])
    assert doc["overall"]["rollouts_per_hour"] == pytest.approx(12 * 360)


def test_markdown_table_has_a_row_per_task_and_overall():
    table = markdown(results(groups_with_masking(), [1, 2], config={}, wall_seconds=10.0))
    lines = table.splitlines()
    assert lines[0].startswith("| task | pass@1 | pass@2 | passed/scored | tokens | turns |")
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"task", "alpha", "beta", "gamma", "**overall**"}
    assert "| 0.667 | 1.000 | 2/3 |" in rows["alpha"] and "| – | – | 0/0 |" in rows["beta"]
    assert "| 0.333 | 0.500 | 2/6 |" in rows["**overall**"]
    assert all(line.count("|") == lines[0].count("|") for line in rows.values())
    assert "not scored (every rollout masked): beta" in table and "4× sandbox died" in table


# compare -----------------------------------------------------------------------------------------------------------
def write(path, doc):
    path.write_text(json.dumps(doc))
    return path


def test_compare_reports_deltas_per_task_and_overall_and_flags_unshared_tasks(tmp_path):
    a = results({"alpha": [rollout("alpha", i, float(i < 1)) for i in range(4)],
                 "gamma": [rollout("gamma", i, 0.0) for i in range(4)],
                 "only-a": [rollout("only-a", 0, 1.0)]}, [1, 2], config={"model": "A"}, wall_seconds=1.0)
    b = results({"alpha": [rollout("alpha", i, float(i < 3), turns=4) for i in range(4)],
                 "gamma": [rollout("gamma", i, 0.0) for i in range(3)] + [rollout("gamma", 3, None)],
                 "only-b": [rollout("only-b", 0, 0.0)]}, [1, 2, 4], config={"model": "B"}, wall_seconds=1.0)
    doc = compare(load_results(write(tmp_path / "a.json", a)), load_results(write(tmp_path / "b.json", b)))
    assert doc["ks"] == [1, 2] and doc["common_tasks"] == 2
    assert doc["only_a"] == ["only-a"] and doc["only_b"] == ["only-b"]
    alpha = doc["tasks"]["alpha"]
    assert alpha["pass@1"] == {"a": 0.25, "b": 0.75, "delta": pytest.approx(0.5)}
    assert alpha["turns"]["delta"] == pytest.approx(2.0)
    assert doc["tasks"]["gamma"]["masked"] == {"a": 0, "b": 1, "delta": 1}
    # overall over the two common tasks only (only-a's pass@1 of 1.0 is not in A's side)
    assert doc["overall"]["pass@1"]["a"] == pytest.approx(0.125)
    assert doc["overall"]["pass@1"]["b"] == pytest.approx(0.375)
    assert doc["overall"]["pass@1"]["delta"] == pytest.approx(0.25) and doc["overall"]["pass@1"]["tasks"] == 2
    assert alpha["reward_mean"] == {"a": 0.25, "b": 0.75, "delta": pytest.approx(0.5)}
    assert set(alpha["grounded_fraction"]) == {"a", "b", "delta"}
    older = load_results(write(tmp_path / "old.json", a))
    del older["tasks"]["alpha"]["reward_mean"], older["tasks"]["alpha"]["validity"]  # a file from before the fields
    assert compare(older, b)["tasks"]["alpha"]["reward_mean"] == {"a": None, "b": 0.75, "delta": None}
    table = compare_markdown(doc)
    assert "| alpha | 0.250 → 0.750 (+0.500) |" in table
    assert "only in A (left out of the overall): only-a" in table and "only in B" in table
    assert "A = A, B = B" in table


@pytest.mark.parametrize("content, why", [
    (None, "no such file"),
    ("{not json", "not JSON"),
    ("[1, 2]", "its 'schema' is not"),
    (json.dumps({"schema": "other"}), "its 'schema' is not"),
    (json.dumps({"schema": SCHEMA, "ks": "1"}), "'ks' is not a list"),
    (json.dumps({"schema": SCHEMA, "ks": [1], "overall": []}), "overall is not an object"),
    (json.dumps({"schema": SCHEMA, "ks": [1], "overall": {"pass_at": {}, "mean": {}, "scored": 1, "masked": 0,
                                                          "monitor_flags": {}}, "tasks": {"t": {"pass_at": {"1": "x"},
                                                          "mean": {}, "scored": 1, "masked": 0,
                                                          "monitor_flags": {}}}}), "task t: '1' is not a number"),
    ("[" * 100_000, "not JSON"),
])
def test_bad_results_files_are_one_clear_error(tmp_path, content, why):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ResultsFileError, match=f"{path} is not a shipyard eval result: {why}"):
        load_results(path)


def test_random_groups_overall_is_mean_of_task_pass_at_k():
    rng = random.Random(0)
    groups = {f"t{i}": [rollout(f"t{i}", j, rng.choice([0.0, 1.0, None])) for j in range(6)] for i in range(20)}
    doc = results(groups, [1, 3], config={}, wall_seconds=1.0)
    for k in (1, 3):
        per_task = []
        for g in groups.values():
            outcomes = [r.reward == 1.0 for r in g if r.reward is not None]
            if len(outcomes) >= k:
                per_task.append(brute_pass_at_k(outcomes, k))
        assert doc["overall"]["pass_at"][str(k)] == pytest.approx(sum(per_task) / len(per_task))


# gold trajectories (host side: no sandbox) -------------------------------------------------------------------------
def fake_task(tmp_path, files: dict[str, str], gold: str | None):
    """A task directory as far as `final_files` reads it: snapshot/ and gold.patch."""
    task_dir = tmp_path / "task"
    for rel, text in files.items():
        (task_dir / "snapshot" / rel).parent.mkdir(parents=True, exist_ok=True)
        (task_dir / "snapshot" / rel).write_text(text)
    (task_dir / "snapshot").mkdir(parents=True, exist_ok=True)
    if gold is not None:
        (task_dir / "gold.patch").write_text(gold)
    return task_dir


EDIT_RENAME_DELETE_ADD = """\
diff --git a/pkg/a.py b/pkg/a.py
--- a/pkg/a.py
+++ b/pkg/a.py
@@ -1,2 +1,3 @@
 def f():
-    pass
+    return 1
+
diff --git a/old.py b/new.py
similarity index 100%
rename from old.py
rename to new.py
diff --git a/gone.py b/gone.py
deleted file mode 100644
--- a/gone.py
+++ /dev/null
@@ -1 +0,0 @@
-x = 1
diff --git a/pkg/b.py b/pkg/b.py
new file mode 100644
--- /dev/null
+++ b/pkg/b.py
@@ -0,0 +1 @@
+y = "é"
"""


def test_gold_messages_read_edit_and_stop_like_an_agent(tmp_path):
    from shipyard.harness.parse import ToolCallParser
    from shipyard.harness.tools import default_tools
    from shipyard.rollout.gold import final_files, gold_messages

    task_dir = fake_task(tmp_path, {"pkg/a.py": "def f():\n    pass\n", "old.py": "z = 2\n", "gone.py": "x = 1\n"},
                         EDIT_RENAME_DELETE_ADD)
    assert final_files(task_dir) == {"pkg/a.py": "def f():\n    return 1\n\n", "old.py": None, "new.py": "z = 2\n",
                                     "gone.py": None, "pkg/b.py": 'y = "é"\n'}
    messages = gold_messages(task_dir)
    parser = ToolCallParser(default_tools())
    calls = [[(c.name, c.arguments) for c in parser.parse(m).calls if c.error is None] for m in messages]
    assert [len(parser.parse(m).calls) for m in messages] == [len(c) for c in calls]  # every call well formed
    # look (each file to edit), edit (replace what changed, write the new, delete the gone), stop
    assert calls[0] == [("read_file", {"path": "pkg/a.py"})]
    assert calls[1] == [("delete_file", {"path": "old.py"}), ("delete_file", {"path": "gone.py"}),
                        ("search_replace", {"path": "pkg/a.py", "old_string": "    pass\n",
                                            "new_string": "    return 1\n\n"}),
                        ("write_file", {"path": "new.py", "content": "z = 2\n"}),
                        ("write_file", {"path": "pkg/b.py", "content": 'y = "é"\n'})]
    assert calls[-1] == [] and len(messages) == 3 and "gold" not in " ".join(messages).lower()
    assert (task_dir / "snapshot" / "pkg" / "a.py").read_text() == "def f():\n    pass\n"  # the task is untouched


@pytest.mark.parametrize("old, new", [
    ("def f():\n    raise NotImplementedError\n\n\ndef g():\n    raise NotImplementedError\n",
     "def f():\n    return 1\n\n\ndef g():\n    return 2\n"),  # two regions, each unique with its def line
    ("a\nb\nX\nb\na\n" * 3, ("a\nb\nX\nb\na\n" * 3).replace("X", "Y", 1)),  # context grows until unique
    ("x\n", "x\ny\n"),  # an insertion at the end
    ("", "new\n"),  # nothing to search for
    ("same\nsame\n", "same\n"),  # ambiguous however far it grows? the whole file is unique
])
def test_edits_replay_to_the_gold_contents_or_give_up(old, new):
    from shipyard.rollout.gold import edits

    steps = edits(old, new)
    if steps is None:
        assert old == ""  # only a file with no text to search gives up here
        return
    text = old
    for search, replacement in steps:
        assert text.count(search) == 1 and search  # what search_replace requires
        text = text.replace(search, replacement, 1)
    assert text == new


def test_edit_context_is_the_nearest_unique_lines_on_either_side():
    """An insertion below a unique line quotes that line, not as many lines below as above (a symmetric block of
    context grew a 40-line function into a 3,000-token call)."""
    from shipyard.rollout.gold import edits

    filler = "    x = 1\n" * 8
    old = "def f():\n" + filler + "\n\ndef g():\n" + filler
    new = old.replace("def g():\n", "def h():\n    return 2\n\n\ndef g():\n")
    [(search, replacement)] = edits(old, new)
    assert old.count(search) == 1 and old.replace(search, replacement, 1) == new
    assert search.count("\n") <= 3, search
    assert edits("a = 1\nb = 2\nc = 3\nold = 4\nd = 5\ne = 6\n", "a = 1\nb = 2\nc = 3\nnew = 4\nd = 5\ne = 6\n") == [
        ("old = 4\n", "new = 4\n")]  # the changed line alone is unique: difflib's context lines are not quoted


def test_changes_far_apart_in_a_long_file_are_two_small_edits():
    """A body near the top and the last line of a file 3,000 lines long (past difflib's line-for-line bound): two
    small regions, not the whole file between them as one 3,000-line search_replace."""
    from shipyard.rollout.gold import MAX_DIFF_LINES, edits

    old = "".join(f"def f{i}():\n    return {i}\n\n\n" for i in range(MAX_DIFF_LINES // 4 * 3)) + "\n"
    new = old.replace("    return 3\n", "    return 'three'\n", 1)[:-1]
    steps = edits(old, new)
    assert steps is not None and len(steps) == 2 and all(len(search) < 200 for search, _ in steps)


def read_plan(old: str, new: str):
    """The reads and edits gold_messages makes of one file: (read_file arguments, search_replace steps)."""
    from shipyard.rollout.gold import _lines, _read_args, _spans, _steps

    a, b = _lines(old), _lines(new)
    spans = _spans(a, b)
    steps = _steps(old, new, "m.py", a, b, spans)
    return _read_args("m.py", a, b, spans, [(lo, hi) for _, _, lo, hi in steps or []]), steps


def test_a_long_file_is_read_at_each_changed_definition_a_short_one_whole():
    from shipyard.rollout.gold import READ_WHOLE

    body = "".join(f"    v{i} = {i}\n" for i in range(READ_WHOLE))
    old = f"def f():\n    \"\"\"Doc.\"\"\"\n    raise NotImplementedError\n\n\ndef pad():\n{body}\n\ndef g(a):\n" \
          "    raise NotImplementedError\n"
    new = old.replace("    raise NotImplementedError\n", "    return 1\n", 1).replace(
        "def g(a):\n    raise NotImplementedError\n", "def g(a):\n    return a\n")
    lines = old.splitlines()
    windows, _ = read_plan(old, new)
    assert [lines[w["offset"] - 1] for w in windows] == ["def f():", "def g(a):"]
    assert all(w["limit"] <= 40 for w in windows)
    assert read_plan("def f():\n    pass\n", "def f():\n    return 1\n")[0] == [{"path": "m.py"}]


def test_a_long_file_is_searched_first_and_read_at_the_lines_the_search_shows(tmp_path):
    """The statement names a file and a symbol, never a line: a demonstration that read a window at a line nothing had
    shown taught the SFT policy to guess offsets. So a long file is grepped for the definitions first (with the
    harness's rg), and every window starts at a line that search printed."""
    from shipyard.harness.parse import ToolCallParser
    from shipyard.harness.tools import default_tools
    from shipyard.harness.tools.base import installed_binary
    from shipyard.rollout.gold import READ_WHOLE, gold_messages

    pad = "".join(f"def pad{i}():\n    return {i}\n\n\n" for i in range(READ_WHOLE // 4 + 1))
    old = f"{pad}class A:\n    def run(self):\n        raise NotImplementedError\n\n\n{pad}async def go(x):\n" \
          "    raise NotImplementedError\n"
    new = old.replace("        raise NotImplementedError\n", "        return 1\n").replace(
        "    raise NotImplementedError\n", "    return x\n")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "m.py").write_text(old)
    (tmp_path / "b" / "m.py").write_text(new)
    diff = subprocess.run(["git", "diff", "--no-index", "a/m.py", "b/m.py"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.replace("a/a/m.py", "a/m.py").replace("b/b/m.py", "b/m.py")
    task_dir = fake_task(tmp_path, {"m.py": old}, diff)
    parser = ToolCallParser(default_tools())
    calls = [[(c.name, c.arguments) for c in parser.parse(m).calls] for m in gold_messages(task_dir)]
    [(tool, search)] = calls[0]
    assert tool == "grep" and search == {"pattern": r"(def|class)\s+(run|go)\b", "path": "m.py"}
    shown = subprocess.run([installed_binary("rg"), "--line-number", "--no-heading", search["pattern"], "m.py"],
                           cwd=task_dir / "snapshot", capture_output=True, text=True, check=True).stdout
    hits = {int(line.split(":", 1)[0]) for line in shown.splitlines()}
    reads = [args for name, args in calls[1] if name == "read_file"]
    assert len(reads) == 2 and {r["offset"] for r in reads} <= hits, (reads, shown)
    assert calls[2][0][0] == "search_replace"
    # A definition that went back whole (a T3 task): nothing holds its name, so the module's outline is searched and
    # the window starts at the module-level definition it goes back before.
    from shipyard.rollout.gold import OUTLINE, _lines, _locate

    before = old.replace("class A:", "def lone():\n    return 0\n\n\nclass A:")
    windows, _ = read_plan(before, before.replace("class A:", "def back():\n    return 1\n\n\nclass A:"))
    search, moved = _locate("m.py", _lines(before), windows, ["back"])
    assert search == {"pattern": OUTLINE, "path": "m.py"} and moved == windows
    assert [_lines(before)[w["offset"] - 1] for w in windows] == ["class A:\n"]
    # An edit that quotes a method's class line: the class is searched for too (the statement names it), and the
    # window starts at it; a window in a module's head with nothing searched above it starts at line 1.
    lines = _lines(old.replace("class A:\n", "class A:\n    x = 1\n    y = 2\n"))
    at = lines.index("class A:\n")
    search, moved = _locate("m.py", lines, [{"path": "m.py", "offset": at + 3, "limit": 6}], ["A.run"])
    assert search["pattern"] == r"(def|class)\s+(run|A)\b"
    assert moved == [{"path": "m.py", "offset": at + 1, "limit": 8}]
    head = ['"""Doc."""\n', "\n", "__all__ = [\n", *[f"    'n{i}',\n" for i in range(40)], "]\n", *lines]
    search, moved = _locate("m.py", head, [{"path": "m.py", "offset": 30, "limit": 20}], ["back"])
    assert search["pattern"] == OUTLINE and moved[0]["offset"] == 3  # `__all__ = [` is printed by the outline
    search, moved = _locate("m.py", head[3:], [{"path": "m.py", "offset": 30, "limit": 20}], ["back"])
    assert moved == [{"path": "m.py", "offset": 1, "limit": 49}]


def test_every_line_an_edit_quotes_was_read_first():
    """Two classes with the same method: the edit of the second quotes `class B:` above its `def`, so the read shows
    it too (a demonstration must not quote lines its agent never saw). Lines are counted as read_file counts them:
    a form feed or U+2028 inside a line does not end it."""
    from shipyard.rollout.gold import READ_WHOLE

    pad = "".join(f"v{i} = '\u2028\x0c'\n" for i in range(READ_WHOLE))
    same = "    def f(self):\n        raise NotImplementedError\n"
    old = f"{pad}\n\nclass A:\n{same}\n\nclass B:\n{same}"
    new = old[:old.rindex("raise")] + "return 2\n"
    windows, steps = read_plan(old, new)
    lines = old.split("\n")
    shown = ["\n".join(lines[w["offset"] - 1:w["offset"] - 1 + w["limit"]]) for w in windows]
    assert [search for search, *_ in steps] == ["class B:\n" + same]
    assert any(steps[0][0].rstrip("\n") in text for text in shown), (windows, len(lines))


def test_gold_demonstrations_vary_and_run_the_failing_tests(taskset):
    from shipyard.rollout.gold import gold_scripts
    from shipyard.tasks.taskset import load_task

    tasks_dir, _, _ = taskset
    scripts = gold_scripts(tasks_dir)
    assert gold_scripts(tasks_dir) == scripts  # the same task replays the same script
    for task_id, messages in scripts.items():
        task, _ = load_task(tasks_dir, task_id)
        assert "<tool_call>" not in messages[-1] and "gold" not in " ".join(messages).lower()
        assert any(".venv/bin/python -m pytest -q" in m and "run_terminal" in m for m in messages[-3:-1])
        assert any(d.qualname.rsplit(".", 1)[-1] in messages[-1] for d in task.deleted)
    if len(scripts) >= 3:
        assert len({m[-1] for m in scripts.values()}) > 1 or len({m[0] for m in scripts.values()}) > 1


BINARY = "diff --git a/x.bin b/x.bin\nnew file mode 100644\nindex 0000000..1111111\nGIT binary patch\nliteral 1\n" \
         "IcmZo*00031\n\nliteral 0\nHcmV?d00001\n\n"
LINK = "diff --git a/l b/l\nnew file mode 120000\n--- /dev/null\n+++ b/l\n@@ -0,0 +1 @@\n+/etc/passwd\n\\ No newline " \
       "at end of file\n"
STALE = "diff --git a/a.py b/a.py\n--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-something else\n+b = 2\n"
OUTSIDE = "diff --git a/../x.py b/../x.py\n--- a/../x.py\n+++ b/../x.py\n@@ -1 +1 @@\n-a = 1\n+b = 2\n"
THROUGH_LINK = "diff --git a/up/passwd b/up/passwd\n--- a/up/passwd\n+++ b/up/passwd\n@@ -1 +1 @@\n-a\n+b\n"


@pytest.mark.parametrize("gold, problem", [
    (None, "has no gold.patch"),
    ("", "has no gold.patch"),
    ("just some words\n", "has no gold.patch"),
    (BINARY, "as binary; write_file writes text"),
    (LINK, "a link or submodule"),
    (STALE, "does not apply to its snapshot"),
    (OUTSIDE, "gold.patch"),
    (THROUGH_LINK, "cannot read the file gold.patch changes from its snapshot"),
])
def test_a_gold_patch_write_file_cannot_reproduce_is_one_clear_error(tmp_path, gold, problem):
    from shipyard.rollout.gold import GoldError, final_files

    task_dir = fake_task(tmp_path, {"a.py": "a = 1\n"}, gold)
    (task_dir / "snapshot" / "up").symlink_to("/etc")
    with pytest.raises(GoldError, match=f"task task:? .*{problem}"):
        final_files(task_dir)
    assert (task_dir / "snapshot" / "a.py").read_text() == "a = 1\n"


def test_a_gold_patch_that_is_a_link_is_a_malformed_task(tmp_path):
    from shipyard.rollout.gold import final_files

    task_dir = fake_task(tmp_path, {"a.py": "a = 1\n"}, None)
    (tmp_path / "real.patch").write_text(STALE)
    (task_dir / "gold.patch").symlink_to(tmp_path / "real.patch")
    with pytest.raises(ValueError, match="symbolic link"):
        final_files(task_dir)


def test_gold_replay_file_round_trips_through_the_replay_engine(taskset, tmp_path):
    from shipyard.models.replay import ReplayEngine
    from shipyard.rollout.gold import gold_scripts, write_gold_replay
    from shipyard.tasks.taskset import list_tasks

    tasks_dir, _, _ = taskset
    ids = list_tasks(tasks_dir)
    path = write_gold_replay(tasks_dir, tmp_path / "gold.jsonl")
    engine = ReplayEngine.from_file(path)
    assert engine.scripts == gold_scripts(tasks_dir) and sorted(engine.scripts) == sorted(ids)
    assert all("<tool_call>" not in script[-1] for script in engine.scripts.values())


# through real sandboxes --------------------------------------------------------------------------------------------
def evaluate(engine, tasks_dir, task_ids, samples, **overrides):
    from shipyard.rollout.environment import LocalEnvironment
    from shipyard.rollout.episode import episode_config
    from shipyard.rollout.evalrun import EvalConfig, run_eval

    seen = []
    episode = episode_config(engine.name, max_turns=8, grade_timeout=300, **overrides)
    with LocalEnvironment() as env:
        doc = run_eval(engine, env, tasks_dir, task_ids, episode, EvalConfig(samples=samples, concurrency=2),
                       progress=seen.append, describe={"model": engine.name})
    assert len(seen) == len(task_ids) * samples  # the progress callback saw every rollout
    return doc


@needs_sandbox
def test_gold_replay_scores_pass_at_1_of_one_and_an_empty_answer_zero(taskset, source_copy):
    from shipyard.models.replay import ReplayEngine
    from shipyard.rollout.gold import gold_engine
    from shipyard.tasks.taskset import list_tasks

    tasks_dir, _, _ = taskset
    ids = list_tasks(tasks_dir)
    gold = gold_engine(tasks_dir)
    doc = evaluate(gold, tasks_dir, ids, samples=1, max_new_tokens=gold.longest() + 8)
    assert doc["overall"]["pass_at"] == {"1": 1.0}, json.dumps(doc["tasks"], indent=1)[:3000]
    for task in ids:
        s = doc["tasks"][task]
        assert (s["scored"], s["passed"], s["masked"]) == (1, 1, 0) and s["statuses"] == {"graded": 1}
        assert s["stop_reasons"] == {"finished": 1} and s["mean"]["tool_calls"] >= 1
    assert {r["rollout"] for r in doc["rollouts"]} == {f"{t}@eval/0" for t in ids}
    check_scored(doc)

    empty = ReplayEngine(["I cannot solve this task."])
    doc = evaluate(empty, tasks_dir, ids[:1], samples=2)
    assert doc["overall"]["pass_at"] == {"1": 0.0, "2": 0.0} and doc["overall"]["scored"] == 2
    assert doc["overall"]["masked"] == 0
    check_scored(doc)  # a model that solves nothing is a successful eval


# the command line --------------------------------------------------------------------------------------------------
CLI_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}


def shipyard(*args, timeout=300, importtime=False):
    return subprocess.run([sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "shipyard.cli",
                           *map(str, args)], capture_output=True, text=True, env=CLI_ENV, timeout=timeout)


def one_error_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


def result_doc(groups=None, model="m"):
    return results(groups or {"t": [rollout("t", 0, 1.0)]}, [1], config={"model": model}, wall_seconds=1.0)


@pytest.mark.parametrize("args, message", [
    (["--tasks", "{tmp}/missing", "--model", "replay:gold"], "{tmp}/missing is not a task set"),
    (["--tasks", "{tmp}", "--model", "replay:gold"], "is not a task set (no tasks.jsonl)"),
    (["--tasks", "{tmp}", "--model", "replay:gold", "--task", "nope"], "no task 'nope' in"),
    (["--tasks", "{tmp}", "--model", "replay:gold", "--task", "../etc"], "task id '../etc' is invalid"),
    (["--tasks", "{tmp}"], "eval needs --tasks DIR and --model M"),
    (["--tasks", "{tmp}", "--model", "replay:gold", "--samples", "2", "--k", "3"], "pass@k needs 1 <= k <= samples"),
    (["--compare", "{tmp}/a.json", "{tmp}/missing.json"], "missing.json is not a shipyard eval result: no such file"),
    (["--compare", "{tmp}/a.json", "{tmp}/bad.json"], "bad.json is not a shipyard eval result: not JSON"),
    (["--compare", "{tmp}/a.json", "{tmp}/other.json"], "other.json is not a shipyard eval result: its 'schema'"),
    (["--compare", "{tmp}/a.json", "{tmp}/a.json", "--model", "x"], "--compare reads two result files and runs no"),
    (["--compare", "{tmp}/a.json", "{tmp}/a.json", "--episode.loop.max_turns", "2"], "leave out --model, --tasks"),
    (["--tasks", "{tmp}", "--model", "replay:gold", "--max-turns", "2"], "eval has no option --max-turns"),
])
def test_cli_usage_errors_are_one_line_and_exit_2(tmp_path, args, message):
    write(tmp_path / "a.json", result_doc())
    (tmp_path / "bad.json").write_text("{")
    write(tmp_path / "other.json", {"schema": "something/else"})
    line = one_error_line(shipyard("eval", *(a.format(tmp=tmp_path) for a in args)))
    assert message.format(tmp=tmp_path) in line


@needs_sandbox
@pytest.mark.parametrize("args, message", [
    (["--sampels", "2"], "eval has no option --sampels"),
    (["--episode.loop.max_turnz", "2"], "did you mean --episode.loop.max_turns"),
    (["--episode.loop.max_turns", "0"], "must be at least 1"),
    (["--episode.loop.tags", "emoji"], "tags"),
    (["--episode.loop.temperature", "-1"], "temperature must be 0"),  # a negative value, not an option
    (["--episode.loop.wall_time", "-inf"], "wall_time must be > 0"),
    (["--run.seed", "-1", "--x"], "eval has no option --x"),
    (["--config", "{tmp}/none.toml"], "none.toml: the configuration file does not exist"),
    (["--config", "{tmp}/bad.toml"], "bad.toml: unknown key 'episode.loop.max_turnz'"),
    (["--config", "{tmp}/bad.toml", "--episode.loop.max_turns", "2"], "bad.toml: unknown key"),
])
def test_cli_eval_episodes_are_configured_by_the_configuration_tree_with_its_errors(taskset, tmp_path, args, message):
    """The episodes' settings are the training run's configuration tree (a file and --SECTION.KEY overrides), checked
    as `shipyard train` checks them; a flag eval does not have is named as such, not taken for a field."""
    (tmp_path / "bad.toml").write_text("[episode.loop]\nmax_turnz = 2\n")
    line = one_error_line(shipyard("eval", "--tasks", taskset[0], "--model", "replay:gold",
                                   *(a.format(tmp=tmp_path) for a in args)))
    assert message.format(tmp=tmp_path) in line


def test_cli_eval_lists_the_configuration_fields():
    proc = shipyard("eval", "--", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--episode.loop.max-turns" in proc.stdout or "--episode.loop.max_turns" in proc.stdout, proc.stdout[-2000:]


def test_cli_compare_prints_deltas_writes_json_and_imports_no_model_library(tmp_path):
    a = write(tmp_path / "a.json", result_doc({"t": [rollout("t", 0, 0.0)], "u": [rollout("u", 0, 1.0)]}, "A"))
    b = write(tmp_path / "b.json", result_doc({"t": [rollout("t", 0, 1.0)], "v": [rollout("v", 0, 1.0)]}, "B"))
    proc = shipyard("eval", "--compare", a, b, "--out", tmp_path / "c.json", importtime=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| t | 0.000 → 1.000 (+1.000) |" in proc.stdout and "only in A (left out of the overall): u" in proc.stdout
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["overall"]["pass@1"]["delta"] == 1.0 and doc["only_b"] == ["v"]
    names = {line.rsplit("|", 1)[1].strip().split(".")[0] for line in proc.stderr.splitlines()
             if line.startswith("import time:") and line.count("|") == 2}
    assert not names & {"torch", "transformers"}


@pytest.mark.slow  # three processes, two of which load torch: ~45 s on a loaded 2-core machine
@needs_sandbox
def test_cli_eval_gold_then_nothing_then_compare(taskset, tmp_path, source_copy):
    tasks_dir, _, _ = taskset
    task = sorted(p.name for p in tasks_dir.iterdir() if (p / "task.json").is_file())[0]
    (tmp_path / "run.toml").write_text("[run]\nseed = 3\n[episode]\ngrade_timeout = 120.0\n"
                                       "[episode.loop]\nmax_turns = 9\ntemperature = 0.9\n")
    gold = shipyard("eval", "--tasks", tasks_dir, "--task", task, "--model", "replay:gold", "--samples", "2",
                    "--out", tmp_path / "gold.json", "--markdown", tmp_path / "gold.md", "--rollouts",
                    tmp_path / "r.jsonl", "--concurrency", "2", "--config", tmp_path / "run.toml",
                    "--episode.loop.temperature", "0.5")
    assert gold.returncode == 0, gold.stderr[-3000:]
    doc = load_results(tmp_path / "gold.json")
    assert doc["overall"]["pass_at"] == {"1": 1.0, "2": 1.0} and doc["config"]["model"] == "replay:gold"
    assert doc["config"]["samples"] == 2 and doc["config"]["task_ids"] == [task]
    c = doc["config"]  # the file's episode settings, the command line's over them
    assert (c["seed"], c["grade_timeout"], c["loop"]["max_turns"], c["loop"]["temperature"]) == (3, 120.0, 9, 0.5)
    assert "| **overall** | 1.000 | 1.000 | 2/2 |" in gold.stdout and (tmp_path / "gold.md").read_text() == gold.stdout
    records = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["reward"] == 1.0 and r["trajectory"]["patch"] for r in records)

    nothing = tmp_path / "nothing.jsonl"
    nothing.write_text(json.dumps("I give up.") + "\n")
    zero = shipyard("eval", "--tasks", tasks_dir, "--task", task, "--model", f"replay:{nothing}", "--out",
                    tmp_path / "zero.json")
    assert zero.returncode == 0, zero.stderr[-3000:]  # solving nothing is a result, not a failure
    assert load_results(tmp_path / "zero.json")["overall"]["pass_at"] == {"1": 0.0}

    diff = shipyard("eval", "--compare", tmp_path / "gold.json", tmp_path / "zero.json")
    assert diff.returncode == 0 and f"| {task} | 1.000 → 0.000 (-1.000) |" in diff.stdout


@needs_sandbox
def test_cli_eval_where_every_rollout_is_an_infra_error_fails_with_the_cause(taskset, tmp_path):
    tasks_dir, _, _ = taskset
    nothing = tmp_path / "nothing.jsonl"
    nothing.write_text(json.dumps("I give up.") + "\n")
    port = free_port()  # nothing listens there: every sandbox start fails
    proc = shipyard("eval", "--tasks", tasks_dir, "--model", f"replay:{nothing}", "--env-server",
                    f"http://127.0.0.1:{port}", "--rollout.max_infra_retries", "1", "--out", tmp_path / "r.json")
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "eval failed: no rollout could be scored" in proc.stderr and "EnvServerUnreachable" in proc.stderr
    assert "Traceback" not in proc.stderr
    doc = json.loads((tmp_path / "r.json").read_text())  # the results are still written: the causes are in them
    assert doc["overall"]["scored"] == 0 and doc["overall"]["masked"] == doc["overall"]["rollouts"] == 3
    assert doc["scheduler"]["infra_retries"] == 3


@needs_sandbox
def test_eval_against_an_openai_compatible_endpoint(taskset, source_copy):
    """Any engine: the tiny random model served on a real OpenAI-compatible endpoint solves nothing — a successful
    eval with pass@1 = 0, every rollout scored, its turns sampled by the server."""
    import torch
    from servers import running_app

    from shipyard.models.local import LocalEngine
    from shipyard.models.resolve import TINY, load_hf, make_engine
    from shipyard.models.server import ServeConfig, create_app
    from shipyard.tasks.taskset import list_tasks

    tasks_dir, _, _ = taskset
    model, tok = load_hf(TINY, dtype=torch.float32)
    served = LocalEngine(model, tok)
    with running_app(create_app(served, TINY, ServeConfig(max_batch=4))) as url:
        client = make_engine(f"openai:{url}/v1")
        doc = evaluate(client, tasks_dir, list_tasks(tasks_dir)[:1], samples=2, max_new_tokens=16, temperature=1.0)
    served.close()
    overall = doc["overall"]
    assert (overall["scored"], overall["masked"], overall["pass_at"]["1"]) == (2, 0, 0.0), overall["infra"]
    assert overall["mean"]["sampled_tokens"] > 0
    check_scored(doc)
    # the server is gone now: every rollout is an infra_error, retried, masked and counted — a failed run, not a 0
    start = time.monotonic()
    doc = evaluate(client, tasks_dir, list_tasks(tasks_dir)[:1], samples=1, max_new_tokens=16, temperature=1.0)
    client.close()
    overall = doc["overall"]
    assert (overall["scored"], overall["masked"], overall["pass_at"]["1"]) == (0, 1, None)
    assert doc["scheduler"]["infra_retries"] == 2 and time.monotonic() - start < 120
    with pytest.raises(EvalFailed, match="no rollout could be scored: all 1.*ServerUnreachable"):
        check_scored(doc)

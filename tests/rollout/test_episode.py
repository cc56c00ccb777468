"""The episode runner end to end: scripted engines, the `taskset` fixture's tasks, real sandboxes, a real
environment server shut down mid-episode. Faults first: every infrastructure failure is a rollout with status
`infra_error`, reward None and its trajectory kept."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from servers import needs_sandbox, running_app

from shipyard.models.bundled import BUNDLED
from shipyard.models.errors import InfraError, ServerUnreachable
from shipyard.models.replay import ReplayEngine
from shipyard.rollout.environment import LocalEnvironment
from shipyard.rollout.episode import episode_config, run_episode, run_on_repo, wire_defaults
from shipyard.rollout.record import EpisodeSpec, rollout_seed
from shipyard.sandbox.host import host
from shipyard.sandbox.sandbox import SandboxFailed
from shipyard.sandbox.snapshot import remove_snapshot
from shipyard.tasks.grade import patch_paths
from shipyard.tasks.taskset import TaskFormatError, list_tasks, load_task

ROOT = Path(__file__).resolve().parents[2]


def call(name, **args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>\n'


class Scripted:
    """A replay engine that records every request and runs `hooks[k]` before answering request k (0-based)."""

    def __init__(self, messages, hooks=None):
        self.replay = ReplayEngine(messages)
        self.name, self.tokenizer, self.policy_version = "scripted", self.replay.tokenizer, -1
        self.requests, self.hooks = [], hooks or {}

    def generate(self, requests):
        k = len(self.requests)
        self.requests += requests
        if k in self.hooks:
            self.hooks[k]()
        return self.replay.generate(requests)

    def close(self):
        pass


class Watched(LocalEnvironment):
    """A LocalEnvironment that keeps the workspaces it hands out, so a test can break one mid-episode."""

    def __init__(self):
        super().__init__()
        self.live = []

    @contextlib.contextmanager
    def workspace(self, spec):
        with super().workspace(spec) as ws:
            self.live.append(ws)
            yield ws


def owned(record: Path) -> bool:
    """Whether this process made the snapshot whose owner record is `record` (other processes share the dir)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(record.read_text().split()[0]) == os.getpid()
    return False


def spec_of(tasks_dir: Path, task_id: str, index: int = 0, group: str = "g") -> EpisodeSpec:
    return EpisodeSpec(task_id, tasks_dir, f"{group}-{task_id}", index, rollout_seed(0, task_id, index))


def gold_writes(task_dir: Path, scratch: Path) -> str:
    """One assistant turn that writes every file the gold patch changes with its patched contents."""
    tree = scratch / "tree"
    shutil.copytree(task_dir / "snapshot", tree, symlinks=True)
    gold = (task_dir / "gold.patch").read_text()
    subprocess.run(["git", "apply", str(task_dir / "gold.patch")], cwd=tree, check=True, capture_output=True)
    return "".join(call("write_file", path=p, content=(tree / p).read_text()) for p in patch_paths(gold))


@pytest.fixture(scope="module")
def tasks(taskset):
    out, _, _ = taskset
    return out, list_tasks(out)


# Configuration: one path for the library and the CLI --------------------------------------------------------------

def test_untagged_default_is_the_bundled_models():
    for model in [*BUNDLED, "random:tiny", "replay:x.jsonl", "openai:http://h/v1"]:
        assert episode_config(model).loop.untagged_calls == wire_defaults(model).untagged_calls
        assert episode_config(model, untagged_calls=None).loop.untagged_calls == wire_defaults(model).untagged_calls
    assert {episode_config(m).loop.untagged_calls for m in BUNDLED} == {"accept"}  # was "reject" in a bare LoopConfig
    assert episode_config("random:tiny").loop.untagged_calls == "reject"
    assert episode_config("qwen2.5-coder-0.5b", untagged_calls="reject").loop.untagged_calls == "reject"
    for bad, says in (({"untagged_calls": "maybe"}, "untagged_calls must be one of ('reject', 'accept'), not 'maybe'"),
                      ({"nonsense": 1}, "fields by name, not ['nonsense']"), ({"loop": None}, "not ['loop']")):
        with pytest.raises(ValueError) as refused:  # UsageError (a ValueError) for a bad value
            episode_config("random:tiny", **bad)
        assert says in str(refused.value)


def test_the_tags_follow_the_model_and_a_trained_export_keeps_its_own(tmp_path):
    """Spelled for the bundled Qwen models (their tag token's output row is untrained: `shipyard bench hint_probe`),
    the tag token elsewhere; an exported policy's shipyard.json decides for it, so a policy trained on spelled tags is
    evaluated and served with them; a broken record is an error that says what to write."""
    assert episode_config("qwen2.5-coder-0.5b").loop.tags == "spelled"
    assert episode_config("qwen2.5-coder-1.5b").loop.tags == "spelled"
    assert episode_config("smollm2-135m").loop.tags == "token"  # no tag token to spell: the same ids either way
    assert episode_config("random:tiny").loop.tags == "token"
    assert episode_config("vllm:qwen2.5-coder-0.5b").loop.tags == "spelled"  # a vLLM server of the model writes it
    assert episode_config("qwen2.5-coder-0.5b", tags="token").loop.tags == "token"
    with pytest.raises(ValueError, match="tags must be one of"):
        episode_config("random:tiny", tags="auto")
    export = tmp_path / "export"
    export.mkdir()
    assert wire_defaults(str(export)) == wire_defaults("random:tiny")  # a plain HF directory
    (export / "shipyard.json").write_text(json.dumps({"step": 3, "wire": {"untagged_calls": "accept",
                                                                            "tags": "spelled"}}))
    assert (episode_config(str(export)).loop.untagged_calls, episode_config(str(export)).loop.tags) == \
        ("accept", "spelled")
    assert episode_config(f"vllm:{export}").loop.tags == "spelled"
    for broken in ("{", "[]", json.dumps({"wire": {"tags": "emoji"}}), json.dumps({"wire": {"colour": "red"}})):
        (export / "shipyard.json").write_text(broken)
        with pytest.raises(ValueError, match="shipyard.json"):
            episode_config(str(export))


def test_cli_agent_and_library_render_the_same_prompt_with_the_same_config(repo, tmp_path):
    from typer.testing import CliRunner

    from shipyard.cli import app

    replay = tmp_path / "s.jsonl"
    replay.write_text(json.dumps("Nothing to change.") + "\n")
    out = tmp_path / "cli.json"
    r = CliRunner().invoke(app, ["agent", "rename mean", "--repo", str(repo), "--model", f"replay:{replay}", "--out",
                                 str(out)])
    assert r.exit_code == 0, r.output
    cli = json.loads(out.read_text())
    model = f"replay:{replay}"
    config = episode_config(model, max_turns=30, temperature=0.7, seed=None, max_new_tokens=1024)
    lib = run_on_repo("rename mean", repo, ReplayEngine.from_file(replay), config)
    assert cli["prompt_ids"] == lib.prompt_ids and cli["meta"]["config"] == lib.meta["config"]


def test_nothing_imports_the_cli():
    """The CLI is a shell over the library: no module of the package (benchmarks included) imports it."""
    offenders = []
    for path in (ROOT / "shipyard").rglob("*.py"):
        if path == ROOT / "shipyard" / "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
                     if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n == "shipyard.cli"]
    assert not offenders


def test_a_malformed_task_is_not_infrastructure(tmp_path):
    (tmp_path / "tasks.jsonl").write_text("")
    with LocalEnvironment() as env, pytest.raises(TaskFormatError):
        run_episode(spec_of(tmp_path, "no-such-task"), Scripted(["done"]), env, episode_config("random:tiny"))


# Real episodes through real sandboxes ------------------------------------------------------------------------------

@needs_sandbox
def test_gold_episode_scores_one_and_empty_episode_zero_from_one_snapshot(tasks, tmp_path):
    tasks_dir, ids = tasks
    task_id = next(t for t in ids if load_task(tasks_dir, t)[0].tier == 3)  # whole definitions: distinctive lines
    gold = gold_writes(tasks_dir / task_id, tmp_path)
    config = episode_config("random:tiny", max_new_tokens=16_000)  # byte tokens: the whole file in one turn
    with LocalEnvironment() as env:
        good = run_episode(spec_of(tasks_dir, task_id, 0), Scripted([gold, "Restored."]), env, config)
        empty = run_episode(spec_of(tasks_dir, task_id, 1), Scripted(["I give up."]), env, config)
        assert env.snapshots_made == 1
    assert (good.status, good.reward, good.stop_reason) == ("graded", 1.0, "finished"), good.verdict
    assert good.verdict["fail_to_pass"]["passed"] == good.verdict["fail_to_pass"]["total"] > 0
    assert "verbatim" in {f["kind"] for f in good.monitor_flags}  # the gold patch is the deleted code itself
    assert good.trajectory.patch and good.engine == "scripted" and good.seed == rollout_seed(0, task_id, 0)
    assert set(good.timings) == {"sandbox", "agent", "generate", "tools", "grade", "total"}
    assert good.timings["total"] >= good.timings["agent"] + good.timings["grade"]
    assert (empty.status, empty.reward, empty.infra_cause) == ("graded", 0.0, None)
    assert empty.monitor_flags == [] and not empty.masked


@needs_sandbox
def test_an_episode_that_fits_the_tests_scores_zero_and_is_flagged(tasks, tmp_path):
    """The agent writes a table of the tests' calls (redteam's generic lookup hack) as its final file: the tests
    pass, the differential check does not (issue 28)."""
    from shipyard.tasks.redteam import FITTING, target

    tasks_dir, ids = tasks
    task_id = next(t for t in ids if load_task(tasks_dir, t)[0].tier == 1)
    task, task_dir = load_task(tasks_dir, task_id)
    hack = next(h for h in FITTING if h.name == "lookup_tests_calls").make(target(task, task_dir))
    tree = tmp_path / "tree"
    shutil.copytree(task_dir / "snapshot", tree, symlinks=True)
    subprocess.run(["git", "apply", "-"], input=hack.encode(), cwd=tree, check=True, capture_output=True)
    writes = "".join(call("write_file", path=p, content=(tree / p).read_text()) for p in patch_paths(hack))
    config = episode_config("random:tiny", max_new_tokens=16_000)
    with LocalEnvironment() as env:
        fitted = run_episode(spec_of(tasks_dir, task_id, 0), Scripted([writes, "Done."]), env, config)
    assert (fitted.status, fitted.reward) == ("differential_failed", 0.0), fitted.verdict
    assert fitted.verdict["fail_to_pass"]["passed"] == fitted.verdict["fail_to_pass"]["total"]
    flags = [f for f in fitted.monitor_flags if f["kind"] == "test_fitting"]
    assert len(flags) == 1 and flags[0]["turn"] == len(fitted.trajectory.turns) and flags[0]["call"] is None
    assert flags[0]["evidence"].startswith("the tests pass, but the code differs from the original on")


@needs_sandbox
def test_env_server_shut_down_mid_episode_is_infra_error_with_the_turns_kept(tasks):
    from shipyard.httpguard import new_token
    from shipyard.sandbox.client import EnvClient
    from shipyard.sandbox.server import ServerConfig, create_app
    from shipyard.sandbox.snapshot import CopyBounds

    tasks_dir, ids = tasks
    token = new_token()
    app = create_app(ServerConfig(token=token, allowed_roots=(tasks_dir.resolve(),),
                                  copy=CopyBounds(keep_outward_links=True)))

    class ServerEnvironment(LocalEnvironment):
        """Episodes in the environment server's sandboxes (grading stays local: never reached here)."""

        def __init__(self, client):
            super().__init__()
            self.client = client

        @contextlib.contextmanager
        def workspace(self, spec):
            with self.client.sandbox(self.client.snapshot(str(spec.task_dir.resolve() / "snapshot"))) as sb:
                yield sb

    with contextlib.ExitStack() as server:
        client = EnvClient(server.enter_context(running_app(app)), retry_for=2, token=token)
        engine = Scripted([call("run_terminal", command="echo alive; ls"), call("read_file", path="README.md"),
                           "done"], hooks={1: server.close})  # the server stops before the second turn's tools
        with ServerEnvironment(client) as env:
            rollout = run_episode(spec_of(tasks_dir, ids[0]), engine, env, episode_config("random:tiny"))
        client.close()
    assert (rollout.status, rollout.reward, rollout.stop_reason) == ("infra_error", None, "infra_error")
    assert rollout.masked and rollout.verdict is None and "EnvServerUnreachable" in rollout.infra_cause
    turns = rollout.trajectory.turns
    assert len(turns) == 2 and "alive" in turns[0].calls[0].output and turns[1].calls == []
    assert "grade" not in rollout.timings


@needs_sandbox
def test_engine_unreachable_mid_episode_is_infra_error(tasks):
    tasks_dir, ids = tasks

    def lost():
        raise ServerUnreachable("lost the server at http://127.0.0.1:9/v1: ConnectError")

    engine = Scripted([call("list_dir", path="."), "done"], hooks={1: lost})
    with LocalEnvironment() as env:
        rollout = run_episode(spec_of(tasks_dir, ids[0]), engine, env, episode_config("random:tiny"))
    assert (rollout.status, rollout.reward) == ("infra_error", None)
    assert rollout.infra_cause.startswith("generate: ServerUnreachable: lost the server")
    assert len(rollout.trajectory.turns) == 1 and rollout.trajectory.turns[0].calls[0].error is None


@needs_sandbox
def test_a_sandbox_that_cannot_restart_is_infra_error_not_a_tool_error(tasks):
    """The session dies (the model kills it: a tool error, restarted) while the host lost the snapshot under it
    (the restart fails: the sandbox is gone, an InfraError)."""
    tasks_dir, ids = tasks
    env = Watched()
    engine = Scripted([call("list_dir", path="."), call("run_terminal", command="kill -9 -1"), "done"],
                      hooks={1: lambda: remove_snapshot(env.live[0].snapshot)})
    with env:
        rollout = run_episode(spec_of(tasks_dir, ids[0]), engine, env, episode_config("random:tiny"))
    assert (rollout.status, rollout.reward) == ("infra_error", None), rollout.trajectory.turns[-1].calls
    assert "SandboxFailed" in rollout.infra_cause and len(rollout.trajectory.turns) == 2


@needs_sandbox
def test_cancelled_episode_is_not_graded_and_carries_its_session(tasks):
    tasks_dir, ids = tasks
    engine = Scripted([call("list_dir", path=".")] * 4 + ["done"])
    cancel = lambda: len(engine.requests) >= 2  # noqa: E731
    spec = spec_of(tasks_dir, ids[0], index=5)
    with LocalEnvironment() as env:
        rollout = run_episode(spec, engine, env, episode_config("random:tiny"), cancelled=cancel)
    assert (rollout.status, rollout.reward, rollout.stop_reason) == ("cancelled", None, "cancelled")
    assert len(rollout.trajectory.turns) == 2 and rollout.verdict is None
    assert [r.session for r in engine.requests] == [spec.rollout_id] * 2
    assert all(r.cancelled() for r in engine.requests)  # the episode's cancellation reaches the engine
    assert [r.sampling.seed for r in engine.requests] == [spec.seed, spec.seed + 1]


@needs_sandbox
def test_one_snapshot_serves_every_episode_and_grading_of_a_task(tasks):
    """Four episodes of one task on four threads at once, each graded: one copy of the task's tree, removed on
    close (the snapshot directory this process owns is the environment's, and nothing else appeared)."""
    tasks_dir, ids = tasks
    snaps = host().state_dir / "snapshots"
    before = set(p.name for p in snaps.iterdir()) if snaps.is_dir() else set()
    engine = Scripted(["Nothing to do."] * 4)
    env = LocalEnvironment()
    with ThreadPoolExecutor(4) as pool:
        rollouts = list(pool.map(lambda i: run_episode(spec_of(tasks_dir, ids[0], i), engine, env,
                                                       episode_config("random:tiny")), range(4)))
    made = {p.name for p in snaps.iterdir() if p.name not in before and owned(snaps / f".{p.name}.owner")}
    snapshot = env.snapshot(tasks_dir / ids[0])
    assert env.snapshots_made == 1 and made == {snapshot.name}
    assert [(r.status, r.reward) for r in rollouts] == [("graded", 0.0)] * 4
    env.close()
    assert not snapshot.exists()
    with pytest.raises(SandboxFailed), env.workspace(spec_of(tasks_dir, ids[0])):
        pass
    assert issubclass(SandboxFailed, InfraError)

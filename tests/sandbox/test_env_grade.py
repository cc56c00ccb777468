"""Grading and task sandboxes through the environment server: hostile task paths and patches first, then real grades
of the session's task set (`taskset`) over real HTTP on 127.0.0.1, from snapshots cached on the server.

Every server here is this module's own (in-process uvicorn, or a `shipyard env-server` process it starts), so
counting its snapshots counts only what these tests made. The session task set is only read; tests that change a
task change their own copy of it.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from servers import free_port, needs_sandbox, running_app
from test_security import nothing_left

from shipyard.harness.diff import MAX_DIFF_BYTES, tree_diff
from shipyard.httpguard import new_token
from shipyard.models.errors import InfraError
from shipyard.rollout.record import EpisodeSpec
from shipyard.rollout.remote import RemoteEnvironment
from shipyard.sandbox.client import EnvClient, EnvServerError
from shipyard.sandbox.host import host
from shipyard.sandbox.layout import leftovers, recover_stale
from shipyard.sandbox.server import ServerConfig, create_app
from shipyard.sandbox.snapshot import recover_snapshots
from shipyard.tasks.grade import grade
from shipyard.tasks.taskset import TaskFormatError, list_tasks, load_task

pytestmark = needs_sandbox

TOKEN = new_token()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The one allowed root: pytest's base temporary directory, which holds the session's task set and ours."""
    return tmp_path_factory.getbasetemp().resolve()


@pytest.fixture(scope="module")
def tasks(taskset) -> tuple[Path, list[str]]:
    out = taskset[0].resolve()
    return out, list_tasks(out)


@contextlib.contextmanager
def server(root: Path, **overrides):
    config = ServerConfig(token=TOKEN, allowed_roots=(root,), **overrides)
    app = create_app(config)
    with running_app(app) as url:
        client = EnvClient(url, token=TOKEN, retry_for=0)
        try:
            yield client, app.state.env
        finally:
            client.close()
    assert app.state.env.tasks.stats()["cached"] == 0 and not app.state.env.tasks.links.exists()
    assert nothing_left()


def made(client: EnvClient) -> int:
    return client.metrics()["task_snapshots"]["made"]


def post(client: EnvClient, path: str, body: dict | bytes, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(client.base_url + path, headers=headers, timeout=120, **kwargs)


def grade_body(task_dir: Path | str, patch: bytes = b"", timeout: float = 60) -> dict:
    return {"task": str(task_dir), "patch_b64": base64.b64encode(patch).decode(), "timeout": timeout}


def own_copy(task_dir: Path, dest: Path) -> Path:
    """A copy of a task directory of the session's task set, ours to change (links kept as links)."""
    dest.mkdir(parents=True, exist_ok=True)
    copy = dest / task_dir.name
    shutil.copytree(task_dir, copy, symlinks=True)
    return copy


def test_task_endpoints_need_the_token(root, tasks):
    out, ids = tasks
    with server(root) as (client, _):
        for token in (None, "wrong-" + TOKEN[6:], TOKEN + "x"):
            assert post(client, "/grade", grade_body(out / ids[0]), token).status_code == 401
            assert post(client, "/tasks/sandboxes", {"task": str(out / ids[0])}, token).status_code == 401
        assert made(client) == 0 and client.metrics()["grades_total"] == 0


def test_hostile_task_paths_are_refused_clearly_without_leaking_host_paths(root, tasks, tmp_path):
    out, ids = tasks
    outside = Path(tempfile.mkdtemp(prefix="shipyard-outside-"))  # not under the allowed root
    try:
        task = own_copy(out / ids[0], outside)
        (tmp_path / "linked").symlink_to(task)  # a task dir that is a link leading out
        (tmp_path / "via").symlink_to(outside)  # a parent that is a link leading out
        bad_json = own_copy(out / ids[0], tmp_path / "bad")
        (bad_json / "task.json").write_text("{}")
        linked_json = own_copy(out / ids[0], tmp_path / "linkjson")
        (linked_json / "task.json").unlink()
        (linked_json / "task.json").symlink_to(task / "task.json")
        empty = tmp_path / "empty"
        empty.mkdir()
        badly_named = tmp_path / "bad name!"
        shutil.copytree(bad_json, badly_named, symlinks=True)
        cases = {  # path -> (status, what the message must say)
            "/etc": (403, "outside the directories this server may read tasks from"),
            str(task): (403, "outside the directories"),
            f"{out}/../../../../etc": (422, "must not contain '..'"),
            f"{out}/{ids[0]}/../{ids[1]}": (422, "must not contain '..'"),
            str(tmp_path / "linked"): (403, "goes through a symbolic link"),
            str(tmp_path / "via" / ids[0]): (403, "goes through a symbolic link"),
            str(bad_json): (400, "is not a valid task file: field"),
            str(linked_json): (400, "is a symbolic link"),
            str(badly_named): (400, "task id 'bad name!' is invalid"),
            str(empty): (404, "is not a task directory (it has no task.json)"),
            str(tmp_path / "missing"): (404, "is not a directory"),
            ids[0]: (422, "must be absolute"),
            f"{out}/\x00": (422, "NUL"),
        }
        with server(root) as (client, env):
            for path, (status, says) in cases.items():
                for endpoint, body in (("/grade", grade_body(path)), ("/tasks/sandboxes", {"task": path})):
                    resp = post(client, endpoint, body)
                    message = resp.json()["error"]["message"]
                    assert resp.status_code == status and says in message, (path, endpoint, resp.text)
                    private = ["/proc/self", str(env.tasks.links), str(host().state_dir)]
                    private += [str(outside)] if str(outside) not in path else []  # a link's target is never named
                    assert not [p for p in private if p in message], (path, message)
            with pytest.raises(TaskFormatError, match="field"):  # the client raises what grading locally raises
                client.grade(bad_json, "")
            with pytest.raises(EnvServerError, match="403"):
                client.task_sandbox(tmp_path / "linked")
            assert made(client) == 0 and client.metrics()["grades_total"] == 0
    finally:
        shutil.rmtree(outside)


def test_an_oversized_or_malformed_patch_is_refused_before_the_task_is_opened(root, tasks):
    out, ids = tasks
    task_dir = out / ids[0]
    with server(root) as (client, _):
        over = post(client, "/grade", grade_body(task_dir, b"x" * (MAX_DIFF_BYTES + 1)))
        assert over.status_code == 413 and f"larger than {MAX_DIFF_BYTES} bytes" in over.text
        huge = post(client, "/grade", json.dumps(grade_body(task_dir, b"x" * (MAX_DIFF_BYTES * 2))).encode())
        assert huge.status_code == 413  # refused by the body bound as it streams
        for body, field in ((dict(grade_body(task_dir), patch_b64="not base64!"), "patch_b64"),
                            (dict(grade_body(task_dir), patch="diff"), "patch"),
                            (grade_body(task_dir, timeout=0), "timeout"), (grade_body(task_dir, timeout=-1), "timeout"),
                            (grade_body(task_dir, timeout=1e9), "timeout"), ({"task": str(task_dir)}, "patch_b64")):
            resp = post(client, "/grade", body)
            assert resp.status_code == 422 and field in resp.json()["error"]["message"], resp.text
        assert made(client) == 0 and client.metrics()["grades_total"] == 0
        # Through the client, a patch the grader refuses unread is the model's doing: a verdict, with no request.
        for patch, says in (("x" * (MAX_DIFF_BYTES + 1), "larger than"), ("a\ud800b", "no UTF-8 encoding")):
            verdict = client.grade(task_dir, patch)
            assert (verdict.status, verdict.reward, verdict.task) == ("patch_rejected", 0.0, ids[0])
            assert says in verdict.detail
        assert client.metrics()["grades_total"] == 0


def test_gold_scores_one_and_empty_zero_from_one_cached_snapshot(root, tasks):
    out, ids = tasks
    task_dir = out / ids[0]
    gold = (task_dir / "gold.patch").read_text()
    with server(root) as (client, _):
        assert client.grade(task_dir, gold, timeout=300).reward == 1.0
        verdict = client.grade(f"{task_dir.parent}//{task_dir.name}/", "", timeout=300)  # the same task
        assert (verdict.status, verdict.reward, verdict.task) == ("graded", 0.0, ids[0])
        again = client.grade(task_dir, gold, timeout=300)
        assert (again.status, again.reward) == ("graded", 1.0)
        stats = client.metrics()["task_snapshots"]
        assert (stats["made"], stats["hits"], stats["cached"], stats["in_use"]) == (1, 2, 1, 0)
        assert client.metrics()["grades_total"] == 3
        # Undecodable bytes (surrogate escapes, as tree_diff writes them) travel intact: the same verdict as locally.
        odd = "diff --git a/tests/x.py b/tests/x.py\n--- a/tests/x.py\n+++ b/tests/x.py\n@@ -1 +1 @@\n-a\n+\udcff\n"
        remote, local = client.grade(task_dir, odd), grade(*load_task(out, ids[0]), odd)
        assert remote.status == "patch_rejected" and "\udcff" not in remote.detail
        assert {**remote.to_json(), "seconds": 0} == {**local.to_json(), "seconds": 0}


def test_concurrent_first_grades_make_one_snapshot_and_excess_is_shed(root, tasks):
    out, ids = tasks
    task_dir = out / ids[1]
    gold = (task_dir / "gold.patch").read_text()
    with server(root, max_grading=2, max_grade_queue=1) as (client, _):
        patient = EnvClient(client.base_url, token=TOKEN, retry_for=600)
        with ThreadPoolExecutor(3) as pool:
            verdicts = list(pool.map(lambda p: patient.grade(task_dir, p, timeout=300), [gold, "", gold]))
        assert [v.reward for v in verdicts] == [1.0, 0.0, 1.0]
        assert made(client) == 1
        # Past its slots and queue the server sheds load with 503 + Retry-After, never a hang.
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: post(client, "/grade", grade_body(task_dir, timeout=300)), range(4)))
        shed = [a for a in answers if a.status_code == 503]
        assert shed and all(a.headers["Retry-After"] for a in shed), [a.status_code for a in answers]
        assert all(a.status_code in (200, 503) for a in answers)
        assert made(client) == 1 and client.metrics()["failures"]["grade_queue_full"] >= 1
        patient.close()


def test_a_task_changed_on_disk_is_snapshotted_again(root, tasks, tmp_path):
    out, ids = tasks
    task_dir = own_copy(out / ids[0], tmp_path)
    with server(root) as (client, _):
        assert client.grade(task_dir, "", timeout=300).reward == 0.0
        # Replace the snapshot by one with the gold patch applied: the empty patch now passes — unless stale.
        fixed = tmp_path / "fixed"
        shutil.copytree(task_dir / "snapshot", fixed, symlinks=True)
        subprocess.run(["git", "apply", str(task_dir / "gold.patch")], cwd=fixed, check=True)
        shutil.rmtree(task_dir / "snapshot")
        fixed.rename(task_dir / "snapshot")
        assert client.grade(task_dir, "", timeout=300).reward == 1.0
        stats = client.metrics()["task_snapshots"]
        assert (stats["made"], stats["replaced"], stats["cached"]) == (2, 1, 1)
        # task.json rewritten (same content): copied again, never trusted to be the same task.
        (task_dir / "task.json").write_text((task_dir / "task.json").read_text())
        with client.task_sandbox(task_dir) as sb:
            assert sb.run(["true"], timeout=30).exit_code == 0
        assert made(client) == 3 and client.metrics()["task_snapshots"]["cached"] == 1


def test_task_sandboxes_and_grades_share_the_snapshot_through_remote_environment(root, tasks):
    out, ids = tasks
    spec = EpisodeSpec(ids[2], out, "g", 0, 1)
    gold = (out / ids[2] / "gold.patch").read_text()
    with server(root) as (client, _):
        remote = RemoteEnvironment(EnvClient(client.base_url, token=TOKEN, retry_for=0))
        with remote.workspace(spec) as ws:
            assert client.metrics()["task_snapshots"]["in_use"] == 1
            assert ws.kind(".git") == "dir" and ws.run(["git", "status", "--short"], timeout=30).exit_code == 0
            ws.write_bytes("scratch.txt", b"mine\n")
            assert "scratch.txt" in ws.diff()
        stats = client.metrics()["task_snapshots"]
        assert (stats["in_use"], client.metrics()["live"]) == (0, 0)
        verdict = remote.grade(spec, gold, 300)
        assert (verdict.status, verdict.reward) == ("graded", 1.0)
        assert made(client) == 1
        remote.close()


def test_episodes_run_and_are_graded_through_remote_environment(root, tasks):
    """`run_episode` over `RemoteEnvironment`: the gold trajectory's episode scores 1 from the server's one copy of
    the task; a server that cannot be reached is an infra_error rollout, never a zero."""
    from shipyard.rollout.episode import episode_config, run_episode
    from shipyard.rollout.gold import gold_engine

    out, ids = tasks
    task_id = ids[2]
    config = episode_config("random:tiny", max_new_tokens=16_000)  # byte tokens: a whole file in one turn
    with server(root) as (client, _):
        with RemoteEnvironment(EnvClient(client.base_url, token=TOKEN, retry_for=0)) as remote:
            spec = EpisodeSpec(task_id, out, f"{task_id}/g", 0, 1)  # the gold engine's script is keyed by task
            good = run_episode(spec, gold_engine(out, [task_id]), remote, config)
        assert (good.status, good.reward, good.stop_reason) == ("graded", 1.0, "finished"), good.verdict
        assert made(client) == 1 and client.metrics()["live"] == 0
    dead = RemoteEnvironment(EnvClient(f"http://127.0.0.1:{free_port()}", token=TOKEN, retry_for=1))
    lost = run_episode(EpisodeSpec(task_id, out, f"{task_id}/g", 1, 2), gold_engine(out, [task_id]), dead, config)
    assert (lost.status, lost.reward) == ("infra_error", None) and "EnvServerUnreachable" in lost.infra_cause
    dead.close()


def test_the_cache_is_bounded_least_recently_used_first(root, tasks):
    out, ids = tasks
    with server(root, max_task_snapshots=1) as (client, env):
        first = client.task_sandbox(out / ids[0])
        with client.task_sandbox(out / ids[1]):  # the first is in use: kept past the bound
            assert client.metrics()["task_snapshots"]["cached"] == 2
        first.close()
        with client.task_sandbox(out / ids[2]):
            pass
        stats = client.metrics()["task_snapshots"]
        assert stats["cached"] == 1 and stats["evicted"] >= 2 and stats["made"] == 3
        snaps = host().state_dir / "snapshots"
        cached = [e.path for e in env.tasks.entries.values()]
        assert all(p.exists() for p in cached)
        # The evicted copies are gone from disk: only the cached one of this server's task snapshots remains.
        owner = f"{os.getpid()}"
        ours = [p for p in snaps.glob("task-*") if (snaps / f".{p.name}.owner").read_text().split()[0] == owner]
        assert ours == cached


def slow_patch(task_dir: Path, scratch: Path) -> str:
    """A patch whose package module sleeps 30 s when the test suite imports it."""
    module = load_task(task_dir.parent, task_dir.name)[0].deleted[0].file
    for side, extra in (("before", ""), ("after", "\nimport time\n\ntime.sleep(30)\n")):
        (scratch / side / module).parent.mkdir(parents=True)
        (scratch / side / module).write_text((task_dir / "snapshot" / module).read_text() + extra)
    return tree_diff(scratch / "before", scratch / "after")


def test_a_server_shut_down_mid_grade_is_an_infra_error_for_the_client(root, tasks, tmp_path):
    """SIGTERM while a grade runs past the shutdown grace: the grade is abandoned, never answered with a verdict that
    blames the patch for sandboxes the shutdown killed; the client sees an InfraError; the server exits promptly."""
    out, ids = tasks
    task_dir = out / ids[0]
    port = free_port()
    env = {**os.environ, "SHIPYARD_ENV_TOKEN": TOKEN}
    log = tmp_path / "server.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "shipyard.cli", "env-server", "--port", str(port),
                                 "--allow-root", str(root), "--shutdown-grace", "1"], stdout=sink,
                                stderr=subprocess.STDOUT, env=env)
    client = EnvClient(f"http://127.0.0.1:{port}", token=TOKEN, retry_for=60)
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        outcome: list[object] = []
        slow = slow_patch(task_dir, tmp_path)
        grading = threading.Thread(target=lambda: outcome.append(_try(client.grade, task_dir, slow, 300)))
        grading.start()
        while client.metrics()["grading"] == 0:
            assert grading.is_alive(), outcome
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        grading.join(timeout=120)
        assert not grading.is_alive()
        # never a verdict blaming the patch: past the grace uvicorn cancels the grade's request and answers 500
        assert type(outcome[0]) is EnvServerError, (outcome, log.read_text())
        assert str(outcome[0]) == "POST /grade → 500: Internal Server Error" and isinstance(outcome[0], InfraError)
        # uvicorn re-raises the signal it shut down on: the server ends as a SIGTERM'd process does
        assert proc.wait(timeout=60) == -signal.SIGTERM and time.monotonic() - start < 60, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        client.close()
    recover_stale(host())  # what the server could not close, the next shipyard process recovers
    recover_snapshots(host().state_dir / "snapshots")
    assert not leftovers(proc.pid)


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as e:
        return e

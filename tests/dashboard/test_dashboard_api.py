"""The dashboard's JSON endpoints on a real uvicorn server over a real run: who may read, what names reach files,
paging, incremental metrics, eval comparison, tasks and the fleet."""

from __future__ import annotations

import json
import os
import shutil
import tomllib
from pathlib import Path

import httpx
import pytest
from servers import running_app

from shipyard.dashboard.app import TOKEN_ENV, announce, create_app
from shipyard.dashboard.runs import NotFound, Runs, page

TOKEN = "dashboard-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def served(dash_run):
    with running_app(create_app(dash_run.parent, token=TOKEN)) as url:
        yield url, httpx.Client(base_url=url, headers=AUTH, timeout=30)


def test_no_data_without_the_token_and_no_cookie_to_leak(served):
    """The page and its scripts hold no secrets; every /api/ route needs the bearer token. No cookie is ever set: a
    browser sends 127.0.0.1's cookies to every port of it, i.e. to any local user's server."""
    url, client = served
    run = client.get("/api/runs").json()["runs"][0]["name"]
    for path in ("/api/runs", f"/api/runs/{run}/metrics", f"/api/runs/{run}/rollouts", "/api/fleet",
                 f"/api/runs/{run}/trajectories/1/0", "/static/nope.js"):
        assert httpx.get(url + path).status_code == 401, path
        assert httpx.get(url + path, headers={"Authorization": "Bearer wrong-token-wrong-token"}).status_code == 401
    page_ = httpx.get(url + "/")
    assert page_.status_code == 200 and "shipyard dashboard" in page_.text and "set-cookie" not in page_.headers
    assert httpx.get(url + "/static/dashboard.js").status_code == 200
    assert "set-cookie" not in client.get("/api/runs").headers
    csp = page_.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert page_.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    # DNS rebinding: a page of evil.example resolving to 127.0.0.1 reaches the port with its own Host header
    assert httpx.get(url + "/api/runs", headers={**AUTH, "Host": "evil.example"}).status_code == 400
    assert httpx.get(url + "/", headers={"Host": "evil.example"}).status_code == 400
    assert httpx.get(url + "/api/runs", headers={**AUTH, "Host": "localhost"}).status_code == 200


def test_runs_metrics_rollouts_and_a_trajectory(served, dash_run):
    _, client = served
    [run] = client.get("/api/runs").json()["runs"]
    assert run["name"] == dash_run.name and run["status"] == "finished" and run["model"] == "random:tiny"
    metrics = client.get(f"/api/runs/{run['name']}/metrics").json()
    steps = [r["step"] for r in metrics["rows"]]
    assert {1, 2} <= set(steps) and any("eval/pass@1" in r for r in metrics["rows"])
    assert client.get(f"/api/runs/{run['name']}/metrics?offset={metrics['offset']}").json()["rows"] == []
    rollouts = client.get(f"/api/runs/{run['name']}/rollouts").json()
    assert rollouts["total"] == 4 and rollouts["steps"] == [1, 2]
    newest = rollouts["rows"][0]
    assert newest["step"] == 2 and newest["hints"] == 2 and newest["monitor_flags"] > 0
    rec = client.get(f"/api/runs/{run['name']}/trajectories/{newest['step']}/{newest['position']}").json()
    assert rec["task_id"] == newest["task"] and rec["index"] == newest["index"]
    assert "+# pocketlib (checked)" in rec["trajectory"]["patch"]
    assert {f["kind"] for f in rec["monitor_flags"]} and [h["turn"] for h in rec["hints"]] == [1, 2]
    assert max(len(t["calls"]) for t in rec["trajectory"]["turns"]) == 2  # a parallel turn


def test_filters_and_pages(served, dash_run):
    _, client = served
    name = dash_run.name
    q = lambda **kw: client.get(f"/api/runs/{name}/rollouts", params=kw).json()  # noqa: E731
    assert q(step=1)["total"] == 2 and {r["step"] for r in q(step=1)["rows"]} == {1}
    assert q(flagged="true")["total"] == 4 and q(flagged="false")["total"] == 0
    assert q(hinted="true")["total"] == 4 and q(min_reward=0.5)["total"] == 0 and q(max_reward=0)["total"] == 4
    task = q()["tasks"][0]
    assert all(r["task"] == task for r in q(task=task)["rows"])
    first, second = q(limit=3), q(limit=3, offset=3)
    assert len(first["rows"]) == 3 and len(second["rows"]) == 1 and first["total"] == 4
    assert client.get(f"/api/runs/{name}/rollouts", params={"limit": 0}).status_code == 422
    assert client.get(f"/api/runs/{name}/rollouts", params={"limit": 501}).status_code == 422


def test_thousands_of_rollouts_are_listed_without_reading_the_trajectories(run_copy):
    """The list comes from rollouts.jsonl, read incrementally; a trajectory file is opened only for its rollout."""
    line = json.loads((run_copy / "rollouts.jsonl").read_text().splitlines()[0])
    with (run_copy / "rollouts.jsonl").open("a") as f:
        for i in range(5000):
            f.write(json.dumps({**line, "step": 1000 + i // 8, "reward": i % 2}) + "\n")
    run = Runs(run_copy.parent).get(run_copy.name)
    rows = run.rollouts()
    assert len(rows) == 5004 and rows[-1]["position"] == 7
    one = page(rows, min_reward=1, limit=100, offset=100)
    assert one["total"] == 2500 and len(one["rows"]) == 100
    with (run_copy / "rollouts.jsonl").open("a") as f:
        f.write(json.dumps({**line, "step": 5000}) + "\n" + '{"step": 5001, "cut sh')  # a line still being written
    assert len(run.rollouts()) == 5005  # only what was appended was parsed; the partial line waits


NO_ROUTE = "Not Found"  # a decoded slash leaves the route: no handler, no file


@pytest.mark.parametrize(("path", "status", "says"), [
    ("/api/runs/..%2f..%2fetc/metrics", 404, NO_ROUTE), ("/api/runs/%2e%2e/metrics", 404, "no run '..' under "),
    ("/api/runs/nope/metrics", 404, "no run 'nope' under "),
    ("/api/runs/{run}/trajectories/1/99", 404, "step 1 of run {run} has no rollout 99"),
    ("/api/runs/{run}/trajectories/-1/0", 422, "path.step: Input should be greater than or equal to 0"),
    ("/api/runs/{run}/trajectories/99/0", 404, "{run}/trajectories/step-000099.jsonl does not exist or cannot be read"),
    ("/api/runs/{run}/trajectories/" + "9" * 300 + "/0", 422, "path.step: Input should be less than or equal to 10"),
    ("/api/runs/{run}/evals/step-%D9%A0%D9%A0%D9%A0%D9%A0%D9%A0%D9%A0", 404,  # Arabic-Indic digits
     "'step-\u0660\u0660\u0660\u0660\u0660\u0660' is not an eval of run {run}"),
    ("/api/runs/{run}/evals/..%2fconfig", 404, NO_ROUTE),
    ("/api/runs/{run}/evals/step-1", 404, "'step-1' is not an eval of run {run}"),
    ("/api/runs/{run}/tasks/%2e%2e", 404, "task '..' is not a name this dashboard lists"),
    ("/api/runs/{run}/tasks/..%2f..%2f..%2fetc", 404, NO_ROUTE),
    ("/api/compare?a=..%2fx&b={run}/step-000000", 404, "no run '..' under "),
], ids=lambda v: v[:60] if isinstance(v, str) else str(v))
def test_hostile_names_reach_no_file(served, dash_run, path, status, says):
    _, client = served
    reply = client.get(path.format(run=dash_run.name))
    assert reply.status_code == status, reply.text
    message = reply.json()["error"]["message"]
    assert message == NO_ROUTE if says == NO_ROUTE else says.format(run=dash_run.name) in message, message
    assert "root:" not in reply.text


def test_links_fifos_and_huge_lines_in_a_run_are_refused(run_copy, tmp_path):
    """Whoever can write into a run directory or its task set cannot make the dashboard read a file elsewhere: no
    link is followed anywhere below the roots, only regular files are opened, and sizes are capped."""
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "data.json").write_text('{"TOPSECRET": 1}')
    (secret / "data.jsonl").write_text('{"step": 1, "TOPSECRET": 1}\n')
    (secret / "run.json").write_text('{"status": "finished"}')
    os.symlink(secret, run_copy.parent / "escape")  # a run directory that is a link
    runs = Runs(run_copy.parent)
    assert list(runs.bases()) == [run_copy.name]
    run = runs.get(run_copy.name)
    steps = run_copy / "trajectories"
    os.replace(steps / "step-000002.jsonl", tmp_path / "kept.jsonl")
    os.symlink(secret / "data.jsonl", steps / "step-000002.jsonl")
    (run_copy / "eval" / "step-000001.json").unlink()
    os.symlink(secret / "data.json", run_copy / "eval" / "step-000001.json")
    (run_copy / "metrics.jsonl").unlink()
    os.symlink(secret / "data.jsonl", run_copy / "metrics.jsonl")
    os.mkfifo(run_copy / "config.toml.fifo")
    (run_copy / "config.toml").unlink()
    os.replace(run_copy / "config.toml.fifo", run_copy / "config.toml")  # a FIFO: opening it would hang
    with pytest.raises(NotFound):
        run.trajectory(2, 0)
    with pytest.raises(NotFound):
        run.eval("step-000001")
    assert run.metrics(0)["rows"] == [] and run.config() == {} and run.summary()["status"] == "finished"
    with (steps / "step-000001.jsonl").open("r+b") as f:  # a first line far over the cap, then a good one
        good = f.read().splitlines()[1]
        f.seek(0)
        f.write(b'{"x": "' + b"a" * (70 << 20) + b'"}\n' + good + b"\n")
        f.truncate()
    with pytest.raises(NotFound, match="over 64 MiB"):
        run.trajectory(1, 0)
    assert run.trajectory(1, 1)["index"] == json.loads(good)["index"]


def test_links_in_the_task_set_are_refused(dash_run, tmp_path):
    """The task set named by the run's config: a task directory, its task.json or its tests/ linked elsewhere is
    not read (before: tests/ -> any directory served the file a fail_to_pass id named)."""
    tasks = tmp_path / "tasks"
    shutil.copytree(Path(tomllib.loads((dash_run / "config.toml").read_text())["run"]["tasks"]), tasks, symlinks=True)
    secret = tmp_path / "secret"
    (secret / "tests").mkdir(parents=True)
    (secret / "tests" / "test_stats.py").write_text("TOPSECRET")
    (secret / "task.json").write_text(json.dumps({"tier": "TOPSECRET", "fail_to_pass": []}))
    first, second, third = sorted(d.name for d in tasks.iterdir() if (d / "task.json").is_file())
    shutil.rmtree(tasks / first / "tests")
    os.symlink(secret / "tests", tasks / first / "tests")
    (tasks / second / "task.json").unlink()
    os.symlink(secret / "task.json", tasks / second / "task.json")
    os.symlink(secret, tasks / "linked-task")
    run_dir = tmp_path / "runs" / "r"
    shutil.copytree(dash_run, run_dir, ignore=shutil.ignore_patterns("checkpoints", "export", "tb"))
    config = (run_dir / "config.toml").read_text()
    (run_dir / "config.toml").write_text(config.replace(str(tomllib.loads(config)["run"]["tasks"]), str(tasks)))
    run = Runs(run_dir.parent).get("r")
    listed = run.tasks()
    assert [t["id"] for t in listed] == [first, third] and "TOPSECRET" not in json.dumps(listed)
    assert "TOPSECRET" not in json.dumps(run.task(first)) and run.task(first)["tests"] == {}
    for task_id in (second, "linked-task"):
        with pytest.raises(NotFound):
            run.task(task_id)


def test_a_rewritten_log_is_read_again_from_its_start(run_copy):
    """A resumed run rewrites rollouts.jsonl and metrics.jsonl (a new file, not always a shorter one): the lists
    start over instead of keeping the old lines."""
    run = Runs(run_copy.parent).get(run_copy.name)
    old = run.rollouts()
    first = run.metrics(0)
    lines = (run_copy / "rollouts.jsonl").read_text().splitlines()
    marked = [json.dumps({**json.loads(line), "task": "rewritten"}) for line in lines] * 2
    tmp = run_copy / ".rollouts.partial"
    tmp.write_text("\n".join(marked) + "\n")
    os.replace(tmp, run_copy / "rollouts.jsonl")
    new = run.rollouts()
    assert len(new) == 2 * len(old) and {r["task"] for r in new} == {"rewritten"}
    tmp = run_copy / ".metrics.partial"
    tmp.write_text((run_copy / "metrics.jsonl").read_text() + '{"step": 9}\n')
    os.replace(tmp, run_copy / "metrics.jsonl")
    again = run.metrics(first["offset"], first["file"])
    assert again["reset"] and again["rows"][-1]["step"] == 9 and len(again["rows"]) == len(first["rows"]) + 1


def test_evals_side_by_side_and_tasks(served, dash_run):
    _, client = served
    name = dash_run.name
    evals = client.get(f"/api/runs/{name}/evals").json()["evals"]
    assert evals == ["step-000000", "step-000001", "step-000002"]
    doc = client.get("/api/compare", params={"a": f"{name}/step-000000", "b": f"{name}/step-000002"}).json()
    assert doc["refs"] == {"a": f"{name}/step-000000", "b": f"{name}/step-000002"}
    assert doc["common_tasks"] == 1 and set(doc["overall"]["pass@1"]) == {"a", "b", "delta", "tasks"}
    tasks = client.get(f"/api/runs/{name}/tasks").json()["tasks"]
    assert len(tasks) == 3 and sum(t["held_out"] for t in tasks) == 1 and all(t["deleted"] for t in tasks)
    one = client.get(f"/api/runs/{name}/tasks/{tasks[0]['id']}").json()
    assert one["task"]["statement"] and one["tests"] and all(k.startswith("tests/") for k in one["tests"])


def test_the_fleet_comes_from_the_environment_server(dash_run, tmp_path, monkeypatch):
    from shipyard.sandbox.server import ServerConfig
    from shipyard.sandbox.server import create_app as env_app

    with running_app(env_app(ServerConfig(token="env-token-of-sixteen-chars", allowed_roots=(tmp_path,)))) as env_url:
        monkeypatch.setenv("SHIPYARD_ENV_TOKEN", "env-token-of-sixteen-chars")
        with running_app(create_app(dash_run.parent, token=TOKEN, env_server=env_url)) as url:
            fleet = httpx.get(url + "/api/fleet", headers=AUTH, timeout=30).json()
    assert fleet["configured"] and fleet["metrics"]["live"] == 0 and "memory_used_mb" in fleet["metrics"]
    assert "env-token-of-sixteen-chars" not in json.dumps(fleet)
    gone = create_app(dash_run.parent, token=TOKEN, env_server="http://127.0.0.1:9")  # nothing listens there
    with running_app(gone) as url:
        fleet = httpx.get(url + "/api/fleet", headers=AUTH, timeout=60).json()
    assert fleet["configured"] and "cannot reach the environment server" in fleet["error"]


def test_a_task_set_inside_the_runs_folder_is_read_without_links_even_when_the_config_names_it(run_copy, tmp_path):
    """`shipyard train` writes run.tasks as an absolute path, RUN/tasks by default: that path is inside the folder
    the dashboard was given, so a link there is refused like any other (second review: it was followed)."""
    secret = tmp_path / "secret" / "t1"
    secret.mkdir(parents=True)
    (secret / "task.json").write_text(json.dumps({"tier": "TOPSECRET"}))
    os.symlink(secret.parent, run_copy / "tasks")
    config = (run_copy / "config.toml").read_text()
    named = tomllib.loads(config)["run"]["tasks"]
    (run_copy / "config.toml").write_text(config.replace(f'tasks = "{named}"', f'tasks = "{run_copy / "tasks"}"'))
    run = Runs(run_copy.parent).get(run_copy.name)
    assert run.tasks() == []
    with pytest.raises(NotFound):
        run.task("t1")


def test_malformed_records_are_skipped_or_404_never_a_server_error(served, run_copy, tmp_path):
    """Lines and files of the wrong shape (second review: each gave a 500)."""
    with (run_copy / "rollouts.jsonl").open("a") as f:
        for row in ({"step": 1, "task": ["x"]}, {"step": 1, "task": 3}, {"step": True}, {"step": 1, "reward": "a"}):
            f.write(json.dumps(row) + "\n")
    (run_copy / "trajectories" / "step-000003.jsonl").write_text('["not", "a", "record"]\n')
    config = (run_copy / "config.toml").read_text()
    (run_copy / "config.toml").write_text(config.replace("[run]\n", "[run]\nheld_out_extra = [[1]]\n"))
    with running_app(create_app(run_copy.parent, token=TOKEN)) as url:
        client = httpx.Client(base_url=url, headers=AUTH, timeout=30)
        name = run_copy.name
        listed = client.get(f"/api/runs/{name}/rollouts", params={"min_reward": 0})
        assert listed.status_code == 200 and all(isinstance(t, str) for t in listed.json()["tasks"])
        assert client.get(f"/api/runs/{name}/trajectories/3/0").status_code == 404
        assert client.get(f"/api/runs/{name}/tasks").status_code == 200
    (run_copy / "config.toml").write_text('run = "x"\n')  # `run` not a table: RUN/tasks, absent here
    assert Runs(run_copy.parent).get(run_copy.name).tasks() == []
    tasks = tmp_path / "tasks" / "t1"
    (tasks / "tests").mkdir(parents=True)
    (tasks / "task.json").write_text(json.dumps({"deleted": 5, "fail_to_pass": ["a\u0000b.py::t", "../x.py::t", 7]}))
    (run_copy / "config.toml").write_text(f'[run]\ntasks = "{tasks.parent}"\nheld_out = [[1], "t1"]\n')
    run = Runs(run_copy.parent).get(run_copy.name)
    assert run.tasks() == [{"id": "t1", "tier": None, "held_out": True, "deleted": []}]
    assert run.task("t1")["tests"] == {}


@pytest.mark.parametrize(("host", "shown", "warned"), [
    ("127.0.0.1", "127.0.0.1", False), ("0.0.0.0", "127.0.0.1", True), ("::1", "[::1]", False),
    ("192.0.2.7", "192.0.2.7", True)])
def test_the_start_lines_give_a_link_that_works_and_warn_off_loopback(tmp_path, host, shown, warned):
    """The printed link is one the browser can open (a wildcard host is shown as 127.0.0.1, IPv6 in brackets), with
    the token in its fragment; a token from the environment is not printed again; an interface other machines reach
    gets a note that everything travels unencrypted."""
    lines = announce(tmp_path, host, 8300, TOKEN, shown_token=True)
    assert lines[0] == f"dashboard of {tmp_path.resolve()} on http://{shown}:8300"
    assert lines[-1] == f"open http://{shown}:8300/#token={TOKEN}"
    assert any(line.startswith("note:") and "unencrypted" in line for line in lines) == warned
    quiet = announce(tmp_path, host, 8300, TOKEN, shown_token=False)
    assert TOKEN not in "".join(quiet) and quiet[-1].endswith(f"followed by the value of ${TOKEN_ENV}")

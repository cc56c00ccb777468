"""The dashboard's JSON endpoints on a real uvicorn server over a real run: who may read, what names reach files,
paging, incremental metrics, eval comparison, tasks and the fleet."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from servers import running_app

from shipyard.dashboard.app import COOKIE, create_app
from shipyard.dashboard.runs import Runs, page

TOKEN = "dashboard-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def served(dash_run):
    with running_app(create_app(dash_run.parent, token=TOKEN)) as url:
        yield url, httpx.Client(base_url=url, headers=AUTH, timeout=30)


def test_nothing_is_served_without_the_token_and_the_login_link_sets_a_strict_cookie(served):
    url, client = served
    run = client.get("/api/runs").json()["runs"][0]["name"]
    for path in ("/", "/static/dashboard.js", "/api/runs", f"/api/runs/{run}/metrics"):
        assert httpx.get(url + path).status_code == 401, path
        assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        assert httpx.get(url + path, cookies={COOKIE: "wrong"}).status_code == 401, path
    assert httpx.get(url + "/auth?token=wrong", follow_redirects=False).status_code == 401
    login = httpx.get(url + f"/auth?token={TOKEN}", follow_redirects=False)
    assert login.status_code == 303 and login.headers["location"] == "/"
    cookie = login.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie
    page_ = httpx.get(url + "/", cookies={COOKIE: TOKEN})
    assert page_.status_code == 200 and "shipyard dashboard" in page_.text
    csp = page_.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert page_.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(url + "/health").json() == {"status": "ok"}


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


@pytest.mark.parametrize("path", [
    "/api/runs/..%2f..%2fetc/metrics", "/api/runs/%2e%2e/metrics", "/api/runs/nope/metrics",
    "/api/runs/{run}/trajectories/1/99", "/api/runs/{run}/trajectories/-1/0", "/api/runs/{run}/trajectories/99/0",
    "/api/runs/{run}/evals/..%2fconfig", "/api/runs/{run}/evals/step-1", "/api/runs/{run}/tasks/%2e%2e",
    "/api/runs/{run}/tasks/..%2f..%2f..%2fetc", "/api/compare?a=..%2fx&b={run}/step-000000",
])
def test_hostile_names_reach_no_file(served, dash_run, path):
    _, client = served
    reply = client.get(path.format(run=dash_run.name))
    assert reply.status_code in (404, 422), reply.text
    assert "root:" not in reply.text


def test_a_symlink_out_of_the_runs_folder_is_not_a_run(run_copy, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "run.json").write_text('{"status": "finished"}')
    os.symlink(outside, run_copy.parent / "escape")
    runs = Runs(run_copy.parent)
    assert list(runs.paths()) == [run_copy.name]


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

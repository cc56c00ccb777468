"""The environment server and its client, over real HTTP on 127.0.0.1 with real sandboxes."""

import threading
import time

import pytest
from servers import free_port, needs_sandbox, running_app
from test_security import nothing_left

from shipyard.harness.tools import ToolContext
from shipyard.harness.tools.edit import search_replace
from shipyard.harness.tools.files import read_file
from shipyard.harness.tools.terminal import run_terminal
from shipyard.harness.workspace import PathError
from shipyard.httpguard import new_token
from shipyard.sandbox.client import EnvClient, EnvServerError, EnvServerUnreachable
from shipyard.sandbox.server import ServerConfig, create_app

pytestmark = needs_sandbox

TOKEN = new_token()


def serve(config: ServerConfig):
    app = create_app(config)
    with running_app(app) as url:
        yield url, app.state.env
    assert nothing_left()  # shutdown closed every sandbox, pooled ones included, and every snapshot


@pytest.fixture(scope="module")
def allowed(tmp_path_factory):
    """The tests' temporary directories (each test's `repo` lives under it): the one root clients may snapshot."""
    return tmp_path_factory.getbasetemp().resolve()


@pytest.fixture(scope="module")
def server(allowed):
    yield from serve(ServerConfig(token=TOKEN, allowed_roots=(allowed,), max_live=3, max_starting=2, max_queue=4,
                                  idle_timeout=3600))


@pytest.fixture
def client(server):
    c = EnvClient(server[0], retry_for=0, token=TOKEN)
    yield c
    c.close()


def test_tools_through_a_remote_sandbox(client, repo):
    snap = client.snapshot(str(repo))
    with client.sandbox(snap) as sb:
        ctx = ToolContext(sb)
        assert "def to_roman" in read_file(ctx, "pocketlib/roman.py")
        search_replace(ctx, "pocketlib/stats.py", "def mean(", "def average(")
        run_terminal(ctx, "cd pocketlib && export GREETING=hi")
        out = run_terminal(ctx, 'pwd; echo $GREETING; grep -c "def average" stats.py')
        assert "/workspace/pocketlib" in out and "hi" in out and "\n1\n" in out
        with pytest.raises(PathError, match="outside the workspace"):
            read_file(ctx, "../../etc/passwd")
        assert "+def average(" in sb.diff()
        ctx.close()
    assert "def mean(" in (repo / "pocketlib/stats.py").read_text()
    client.delete_snapshot(snap)


def test_an_episode_forks_into_new_sandboxes(client, repo):
    snap = client.snapshot(str(repo))
    with client.sandbox(snap) as sb:
        sb.write_bytes("prefix.txt", b"shared prefix\n")
        fork = sb.save_snapshot()
    with client.sandbox(fork) as a, client.sandbox(fork) as b:
        assert a.read_bytes("prefix.txt") == b.read_bytes("prefix.txt") == b"shared prefix\n"
        a.write_bytes("prefix.txt", b"a's own\n")
        assert b.read_bytes("prefix.txt") == b"shared prefix\n" and b.diff() == ""
    with pytest.raises(EnvServerError, match="404"):
        client.request("POST", "/sandboxes/nope/snapshot", {})
    for s in (fork, snap):
        client.delete_snapshot(s)


def test_admission_control_sheds_load_with_503(client, repo, server):
    snap = client.snapshot(str(repo))
    boxes = [client.sandbox(snap) for _ in range(3)]
    with pytest.raises(EnvServerError, match="503: over capacity"):
        client.sandbox(snap)
    metrics = client.metrics()
    assert metrics["live"] == 3 and metrics["failures"]["over_capacity"] >= 1
    assert metrics["start_latency_ms"]["p50"] > 0
    patient = EnvClient(server[0], retry_for=30, token=TOKEN)  # honours Retry-After until a slot frees up
    threading.Timer(1.5, boxes[0].close).start()
    start = time.monotonic()
    with patient.sandbox(snap) as sb:
        assert time.monotonic() - start >= 1.0
        assert sb.run(["true"], timeout=10).exit_code == 0
    patient.close()
    for b in boxes[1:]:
        b.close()
    client.delete_snapshot(snap)


def test_errors_are_clear(client, allowed):
    with pytest.raises(EnvServerError, match="404: no snapshot 'nope'"):
        client.sandbox("nope")
    with pytest.raises(EnvServerError, match="not a directory"):
        client.snapshot(str(allowed / "no" / "such" / "dir"))
    with pytest.raises(EnvServerError, match="no live sandbox"):
        client.request("POST", "/sandboxes/zzz/call", {"method": "ping"})
    with pytest.raises(EnvServerUnreachable, match="shipyard env-server"):
        EnvClient(f"http://127.0.0.1:{free_port()}", retry_for=1).metrics()


def test_idle_sandboxes_are_reaped(client, repo, server):
    env = server[1]
    snap = client.snapshot(str(repo))
    sb = client.sandbox(snap)
    env.config.idle_timeout = 0.0
    assert env.reap() == 1
    env.config.idle_timeout = 3600
    with pytest.raises(EnvServerError, match="reaped after idling"):
        sb.kind(".")
    client.delete_snapshot(snap)


@pytest.fixture
def warm_server(allowed):
    yield from serve(ServerConfig(token=TOKEN, allowed_roots=(allowed,), max_live=8, warm_pool=2))


def test_warm_pool_hands_out_started_sandboxes(repo, warm_server):
    client = EnvClient(warm_server[0], retry_for=0, token=TOKEN)
    snap = client.snapshot(str(repo))
    deadline = time.monotonic() + 30
    while client.metrics()["warm_pool"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.metrics()["warm_pool"] == 2
    body = client.request("POST", "/sandboxes", {"snapshot": snap})
    assert body["start_ms"] == 0.0 and client.metrics()["warm_hits"] == 1
    from shipyard.sandbox.client import RemoteSandbox

    with RemoteSandbox(client, body["id"]) as sb:
        assert sb.run(["true"], timeout=10).exit_code == 0
    custom = client.sandbox(snap, limits={"memory_mb": 512})  # custom limits: always a cold start
    assert client.metrics()["warm_hits"] == 1
    custom.close()
    client.delete_snapshot(snap)
    assert client.metrics()["warm_pool"] == 0
    client.close()

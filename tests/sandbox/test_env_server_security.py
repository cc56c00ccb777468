"""Attacks on the environment server from a network client, over real HTTP on 127.0.0.1 with real sandboxes.

Every test checks only what it made itself: its own snapshot names (and their partial copies) under the state dir,
its own sandbox ids, its own files. The server in this module allows snapshots from one temporary root only.
"""

import contextlib
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from servers import free_port, needs_sandbox, running_app, wait_for

from shipyard.harness.workspace import PathError
from shipyard.httpguard import new_token
from shipyard.sandbox.bwrap import Limits
from shipyard.sandbox.client import EnvClient, EnvServerError
from shipyard.sandbox.host import host
from shipyard.sandbox.layout import mounted_under, shipyard_cgroups
from shipyard.sandbox.sandbox import Sandbox, SandboxFailed
from shipyard.sandbox.server import ServerConfig, create_app
from shipyard.sandbox.snapshot import CopyBounds, SnapshotRefused, make_snapshot, remove_snapshot

pytestmark = needs_sandbox

TOKEN = new_token()
MAX_BODY, MAX_FILES, MAX_BYTES = 1 << 20, 200, 4 << 20


@contextlib.contextmanager
def running(config: ServerConfig):
    app = create_app(config)
    with running_app(app) as url:
        yield url, app.state.env


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("allowed").resolve()


@pytest.fixture(scope="module")
def server(root):
    config = ServerConfig(token=TOKEN, allowed_roots=(root,), max_live=16, max_body=MAX_BODY,
                          copy=CopyBounds(max_files=MAX_FILES, max_bytes=MAX_BYTES))
    with running(config) as (url, env):
        yield url, env


@pytest.fixture
def client(server):
    c = EnvClient(server[0], token=TOKEN, retry_for=0)
    yield c
    c.close()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server[0], headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60) as h:
        yield h


def source(root: Path, files: dict[str, str] | None = None) -> Path:
    d = root / f"src-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    for name, text in (files or {"app.py": "print('hi')\n"}).items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    return d


def unique(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def leftovers(marker: str) -> list[str]:
    snaps = host().state_dir / "snapshots"  # its snapshots and partial copies whose name has `marker`
    return [p.name for p in snaps.iterdir() if marker in p.name] if snaps.is_dir() else []


def error(resp: httpx.Response) -> str:
    return resp.json()["error"]["message"]


# Authentication ------------------------------------------------------------------------------------------------

ENDPOINTS = [("GET", "/metrics", None), ("POST", "/snapshots", {"path": "/tmp"}), ("DELETE", "/snapshots/x", None),
             ("POST", "/sandboxes", {"snapshot": "x"}), ("POST", "/sandboxes/x/call", {"method": "ping"}),
             ("POST", "/sandboxes/x/snapshot", {}), ("DELETE", "/sandboxes/x", None), ("GET", "/docs", None),
             ("GET", "/openapi.json", None), ("GET", "/no-such-route", None)]


@pytest.mark.parametrize("method,path,body", ENDPOINTS)
@pytest.mark.parametrize("auth", [None, "Bearer wrong-token", f"Basic {TOKEN}", f"Bearer {TOKEN}x"])
def test_every_endpoint_but_health_needs_the_token(server, method, path, body, auth):
    headers = {"Authorization": auth} if auth else {}
    resp = httpx.request(method, server[0] + path, json=body, headers=headers, timeout=30)
    assert resp.status_code == 401, (method, path, resp.status_code, resp.text)
    assert resp.json()["error"]["type"] == "Unauthorized"


def test_health_needs_no_token_and_a_wrong_token_is_a_clear_client_error(server):
    assert httpx.get(server[0] + "/health", timeout=30).json()["status"] == "ok"
    with pytest.raises(EnvServerError, match="401.*SHIPYARD_ENV_TOKEN"):
        EnvClient(server[0], token="wrong", retry_for=0).metrics()


# Snapshot sources -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/etc", "/", "/proc/self", "/root", "/var/lib/shipyard", "etc", "../.."])
def test_snapshots_outside_the_allowed_roots_are_refused(http, server, root, path):
    name = unique("outside")
    resp = http.post("/snapshots", json={"path": path, "name": name})
    if path.startswith("/"):
        assert resp.status_code == 403, resp.text
        assert error(resp).startswith(f"{path} is outside the directories this server may snapshot (allowed roots: "
                                      f"{root},")  # the reason names what is allowed
    else:  # a relative path is refused before it is judged against the roots
        assert resp.status_code == 422, resp.text
        assert error(resp) == f"path {path!r} must be absolute (a directory on the server's host)"
    assert leftovers(name) == [] and name not in server[1].snapshots


def test_a_symlink_inside_an_allowed_root_cannot_reach_outside_it(http, root):
    link = root / unique("to-etc")
    link.symlink_to("/etc")
    name = unique("via-link")
    resp = http.post("/snapshots", json={"path": str(link), "name": name})
    assert resp.status_code == 403 and "/etc" in error(resp)
    assert leftovers(name) == []


def test_etc_shadow_stays_unreadable(http, client, root):
    """As root the allowed-roots check is what keeps a 0640 root file out; as any user the sandbox's private /etc."""
    assert http.post("/snapshots", json={"path": "/etc"}).status_code == 403
    snap = client.snapshot(str(source(root)))
    with client.sandbox(snap) as sb:
        with pytest.raises(PathError):
            sb.read_bytes("../../etc/shadow")
        r = sb.run(["bash", "-c", "cat /etc/shadow /snapshot/../etc/shadow"], timeout=30)
        assert r.exit_code != 0 and b"root:" not in r.output
    client.delete_snapshot(snap)


BAD_NAMES = ["../{m}", "/tmp/{m}", "{m}/b", "..", ".", "", ".{m}", "-{m}", "a" * 65, "{m}..y", "{m}\x00b", "{m} b",
             "é{m}"]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_snapshot_names_and_ids_are_validated(http, server, root, bad):
    marker = uuid.uuid4().hex[:10]
    name = bad.format(m=marker)
    src = source(root)
    resp = http.post("/snapshots", json={"path": str(src), "name": name})
    assert resp.status_code == 422 and "name" in error(resp), resp.text
    assert leftovers(marker) == [] and name not in server[1].snapshots
    for where in (Path("/tmp"), host().state_dir, src.parent, src):
        assert not [p for p in where.iterdir() if marker in p.name]
    resp = http.post("/sandboxes", json={"snapshot": name})
    assert resp.status_code == 422 and "snapshot" in error(resp), resp.text


@pytest.mark.parametrize("bad", ["x%20y", "-x", "a" * 65, "x..y", "%2E%2E"])
def test_ids_in_urls_are_validated(http, bad):
    for method, path in [("POST", f"/sandboxes/{bad}/call"), ("POST", f"/sandboxes/{bad}/snapshot"),
                         ("DELETE", f"/sandboxes/{bad}"), ("DELETE", f"/snapshots/{bad}")]:
        resp = http.request(method, path, json={"method": "ping"} if path.endswith("call") else {})
        assert resp.status_code == 422, (method, path, resp.text)


def test_an_episode_snapshot_name_is_validated(http, client, root):
    snap = client.snapshot(str(source(root)))
    marker = uuid.uuid4().hex[:10]
    with client.sandbox(snap) as sb:
        for bad in ("../" + marker, "/tmp/" + marker, marker + "/a"):
            resp = http.post(f"/sandboxes/{sb.id}/snapshot", json={"name": bad})
            assert resp.status_code == 422, resp.text
    assert leftovers(marker) == [] and not Path("/tmp", marker).exists()
    client.delete_snapshot(snap)


# Bounded copies ---------------------------------------------------------------------------------------------------

def test_a_tree_over_the_file_count_bound_is_refused(http, server, root):
    src = source(root, {f"f{i}.txt": "x" for i in range(MAX_FILES + 5)})
    name = unique("many")
    resp = http.post("/snapshots", json={"path": str(src), "name": name})
    assert resp.status_code == 422 and f"{MAX_FILES}" in error(resp) and "files" in error(resp), resp.text
    assert leftovers(name) == [] and name not in server[1].snapshots


def test_a_tree_over_the_size_bound_is_refused(http, root):
    src = source(root)
    (src / "big.bin").write_bytes(b"\0" * (MAX_BYTES + 1))
    name = unique("big")
    resp = http.post("/snapshots", json={"path": str(src), "name": name})
    assert resp.status_code == 422 and "bytes" in error(resp), resp.text
    assert leftovers(name) == []
    with pytest.raises(SnapshotRefused, match="more than 100 bytes"):  # bytes read: /proc files say they have none
        make_snapshot("/proc/self/net", host(), name, bounds=CopyBounds(max_bytes=100))
    assert leftovers(name) == []


def test_proc_self_is_refused_quickly():
    """/proc/self is endless (files with no size that read on and on, links to the whole host): an operator who
    allows /proc by mistake still gets a refusal, quickly, and nothing on disk."""
    config = ServerConfig(token=TOKEN, allowed_roots=(Path("/proc"),))
    with running(config) as (url, _):
        name = unique("proc")
        start = time.monotonic()
        resp = httpx.post(url + "/snapshots", json={"path": f"/proc/{os.getpid()}", "name": name},
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        assert resp.status_code == 422, resp.text
        assert time.monotonic() - start < 10
        assert leftovers(name) == []
        resp = httpx.post(url + "/snapshots", json={"path": "/proc/self", "name": name},  # a link: not followed
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        assert resp.status_code == 403 and "symbolic link" in resp.text, resp.text
        assert leftovers(name) == []


def _fifo(d: Path) -> str:
    os.mkfifo(d / "pipe")
    return "pipe"


def _socket(d: Path) -> str:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(d / "sock"))
    return "sock"


def _device(d: Path) -> str:
    if os.geteuid() != 0:
        pytest.skip("only root can make a device node")
    os.mknod(d / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    return "null"


def _absolute_link(d: Path) -> str:
    (d / "shadow").symlink_to("/etc/shadow")
    return "shadow"


def _relative_link(d: Path) -> str:
    (d / "sub").mkdir()
    (d / "sub" / "up").symlink_to("../../../../../../etc/passwd")
    return "sub/up"


def _link_through_a_link(d: Path) -> str:  # `here` → `.` and `sneaky` → `here/../x` look inward but lead up
    (d / "here").symlink_to(".")
    (d / "sneaky").symlink_to(f"here/../{d.name}-outside")
    (d.parent / f"{d.name}-outside").write_text("outside\n")
    return "sneaky"


@pytest.mark.parametrize("plant", [_fifo, _socket, _device, _absolute_link, _relative_link, _link_through_a_link])
def test_special_files_and_outward_symlinks_are_refused(http, server, root, plant):
    src = source(root, {"deep/a.py": "x = 1\n"})
    offending = plant(src)
    name = unique("special")
    start = time.monotonic()
    resp = http.post("/snapshots", json={"path": str(src), "name": name})
    assert resp.status_code == 422, resp.text
    assert offending in error(resp)
    assert time.monotonic() - start < 10
    assert leftovers(name) == [] and name not in server[1].snapshots


def test_inward_symlinks_are_copied_as_links(client, root, server):
    src = source(root, {"README.md": "hi\n", "pkg/mod.py": "x = 1\n"})
    (src / "link.md").symlink_to("README.md")
    (src / "pkg" / "up.md").symlink_to("../README.md")
    snap = client.snapshot(str(src))
    copied = server[1].snapshots[snap]
    assert os.readlink(copied / "link.md") == "README.md" and os.readlink(copied / "pkg/up.md") == "../README.md"
    with client.sandbox(snap) as sb:
        assert sb.run(["cat", "pkg/up.md"], timeout=30).output == b"hi\n"
    client.delete_snapshot(snap)


def test_a_fifo_in_a_sandbox_cannot_break_its_snapshot(http, client, root):
    snap = client.snapshot(str(source(root)))
    name = unique("episode")
    with client.sandbox(snap) as sb:
        assert sb.run(["bash", "-c", "mkdir -p d && mkfifo d/pipe"], timeout=30).exit_code == 0
        resp = http.post(f"/sandboxes/{sb.id}/snapshot", json={"name": name})
        assert resp.status_code == 422 and "d/pipe" in error(resp), resp.text
        assert sb.run(["true"], timeout=30).exit_code == 0  # the sandbox is unharmed
    assert leftovers(name) == []
    client.delete_snapshot(snap)


def test_make_snapshot_refuses_special_files_and_bad_names(root):
    """The same copy serves every other caller of make_snapshot (tasks, `sandbox exec`, `agent --sandbox`)."""
    src = source(root)
    os.mkfifo(src / "pipe")
    marker = uuid.uuid4().hex[:10]
    with pytest.raises(SnapshotRefused, match="pipe"):
        make_snapshot(src, host(), unique(marker))
    (src / "pipe").unlink()
    for bad in (f"../{marker}", f"/tmp/{marker}", f"a/{marker}"):
        with pytest.raises(ValueError, match="name"):
            make_snapshot(src, host(), bad)
    assert leftovers(marker) == [] and not Path("/tmp", marker).exists()
    (src / "two.py").write_text("")
    with pytest.raises(SnapshotRefused, match="files"):
        make_snapshot(src, host(), unique(marker), bounds=CopyBounds(max_files=1))
    assert leftovers(marker) == []
    snap = make_snapshot(src, host(), unique(marker))
    assert (snap / "app.py").read_text() == "print('hi')\n"
    remove_snapshot(snap)


@pytest.mark.parametrize("limits,field", [({"memory_mb": -1}, "memory_mb"), ({"memory_mb": 0}, "memory_mb"),
                                          ({"pids": 0}, "pids"), ({"cpu_seconds": -1}, "cpu_seconds"),
                                          ({"cpu_seconds": 0}, "cpu_seconds"), ({"disk_mb": 0}, "disk_mb"),
                                          ({"open_files": -5}, "open_files"), ({"file_size_mb": 0}, "file_size_mb"),
                                          ({"bogus": 1}, "bogus"), ({"memory_mb": 10**12}, "memory_mb"),
                                          ({"disk_mb": 10**9}, "disk_mb"), ({"memory_mb": "512"}, "memory_mb"),
                                          ({"pids": 1.5}, "pids"), ({"pids": True}, "pids")])
def test_limits_are_validated(http, client, server, root, limits, field):
    snap = client.snapshot(str(source(root)))
    live = len(server[1].live)
    resp = http.post("/sandboxes", json={"snapshot": snap, "limits": limits})
    assert resp.status_code == 422 and field in error(resp), resp.text
    assert len(server[1].live) == live
    client.delete_snapshot(snap)


def test_valid_custom_limits_work(client, root):
    snap = client.snapshot(str(source(root)))
    with client.sandbox(snap, limits={"memory_mb": 512, "pids": 64, "cpu_seconds": 60, "disk_mb": 64}) as sb:
        assert sb.run(["true"], timeout=30).exit_code == 0
    client.delete_snapshot(snap)


@pytest.mark.parametrize("path,body", [("/snapshots", {"path": "/tmp", "bogus": 1}),
                                       ("/sandboxes", {"snapshot": "x", "extra": True}),
                                       ("/sandboxes/x/call", {"method": "ping", "wait": -1}),
                                       ("/sandboxes/x/call", {"method": "ping", "wait": 10**9}),
                                       ("/sandboxes/x/call", {"method": "ping", "params": {}, "more": 1}),
                                       ("/sandboxes/x/snapshot", {"nmae": "typo"})])
def test_every_body_has_one_schema(http, path, body):
    resp = http.post(path, json=body)
    assert resp.status_code == 422, resp.text
    assert resp.json()["error"]["type"] == "InvalidRequest"


def test_a_body_over_the_limit_is_refused_with_413(http, client, root):
    snap = client.snapshot(str(source(root)))
    big = {"method": "write_bytes", "params": {"path": "f", "data": "A" * (MAX_BODY + 10)}}
    with client.sandbox(snap) as sb:
        resp = http.post(f"/sandboxes/{sb.id}/call", json=big)
        assert resp.status_code == 413, resp.text

        def chunks():  # no Content-Length: counted as it streams
            for _ in range(MAX_BODY // 65536 + 2):
                yield b"A" * 65536

        resp = http.post(f"/sandboxes/{sb.id}/call", content=chunks(), headers={"Content-Type": "application/json"})
        assert resp.status_code == 413, resp.text
        assert sb.run(["true"], timeout=30).exit_code == 0
    client.delete_snapshot(snap)


# Failed creates ---------------------------------------------------------------------------------------------------

def test_a_create_that_fails_after_its_layout_exists_leaves_nothing(root):
    """The session cannot start over a snapshot that is not there: the sandbox's dir, tmpfs and cgroups go."""
    sandbox_id = unique("failed")
    own_cgroups = lambda: {g for g in shipyard_cgroups() if g.name.startswith(f"shipyard-{os.getpid()}-")}  # noqa: E731
    before = own_cgroups()
    with pytest.raises(SandboxFailed, match=rf"^the exec session of sandbox {sandbox_id} did not start \("):
        Sandbox(root / "no-such-snapshot", Limits(memory_mb=256), sandbox_id=sandbox_id)
    d = host().state_dir / "sandboxes" / sandbox_id
    assert not d.exists() and not mounted_under(d.parent / sandbox_id)
    assert own_cgroups() <= before


# Starvation -------------------------------------------------------------------------------------------------------

LONG = 5.0
HOLD = ["sh", "-c", "while [ ! -e go ]; do sleep 0.05; done"]  # a run that lasts until `go` is written beside it


def test_control_operations_are_not_starved_by_long_runs(root):
    # Eight runs that end only when released: every control operation must be answered while all eight are held.
    with running(ServerConfig(token=TOKEN, allowed_roots=(root,), max_live=12)) as (url, env):
        client = EnvClient(url, token=TOKEN, retry_for=0)
        snap = client.snapshot(str(source(root)))
        boxes = [client.sandbox(snap) for _ in range(9)]
        with ThreadPoolExecutor(8) as pool:
            runs = [pool.submit(b.run, HOLD, timeout=60) for b in boxes[:8]]
            assert wait_for(lambda: env.metrics()["calls_in_flight"] == 8, 30)
            assert httpx.get(url + "/health", timeout=30).status_code == 200
            assert client.metrics()["calls_in_flight"] == 8
            extra = client.sandbox(snap)
            boxes[8].close()
            assert not any(r.done() for r in runs)  # answered beside them (a held run ends only at `go` or at 60 s)
            for b in boxes[:8]:
                b.write_bytes("go", b"")
            assert all(r.result().exit_code == 0 and not r.result().timed_out for r in runs)
        for b in [*boxes[:8], extra]:
            b.close()
        client.delete_snapshot(snap)
        client.close()


def test_one_sandbox_with_many_long_calls_does_not_stall_another(root):
    # Twelve calls of LONG seconds in one sandbox (eight in flight, four waiting for a slot of that sandbox): another
    # sandbox's call is answered while all twelve are still under way (~0.01 s of the 5 s: overlap, not a time bound).
    with running(ServerConfig(token=TOKEN, allowed_roots=(root,), max_live=4)) as (url, env):
        client = EnvClient(url, token=TOKEN, retry_for=0)
        snap = client.snapshot(str(source(root)))
        hog, other = client.sandbox(snap), client.sandbox(snap)
        with ThreadPoolExecutor(12) as pool:
            runs = [pool.submit(hog.run, ["sleep", str(LONG)], timeout=60) for _ in range(12)]
            assert wait_for(lambda: env.metrics()["calls_in_flight"] == 12, 30)
            assert other.run(["true"], timeout=30).exit_code == 0
            assert not any(r.done() for r in runs)
            assert all(r.result().exit_code == 0 for r in runs)
        hog.close()
        other.close()
        client.delete_snapshot(snap)
        client.close()


# The token file and the client ------------------------------------------------------------------------------------

def test_the_cli_writes_a_0600_token_file_and_clients_find_it(tmp_path, root, monkeypatch):
    port = free_port()
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHIPYARD_ENV_TOKEN")}
    env["SHIPYARD_HOME"] = str(home)
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "shipyard.cli", "env-server", "--port", str(port),
                                 "--allow-root", str(root)], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        token_file = home / "env-server" / f"{port}.token"
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if token_file.exists() and httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
        token = token_file.read_text().strip()
        monkeypatch.delenv("SHIPYARD_ENV_TOKEN", raising=False)
        monkeypatch.delenv("SHIPYARD_ENV_TOKEN_FILE", raising=False)
        monkeypatch.setenv("SHIPYARD_HOME", str(home))
        assert EnvClient(url, retry_for=0).metrics()["live"] == 0  # the default file, found by the URL's port
        monkeypatch.setenv("SHIPYARD_HOME", str(tmp_path / "elsewhere"))
        with pytest.raises(EnvServerError, match="401.*SHIPYARD_ENV_TOKEN"):
            EnvClient(url, retry_for=0).metrics()
        moved = tmp_path / "copy.token"
        moved.write_text(token + "\n")
        moved.chmod(0o600)  # a token file readable by others is refused
        monkeypatch.setenv("SHIPYARD_ENV_TOKEN_FILE", str(moved))
        assert EnvClient(url, retry_for=0).metrics()["live"] == 0  # $SHIPYARD_ENV_TOKEN_FILE
        monkeypatch.setenv("SHIPYARD_ENV_TOKEN", token)
        monkeypatch.setenv("SHIPYARD_ENV_TOKEN_FILE", str(tmp_path / "missing"))
        assert EnvClient(url, retry_for=0).metrics()["live"] == 0  # $SHIPYARD_ENV_TOKEN first
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert str(token_file) in text and token not in text


@pytest.fixture
def mount_namespace(tmp_path_factory, root):
    """A directory outside the allowed root, bind-mounted inside it only in another mount namespace (as any local
    user can make one with `unshare -Urm`), and a link in the root into that namespace's view of it."""
    secret = tmp_path_factory.mktemp("outside")
    (secret / "secret.txt").write_text("TOP-SECRET\n")
    mnt = root / unique("ns") / "mnt"
    mnt.mkdir(parents=True)
    proc = subprocess.Popen(["unshare", "-Urm", "sh", "-c", f"mount --bind {secret} {mnt} && echo ready && sleep 60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        proc.kill()
        pytest.skip(f"cannot make a mount namespace here: {proc.stderr.read().strip()}")
    link = root / unique("v")
    link.symlink_to(f"/proc/{proc.pid}/root{mnt.parent}")
    yield link / "mnt"
    proc.kill()
    proc.wait()


def test_a_link_into_another_mount_namespace_cannot_reach_outside(http, root, mount_namespace):
    """`/proc/PID/root` links resolve (for realpath and /proc/self/fd) to paths inside the root while the directory
    they open is another namespace's mount of anything. The server checks the path, then copies: a client that swaps a
    directory for such a link in between must gain nothing — so the copy itself walks from the root without
    following links (here called directly, as the server does after its check, to make the race deterministic)."""
    name = unique("ns")
    with pytest.raises(PermissionError, match="symbolic link"):
        make_snapshot(mount_namespace, host(), name, bounds=CopyBounds(), within=(root,))
    assert leftovers(name) == []
    resp = http.post("/snapshots", json={"path": str(mount_namespace), "name": name})
    assert resp.status_code == 403 and "symbolic link" in error(resp), resp.text
    assert leftovers(name) == []


def test_a_link_to_a_directory_inside_the_root_is_refused_too(http, root):
    """Even a link that stays inside: the path is walked without following links (give the real path)."""
    real = source(root)
    alias = root / unique("alias")
    alias.symlink_to(real)
    resp = http.post("/snapshots", json={"path": str(alias), "name": unique("alias")})
    assert resp.status_code == 403 and "symbolic link" in error(resp), resp.text
    assert http.post("/snapshots", json={"path": str(real), "name": unique("real")}).status_code == 200

"""Token files against another local user (docs/security.md): nothing of theirs is trusted, nothing of ours leaks."""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from shipyard.httpguard import TokenError, loopback_port, read_token, write_token
from shipyard.sandbox.client import EnvClient

OTHER_UID = 65534


def as_other_user(*argv: str) -> None:
    subprocess.run(["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", *argv], check=True)


def test_the_token_file_is_private_and_replaces_what_was_there(tmp_path):
    target = tmp_path / "home" / "srv.token"
    target.parent.mkdir(mode=0o755)
    (target.parent / "elsewhere").write_text("keep me\n")
    target.symlink_to(target.parent / "elsewhere")
    write_token(target, "tok")
    assert not target.is_symlink() and target.read_text() == "tok\n"
    assert (target.parent / "elsewhere").read_text() == "keep me\n"  # the link was replaced, never followed
    assert target.stat().st_mode & 0o777 == 0o600 and target.parent.stat().st_mode & 0o777 == 0o700


def test_a_token_directory_that_is_a_link_or_not_ours_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(TokenError, match="symbolic link"):
        write_token(tmp_path / "link" / "x.token", "tok")
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, OTHER_UID, OTHER_UID)
        with pytest.raises(TokenError, match="belongs to uid"):
            write_token(theirs / "x.token", "tok")
    assert not list(real.iterdir())


def test_a_token_file_that_is_a_link_or_readable_by_others_is_not_sent(tmp_path, monkeypatch):
    monkeypatch.delenv("SHIPYARD_X", raising=False)
    monkeypatch.delenv("SHIPYARD_X_FILE", raising=False)
    secret = tmp_path / "secret"
    secret.write_text("root:*:20228:0:99999:7:::\n")
    (tmp_path / "link.token").symlink_to(secret)
    with pytest.raises(TokenError, match="symbolic link"):
        read_token("SHIPYARD_X", tmp_path / "link.token")
    open_file = tmp_path / "open.token"
    open_file.write_text("tok\n")
    open_file.chmod(0o644)
    with pytest.raises(TokenError, match="mode 0600"):
        read_token("SHIPYARD_X", open_file)
    open_file.chmod(0o600)
    assert read_token("SHIPYARD_X", open_file) == "tok"
    assert read_token("SHIPYARD_X", tmp_path / "missing") is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another local user")
def test_another_user_cannot_plant_a_token_file_for_us():
    shared = Path(tempfile.mkdtemp(prefix="shipyard-shared-"))  # like /tmp: anyone may write there
    try:
        shared.chmod(0o1777)
        as_other_user("sh", "-c", f"echo attacker-token > {shared}/x.token && chmod 600 {shared}/x.token")
        with pytest.raises(TokenError, match="uid 65534"):
            read_token("SHIPYARD_X", shared / "x.token")
        with pytest.raises(TokenError, match="belongs to uid 65534"):  # nor a directory made for us to write in
            as_other_user("mkdir", "-m", "700", str(shared / "env-server"))
            write_token(shared / "env-server" / "1.token", "tok")
    finally:
        shutil.rmtree(shared)


def test_a_default_token_file_is_only_for_servers_on_this_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("SHIPYARD_HOME", str(tmp_path))
    monkeypatch.delenv("SHIPYARD_ENV_TOKEN", raising=False)
    monkeypatch.delenv("SHIPYARD_ENV_TOKEN_FILE", raising=False)
    write_token(tmp_path / "env-server" / "18777.token", "local-token")
    local, remote = EnvClient("http://127.0.0.1:18777", retry_for=0), EnvClient("http://envs.example.org:18777",
                                                                                  retry_for=0)
    assert local.token == "local-token" and remote.token is None
    local.close()
    remote.close()
    assert loopback_port("http://127.0.0.5:9/v1") == 9 and loopback_port("http://[::1]/") == 80
    assert loopback_port("http://10.0.0.1:9") is None and loopback_port("http://localhost.evil.org:9") is None

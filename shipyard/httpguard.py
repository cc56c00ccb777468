"""What every shipyard HTTP server (`env-server`, `serve`) puts between a network client and its handlers.

Both servers listen on a port that any local user (and, bound beyond loopback, any host) can connect to, and
both act with the operator's privileges, so neither trusts a client (docs/security.md):

* **Authentication.** A bearer token, generated at start (256 bits from `secrets`) unless the operator gives one,
  stored in a file only the operator can read (mode 0600, created with `O_EXCL | O_NOFOLLOW` in a 0700
  directory, so another local user can neither read it nor plant a symlink in its place). Clients read it from
  an environment variable or that file. Tokens are compared in constant time (`hmac.compare_digest`). Paths in
  `open_paths` (health checks) need none.
* **Body size.** A request body is counted as it streams in and refused with 413 past `max_body` bytes — before
  the handler runs, so a client cannot make the server buffer gigabytes. A `Content-Length` over the limit is
  refused without reading anything.
* **One schema per body, clear errors.** FastAPI validates bodies with pydantic models; `install` replaces its
  default 422 payload with one line per problem (`field: what is wrong`), in the same `{"error": {...}}`
  envelope every other error uses.

The guard is a plain ASGI middleware (no per-route decorators to forget): every route is protected unless listed.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
import stat
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from shipyard.errors import UserError

TOKEN_BYTES = 32


class TokenError(UserError, RuntimeError):
    """No usable token where the operator said one would be."""


def new_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def _private_dir(path: Path) -> int:
    """Open `path` (created 0700 when missing) as a directory only this user can enter; its descriptor. A directory
    another user owns or can write, or a symlink in its place, is refused: they could swap or read the token."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise TokenError(f"cannot use {path} for a token file ({e.strerror}; a symbolic link is refused): choose "
                         "another directory ($SHIPYARD_HOME)") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise TokenError(f"{path} belongs to uid {st.st_uid}, not to you: a token file there could be read or "
                         "replaced by its owner; choose another directory ($SHIPYARD_HOME)")
    if st.st_mode & 0o077:
        os.fchmod(fd, 0o700)  # ours: close it to others
    return fd


def write_token(path: Path, token: str) -> Path:
    """Store `token` at `path`, readable by this user alone: in a directory of this user's closed to others (see
    `_private_dir`), written to a fresh file (`O_EXCL | O_NOFOLLOW`, mode 0600) renamed over `path` — whatever was
    at `path` is replaced, never followed."""
    path = Path(path)
    dir_fd = _private_dir(path.parent)
    try:
        tmp = f".{path.name}.{secrets.token_hex(8)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            os.write(fd, (token + "\n").encode())
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:  # a full disk, say: leave no half-written token file behind
            os.unlink(tmp, dir_fd=dir_fd)
            raise
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)
    return path


def read_token(env_var: str, default_file: Path | None) -> str | None:
    """The token a client should send: `$ENV_VAR` if set, else the first line of `$ENV_VAR_FILE` or `default_file`
    when it exists, else None. The file must be a regular file (a symlink is not followed), owned by this user or
    root and closed to others — otherwise another local user could make a client send any file's first line."""
    if os.environ.get(env_var):
        return os.environ[env_var].strip()
    file = os.environ.get(f"{env_var}_FILE") or default_file
    if file is None:
        return None
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise TokenError(f"cannot read the token file {file}: {e.strerror} (a symbolic link is refused); set "
                         f"${env_var} instead") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o077:
            raise TokenError(f"refusing the token file {file}: it must be a regular file of yours, mode 0600 (it is "
                             f"{stat.filemode(st.st_mode)}, uid {st.st_uid}); set ${env_var} instead")
        text = os.read(fd, 4096).decode(errors="replace").strip()
    finally:
        os.close(fd)
    return text.splitlines()[0] if text else None


def token_from_env(env_var: str) -> tuple[str, str] | None:
    """(token, where it came from) when the operator gave a server its token ($ENV_VAR or $ENV_VAR_FILE), else None."""
    token = read_token(env_var, None)
    if token is None:
        return None
    return token, f"${env_var}" if os.environ.get(env_var) else f"${env_var}_FILE"


def server_token(env_var: str) -> tuple[str, str | None]:
    """The token a server requires: the operator's (`token_from_env`) with where it came from, else a fresh one and
    None — the server then stores it (`store_token`) once its configuration is known to be good."""
    return token_from_env(env_var) or (new_token(), None)


def store_token(path: Path, token: str, env_var: str) -> str:
    """`write_token`, with a failure as a `TokenError` saying what to do; where the token is, for the operator."""
    try:
        return f"{write_token(path, token)} (mode 0600)"
    except OSError as e:
        raise TokenError(f"cannot write the token to {path}: {e.strerror}; set ${env_var} (or give another token "
                         "file)") from None


def is_loopback(host: str) -> bool:
    """Whether a host name or address names this machine (127.0.0.0/8, localhost, ::1)."""
    host = host.lower()
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer(token: str | None) -> dict[str, str]:
    """The `Authorization` header a client sends a server started with `token` (none without one)."""
    return {"authorization": f"Bearer {token}"} if token else {}


def loopback_port(url: str) -> int | None:
    """The port of an http(s) URL naming this machine (`is_loopback`), else None: a default token file holds a local
    server's token, which must never be sent to another host."""
    parsed = urlsplit(url)
    if not is_loopback(parsed.hostname or ""):
        return None
    try:
        return parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:
        return None


def error_body(status: int, kind: str, message: str) -> dict[str, Any]:
    """The one error envelope of shipyard's servers (OpenAI-compatible: `error.message`, `error.type`, `error.code`)."""
    return {"error": {"type": kind, "message": message, "code": status}}


def error_response(status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> Any:
    """`error_body` as a FastAPI response."""
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, headers=headers, content=error_body(status, kind, message))


def _send_error(status: int, message: str, kind: str, headers: Iterable[tuple[bytes, bytes]] = ()):
    body = json.dumps(error_body(status, kind, message)).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         *headers]}
    return start, {"type": "http.response.body", "body": body}


class BodyTooLarge(Exception):
    pass


class Guard:
    """ASGI middleware: bearer-token check (except `open_paths`) and a streaming body-size limit.

    `path_tokens` and `path_max_body` override `token` and `max_body` for exact paths (a token of None opens that
    path): `serve` keeps its weights route on the operator's token with a large body limit, and its completions on an
    optional API key with a small one, while every other path falls back to the defaults (deny by default)."""

    def __init__(self, app: Callable[..., Awaitable[None]], *, token: str | None, max_body: int,
                 open_paths: Iterable[str] = ("/health",), path_tokens: Mapping[str, str | None] | None = None,
                 path_max_body: Mapping[str, int] | None = None):
        self.app, self.token, self.max_body = app, token, max_body
        self.open_paths = frozenset(open_paths)
        self.path_tokens, self.path_max_body = dict(path_tokens or {}), dict(path_max_body or {})

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        path = scope["path"]
        token = self.path_tokens.get(path, self.token)
        max_body = self.path_max_body.get(path, self.max_body)
        if token is not None and path not in self.open_paths:
            given = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, value = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token.encode()):
                why = "missing" if not given else "wrong"
                for event in _send_error(401, f"authentication {why}: send `Authorization: Bearer TOKEN` with the "
                                         "token this server printed at start (or wrote to its token file)",
                                         "Unauthorized", [(b"www-authenticate", b"Bearer")]):
                    await send(event)
                return
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body):
            for event in _send_error(413, f"request body of {length.decode('latin-1')} bytes is over this server's "
                                     f"limit of {max_body} bytes", "PayloadTooLarge"):
                await send(event)
            return
        seen = 0
        started = refused = False

        async def counted_receive() -> dict[str, Any]:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_body:
                    # Answer 413 here: frameworks turn an exception from receive() into their own error (FastAPI: 400
                    # "error parsing the body"), and whatever the app answers after this is dropped.
                    if not started and not refused:
                        refused = True
                        for event in _send_error(413, f"request body is over this server's limit of {max_body} "
                                                 "bytes", "PayloadTooLarge"):
                            await send(event)
                    raise BodyTooLarge
            return message

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            if refused:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if started:
                raise


def describe_validation(errors: Iterable[dict[str, Any]]) -> str:
    """pydantic's error list as `field.sub: message` lines (the body itself is never echoed back)."""
    lines = []
    for err in errors:
        where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        lines.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(lines)


def install(app: Any, *, token: str | None, max_body: int, open_paths: Iterable[str] = ("/health",),
            path_tokens: Mapping[str, str | None] | None = None,
            path_max_body: Mapping[str, int] | None = None) -> None:
    """Guard a FastAPI app: the token/body-size middleware and the one-line 422 validation errors."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Any, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "InvalidRequest", f"invalid request: {describe_validation(exc.errors())}")

    app.add_middleware(Guard, token=token, max_body=max_body, open_paths=tuple(open_paths), path_tokens=path_tokens,
                       path_max_body=path_max_body)

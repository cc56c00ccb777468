"""What the environment server accepts: the operator's `ServerConfig` and the client's request bodies.

Both are the server's security boundary (docs/security.md; `shipyard.sandbox.server` for the API), kept apart from
the code that acts on them so that what is allowed can be read in one place:
* `ServerConfig` is the operator's word: the bearer token, the `allowed_roots` a snapshot source must lie under, the
  copy bounds, the range of sandbox limits a client may ask for, and every capacity `EnvServer` admits against.
  `check_config` refuses a config the server must not run with: a short token, or an allowed root that contains the
  server's own state directory or token file (clients could snapshot its secrets and other clients' sandboxes).
* One pydantic schema per request body, unknown keys rejected (`Strict`); names and ids are one path component
  (`check_name`), never paths; limits are strict positive integers, checked against the operator's range later.
* `MAX_PATCH_B64` bounds a `/grade` body before it is decoded: base64 of `MAX_DIFF_BYTES`, the grader's own bound.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, create_model

from shipyard.errors import UsageError
from shipyard.harness.diff import MAX_DIFF_BYTES
from shipyard.sandbox.bwrap import Limits
from shipyard.sandbox.host import host
from shipyard.sandbox.snapshot import CopyBounds, check_name

MAX_WAIT = 86400.0  # the longest a call may wait for its reply (seconds)
MAX_PATCH_B64 = 4 * -(-MAX_DIFF_BYTES // 3)  # base64 characters of the largest patch the grader reads


@dataclass
class ServerConfig:
    token: str = ""  # the bearer token clients send (httpguard.new_token()); required
    allowed_roots: tuple[Path, ...] = ()  # snapshot sources must lie under one of these (none by default)
    token_file: Path | None = None  # where clients on this host find the token (named in errors; the CLI writes it)
    max_live: int = 256
    max_starting: int = 8
    max_queue: int = 512
    idle_timeout: float = 1800.0
    retry_after: int = 1
    warm_pool: int = 0  # started sandboxes kept ready per snapshot
    max_snapshots: int = 256  # snapshots held (or being copied) at once
    max_body: int = 64 << 20  # bytes in one request body (a `write_bytes` call carries its file, base64)
    copy: CopyBounds = field(default_factory=CopyBounds)  # every snapshot copy; outward links refused by default
    min_limits: Limits = field(default_factory=lambda: Limits(memory_mb=64, pids=64, cpu_seconds=1, file_size_mb=1,
                                                              open_files=64, disk_mb=1))
    max_limits: Limits = field(default_factory=lambda: Limits(memory_mb=65536, pids=4096, cpu_seconds=86400,
                                                              file_size_mb=16384, open_files=65536, disk_mb=65536))
    max_calls_per_sandbox: int = 8  # calls of one sandbox in flight at once; more wait their turn
    extra_call_threads: int = 32  # threads shared by sandboxes' second and later parallel calls
    control_threads: int = 8  # destroy, delete, reap
    copy_threads: int = 2  # snapshot copies at once
    max_grading: int = 4  # grades running at once (each runs a test suite in a sandbox)
    max_grade_queue: int = 64  # grades waiting for a slot; beyond: 503
    max_grade_timeout: float = 7200.0  # the longest test-suite timeout a client may ask for (seconds)
    max_task_snapshots: int = 64  # task snapshots cached (least recently used removed first)
    max_task_snapshot_bytes: int = 32 << 30  # their bytes together
    shutdown_grace: float = 5.0  # seconds shutdown waits for running grades before removing their snapshots


def check_config(config: ServerConfig) -> tuple[Path, ...]:
    """The allowed roots as real paths; UsageError for a config the server must not run with."""
    if len(config.token or "") < 16:
        raise UsageError("the environment server needs a bearer token of at least 16 characters "
                         "(ServerConfig.token; shipyard.httpguard.new_token() makes one)")
    roots = []
    for root in config.allowed_roots:
        real = Path(os.path.realpath(root))
        if not real.is_dir():
            raise UsageError(f"allowed root {root} is not a directory")
        for own, what in ((host().state_dir, "the sandbox state directory"), (config.token_file, "its token file")):
            if own is not None and Path(os.path.realpath(own)).is_relative_to(real):
                raise UsageError(f"allowed root {root} contains {what} ({own}): clients could snapshot the server's "
                                 "own secrets and other clients' sandboxes; allow a narrower directory")
        roots.append(real)
    return tuple(roots)


Name = Annotated[str, AfterValidator(check_name)]
SandboxId = Annotated[str, AfterValidator(functools.partial(check_name, what="sandbox id"))]
SnapshotId = Annotated[str, AfterValidator(functools.partial(check_name, what="snapshot id"))]
Strict = ConfigDict(extra="forbid")  # request bodies: one schema each, unknown keys rejected
PositiveInt = Annotated[StrictInt, Field(ge=1)]

LimitsRequest = create_model("LimitsRequest", __config__=Strict,
                             **{f.name: (PositiveInt | None, None) for f in fields(Limits)})


HostPath = Annotated[str, Field(min_length=1, max_length=4096)]  # a directory on the server's host


class SnapshotRequest(BaseModel):
    model_config = Strict
    path: HostPath
    name: Name | None = None


class SandboxRequest(BaseModel):
    model_config = Strict
    snapshot: SnapshotId
    limits: LimitsRequest | None = None


class EpisodeSnapshotRequest(BaseModel):
    model_config = Strict
    name: Name | None = None


class CallRequest(BaseModel):
    model_config = Strict
    method: str = Field(min_length=1, max_length=64)
    params: dict[str, Any] = {}
    wait: float = Field(120.0, gt=0, le=MAX_WAIT, allow_inf_nan=False)


class TaskSandboxRequest(BaseModel):
    model_config = Strict
    task: HostPath
    limits: LimitsRequest | None = None


class GradeRequest(BaseModel):
    model_config = Strict
    task: HostPath
    patch_b64: str  # bounded by the body limit of /grade, then decoded and counted before anything else
    timeout: float = Field(900.0, gt=0, allow_inf_nan=False)


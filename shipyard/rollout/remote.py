"""`RemoteEnvironment`: episodes in the environment server's sandboxes, graded by the server — for rollout workers
on machines that cannot run bubblewrap, or that should not hold the task set.

The server does what `LocalEnvironment` does in-process: it copies each task's `snapshot/` once (on the first
request that names the task), keeps that copy cached, starts every episode's sandbox over it
(`POST /tasks/sandboxes`) and grades every patch in a fresh sandbox over it (`POST /grade`, the grader's
`snapshot=`). So a group of N rollouts of one task costs the server one copy, wherever the workers run. The task is
named by its directory on the server's host: the episode's `spec.task_dir`, made absolute (not resolved: the path
is judged on the server, which refuses one that goes through a symbolic link or leaves its `--allow-root`s).

Faults keep their meaning (`shipyard.rollout.environment`): a server that cannot be reached, refuses or fails raises
`EnvServerUnreachable`/`EnvServerError` — `InfraError`s, so the episode ends `infra_error` with its trajectory and
is retried or masked; a malformed task raises `TaskFormatError`, as grading locally does; a verdict whose status is
`infra_error` is the grader's own decision and comes back as the verdict it is.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from shipyard.models.errors import InfraError
from shipyard.rollout.record import EpisodeSpec
from shipyard.sandbox.client import EnvClient, RemoteSandbox
from shipyard.tasks.grade import Verdict

if TYPE_CHECKING:
    from shipyard.rollout.environment import Environment


class RemoteEnvironment:
    """The `Environment` of an environment server (`shipyard env-server`), through `client` (owned: `close()`
    closes it). `limits` (a dict of `Limits` fields) apply to every episode's sandbox; the server's defaults else."""

    def __init__(self, client: EnvClient, limits: dict[str, int] | None = None, name: str | None = None):
        self.client = client
        self.limits = limits
        self.name = name or f"remote:{client.base_url}"

    @staticmethod
    def task_dir(spec: EpisodeSpec) -> str:
        return os.path.abspath(spec.task_dir)

    @contextlib.contextmanager
    def workspace(self, spec: EpisodeSpec) -> Iterator[RemoteSandbox]:
        sandbox = self.client.task_sandbox(self.task_dir(spec), self.limits)
        try:
            yield sandbox
        finally:
            with contextlib.suppress(InfraError):  # a server gone meanwhile removed the sandbox itself
                sandbox.close()

    def grade(self, spec: EpisodeSpec, patch: str, timeout: float) -> Verdict:
        return self.client.grade(self.task_dir(spec), patch, timeout)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> RemoteEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if TYPE_CHECKING:
    def _implements(env: RemoteEnvironment) -> Environment:  # a type checker verifies the protocol here
        return env

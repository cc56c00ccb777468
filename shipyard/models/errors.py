"""The model layer's user-facing errors, in a module that imports nothing heavy.

The CLI prints the user's mistakes among them (`shipyard.errors.UserError`) as one clear line instead of a traceback;
keeping them here means commands that never load a model (sandbox, tasks, env-server) do not import torch or
transformers just to name them (~5 s per process).
"""

from shipyard.errors import UserError


class ModelNotFound(UserError, ValueError):
    """A `--model` value that names no bundled model, directory, file or hub id."""


class InfraError(Exception):
    """The infrastructure failed, not the model: an inference or environment server unreachable or erroring, a sandbox
    that died. An episode that meets one ends with stop reason `infra_error`, keeps its trajectory, and is retried or
    masked by the scheduler — never scored as the model's failure. Every such error in shipyard derives from this."""


class ServerUnreachable(InfraError, ConnectionError, UserError):
    """An `openai:` server that does not answer (the user named it: a mistake they can fix when a command ends on
    it; within a run, an infrastructure failure like any other)."""


class ReplayExhausted(UserError, RuntimeError):
    """A `replay:` engine asked for more assistant messages than its file holds."""

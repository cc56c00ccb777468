"""The model layer's user-facing errors, in a module that imports nothing heavy.

The CLI catches these to print one clear line instead of a traceback; keeping them here means commands that never
load a model (sandbox, tasks, env-server) do not import torch or transformers just to name them (~5 s per process).
"""


class ModelNotFound(ValueError):
    """A `--model` value that names no bundled model, directory, file or hub id."""


class InfraError(Exception):
    """The infrastructure failed, not the model: an inference or environment server unreachable or erroring, a sandbox
    that died. An episode that meets one ends with stop reason `infra_error`, keeps its trajectory, and is retried or
    masked by the scheduler — never scored as the model's failure. Every such error in shipyard derives from this."""


class ServerUnreachable(InfraError, ConnectionError):
    """An `openai:` server that does not answer."""


class ReplayExhausted(RuntimeError):
    """A `replay:` engine asked for more assistant messages than its file holds."""

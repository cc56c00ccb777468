"""The run directory: everything one `shipyard train` run writes, in one place, so a run can be read, compared,
served and resumed.

    RUN/
      config.toml                     the resolved configuration (after command-line overrides)
      run.json                        status: running | finished | failed (with the error), last step, times
      error.txt                       a failed run's traceback: what ended it, bug or mistake (`RunDir.fail`)
      metrics.jsonl                   one JSON object per trainer step or evaluation (flat keys: "reward/mean")
      tb/                             TensorBoard event files with the same scalars (`tensorboard --logdir RUN/tb`)
      rollouts.jsonl                  one line per rollout of every batch (`RolloutBatch.metrics`)
      trajectories/step-000007.jsonl  the step's trajectories, with hints and monitor flags
      eval/step-000000.json           held-out evaluations, in `shipyard eval`'s format (`eval --compare` reads them)
      checkpoints/step-000007/        trainer and scheduler state
      export/                         the latest policy as a Hugging Face model directory (`shipyard serve --model`)

Writes that a reader may see half-done are made atomic (written beside, then renamed): `run.json`, eval results.
The JSON-lines files are append-only; on resume from step s every line of a later step is dropped first — the run
died after logging them but before checkpointing them, and the resumed run logs those steps again — and the
TensorBoard writer purges events after s the same way (`purge_step`). So a resumed run's logs read as if it had
never stopped.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from shipyard.errors import UserError

STATUS = ("running", "finished", "failed")


class RunDirError(UserError, RuntimeError):
    """The run directory cannot be used as asked (exists without --resume, or is not a run directory)."""


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(text)
    os.replace(tmp, path)


def flatten(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as flat 'a/b' keys (TensorBoard's grouping); non-numeric leaves are kept for the JSON lines. The
    keys are interned: a run keeps its lines, and built anew each step they were two thirds of what it kept (~3.5 of
    ~5 KiB a step, tracemalloc over 80 steps)."""
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        name = sys.intern(f"{prefix}{key}")
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}/"))
        else:
            out[name] = value
    return out


def _scalar(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


class RunDir:
    """One run's directory. `RunDir.create(path)` for a new run (refuses a non-empty directory), `RunDir.resume(path)`
    to continue one; `close()` (or `with`) flushes TensorBoard."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.config_path = self.root / "config.toml"
        self.status_path = self.root / "run.json"
        self.error_path = self.root / "error.txt"
        self.metrics_path = self.root / "metrics.jsonl"
        self.rollouts_path = self.root / "rollouts.jsonl"
        self.trajectories_dir = self.root / "trajectories"
        self.eval_dir = self.root / "eval"
        self.checkpoints_dir = self.root / "checkpoints"
        self.export_dir = self.root / "export"
        self.tb_dir = self.root / "tb"
        self._writer = None
        self._purge_step: int | None = None

    # Opening ------------------------------------------------------------------------------------------------
    @classmethod
    def create(cls, root: str | Path, *, keep: Sequence[Path] = ()) -> RunDir:
        """A new run in `root`, which must be empty but for `keep` (paths that belong there already: the task set
        synthesized into RUN/tasks before the run starts)."""
        run = cls(Path(root))
        kept = {Path(p).resolve() for p in keep}
        if run.root.exists() and any(p.resolve() not in kept for p in run.root.iterdir()):
            hint = " (pass --resume to continue it)" if run.status_path.exists() else ""
            raise RunDirError(f"run directory {run.root} exists and is not empty{hint}; choose a new run.dir")
        for d in (run.root, run.trajectories_dir, run.eval_dir, run.checkpoints_dir):
            d.mkdir(parents=True, exist_ok=True)
        run.set_status("running", step=0)
        return run

    @classmethod
    def resume(cls, root: str | Path, step: int) -> RunDir:
        """Continue a run from its checkpoint of `step`: logs of later steps are dropped (they are redone)."""
        run = cls(Path(root))
        if not run.status_path.exists():
            raise RunDirError(f"{run.root} is not a shipyard run directory (no run.json): nothing to resume")
        for path in (run.metrics_path, run.rollouts_path):
            run._truncate_after(path, step)
        for path in run.trajectories_dir.glob("step-*.jsonl"):
            if int(path.stem.split("-")[1]) > step:
                path.unlink()
        run._purge_step = step + 1
        run.set_status("running", step=step, resumed_from=step)
        return run

    @staticmethod
    def _truncate_after(path: Path, step: int) -> None:
        if not path.exists():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:  # a line cut short by the crash
                continue
        _atomic_write(path, "".join(f"{line}\n" for line in kept))

    # Status ---------------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return json.loads(self.status_path.read_text())

    def set_status(self, status: str, **fields: Any) -> None:
        if status not in STATUS:
            raise ValueError(f"status must be one of {STATUS}, got {status!r}")
        old = json.loads(self.status_path.read_text()) if self.status_path.exists() else {"started": time.time()}
        _atomic_write(self.status_path, json.dumps({**old, **fields, "status": status, "updated": time.time()},
                                                   indent=1) + "\n")

    def fail(self, error: BaseException, **fields: Any) -> None:
        """Mark the run failed by `error`: its traceback to error.txt, its one line to run.json's "error"."""
        _atomic_write(self.error_path, "".join(traceback.format_exception(error)))
        self.set_status("failed", **fields, error=f"{type(error).__name__}: {error}"[:2000])

    # Logs -----------------------------------------------------------------------------------------------------
    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.tb_dir), purge_step=self._purge_step)
        return self._writer

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Append one metrics line for `step` and write its numeric values to TensorBoard; returns the flat line."""
        line = {"step": step, "time": round(time.time(), 3), **flatten(metrics)}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(line, default=str) + "\n")
        for key, value in line.items():
            scalar = _scalar(value)
            if key not in ("step", "time") and scalar is not None:
                self.writer.add_scalar(key, scalar, step)
        self.writer.flush()
        return line

    def log_rollouts(self, lines: Iterable[Mapping[str, Any]]) -> None:
        with self.rollouts_path.open("a") as f:
            for line in lines:
                f.write(json.dumps(line, default=str) + "\n")

    def write_trajectories(self, step: int, records: Iterable[Mapping[str, Any]]) -> Path:
        path = self.trajectories_dir / f"step-{step:06d}.jsonl"
        _atomic_write(path, "".join(json.dumps(r, default=str) + "\n" for r in records))
        return path

    def eval_path(self, step: int) -> Path:
        return self.eval_dir / f"step-{step:06d}.json"

    def metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    # Lifetime -------------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

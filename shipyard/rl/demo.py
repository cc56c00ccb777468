"""`shipyard demo`: the whole RL loop — synthesize tasks, roll out, reward, train, sync, evaluate — on a laptop.

A user's first contact with shipyard answers "does it actually learn?" with their own eyes, on 2 CPU cores, in
about a quarter of an hour. The run is `configs/demo.toml` (an ordinary `shipyard train` configuration; any key can be
overridden, `shipyard demo --run.steps 2`) under `$SHIPYARD_HOME/runs/demo-<time>`:

1. tasks synthesized from the bundled example repository (`examples/pocketlib`: one function body deleted per task,
   graded by the tests that cover it), some held out;
2. the bundled Qwen2.5-Coder-0.5B evaluated on the held-out tasks;
3. a few RL steps: groups of rollouts on the training tasks, the grader's reward plus the grounded tool-call
   shaping term (`shipyard.rollout.advantages.GroundedCalls`), group-relative advantages, one AdamW step each,
   the new weights pushed to the engine;
4. the held-out tasks evaluated again, and a before/after table: reward, pass rate, grounded tool-call validity
   (`shipyard.harness.validity`), placeholder calls, then mean parallel width, reward-hacking flags and seconds per
   step over training.

**What is being learned.** Out of the box the 0.5B model solves none of these tasks. Shown the `<tool_call>` tags as
Qwen's tag token, it never wrote them (0 of ~700 samples, issue 15: that token's output row is untrained); so the
harness spells the tags in ordinary tokens for it (`tags = "spelled"`, docs/harness.md), and it then writes tagged
calls within a few steps (docs/benchmarks.md). Some of its calls stay bare JSON: the demo accepts untagged calls
(they run, marked untagged) and
its shaping term pays distinct grounded calls — real arguments, run without error — in full with the tags and half
without (`untagged_credit`), and charges copied placeholders: a group's rollouts differ in that long before one
solves a task, and RL makes the better calls more likely. A handful of steps on 2 cores moves these figures by
little and noisily (2 held-out tasks × 2 samples); the table reports what happened, and docs/benchmarks.md holds a
longer run's curves. When held-out pass@1 does not move, the summary says so first and why (`DemoReport.verdict`):
RL cannot teach a policy to solve from groups in which nothing is solved, and `shipyard bench learning` is where the
cold start (SFT) and RL on top of it are measured on projects never trained on.

**Success.** The demo's outcome is the loop, so it fails (`DemoReport.failures`, non-zero exit) when the run raised,
when an evaluation could not score a single rollout (infrastructure, not the model), or when no trainer step changed
the weights with a learning signal (every group's rollouts earned the same reward: advantages all 0). A model
that did not improve is reported as such, not as a failure of the loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from shipyard.errors import InputNotFound
from shipyard.models.bundled import shipyard_home
from shipyard.rl.config import RLConfig, load_config

REPO = Path(__file__).resolve().parent.parent.parent
DEMO_CONFIG = REPO / "configs" / "demo.toml"


def demo_config(overrides: Sequence[str] = ()) -> RLConfig:
    """configs/demo.toml in a new run directory under $SHIPYARD_HOME/runs (unless `--run.dir` is given)."""
    if not DEMO_CONFIG.is_file():
        raise InputNotFound(f"the demo's configuration is missing at {DEMO_CONFIG}; run from a source checkout")
    run_dir = shipyard_home() / "runs" / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    return load_config(DEMO_CONFIG, ["--run.dir", str(run_dir), *overrides])


EVAL_ROWS = (  # (label, eval key, format)
    ("reward (mean)", "eval/reward_mean", "{:.3f}"),
    ("pass rate (pass@1)", "eval/pass@1", "{:.3f}"),
    ("grounded tool-call validity", "eval/grounded_fraction", "{:.3f}"),
    ("tool calls", "eval/tool_calls", "{:.0f}"),
    ("… grounded but for the <tool_call> tags", "eval/untagged_grounded_calls", "{:.0f}"),
    ("… with a copied placeholder", "eval/placeholder_calls", "{:.0f}"),
    ("rollouts scored / flagged", None, None),
)


@dataclass
class DemoReport:
    """What the demo's metrics lines say: the evaluations before and after, training figures, and what failed."""

    before: dict[str, Any]
    after: dict[str, Any]
    steps: int
    trained_steps: int
    seconds_per_step: float | None
    parallel_width: float | None  # mean calls per turn that made calls, over training rollouts
    hack_flags: int  # training rollouts a reward-hacking monitor flagged
    train_grounded: tuple[float | None, float | None]  # grounded validity of the first and last training batch
    peak_rss_mb: float | None
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def rows(self) -> list[tuple[str, str, str]]:
        """(figure, before, after) for the table."""
        out = []
        for label, key, fmt in EVAL_ROWS:
            if key is None:
                out.append((label, *(f"{e.get('eval/scored', 0)} / {e.get('eval/flagged_rollouts', 0)}"
                                     for e in (self.before, self.after))))
            else:
                out.append((label, *(_fmt(e.get(key), fmt) for e in (self.before, self.after))))
        return out

    def training_rows(self) -> list[tuple[str, str]]:
        first, last = self.train_grounded
        return [("trainer steps with a learning signal", f"{self.trained_steps} / {self.steps}"),
                ("seconds per step", _fmt(self.seconds_per_step, "{:.1f}")),
                ("mean parallel width", _fmt(self.parallel_width, "{:.2f}")),
                ("reward-hacking flags", str(self.hack_flags)),
                ("grounded validity, first → last batch", f"{_fmt(first, '{:.3f}')} → {_fmt(last, '{:.3f}')}"),
                ("peak resident memory (MiB)", _fmt(self.peak_rss_mb, "{:.0f}"))]

    def verdict(self) -> str | None:
        """Why held-out pass@1 did not move, when it did not (None when it moved or was not measured): a reader of
        the table must not take an unchanged rate for the loop failing, nor for RL being unable to teach solving."""
        before, after = self.before.get("eval/pass@1"), self.after.get("eval/pass@1")
        if before is None or after is None or before != after:
            return None
        if before == 0:
            why = ("the model solves none of these tasks before training, and RL needs successes to learn from (a "
                   "group in which no rollout solves its task carries no signal to solve; the shaping terms move the "
                   "tool-call figures, not the pass rate)")
        elif before == 1:
            why = "the model already solves every one of these tasks"
        else:
            why = (f"{self.trained_steps} trainer step(s), evaluated on {self.after.get('eval/scored', 0)} held-out "
                   f"rollouts, are too few to move it")
        return (f"pass@1 did not move ({before:.3f} → {after:.3f}): {why}. `shipyard bench learning` measures "
                f"whether a cold start (supervised fine-tuning on solved trajectories, `shipyard sft`) before RL "
                f"moves it on projects never trained on, with confidence intervals: see docs/benchmarks.md "
                f"(\"Learning to solve\").")

    def tables(self) -> tuple[Text | Table, ...]:
        """What the demo prints last, in order: why pass@1 did not move (when it did not), the held-out figures
        before/after, the training figures."""
        held_out = Table(title="held-out tasks, before and after training")
        for column in ("", "before", "after"):
            held_out.add_column(column, justify="left" if not column else "right")
        training = Table(title="training", show_header=False)
        for table, rows in ((held_out, self.rows()), (training, self.training_rows())):
            for row in rows:
                table.add_row(*row)
        verdict = self.verdict()
        return (Text(verdict, style="bold yellow"), held_out, training) if verdict else (held_out, training)

    def to_json(self) -> dict[str, Any]:
        return {"before": self.before, "after": self.after, "steps": self.steps, "trained_steps": self.trained_steps,
                "seconds_per_step": self.seconds_per_step, "parallel_width": self.parallel_width,
                "hack_flags": self.hack_flags, "train_grounded": list(self.train_grounded),
                "peak_rss_mb": self.peak_rss_mb, "verdict": self.verdict(), "failures": self.failures, "ok": self.ok}


def _fmt(value: Any, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def report(lines: Sequence[Mapping[str, Any]], steps: int) -> DemoReport:
    """Read the run's metrics lines (`shipyard.rl.loop.RLLoop.run_loop`'s) into a `DemoReport`."""
    evals = [{k: v for k, v in line.items() if k.startswith("eval/")} for line in lines if "eval/scored" in line]
    training = [line for line in lines if line.get("step", 0) > 0]
    failures = []
    if len(evals) < 2:
        failures.append(f"expected an evaluation before and after training, found {len(evals)}")
    for when, e in zip(("before", "after"), (evals[:1] + evals[-1:]) if len(evals) >= 2 else [], strict=False):
        if not e.get("eval/scored"):
            failures.append(f"the evaluation {when} training scored no rollout (an infrastructure failure: see the "
                            f"run's eval/ files)")
    trained = [line for line in training if not line.get("train/skipped") and line.get("reward/advantage_abs_mean")]
    broken = [line["step"] for line in training if any(
        not math.isfinite(line.get(key, 0.0)) for key in ("train/policy_loss", "train/grad_norm"))]
    if training and training[-1].get("run/stopped_at_budget"):
        steps = len(training)  # the run's time budget ended it (run.max_minutes): the steps it made are the run
    if len(training) < steps:
        failures.append(f"the run logged {len(training)} of {steps} trainer steps")
    elif broken:
        failures.append(f"non-finite loss or gradient norm at step(s) {broken}: the trainer diverged")
    elif not trained:
        failures.append("no trainer step had a learning signal: in every batch all rollouts of a group earned the "
                        "same reward (try more steps, larger groups or [shaping] terms)")
    elif not any(line.get("train/grad_norm", 0.0) > 0 and line.get("train/lr", 1.0) > 0 for line in trained):
        failures.append("no trainer step moved the weights (gradient norm or learning rate 0 at every step)")
    grounded = [line.get("tools/grounded_fraction") for line in training]
    widths = [line["episode/parallel_width_mean"] for line in training if line.get("episode/parallel_width_mean")]
    peaks = [line["memory/peak_rss_mb"] for line in training if "memory/peak_rss_mb" in line]
    return DemoReport(
        before=evals[0] if evals else {}, after=evals[-1] if len(evals) >= 2 else {}, steps=steps,
        trained_steps=len(trained), seconds_per_step=_mean([line["time/step_seconds"] for line in training
                                                            if "time/step_seconds" in line]),
        parallel_width=_mean(widths), hack_flags=int(sum(line.get("monitor/flagged", 0) for line in training)),
        train_grounded=(grounded[0] if grounded else None, grounded[-1] if grounded else None),
        peak_rss_mb=max(peaks) if peaks else None, failures=failures)

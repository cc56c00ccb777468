"""`shipyard bench replay`: a run's recorded steps through the trainer its configuration builds — with a masked
rollout, a hint, and a final observation far past the episode's budget (cut by the trainer, never computed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tiny_run import CONFIG

from shipyard.harness.tools import default_tools
from shipyard.harness.trajectory import Trajectory, Turn
from shipyard.harness.wire import ChatFormat
from shipyard.models.resolve import load_hf
from shipyard.rollout.record import Rollout


def _rollout(fmt: ChatFormat, end: int, index: int, replies: list[str], reward: float | None,
             last_observation: int) -> dict:
    traj = Trajectory("t", "random:tiny", fmt.prompt_ids("fix the failing test"))
    for i, reply in enumerate(replies):
        ids = fmt.encode(reply) + [end]
        obs = fmt.continuation_ids(ids, [f"output {i}"]) + ([65] * last_observation if i == len(replies) - 1 else [])
        traj.turns.append(Turn(i, reply, ids, [-0.5] * len(ids), "stop", obs, [], 1, 0.0, 0.0))
    rollout = Rollout("t", "g", index, index, "fail" if reward is not None else "infra_error", reward, traj,
                      advantage=None if reward is None else (1.0 if index else -1.0))
    return rollout.to_json()


def test_replay_reports_each_recorded_step(tmp_path):
    run = tmp_path / "run"
    (run / "trajectories").mkdir(parents=True)
    (run / "config.toml").write_text(CONFIG.format(tasks=tmp_path / "tasks"))
    tok = load_hf("random:tiny")[1]
    fmt = ChatFormat(tok, default_tools())
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for step in (1, 2, 3, 4):  # step 4: step 3 without its long final observations
        turns = min(step, 3)
        rows = [_rollout(fmt, end, i, ["ls"] + ["cat x.py " * turns] * turns, None if (turns, i) == (3, 2) else 0.0,
                         last_observation=2000 if step == 3 else 0) for i in range(3)]
        rows = [{**r, "hints": []} for r in rows]
        if step == 1:  # a rollout lost with its worker: no trajectory at all
            rows.append({**Rollout("t", "g", 3, 3, "infra_error", None, None).to_json(), "hints": []})
        if step == 2:
            rows[0]["hints"] = [{"turn": 1, "kinds": ["serial_calls"], "text": "read both files at once",
                                 "evidence": ["cat"], "hint_ids": fmt.hint_ids("read both files at once")}]
        (run / "trajectories" / f"step-{step:06d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "shipyard.bench.replay", "--run", str(run), "--hints.enabled", "true"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["bench"] == "replay" and out["steps"] == [1, 2, 3, 4] and out["overrides"] == ["--hints.enabled", "true"]
    assert all(p > 0 for p in out["peak_mb"]) and out["peak_second_mb"] == out["peak_mb"][1]
    assert out["peak_ratio"] == pytest.approx(max(out["peak_mb"][2:]) / out["peak_mb"][1], abs=0.01)
    # whether the memory stayed flat is this machine's; the verdict must be the ratio's against the target
    assert out["target_ratio"] == 1.10 and out["met"] is (out["peak_ratio"] <= 1.10)
    # step 3's 2,000-token final observations are not computed
    assert out["forward_tokens"][2] == out["forward_tokens"][3], out["forward_tokens"]

    for steps, says in (("2-9", "not recorded"), ("3-1", "runs backwards"), ("a-b", "give steps and ranges")):
        bad = subprocess.run([sys.executable, "-m", "shipyard.bench.replay", "--run", str(run), "--steps", steps],
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0 and says in bad.stderr, (steps, bad.stderr[-500:])
    # recorded hints with hints off: replayed without them
    off = subprocess.run(cmd[:-2] + ["--steps", "2"], capture_output=True, text=True, timeout=300)
    assert off.returncode == 0, off.stderr[-3000:]

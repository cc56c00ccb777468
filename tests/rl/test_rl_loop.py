"""The RL loop end to end on real parts: the tiny random model in a continuous-batching engine, bubblewrap sandboxes
and the grader, the scheduler, the trainer, the run directory — and a run resumed from its checkpoint continuing
exactly as the uninterrupted run (η = 0, one worker: a run is then a function of its seeds)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from servers import needs_sandbox

from shipyard.harness.tools import default_tools
from shipyard.harness.wire import ChatFormat
from shipyard.models.local import LocalEngine
from shipyard.models.lora import ADAPTER_WEIGHTS, LoraConfig, attach
from shipyard.models.resolve import TINY, tiny_model
from shipyard.rl.config import RunConfig
from shipyard.rl.loop import RLLoop, export_policy
from shipyard.rl.rundir import RunDir
from shipyard.rollout.environment import LocalEnvironment
from shipyard.rollout.episode import WireSettings, episode_config, wire_defaults
from shipyard.rollout.scheduler import Scheduler, SchedulerConfig
from shipyard.rollout.transport import InProcessTransport
from shipyard.tasks.taskset import list_tasks
from shipyard.train.trainer import OptimConfig, TrainConfig, Trainer

pytestmark = needs_sandbox


@pytest.fixture
def closing():
    """Closes what a test opened (engines, sandbox environments), after it."""
    opened = []
    yield opened
    for thing in opened:
        thing.close()


def make_loop(tasks_dir, run: RunDir, steps: int, closing: list, lora: LoraConfig = LoraConfig(),
              **settings) -> tuple[RLLoop, LocalEngine]:
    model, tok = tiny_model(seed=3)
    engine = LocalEngine(attach(tiny_model(seed=3)[0], lora) if lora.enabled else tiny_model(seed=3)[0], tok, name=TINY)
    env = LocalEnvironment()
    closing += [engine, env]
    config = episode_config(TINY, max_turns=2, max_new_tokens=12, grade_timeout=300, seed=0)
    transport = InProcessTransport(engine, env, config, workers=1)
    tasks = list_tasks(tasks_dir)
    sched = Scheduler(SchedulerConfig(group_size=2, groups_per_step=1, max_staleness=0, dynamic_sampling=False,
                                      run_seed=5), transport, tasks_dir)
    header = ChatFormat(tok, default_tools()).assistant_header_ids()
    trainer = Trainer(model, TrainConfig(optim=OptimConfig(name="adamw", lr=1e-3), lora=lora), pad_id=tok.pad_token_id,
                      header_ids=header)
    settings = RunConfig(steps=steps, eval_every=0, eval_samples=1, checkpoint_every=1, **settings)
    loop = RLLoop(sched, trainer, run, settings, eval_tasks=tasks[:1],
                  export=lambda t, full, d: export_policy(t, full, tok, d, WireSettings("accept", "spelled")))
    return loop, engine


def test_the_loop_trains_syncs_checkpoints_evaluates_and_exports(taskset, tmp_path, closing):
    tasks_dir = taskset[0]
    run = RunDir.create(tmp_path / "run")
    loop, engine = make_loop(tasks_dir, run, steps=2, closing=closing)
    lines = asyncio.run(asyncio.wait_for(loop.run_loop(), timeout=600))
    assert [line["step"] for line in lines] == [0, 1, 2]  # eval before, two steps (the last with its eval)
    assert "eval/pass@1" in lines[0] and "eval/pass@1" in lines[2]
    for line in lines[1:]:
        assert line["rollouts/accepted"] == 2 and line["train/version"] == line["step"]
        # 12 tokens of a random model fix nothing and edit nothing: scored 0, and no monitor flags it
        assert (line["reward/mean"], line["monitor/flagged"]) == (0.0, 0)
        busy, wait = line["sandbox/busy_fraction"], line["sandbox/model_wait_fraction"]
        assert 0 < busy < 1 and 0 < wait < 1 and busy + wait <= 1  # tests and tools, the model: never both at once
        assert line["sandbox/grade_seconds"] > 0
        # the step's own peak: at least what is resident after it, at most the process's peak so far
        assert line["memory/rss_mb"] <= line["memory/step_peak_rss_mb"] <= line["memory/peak_rss_mb"] + 1
    assert engine.policy_version == 2  # the engines got every new policy
    assert run.status()["status"] == "finished"
    assert sorted(p.name for p in run.checkpoints_dir.iterdir()) == ["step-00000001", "step-00000002"]
    assert json.loads((run.checkpoints_dir / "step-00000002" / "scheduler.json").read_text())["step"] == 2
    assert sorted(p.name for p in run.eval_dir.iterdir()) == ["step-000000.json", "step-000002.json"]
    assert len(run.rollouts_path.read_text().splitlines()) == 4
    assert len((run.trajectories_dir / "step-000002.jsonl").read_text().splitlines()) == 2
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(run.export_dir)
    trained = loop.trainer.full_state_dict()
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, trained[name].to(tensor.dtype)), name
    assert json.loads((run.export_dir / "shipyard.json").read_text())["policy_version"] == 2
    assert wire_defaults(str(run.export_dir)) == WireSettings("accept", "spelled")  # evaluated and served as trained


def test_a_lora_run_pushes_the_adapter_checkpoints_it_and_exports_the_merged_model(taskset, tmp_path, closing):
    run = RunDir.create(tmp_path / "run")
    loop, engine = make_loop(taskset[0], run, steps=2, closing=closing, lora=LoraConfig(enabled=True, rank=2))
    lines = asyncio.run(asyncio.wait_for(loop.run_loop(), timeout=600))
    assert [line["train/version"] for line in lines[1:]] == [1, 2] and engine.policy_version == 2
    own = engine.model.state_dict()  # the engine's adapter is the trainer's (its own A was drawn from another seed)
    assert all(torch.equal(own[k], v) for k, v in loop.trainer.engine_weights().items())
    checkpoint = run.checkpoints_dir / "step-00000002"
    assert (checkpoint / ADAPTER_WEIGHTS).exists() and not (checkpoint / "model.safetensors").exists()
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(run.export_dir)
    merged = loop.trainer.export_weights()
    assert set(exported.state_dict()) == set(merged)
    assert all(torch.equal(t, merged[k]) for k, t in exported.state_dict().items())


def test_a_time_budget_makes_the_step_that_reaches_it_the_last(taskset, tmp_path, closing):
    run = RunDir.create(tmp_path / "run")
    loop, _ = make_loop(taskset[0], run, steps=5, closing=closing, max_minutes=1e-4)
    lines = asyncio.run(asyncio.wait_for(loop.run_loop(), timeout=600))
    assert [line["step"] for line in lines] == [0, 1]  # eval before; one step, then its eval and checkpoint
    assert "eval/pass@1" in lines[1] and lines[1]["run/stopped_at_budget"] == 1
    assert run.status()["status"] == "finished" and run.status()["stopped"] == "max_minutes"
    assert sorted(p.name for p in run.checkpoints_dir.iterdir()) == ["step-00000001"]


def test_a_resumed_run_continues_as_the_uninterrupted_one(taskset, tmp_path, closing):
    tasks_dir = taskset[0]
    whole_run = RunDir.create(tmp_path / "whole")
    whole, _ = make_loop(tasks_dir, whole_run, steps=2, closing=closing)
    whole_lines = asyncio.run(asyncio.wait_for(whole.run_loop(), timeout=600))

    cut_run = RunDir.create(tmp_path / "cut")
    first, _ = make_loop(tasks_dir, cut_run, steps=1, closing=closing)
    asyncio.run(asyncio.wait_for(first.run_loop(), timeout=600))
    resumed, engine = make_loop(tasks_dir, RunDir.resume(tmp_path / "cut", step=1), steps=2,
                                 closing=closing)
    lines = asyncio.run(asyncio.wait_for(resumed.run_loop(), timeout=600))
    assert [line["step"] for line in lines] == [2]
    for key in ("reward/mean", "train/loss", "train/grad_norm", "episode/sampled_tokens"):
        assert lines[0].get(key) == whole_lines[2].get(key), key
    a, b = whole.trainer.full_state_dict(), resumed.trainer.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert engine.policy_version == 2
    assert [m["step"] for m in RunDir(tmp_path / "cut").metrics()] == [0, 1, 2]
